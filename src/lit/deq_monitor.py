"""The DEQ contraction monitor of every LightningModule with a DEQ block.

A forward pre-hook keeps the first ``deq_input_rows`` rows of the last training input each DEQ block saw (a
family that measures elsewhere sets 0: NCSN); at the end of each validation the block's contraction rate
‖∂f/∂z‖₂ at that input's fixed point is logged (``val/deq_contraction_rate``, the largest over blocks, and
``val/deq_contraction_rate/<block>`` when there are several), and :meth:`DEQMonitorMixin.check_phantom_truncation`
warns when the phantom backward (Alg. 1) truncates a loss that differentiates through the DEQ by more than
``src.deq.block.PHANTOM_TRUNCATION_WARN``.

:class:`DEQMonitorMixin` is mixed into :class:`src.lit.base.DeqsmModule`.
"""

from __future__ import annotations

import warnings

import torch

from src.deq.block import PHANTOM_TRUNCATION_WARN, phantom_truncation
from src.deq.lookup import blocks_of, forward_infos


class DEQMonitorMixin:
    """Contraction rates of the module's DEQ blocks and the phantom-truncation warning."""

    deq_input_rows = 16  # rows of the last training input kept per DEQ block for its contraction rate (0: none)
    outputs_score = False  # the network outputs the score itself (not an energy): see loss_differentiates_through_deq
    _deq_inputs: dict
    _deq_hooks: list

    def loss_differentiates_through_deq(self) -> bool:
        """Whether the training loss's value contains a derivative w.r.t. the data through the DEQ, so that the
        phantom backward (Alg. 1) truncates the loss itself, not only its parameter gradient. An energy / density
        model's score is ∇ₓ log p through the DEQ: every score-matching loss does, MLE does not (NICE's additive
        couplings have unit Jacobian determinant). A score network (``outputs_score``: NCSN, the VAE's estimator)
        is differentiated only by the divergence of SSM / SSM-VR / SM, not by DSM."""
        name = self.loss_name
        return not (name == "mle" or (self.outputs_score and name == "dsm"))

    def deq_forwards(self):
        """Context manager yielding ``[(block name, info)]`` of the DEQ block forwards run inside it
        (:func:`src.deq.lookup.forward_infos`): a training step wraps its objective in it and passes the list to
        :meth:`with_deq_penalty`."""
        return forward_infos(self)

    def with_deq_penalty(self, loss: torch.Tensor, batch_size: int, infos: list = ()) -> torch.Tensor:
        """``loss`` plus the Jacobian regularisers recorded in ``infos`` (:meth:`deq_forwards`; ``deq.
        jacobian_penalty`` > 0: γ × :meth:`src.deq.block.DEQBlock.jacobian_penalty` of each training forward,
        averaged over a block's forwards, summed over blocks), logged as ``train/deq_jacobian_penalty``; ``loss``
        itself when none has one."""
        per_block: dict[str, list] = {}
        for name, info in infos:
            if info is not None and info.jacobian_penalty is not None:
                per_block.setdefault(name, []).append(info.jacobian_penalty)
        if not per_block:
            return loss
        penalty = torch.stack([torch.stack(terms).mean() for terms in per_block.values()]).sum()
        self.log("train/deq_jacobian_penalty", penalty.detach(), on_step=True, on_epoch=True, batch_size=batch_size)
        return loss + penalty

    def on_fit_start(self) -> None:
        # a resumed run starts from the inputs its checkpoint kept (deq_monitor_state): a run resumed after its
        # last training step (killed in its test) measures its test diagnostics at the same rows as the
        # uninterrupted run
        restored = self.__dict__.pop("_restored_deq_inputs", {})
        self._deq_inputs = {name: tuple(a.to(self.device) if torch.is_tensor(a) else a for a in args)
                            for name, args in restored.items()}
        if not self.deq_input_rows:  # the family measures its rate on other inputs (NCSN: validation images)
            return
        for name, block in blocks_of(self):
            self._deq_hooks.append(block.register_forward_pre_hook(self._deq_input_hook(name)))

    def on_fit_end(self) -> None:
        for handle in self._deq_hooks:
            handle.remove()
        self._deq_hooks = []

    def _deq_input_hook(self, name: str):
        rows = self.deq_input_rows

        def keep(block, args):
            if block.training:  # training forwards only; the first rows, detached, copied (not a view)
                self._deq_inputs[name] = tuple(a.detach()[:rows].clone() if torch.is_tensor(a) and a.dim() else a
                                               for a in args)
        return keep

    def deq_monitor_state(self) -> dict[str, tuple]:
        """The kept training inputs, as CPU copies, for a checkpoint (src/lit/resume.py)."""
        return {name: tuple(a.detach().cpu() if torch.is_tensor(a) else a for a in args)
                for name, args in getattr(self, "_deq_inputs", {}).items()}

    def load_deq_monitor_state(self, state: dict[str, tuple]) -> None:
        """Keep a checkpoint's :meth:`deq_monitor_state` for the fit that resumes from it (:meth:`on_fit_start`)."""
        self._restored_deq_inputs = {name: tuple(args) for name, args in state.items()}

    def deq_contraction_rates(self) -> dict[str, float]:
        """{block name: ‖∂f/∂z‖₂ at the fixed point} of each DEQ block, at the last training input it saw
        (:meth:`src.deq.block.DEQBlock.contraction_rate`); blocks that have not seen one are left out."""
        return {name: block.contraction_rate(*self._deq_inputs[name])
                for name, block in blocks_of(self) if name in self._deq_inputs}

    def deq_diagnostic_inputs(self) -> dict[str, tuple]:
        """{block name: the inputs (x, *cond) its recurrence share is measured at}: the last training input."""
        return {name: self._deq_inputs[name] for name, _ in blocks_of(self) if name in self._deq_inputs}

    def deq_recurrence_metrics(self, stage: str = "val") -> dict[str, float]:
        """``{stage}/deq_recurrence_share[/<block>]`` (‖z* − φ(0)‖/‖z*‖, mean over samples), ``…_max``,
        ``{stage}/deq_branch_ratio`` (residual maps: ‖h(z*)‖/‖g‖), ``{stage}/deq_iterations`` and
        ``{stage}/deq_hit_cap`` of each DEQ block (:func:`src.deq.diagnostics.recurrence_share`) at
        :meth:`deq_diagnostic_inputs`; a near-inert block is warned about once per run (the value is logged at
        every validation)."""
        from src.deq.diagnostics import NEAR_INERT_SHARE, near_inert, recurrence_share

        blocks = dict(blocks_of(self))
        out: dict[str, float] = {}
        for name, inputs in self.deq_diagnostic_inputs().items():
            stats = recurrence_share(blocks[name], *inputs, rate=False)
            suffix = f"/{name}" if len(blocks) > 1 else ""
            for key, logged in (("share_mean", "recurrence_share"), ("share_max", "recurrence_share_max"),
                                ("branch_mean", "branch_ratio"), ("iterations", "iterations"),
                                ("hit_cap", "hit_cap")):
                if key in stats:
                    out[f"{stage}/deq_{logged}{suffix}"] = stats[key]
            warned = self.__dict__.setdefault("_near_inert_warned", set())
            if near_inert(stats) and name not in warned:  # once per block and run: not at every validation
                warned.add(name)
                warnings.warn(f"{type(self).__name__}: DEQ block '{name}' is near-inert: its fixed point is within "
                              f"{stats['share_mean']:.1%} of one explicit pass φ(0) (< {NEAR_INERT_SHARE:.0%}), so "
                              "it is in effect an explicit network (a tighter deq.norm / deq.norm_lambda helps).",
                              RuntimeWarning, stacklevel=2)
        return out

    def log_deq_recurrence(self) -> None:
        """Log :meth:`deq_recurrence_metrics` at validation (largest over ranks)."""
        for key, value in self.deq_recurrence_metrics("val").items():
            self.log(key, value, sync_dist=True, reduce_fx="max")

    def log_deq_contraction(self) -> None:
        """Log ``val/deq_contraction_rate`` (largest over blocks; per block too when there are several) and warn
        when it makes the phantom backward truncate the loss (:meth:`check_phantom_truncation`); then the
        recurrence share of every block (:meth:`log_deq_recurrence`)."""
        self.log_deq_recurrence()
        rates = self.deq_contraction_rates()
        if not rates:
            return
        self.log("val/deq_contraction_rate", max(rates.values()), sync_dist=True, reduce_fx="max")
        if len(rates) > 1:
            for name, rate in rates.items():
                self.log(f"val/deq_contraction_rate/{name}", rate, sync_dist=True, reduce_fx="max")
        blocks = dict(blocks_of(self))
        for name, rate in rates.items():
            self.check_phantom_truncation(rate, blocks[name])

    def check_phantom_truncation(self, rate: float, block=None) -> float | None:
        """Warn when the phantom backward of ``block`` (default: the only DEQ block) truncates a loss that
        differentiates through the DEQ by more than ``PHANTOM_TRUNCATION_WARN`` at the contraction ``rate``
        (:func:`src.deq.block.phantom_truncation`); returns the bound, or None when it does not apply (no DEQ,
        the implicit backward, which is exact, or a loss with no derivative through the DEQ)."""
        if block is None:
            blocks = blocks_of(self)
            if len(blocks) != 1:
                return None
            block = blocks[0][1]
        if block.config.backward != "phantom" or not self.loss_differentiates_through_deq():
            return None
        k = int(block.config.phantom_steps)
        bound = phantom_truncation(rate, k)
        if bound > PHANTOM_TRUNCATION_WARN:
            warnings.warn(
                f"{type(self).__name__}: DEQ block '{block.name}' contracts at {rate:.3f}, so the phantom gradient "
                f"with K = {k} (deq.phantom_steps) truncates the training loss's derivative through the DEQ by up "
                f"to {bound:.0%}; the network can lower that truncated loss while the exact one rises. Use "
                "deq.backward=implicit (exact) or raise deq.phantom_steps until ρᴷ/(1 − ρ) is small.",
                RuntimeWarning, stacklevel=2)
        return bound
