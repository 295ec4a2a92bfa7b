"""Exact SM loss (eq. 1) as an evaluation metric: ``model.metrics.exact_sm``."""

from __future__ import annotations

import torch

from src.data.contract import ScoreDataModule
from src.metrics.base import EvalMetric, MeanAndStderr
from src.metrics.distributed import cap_points, rank_share, test_points_available
from src.objectives.sm import sm as exact_sm
from src.runtime import progress

# the exact trace costs D backward passes per batch: above this dimension refuse unless asked explicitly
EXACT_SM_MAX_DIM = 1024


class ExactSMLoss(EvalMetric):
    """Exact SM loss (eq. 1) per sample, ½‖s‖² + tr ∇ₓs, averaged, **not** divided by D — the common yardstick.

    ``val_points``: at most this many points of each validation batch; ``test_points``: at most this many
    test points in all (all DDP ranks together); ``backward_budget``: at most this many backward passes (points × D) per
    validation batch and on the whole test set — the point caps become ⌊budget / D⌋ (at least 1) where that is
    fewer, so one setting sizes the cost for any D (the quick evaluation preset uses it: at D = 784 a NICE point
    costs 784 backward passes through every coupling). ``<stage>/sm_loss_n_points`` records how many points
    were used. The test points show as a progress task (:mod:`src.runtime.progress`). Refuses D > ``max_dim`` (3072-d CIFAR-10 would cost 3072 backward passes
    per batch): use a sliced or denoising test loss there, or raise ``max_dim`` knowingly.
    """

    name = "exact_sm"
    stages = ("val", "test")
    PROGRESS_CHUNK = 16  # test points per progress update

    def __init__(self, val_points: int | None = None, test_points: int | None = None,
                 max_dim: int = EXACT_SM_MAX_DIM, backward_budget: int | None = None):
        super().__init__()
        self.val_points = None if val_points is None else int(val_points)
        self.test_points = None if test_points is None else int(test_points)
        self.backward_budget = None if backward_budget is None else int(backward_budget)
        if self.backward_budget is not None and self.backward_budget < 1:
            raise ValueError(f"model.metrics.exact_sm.backward_budget={backward_budget}: give >= 1, or null")
        self.max_dim = int(max_dim)
        self.val = MeanAndStderr()
        self.test = MeanAndStderr()
        self._progress: progress.Phase | None = None

    def setup(self, module, datamodule: ScoreDataModule) -> None:
        d = datamodule.data_dim
        if d > self.max_dim:
            raise ValueError(
                f"model.metrics.exact_sm: the exact SM loss at D={d} costs {d} backward passes per batch "
                f"(max_dim={self.max_dim}). Switch it off (model.metrics.exact_sm=null) and use the sliced / "
                "denoising test losses (model.metrics.noise_conditional), or raise model.metrics.exact_sm.max_dim"
            )

    def points(self, stage: str, d: int) -> int | None:
        """The point cap of ``stage`` at data dimension ``d`` (``*_points`` and ``backward_budget``; None: all)."""
        cap = self.val_points if stage == "val" else self.test_points
        if self.backward_budget is not None:
            cap = cap_points(max(1, self.backward_budget // d), cap)
        return cap

    def update(self, module, x, stage):
        acc = self.val if stage == "val" else self.test
        cap = self.points(stage, x[0].numel())
        if cap is not None:
            x = x[: cap if stage == "val" else max(0, rank_share(module, cap) - acc.local_count)]
        if x.shape[0] == 0:
            return
        if stage == "test":
            if self._progress is None:  # one task over the whole test set (D backward passes per point)
                self._progress = progress.Phase(module, f"exact SM loss (test points, D={x[0].numel()})",
                                                cap_points(cap, test_points_available(module)))
            chunks = x.split(self.PROGRESS_CHUNK)  # per-point values: chunking changes no number
        else:
            chunks = (x,)
        for chunk in chunks:
            with torch.enable_grad():
                per_sample = exact_sm(module.eval_model(), chunk, create_graph=False).per_sample.detach()
            acc.update(per_sample)
            if stage == "test":
                self._progress.advance(chunk.shape[0])

    def compute(self, module, stage):
        if stage == "test" and self._progress is not None:
            self._progress.close()
            self._progress = None
        m, se, n = (self.val if stage == "val" else self.test).compute()
        if n == 0:
            return {}
        return {f"{stage}/sm_loss": m, f"{stage}/sm_loss_stderr": se, f"{stage}/sm_loss_n_points": float(n)}
