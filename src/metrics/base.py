"""The metric interface every evaluation metric implements, and the stream statistic they share.

Interface (what :class:`src.lit.base.DeqsmModule` calls): ``setup(module, datamodule)`` once before a
stage (a metric that cannot run raises a clear error here), ``update(module, x, stage)`` per batch,
``compute(module, stage) -> {name: float}`` at the end of the epoch, ``reset()``. ``stages`` says where it
runs (``"val"``, ``"test"``). Every metric accumulates with torchmetrics, so under DDP ``compute`` reduces
across ranks.
"""

from __future__ import annotations

import math

import torch
import torchmetrics
from torch import nn

from src.data.contract import ScoreDataModule


class MeanAndStderr(nn.Module):
    """Mean and standard error of a stream of per-sample values, reduced across DDP ranks."""

    def __init__(self):
        super().__init__()
        # float64 accumulation whatever the run's precision (torchmetrics keeps its own state dtype)
        self.mean = torchmetrics.MeanMetric().set_dtype(torch.float64)
        self.mean_sq = torchmetrics.MeanMetric().set_dtype(torch.float64)
        self.count = torchmetrics.SumMetric().set_dtype(torch.float64)
        self.local_count = 0  # samples seen on this rank since the last reset (caps per-rank point budgets)

    def update(self, values: torch.Tensor) -> None:
        values = values.detach().flatten().double()
        if values.numel() == 0:
            return
        self.mean.update(values)
        self.mean_sq.update(values.pow(2))
        self.count.update(torch.tensor(float(values.numel()), dtype=torch.float64, device=values.device))
        self.local_count += values.numel()

    def compute(self) -> tuple[float, float, int]:
        n = int(self.count.compute().item())
        if n == 0:
            return math.nan, math.nan, 0
        m = float(self.mean.compute())
        var = max(float(self.mean_sq.compute()) - m * m, 0.0) * n / max(n - 1, 1)
        return m, math.sqrt(var / n), n

    def reset(self) -> None:
        self.mean.reset()
        self.mean_sq.reset()
        self.count.reset()
        self.local_count = 0


class EvalMetric(nn.Module):
    name: str = "metric"
    stages: tuple[str, ...] = ("test",)

    def setup(self, module, datamodule: ScoreDataModule) -> None:
        pass

    def update(self, module, x: torch.Tensor, stage: str) -> None:
        raise NotImplementedError

    def compute(self, module, stage: str) -> dict[str, float]:
        raise NotImplementedError

    def point_values(self) -> dict[str, list[float]]:
        """Per-test-point values, in test-set order, for comparisons paired by point (written to metrics.json
        beside the scalars, never logged); ``{}`` for a metric that keeps none."""
        return {}

    def reset(self) -> None:
        for m in self.modules():
            if isinstance(m, (torchmetrics.Metric, MeanAndStderr)) and m is not self:
                m.reset()
