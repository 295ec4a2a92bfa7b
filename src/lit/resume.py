"""Exact resume of every LightningModule: what a checkpoint holds beyond the weights, and putting it back.

A checkpoint also holds the family's name, the RNG states (:mod:`src.runtime.rng`), each DEQ block's
warm-start fixed points and the training rows the DEQ diagnostics are measured at (src/lit/deq_monitor.py), so a
resumed run continues exactly; under DDP every rank's RNG streams, training-loader
position and warm starts (:func:`gather_rank_states`), each given back to its own rank on resume
(:func:`restore_rank_state`); non-finite states are refused at save time with
the newest finite checkpoint named. Validation leaves the training RNG where it found it
(:class:`src.runtime.rng.EvaluationRngGuard`, added by ``configure_callbacks``).

:class:`ResumeHooksMixin` is mixed into :class:`src.lit.base.DeqsmModule`.
"""

from __future__ import annotations

import logging

from src.deq.lookup import blocks_of
from src.runtime.checkpoints import NonFiniteCheckpointError, newest_checkpoint, nonfinite_entries
from src.runtime.rng import EvaluationRngGuard, capture_rng_states, restore_rng_states

log = logging.getLogger(__name__)


def rank_state(trainer, warm_start: dict) -> dict:
    """This rank's part of a checkpoint that differs between DDP ranks: its RNG streams
    (:func:`~src.runtime.rng.capture_rng_states`), its training loaders' positions (src.data.resumable) and its DEQ
    blocks' warm-start fixed points (of its own rows)."""
    loader = getattr(getattr(trainer, "fit_loop", None), "_combined_loader", None)
    loaders = loader._state_dicts() if loader is not None else []
    return {"rank": int(trainer.global_rank), "rng": capture_rng_states(), "loaders": loaders,
            "warm_start": warm_start}  # CPU copies (DEQBlock.warm_start_state)


def gather_rank_states(trainer, warm_start: dict) -> list[dict] | None:
    """Every rank's :func:`rank_state`, in rank order (a collective: every rank calls it as a checkpoint is
    saved, rank 0 writes it); None with one process."""
    import torch.distributed as dist

    if getattr(trainer, "world_size", 1) <= 1 or not (dist.is_available() and dist.is_initialized()):
        return None
    gathered: list = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, rank_state(trainer, warm_start))
    return sorted(gathered, key=lambda r: r["rank"])


def restore_rank_state(checkpoint: dict, trainer) -> dict | None:
    """Give this rank its own saved RNG streams and loader positions (scatter of :func:`gather_rank_states`):
    the loader positions replace rank 0's in the checkpoint's loop state, which Lightning applies next. Returns
    this rank's saved state (its warm starts are loaded by the caller), or None, after one log line, when the
    checkpoint's world size is not this run's (then every rank continues from rank 0's streams: the run goes on,
    not bit-equal to an uninterrupted run of either size)."""
    ranks = checkpoint.get("deqsm_rank_states")
    world = int(getattr(trainer, "world_size", 1) or 1)
    saved_world = len(ranks) if ranks else 1
    if saved_world != world:
        if getattr(trainer, "is_global_zero", True):
            log.warning("resuming a checkpoint of world size %d with world size %d: every rank continues from rank "
                        "0's RNG streams and loader position, so the run goes on but is not bit-equal to an "
                        "uninterrupted one", saved_world, world)
        return None
    if not ranks:
        return None
    mine = ranks[int(trainer.global_rank)]
    restore_rng_states(mine["rng"])
    fit_state = checkpoint.get("loops", {}).get("fit_loop", {}).get("state_dict", {})
    if mine["loaders"] and "combined_loader" in fit_state:
        fit_state["combined_loader"] = mine["loaders"]
    return mine


class ResumeHooksMixin:
    """``on_save_checkpoint`` / ``on_load_checkpoint`` / ``on_train_start`` for an exact resume."""

    def configure_callbacks(self):
        """:class:`~src.runtime.rng.EvaluationRngGuard`: validation leaves the training RNG where it found it."""
        return [EvaluationRngGuard()]

    def _resume_hint(self) -> str:
        """Where to resume from: the newest checkpoint of this run (every one on disk is finite)."""
        trainer = getattr(self, "_trainer", None)
        folders = [getattr(cb, "dirpath", None) for cb in (trainer.checkpoint_callbacks if trainer else [])]
        newest = newest_checkpoint(folders)
        if newest is None:
            return "no checkpoint of this run was written yet"
        return f"the newest finite checkpoint is {newest} (resume with ckpt_path={newest})"

    def on_save_checkpoint(self, checkpoint: dict) -> None:
        """Also save RNG states and DEQ warm-start fixed points, so a resumed run continues exactly; refuse to
        save non-finite parameters, optimiser, EMA or warm-start states (on every rank: DDP stops together)."""
        checkpoint["deqsm_family"] = type(self).__name__  # named when a checkpoint is given to another family
        checkpoint["deqsm_rng_states"] = capture_rng_states()
        checkpoint["deqsm_warm_start"] = {name: m.warm_start_state() for name, m in blocks_of(self)}
        checkpoint["deqsm_deq_inputs"] = self.deq_monitor_state()  # the DEQ diagnostics' inputs (rank 0's)
        trainer = getattr(self, "_trainer", None)
        ranks = gather_rank_states(trainer, checkpoint["deqsm_warm_start"]) if trainer is not None else None
        if ranks is not None:  # DDP: every rank's RNG streams, loader positions, warm starts (rank 0's above)
            checkpoint["deqsm_rank_states"] = ranks
        bad = nonfinite_entries(checkpoint)
        if bad:
            raise NonFiniteCheckpointError(
                f"the state at global step {checkpoint.get('global_step', self.global_step)} is not finite "
                f"({', '.join(bad[:3])}{' …' if len(bad) > 3 else ''}): no checkpoint written; "
                f"{self._resume_hint()}. Try a smaller model.optimizer lr, a larger deq.norm_lambda, or gradient "
                "clipping (trainer.gradient_clip_val)."
            )

    def on_train_start(self) -> None:
        # The training loader's position (src.data.resumable) is restored by Lightning only when it builds the
        # loader after loading the checkpoint; a scheduler sized by trainer.estimated_stepping_batches (a
        # model.scheduler's T_max) makes it build the loader earlier, in configure_optimizers, and the saved position
        # was then never applied (measured: the resumed epoch restarted at its first batch). Apply it now,
        # before the first batch is drawn (the resumable loader reads its position lazily).
        fit_loop = self.trainer.fit_loop
        if getattr(fit_loop, "_combined_loader_states_to_load", None):
            fit_loop._load_combined_loader_states()

    def on_load_checkpoint(self, checkpoint: dict) -> None:
        trainer = getattr(self, "_trainer", None)
        if trainer is not None:
            # Lightning loads the weights before its precision plugin converts the module (Trainer._run restores,
            # then sets the strategy up): with trainer.precision=64-true the float64 weights would pass through
            # float32 parameters and lose their low bits (measured: 1e-7 relative). Convert first (in place).
            trainer.precision_plugin.convert_module(self)
        if "deqsm_rng_states" in checkpoint:
            restore_rng_states(checkpoint["deqsm_rng_states"])
        mine = None
        if trainer is not None and trainer.state.fn == "fit":
            mine = restore_rank_state(checkpoint, trainer)  # under DDP: this rank's own streams, position
        states = mine["warm_start"] if mine is not None else checkpoint.get("deqsm_warm_start", {})
        for name, m in blocks_of(self):
            if name in states:
                m.load_warm_start_state(states[name])
        if trainer is not None and trainer.state.fn == "fit":
            self.load_deq_monitor_state(checkpoint.get("deqsm_deq_inputs", {}))
