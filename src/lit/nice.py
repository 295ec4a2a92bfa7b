"""LightningModule for NICE on MNIST (paper §4.3, Table 4): any objective, exact likelihood for evaluation.

Test metrics (``model.metrics``): exact SM loss on a fixed test subset (``metrics.exact_sm.test_points``;
exact SM at D = 784 costs 784 backward passes per batch, so it is capped), test log-likelihood in logit
space (as the reference code reports it), bits/dim in 8-bit pixel space with every Jacobian included, and a
PNG grid of samples (also logged to W&B when that logger is on).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from src.config.values import plain
from src.lit.base import ScoreMatchingModule
from src.metrics.registry import metric_options
from src.models.nice import build_nice


class NICELitModule(ScoreMatchingModule):
    """See the module docstring. ``net``: ``model.net``, a partial :func:`src.models.nice.build_nice` (its sizes; the
    module adds ``dim`` = ``data.dim``, the parsed ``deq`` setting and ``depth``)."""

    family = "nice"
    default_net = build_nice

    def __init__(
        self,
        input_dim: int,
        loss: Mapping,
        net: Any = None,
        deq: Mapping | None = None,
        depth: int | None = None,
        optimizer: Any = None, scheduler: Any = None,
        metrics: Mapping | None = None,
        n_samples_grid: int = 64,
    ):
        # plain containers, so the checkpoint's hyper_parameters hold no OmegaConf objects
        loss, deq, metrics = (plain(c) for c in (loss, deq, metrics))
        super().__init__(loss=loss, optimizer=optimizer, scheduler=scheduler, metrics=metrics, deq=deq)
        self.save_hyperparameters(ignore=["optimizer", "scheduler", "net"])  # partials: not hyper-parameters
        metric_options(metrics, "log_likelihood", {})  # the exact likelihood takes no options: refuse any
        self.net = self.build_net(net, dim=input_dim, deq=self.deq, depth=depth)
        self.n_samples_grid = n_samples_grid

    def log_likelihood_metrics(self, x: torch.Tensor) -> dict[str, torch.Tensor]:
        """Exact log p(x) in the model's (logit) space and, where the data define one, pixel-space bits/dim."""
        ll = self.net.log_likelihood(x)
        out = {"log_likelihood": ll}
        dm = self.datamodule()
        if dm.has_bits_per_dim:
            out["bits_per_dim"] = dm.bits_per_dim(ll, x)
        return out

    def sample(self, n: int, generator: torch.Generator | None = None) -> torch.Tensor:
        return self.net.sample(n, generator=generator)
