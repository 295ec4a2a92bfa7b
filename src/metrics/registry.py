"""Evaluation metrics as pluggable pieces: each LightningModule composes the ones its config names.

``model.metrics`` maps a metric name to its options (``null`` or ``false`` switches it off)::

    metrics:
      exact_sm: {val_points: 32, test_points: 256}   # eq. 1, exact trace (D backward passes per batch)
      ground_truth: {}                               # Fisher divergence + true log-likelihood (synthetic data)
      log_likelihood: {}                             # the family's likelihood (its estimator's options here)
      noise_conditional: {losses: [dsm, ssm_vr]}     # per-noise-level test losses (noise-conditional scores)
      fid: {kind: mnist, n_samples: 1000}            # FID of generated samples against real test images

Every metric accumulates with torchmetrics (``MeanMetric``), so under DDP each rank evaluates its shard of
the validation/test set and ``compute`` reduces across ranks: the test phase runs sharded like training.
Lightning's distributed sampler pads a split whose size is not a multiple of the world size by repeating a
few samples; the means then count those samples twice (at most world_size − 1 of them).

The registry: :data:`METRICS` (name → class, every metric listed explicitly), :func:`build_metrics`
(a ``model.metrics`` spec → metric instances) and :func:`metric_options` (a family's options of a metric it
estimates itself). Interface (:mod:`src.metrics.base`; what :class:`src.lit.base.DeqsmModule` calls): ``setup(module, datamodule)`` once before a
stage (a metric that cannot run raises a clear error here), ``update(module, x, stage)`` per batch,
``compute(module, stage) -> {name: float}`` at the end of the epoch, ``reset()``. ``stages`` says where it
runs (``"val"``, ``"test"``).
"""

from __future__ import annotations

from collections.abc import Mapping

from torch import nn

from src.metrics.base import EvalMetric
from src.metrics.exact_sm import ExactSMLoss
from src.metrics.fid import FID
from src.metrics.ground_truth import GroundTruthMetrics
from src.metrics.log_likelihood import LogLikelihood
from src.metrics.noise_conditional import NoiseConditionalLosses
from src.metrics.vae import VAEMetrics

# Every metric, registered here explicitly (no import side effects): a new metric is one file under
# src/metrics/ and one line below.
METRICS: dict[str, type[EvalMetric]] = {cls.name: cls for cls in (
    NoiseConditionalLosses, FID, ExactSMLoss, GroundTruthMetrics, LogLikelihood, VAEMetrics,
)}


def metric_options(spec: Mapping | None, name: str, defaults: Mapping) -> dict | None:
    """The options of metric ``name`` in a ``model.metrics`` spec over the family's ``defaults`` (nested
    mappings merged key by key), for a metric whose estimator the family implements (``log_likelihood``);
    None when the metric is off. A key ``defaults`` lacks is refused in one line naming the valid ones."""
    options = dict(spec or {}).get(name)
    if options is None or options is False:
        return None
    return _merged(defaults, {} if options is True else options, f"model.metrics.{name}")


def _merged(defaults: Mapping, given: Mapping, where: str) -> dict:
    if not isinstance(given, Mapping):
        raise ValueError(f"{where}={given!r}: give a mapping of {', '.join(defaults)}")  # noqa: TRY004  a config value
    unknown = sorted(set(given) - set(defaults))
    if unknown:
        raise ValueError(f"{where}: unknown key(s) {unknown}; valid: {', '.join(defaults) or 'none'}")
    return {k: _merged(v, given.get(k) or {}, f"{where}.{k}") if isinstance(v, Mapping) else given.get(k, v)
            for k, v in defaults.items()}


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
