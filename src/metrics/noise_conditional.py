"""Per-noise-level test losses of noise-conditional score models: ``model.metrics.noise_conditional``."""

from __future__ import annotations

import torch
from torch import nn

from src.metrics.base import EvalMetric, MeanAndStderr
from src.metrics.distributed import cap_points, rank_share, test_points_available
from src.runtime import progress
from src.runtime.rng import seeded_rng


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
            n = cap_points(self.test_points, test_points_available(module))
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
