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

Interface (what :class:`src.lit.base.DeqsmModule` calls): ``setup(module, datamodule)`` once before a
stage (a metric that cannot run raises a clear error here), ``update(module, x, stage)`` per batch,
``compute(module, stage) -> {name: float}`` at the end of the epoch, ``reset()``. ``stages`` says where it
runs (``"val"``, ``"test"``).
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Mapping

import torch
import torchmetrics
from torch import nn

from src import progress
from src.data.contract import ScoreDataModule
from src.objectives.base import compute_score
from src.objectives.sm import sm as exact_sm

# the exact trace costs D backward passes per batch: above this dimension refuse unless asked explicitly
EXACT_SM_MAX_DIM = 1024


@contextlib.contextmanager
def seeded_rng(seed: int | None, device: torch.device):
    """Draw from torch's global RNG seeded with ``seed`` (and ``device``'s CUDA RNG when on a GPU), then put
    the RNG states back: evaluation repeats exactly and never moves the training RNG. ``seed=None``: draw from
    the states as they are, and put them back all the same (a probe that must leave no trace)."""
    with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []):
        if seed is not None:
            torch.manual_seed(seed)
        yield


def test_points_available(module) -> int | None:
    """How many test points the run's test loop will see (dataset size, capped by ``limit_test_batches``), for
    progress totals; None when unknown (outside a Trainer)."""
    trainer = getattr(module, "_trainer", None)
    try:
        loaders = trainer.test_dataloaders
        loaders = loaders if isinstance(loaders, (list, tuple)) else [loaders]
        n_batches = trainer.num_test_batches
        n_batches = n_batches if isinstance(n_batches, (list, tuple)) else [n_batches]
        total = 0
        for dl, nb in zip(loaders, n_batches):
            size = len(dl.dataset)
            total += size if nb == float("inf") else min(size, int(nb) * int(dl.batch_size or size))
        return total // max(1, trainer.world_size)
    except (AttributeError, TypeError):
        return None


def rank_share(module, n: int) -> int:
    """How many of the first ``n`` evaluation points this rank holds: under DDP Lightning's distributed sampler
    gives rank r the points r, r + W, …, so a cap of ``n`` test points takes, over all ranks together, the
    same points as one process. ``n`` in one process."""
    trainer = getattr(module, "_trainer", None)
    if trainer is None or trainer.world_size <= 1:
        return n
    return len(range(trainer.global_rank, n, trainer.world_size))


def _cap(points: int | None, available: int | None) -> int | None:
    if points is None:
        return available
    return points if available is None else min(points, available)


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

    def reset(self) -> None:
        for m in self.modules():
            if isinstance(m, (torchmetrics.Metric, MeanAndStderr)) and m is not self:
                m.reset()


class ExactSMLoss(EvalMetric):
    """Exact SM loss (eq. 1) per sample, ½‖s‖² + tr ∇ₓs, averaged, **not** divided by D — the common yardstick.

    ``val_points``: at most this many points of each validation batch; ``test_points``: at most this many
    test points in all (all DDP ranks together); ``backward_budget``: at most this many backward passes (points × D) per
    validation batch and on the whole test set — the point caps become ⌊budget / D⌋ (at least 1) where that is
    fewer, so one setting sizes the cost for any D (the quick evaluation preset uses it: at D = 784 a NICE point
    costs 784 backward passes through every coupling). ``<stage>/sm_loss_n_points`` records how many points
    were used. The test points show as a progress task (:mod:`src.progress`). Refuses D > ``max_dim`` (3072-d CIFAR-10 would cost 3072 backward passes
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
            cap = _cap(max(1, self.backward_budget // d), cap)
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
                                                _cap(cap, test_points_available(module)))
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
        self.fisher = MeanAndStderr()
        self.true_ll = MeanAndStderr()
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
    over the test set with their standard errors over test points (NICE: exact log p and bits/dim; DKEF:
    log p̃ − log Ẑ with Ẑ by importance sampling; VAE: AIS).

    ``options`` configure the family's estimator (DKEF: ``samples``, ``proposal_std``; VAE: ``test_points``,
    ``seed``, ``ais.*``): the family reads and checks them with :func:`metric_options`."""

    name = "log_likelihood"
    stages = ("test",)

    def __init__(self, **_options):  # read by the family (metric_options), not by the metric
        super().__init__()
        self.parts = nn.ModuleDict()

    def update(self, module, x, stage):
        with torch.no_grad():
            values = module.log_likelihood_metrics(x)
        for key, v in values.items():
            if key not in self.parts:
                self.parts[key] = MeanAndStderr().to(v.device)
            self.parts[key].update(v)

    def compute(self, module, stage):
        out = {}
        for k, acc in self.parts.items():
            m, se, _ = acc.compute()
            out[f"test/{k}"], out[f"test/{k}_stderr"] = m, se  # stderr over test points (not of the estimator)
        out.update(module.log_likelihood_constants())
        return out

    def reset(self):
        self.parts = nn.ModuleDict()


class NoiseConditionalLosses(EvalMetric):
    """Test losses of a noise-conditional score network (NCSN) per noise level σᵢ and σ²-weighted overall.

    For each loss in ``losses`` (``dsm``: ½‖s(x̃, i) + ε/σᵢ‖², the NCSN convention; ``ssm_vr``: eq. 4 on
    x̃ = x + σᵢε) and each level i, every test point is perturbed at level i and its loss weighted by σᵢ²
    (:func:`src.objectives.conditional.noise_conditional`). Reports ``test/<loss>_loss`` (the mean over
    levels, i.e. the expectation under NCSN's uniform level distribution) and ``test/<loss>_loss/sigma_<i>``.
    The perturbation noise is seeded (``seed``, batch number, level), so re-evaluation repeats exactly, and
    drawn under ``torch.random.fork_rng`` so evaluation never moves the training RNG. ``test_points``: at most
    this many test points (all DDP ranks together; null: the whole test loop); ``test/noise_conditional_n_points`` records how
    many were used. The module provides
    ``noise_levels`` (a 1-D tensor σ₁ > … > σ_L) and a model with ``score(x, labels)``.
    """

    name = "noise_conditional"
    stages = ("test",)
    LOSSES = ("dsm", "ssm_vr")

    def __init__(self, losses: list[str] | tuple[str, ...] = ("dsm", "ssm_vr"), seed: int = 0,
                 n_projections: int = 1, test_points: int | None = None):
        super().__init__()
        losses = [losses] if isinstance(losses, str) else list(losses)
        bad = [n for n in losses if n not in self.LOSSES]
        if bad or not losses:
            raise ValueError(f"model.metrics.noise_conditional.losses={losses}: choose from {', '.join(self.LOSSES)}")
        self.losses, self.seed, self.n_projections = losses, int(seed), int(n_projections)
        self.test_points = None if test_points is None else int(test_points)
        if self.test_points is not None and self.test_points < 1:
            raise ValueError(f"model.metrics.noise_conditional.test_points={test_points}: give >= 1, or null (all)")
        self.acc = nn.ModuleDict()
        self._batches = 0
        self._seen = 0
        self._progress: progress.Phase | None = None

    def setup(self, module, datamodule):
        if getattr(module, "noise_levels", None) is None:
            raise ValueError(f"model.metrics.noise_conditional needs a noise-conditional model (noise_levels); "
                             f"{type(module).__name__} has none")

    def update(self, module, x, stage):
        from src.objectives.conditional import noise_conditional
        from src.objectives.registry import get_objective

        sigmas = module.noise_levels.to(device=x.device, dtype=x.dtype)
        self._batches += 1
        if self.test_points is not None:
            x = x[: max(0, rank_share(module, self.test_points) - self._seen)]
        if x.shape[0] == 0:
            return
        self._seen += x.shape[0]
        if self._progress is None:  # one task over the test set: points x levels x losses evaluations
            n = _cap(self.test_points, test_points_available(module))
            self._progress = progress.Phase(module, "noise-conditional test losses (points × levels × losses)",
                                            None if n is None else n * sigmas.numel() * len(self.losses))
        for name in self.losses:
            kwargs = {} if name == "dsm" else {"n_projections": self.n_projections}
            objective = get_objective(name, **kwargs)
            for i in range(sigmas.numel()):
                labels = torch.full((x.shape[0],), i, dtype=torch.long, device=x.device)
                seed = self.seed + 1_000_003 * self._batches + 7919 * i
                with seeded_rng(seed, x.device), torch.enable_grad():
                    out = noise_conditional(objective, module.eval_model(), x, sigmas, labels=labels,
                                            create_graph=False)
                key = f"{name}_{i}"
                if key not in self.acc:
                    self.acc[key] = MeanAndStderr().to(x.device)
                self.acc[key].update(out.per_sample)
                self._progress.advance(x.shape[0])

    def compute(self, module, stage):
        if self._progress is not None:
            self._progress.close()
            self._progress = None
        n_points = max((acc.compute()[2] for acc in self.acc.values()), default=0)
        out: dict[str, float] = {"test/noise_conditional_n_points": float(n_points)}
        for name in self.losses:
            levels = sorted((int(k.rsplit("_", 1)[1]), acc) for k, acc in self.acc.items()
                            if k.rsplit("_", 1)[0] == name)
            values = [acc.compute()[0] for _, acc in levels]
            for i, v in zip([i for i, _ in levels], values):
                out[f"test/{name}_loss/sigma_{i}"] = v
            if values:
                out[f"test/{name}_loss"] = float(sum(values) / len(values))
        return out

    def reset(self):
        self.acc = nn.ModuleDict()
        self._batches = 0
        self._seen = 0


class FID(EvalMetric):
    """FID of ``n_samples`` generated images against ``n_samples`` real test images (:mod:`src.metrics.fid`).

    ``kind``: ``mnist`` (the project's shipped MNIST classifier features) or ``inception`` (Inception-v3
    from ``weights``, a file the user gives — CIFAR-10, CelebA). Samples come from ``module.sample_pixels``
    (EMA weights when EMA is on), real images from the data contract's ``split_tensor("test")`` through
    ``to_pixels``. Under DDP each rank draws its share of both sets and torchmetrics sums the feature
    statistics across ranks. Computed once per test epoch, at its end, with a progress task over the images
    (the sampler may show its own, e.g. Langevin levels × steps); ``test/fid_n_samples`` records the count.
    With ``bootstrap`` > 0 every image's features are kept (gathered across ranks) instead of summed, and both the
    FID (:func:`src.metrics.fid.fid_of_features`: the same distance as torchmetrics' sums) and its bootstrap sd
    come from them: each image goes through the feature network once.
    """

    name = "fid"
    stages = ("test",)

    def __init__(self, kind: str = "mnist", n_samples: int = 1000, weights: str | None = None,
                 sha256: str | None = None, batch_size: int = 250, seed: int = 0, bootstrap: int = 0):
        super().__init__()
        self.kind, self.n_samples, self.weights, self.sha256 = kind, int(n_samples), weights, sha256
        self.batch_size, self.seed, self.bootstrap = int(batch_size), int(seed), int(bootstrap)
        if self.n_samples < 2:
            raise ValueError(f"model.metrics.fid.n_samples={n_samples}: FID needs at least 2 samples")
        if self.bootstrap == 1 or self.bootstrap < 0:
            raise ValueError(f"model.metrics.fid.bootstrap={bootstrap}: 0 (off) or the number of bootstrap "
                             "replicates (>= 2; e.g. 100) of the FID's sampling error")
        self._fid = None

    def setup(self, module, datamodule):
        if not datamodule.is_image:
            raise ValueError(f"model.metrics.fid needs image data; {type(datamodule).__name__} holds none")
        if self._fid is None:
            from src.metrics.fid import build_fid

            # kept out of the module tree: the feature network's weights must not enter checkpoints/optimisers
            object.__setattr__(self, "_fid", build_fid(self.kind, self.weights, self.sha256))
        self._dm = datamodule

    def update(self, module, x, stage):
        pass  # everything happens at the end of the epoch

    def compute(self, module, stage):
        trainer = module.trainer
        world, rank = max(1, trainer.world_size), trainer.global_rank
        share = range(rank, self.n_samples, world)  # this rank's indices of the n samples
        fid = self._fid.to(module.device)
        fid.reset()
        real = self._dm.split_tensor("test", self.n_samples)
        if real.shape[0] < self.n_samples:
            raise ValueError(f"model.metrics.fid.n_samples={self.n_samples} exceeds the {real.shape[0]} test "
                             "images: lower it")
        real = self._dm.to_pixels(real[list(share)])
        n_fake = len(share)
        features = {True: [], False: []}  # kept only for the bootstrap

        def add(images: torch.Tensor, is_real: bool) -> None:
            images = images.to(module.device).float()
            if self.bootstrap:  # features kept (extracted once): the FID and its bootstrap are computed from them
                with torch.no_grad():
                    features[is_real].append(fid.inception(images).double())
            else:  # streamed into torchmetrics' running sums
                fid.update(images, real=is_real)

        with progress.phase(module, f"FID ({self.kind} features): real + generated images",
                            real.shape[0] + n_fake) as advance:
            for start in range(0, max(real.shape[0], n_fake), self.batch_size):
                if start < real.shape[0]:
                    batch = real[start:start + self.batch_size]
                    add(batch, True)
                    advance(batch.shape[0])
                if start < n_fake:
                    k = min(self.batch_size, n_fake - start)
                    fake = module.sample_pixels(k, seed=self.seed + 104729 * rank + start)
                    if fake is None:
                        raise ValueError(f"model.metrics.fid: {type(module).__name__} does not generate samples")
                    add(fake, False)
                    advance(k)
        if not self.bootstrap:
            return {"test/fid": float(fid.compute()), "test/fid_n_samples": float(self.n_samples)}
        from src.metrics.fid import bootstrap_fid_sd, fid_of_features

        real_f, fake_f = (_gathered_rows(module, torch.cat(features[flag])).cpu() for flag in (True, False))
        g = torch.Generator().manual_seed(self.seed)  # the same replicates on every rank
        return {"test/fid": float(fid_of_features(real_f, fake_f)), "test/fid_n_samples": float(self.n_samples),
                "test/fid_bootstrap_sd": bootstrap_fid_sd(real_f, fake_f, self.bootstrap, g)}


def _gathered_rows(module, x: torch.Tensor) -> torch.Tensor:
    """The rows [n_rank, F] of every DDP rank, concatenated in rank order (shares may differ in length by one)."""
    trainer = module.trainer
    if max(1, trainer.world_size) == 1:
        return x
    counts = module.all_gather(torch.tensor([x.shape[0]], device=x.device)).flatten().tolist()
    padded = torch.cat([x, x.new_zeros(max(counts) - x.shape[0], x.shape[1])])
    rows = module.all_gather(padded)  # [world, max_count, F]
    return torch.cat([rows[r, :c] for r, c in enumerate(counts)])


METRICS: dict[str, type[EvalMetric]] = {
    NoiseConditionalLosses.name: NoiseConditionalLosses,
    FID.name: FID,
    ExactSMLoss.name: ExactSMLoss,
    GroundTruthMetrics.name: GroundTruthMetrics,
    LogLikelihood.name: LogLikelihood,
}


def register_metric(cls: type[EvalMetric]) -> type[EvalMetric]:
    """Class decorator adding a metric to the registry under ``cls.name``."""
    METRICS[cls.name] = cls
    return cls


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
