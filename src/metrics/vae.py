"""The SSM-VAE's own evaluation metric (paper §4.1, Table 1): ``model.metrics.vae``.

Per validation/test point, with z ~ q(z|x) from the implicit encoder (one draw, seeded):

- ``<stage>/score_ssm_loss``: the score estimator's SSM loss (eq. 3, the configured projection) on that z —
  how well s(z|x) matches ∇_z log q(z|x), up to the constant of score matching;
- ``<stage>/recon_error``: −log p(x|z) (nats; Bernoulli: binary cross-entropy summed over pixels).

The draws are seeded (``seed``, batch number) under ``torch.random.fork_rng``, so evaluation repeats exactly
and never moves the training RNG. ``val_points`` / ``test_points`` cap the points per batch / in all (all DDP
ranks together). The AIS log-likelihood goes through the ``log_likelihood`` metric
(``VAELitModule.log_likelihood_metrics``).
The module provides ``vae_eval_terms(x, generator) -> {"score_ssm_loss": [B], "recon_error": [B]}``.
Registered in :data:`src.metrics.registry.METRICS`.
"""

from __future__ import annotations

import torch

from src.metrics.base import EvalMetric, MeanAndStderr
from src.metrics.distributed import rank_share
from src.runtime.rng import seeded_rng


class VAEMetrics(EvalMetric):
    name = "vae"
    stages = ("val", "test")
    KEYS = ("score_ssm_loss", "recon_error")

    def __init__(self, val_points: int | None = None, test_points: int | None = None, seed: int = 0):
        super().__init__()
        self.val_points = None if val_points is None else int(val_points)
        self.test_points = None if test_points is None else int(test_points)
        self.seed = int(seed)
        self.acc = torch.nn.ModuleDict({f"{s}_{k}": MeanAndStderr() for s in self.stages for k in self.KEYS})
        self._batches = 0

    def setup(self, module, datamodule):
        if getattr(module, "vae_eval_terms", None) is None:
            raise ValueError(f"model.metrics.vae needs an SSM-VAE module; {type(module).__name__} is not one")
        self._batches = 0

    def update(self, module, x, stage):
        cap = self.val_points if stage == "val" else self.test_points
        seen = self.acc[f"{stage}_recon_error"].local_count
        if cap is not None:
            x = x[: cap if stage == "val" else max(0, rank_share(module, cap) - seen)]
        self._batches += 1
        if x.shape[0] == 0:
            return
        g = torch.Generator(device=x.device).manual_seed(self.seed + 1_000_003 * self._batches)
        with seeded_rng(self.seed + 7919 * self._batches, x.device):
            terms = module.vae_eval_terms(x, generator=g)
        for k in self.KEYS:
            self.acc[f"{stage}_{k}"].update(terms[k])

    def compute(self, module, stage):
        out = {}
        for k in self.KEYS:
            m, se, n = self.acc[f"{stage}_{k}"].compute()
            if n:
                out[f"{stage}/{k}"], out[f"{stage}/{k}_stderr"] = m, se
        return out

    def reset(self):
        super().reset()
        self._batches = 0
