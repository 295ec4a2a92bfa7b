"""The family's log-likelihood as an evaluation metric: ``model.metrics.log_likelihood``."""

from __future__ import annotations

import torch
from torch import nn

from src.metrics.base import EvalMetric, MeanAndStderr


class LogLikelihood(EvalMetric):
    """The family's likelihood metrics: ``module.log_likelihood_metrics(x) -> {name: [B] tensor}`` averaged
    over the test set with their standard errors over test points (NICE: exact log p and bits/dim; DKEF:
    log p̃ − log Ẑ with Ẑ by importance sampling; VAE: AIS).

    ``options`` configure the family's estimator (DKEF: ``samples``, ``proposal_std``; VAE: ``test_points``,
    ``seed``, ``ais.*``): the family reads and checks them with :func:`metric_options`.

    Each test point's value is kept too (:meth:`point_values`: ``test/<name>_per_point`` in metrics.json), so
    two runs tested on the same first points (AIS: the first ``test_points`` test images) compare paired by
    point. Kept in one process only: under DDP each rank sees a strided share, and the list is left out."""

    name = "log_likelihood"
    stages = ("test",)

    def __init__(self, **_options):  # read by the family (metric_options), not by the metric
        super().__init__()
        self.parts = nn.ModuleDict()
        self.points: dict[str, list[float]] = {}

    def update(self, module, x, stage):
        with torch.no_grad():
            values = module.log_likelihood_metrics(x)
        for key, v in values.items():
            if key not in self.parts:
                self.parts[key] = MeanAndStderr().to(v.device)
            self.parts[key].update(v)
            self.points.setdefault(key, []).extend(v.detach().double().flatten().cpu().tolist())

    def compute(self, module, stage):
        out = {}
        for k, acc in self.parts.items():
            m, se, _ = acc.compute()
            out[f"test/{k}"], out[f"test/{k}_stderr"] = m, se  # stderr over test points (not of the estimator)
        out.update(module.log_likelihood_constants())
        return out

    def point_values(self) -> dict[str, list[float]]:
        distributed = torch.distributed.is_available() and torch.distributed.is_initialized() \
            and torch.distributed.get_world_size() > 1
        return {} if distributed else {f"test/{k}_per_point": list(v) for k, v in self.points.items()}

    def reset(self):
        self.parts = nn.ModuleDict()
        self.points = {}
