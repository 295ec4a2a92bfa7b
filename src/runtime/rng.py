"""The run's random-number states, in one home: capture and restore, seeded forks, and the guard that keeps
validation from moving the training RNG.

- :func:`capture_rng_states` / :func:`restore_rng_states`: the Python, numpy, torch (and CUDA) RNG states as
  tensors and plain values (a checkpoint holding them loads weights-only); the resume hooks
  (:mod:`src.lit.resume`) save and restore them for an exact resume.
- :func:`seeded_rng`: draw from a seeded fork of torch's RNG and put the states back (evaluation, probes).
- :class:`EvaluationRngGuard`: Validation leaves the training RNG where it found it.

Whether (and how often) validation runs must not change the training that follows: a validation metric or
diagnostic that draws from the global RNG (a projection, a loader's base seed, NCSN's contraction check through
``split_tensor``) would otherwise shift every later noise draw, so a resumed run (no sanity check) or a run
validating at another interval would train on other noise. :class:`EvaluationRngGuard` captures the Python,
numpy, torch (and CUDA) RNG states as validation starts during ``fit`` (the sanity check included) and restores
them as it ends — before the checkpoint callbacks save at ``on_validation_end`` (Lightning runs checkpoint
callbacks last), so a checkpoint written after validation holds the training RNG. Every
:class:`~src.lit.base.DeqsmModule` adds it (``configure_callbacks``).
"""


from __future__ import annotations

import contextlib
import random

import lightning.pytorch as L
import numpy as np
import torch
from lightning.pytorch.trainer.states import TrainerFn


class EvaluationRngGuard(L.Callback):
    def __init__(self):
        self._saved: dict | None = None

    def on_validation_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self._saved = capture_rng_states() if trainer.state.fn == TrainerFn.FITTING else None

    def on_validation_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if self._saved is not None:
            restore_rng_states(self._saved)
            self._saved = None


def capture_rng_states() -> dict:
    """The process's Python, numpy, torch (and CUDA) RNG states as tensors and plain Python values, so that a
    checkpoint holding them loads with ``weights_only=True`` (src.runtime.checkpoints)."""
    name, key, pos, has_gauss, cached = np.random.get_state(legacy=True)
    states = {"python": random.getstate(),
              "numpy": {"bit_generator": str(name), "key": torch.from_numpy(key.astype(np.int64)), "pos": int(pos),
                        "has_gauss": int(has_gauss), "cached_gaussian": float(cached)},
              "torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        states["cuda"] = torch.cuda.get_rng_state_all()
    return states


def restore_rng_states(states: dict) -> None:
    """Restore :func:`capture_rng_states`'s states (also the numpy tuple older checkpoints hold)."""
    random.setstate(tuple(tuple(s) if isinstance(s, list) else s for s in states["python"]))
    state = states["numpy"]
    if isinstance(state, dict):
        state = (state["bit_generator"], np.asarray(state["key"], dtype=np.int64).astype(np.uint32), state["pos"],
                 state["has_gauss"], state["cached_gaussian"])
    np.random.set_state(state)
    torch.set_rng_state(states["torch"])
    if "cuda" in states and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(states["cuda"])


@contextlib.contextmanager
def seeded_rng(seed: int | None, device: torch.device):
    """Draw from torch's global RNG seeded with ``seed`` (and ``device``'s CUDA RNG when on a GPU), then put
    the RNG states back: evaluation repeats exactly and never moves the training RNG. ``seed=None``: draw from
    the states as they are, and put them back all the same (a probe that must leave no trace)."""
    with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []):
        if seed is not None:
            torch.manual_seed(seed)
        yield
