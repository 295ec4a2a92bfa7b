"""Evaluation metrics as pluggable pieces: each LightningModule composes the ones its config names.

``model.metrics`` maps a metric name to its options (``null`` or ``false`` switches it off)::

    metrics:
      exact_sm: {val_points: 32, test_points: 256}   # eq. 1, exact trace (D backward passes per batch)
      ground_truth: {}                               # Fisher divergence + true log-likelihood (synthetic data)
      log_likelihood: {}                             # the family's tractable / estimated likelihood
      noise_conditional: {losses: [dsm, ssm_vr]}     # per-noise-level test losses (noise-conditional scores)
      fid: {kind: mnist, n_samples: 1000}            # FID of generated samples against real test images

Every metric accumulates with torchmetrics (``MeanMetric``), so under DDP each rank evaluates its shard of
the validation/test set and ``compute`` reduces across ranks: the test phase runs sharded like training.
Lightning's distributed sampler pads a split whose size is not a multiple of the world size by repeating a
few samples; the means then count those samples twice (at most world_size − 1 of them).

Interface (what :class:`src.lit.base.DeqsmModule` calls): ``setup(module, datamodule)`` once before a
stage (a metric that cannot run raises a clear error here), ``update(module, x, stage)`` per batch,
``compute(module, stage) -> {name: float}`` at the end of the epoch, ``reset()``. ``stages`` says where it
runs (``"val"``, ``"test"``).
"""

from __future__ import annotations

import math
from collections.abc import Mapping

import torch
import torchmetrics
from torch import nn

from src.data.contract import ScoreDataModule
from src.objectives.base import compute_score
from src.objectives.sm import sm as exact_sm

# the exact trace costs D backward passes per batch: above this dimension refuse unless asked explicitly
EXACT_SM_MAX_DIM = 1024


class _MeanAndStderr(nn.Module):
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

    def reset(self) -> None:
        for m in self.modules():
            if isinstance(m, (torchmetrics.Metric, _MeanAndStderr)) and m is not self:
                m.reset()


class ExactSMLoss(EvalMetric):
    """Exact SM loss (eq. 1) per sample, ½‖s‖² + tr ∇ₓs, averaged, **not** divided by D — the common yardstick.

    ``val_points``: at most this many points of each validation batch; ``test_points``: at most this many
    test points in all (per rank). Refuses D > ``max_dim`` (3072-d CIFAR-10 would cost 3072 backward passes
    per batch): use a sliced or denoising test loss there, or raise ``max_dim`` knowingly.
    """

    name = "exact_sm"
    stages = ("val", "test")

    def __init__(self, val_points: int | None = None, test_points: int | None = None,
                 max_dim: int = EXACT_SM_MAX_DIM):
        super().__init__()
        self.val_points = None if val_points is None else int(val_points)
        self.test_points = None if test_points is None else int(test_points)
        self.max_dim = int(max_dim)
        self.val = _MeanAndStderr()
        self.test = _MeanAndStderr()

    def setup(self, module, datamodule: ScoreDataModule) -> None:
        d = datamodule.data_dim
        if d > self.max_dim:
            raise ValueError(
                f"model.metrics.exact_sm: the exact SM loss at D={d} costs {d} backward passes per batch "
                f"(max_dim={self.max_dim}). Switch it off (model.metrics.exact_sm=null) and use the sliced / "
                "denoising test losses (model.metrics.noise_conditional), or raise model.metrics.exact_sm.max_dim"
            )

    def update(self, module, x, stage):
        acc = self.val if stage == "val" else self.test
        if stage == "val":
            if self.val_points is not None:
                x = x[: self.val_points]
        elif self.test_points is not None:
            x = x[: max(0, self.test_points - acc.local_count)]
        if x.shape[0] == 0:
            return
        with torch.enable_grad():
            per_sample = exact_sm(module.eval_model(), x, create_graph=False).per_sample.detach()
        acc.update(per_sample)

    def compute(self, module, stage):
        m, se, n = (self.val if stage == "val" else self.test).compute()
        if n == 0:
            return {}
        return {f"{stage}/sm_loss": m, f"{stage}/sm_loss_stderr": se}


class GroundTruthMetrics(EvalMetric):
    """Fisher divergence ½E‖s_θ(x) − ∇log p(x)‖² and the true log-likelihood, on data with a known density.

    ``required=False`` (default): on data without a known density the metric does nothing; ``True``: it
    refuses such data with a clear error.
    """

    name = "ground_truth"
    stages = ("test",)

    def __init__(self, required: bool = False):
        super().__init__()
        self.required = bool(required)
        self.fisher = _MeanAndStderr()
        self.true_ll = _MeanAndStderr()
        self._dm = None

    def setup(self, module, datamodule):
        if not datamodule.has_ground_truth and self.required:
            raise ValueError(f"model.metrics.ground_truth.required=true needs data with a known density; "
                             f"{type(datamodule).__name__} has none (switch the metric off: "
                             "model.metrics.ground_truth=null)")
        self._dm = datamodule if datamodule.has_ground_truth else None

    def update(self, module, x, stage):
        if self._dm is None:
            return
        with torch.enable_grad():
            s = compute_score(module.eval_model(), x, create_graph=False).detach()
        s_true = self._dm.true_score(x)
        self.fisher.update(0.5 * (s - s_true).flatten(1).pow(2).sum(-1))
        self.true_ll.update(self._dm.true_log_density(x))

    def compute(self, module, stage):
        if self._dm is None:
            return {}
        return {"test/fisher_divergence": self.fisher.compute()[0],
                "test/true_log_likelihood": self.true_ll.compute()[0]}


class LogLikelihood(EvalMetric):
    """The family's likelihood metrics: ``module.log_likelihood_metrics(x) -> {name: [B] tensor}`` averaged
    over the test set (NICE: exact log p and bits/dim; DKEF: log p̃ − log Ẑ with Ẑ by importance sampling)."""

    name = "log_likelihood"
    stages = ("test",)

    def __init__(self):
        super().__init__()
        self.parts = nn.ModuleDict()

    def update(self, module, x, stage):
        with torch.no_grad():
            values = module.log_likelihood_metrics(x)
        for key, v in values.items():
            if key not in self.parts:
                self.parts[key] = _MeanAndStderr().to(v.device)
            self.parts[key].update(v)

    def compute(self, module, stage):
        out = {f"test/{k}": acc.compute()[0] for k, acc in self.parts.items()}
        out.update(module.log_likelihood_constants())
        return out

    def reset(self):
        self.parts = nn.ModuleDict()


METRICS: dict[str, type[EvalMetric]] = {
    ExactSMLoss.name: ExactSMLoss,
    GroundTruthMetrics.name: GroundTruthMetrics,
    LogLikelihood.name: LogLikelihood,
}


def register_metric(cls: type[EvalMetric]) -> type[EvalMetric]:
    """Class decorator adding a metric to the registry under ``cls.name``."""
    METRICS[cls.name] = cls
    return cls


def build_metrics(spec: Mapping | None) -> nn.ModuleDict:
    """``{name: options}`` (``None``/``False`` = off) -> a ModuleDict of metric instances, in config order."""
    out = nn.ModuleDict()
    for name, options in dict(spec or {}).items():
        if options is None or options is False:
            continue
        if name not in METRICS:
            raise ValueError(f"model.metrics.{name} is not a metric; valid: {', '.join(sorted(METRICS))}")
        options = {} if options is True else dict(options)
        try:
            out[name] = METRICS[name](**options)
        except TypeError as exc:
            raise ValueError(f"model.metrics.{name}: {exc}") from None
    return out
