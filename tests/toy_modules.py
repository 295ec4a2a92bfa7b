"""Small LightningModules and callbacks the base-class tests train through `src.lit.base` (test-only)."""

from __future__ import annotations

from typing import ClassVar

import lightning.pytorch as L
import torch
from torch import nn

from src.lit.base import DeqsmModule, batch_tensor
from src.objectives.dsm import dsm


class GaussianNoiseScore(nn.Module):
    """The exact noise-conditional score of N(0, I) data perturbed by N(0, σ²I): s(x̃, i) = −x̃ / (1 + σᵢ²)."""

    def __init__(self, sigmas: torch.Tensor):
        super().__init__()
        self.register_buffer("sigmas", sigmas)
        self.unused = nn.Parameter(torch.zeros(()))  # an optimiser needs one parameter

    def score(self, x, labels):
        var = 1.0 + self.sigmas[labels].pow(2)
        return -x / var.reshape(-1, *([1] * (x.dim() - 1)))


class NoiseConditionalGaussian(DeqsmModule):
    def __init__(self, sigmas, metrics):
        super().__init__(metrics=metrics)
        self.net = GaussianNoiseScore(torch.as_tensor(sigmas, dtype=torch.float32))

    @property
    def noise_levels(self):
        return self.net.sigmas

    def training_step(self, batch, batch_idx):  # pragma: no cover  evaluation-only module
        return self.net.unused * 0


class PixelScore(nn.Module):
    """Per-pixel Gaussian score s(x) = (m − x)·exp(−2 log σ) — the score net of the toy below."""

    def __init__(self, shape):
        super().__init__()
        self.mean = nn.Parameter(torch.zeros(shape))
        self.log_std = nn.Parameter(torch.zeros(shape))

    def score(self, x):
        return (self.mean - x) * torch.exp(-2 * self.log_std)


class PixelGenerator(nn.Module):
    """x = clamp(μ + exp(ρ) ε): a per-pixel Gaussian image generator."""

    def __init__(self, shape):
        super().__init__()
        self.mean = nn.Parameter(torch.zeros(shape))
        self.log_std = nn.Parameter(torch.zeros(shape))

    def forward(self, n, generator=None):
        eps = torch.randn((n, *self.mean.shape), generator=generator, device=self.mean.device, dtype=self.mean.dtype)
        return self.mean + self.log_std.exp() * eps


class TwoOptimiserToy(DeqsmModule):
    """Alternating updates through the base: ``score_steps`` DSM updates of a score network (optimiser
    ``score``), then one moment-matching update of a generator (optimiser ``generator``) — the shape of
    the SSM-VAE's training step, on a model small enough for a test."""

    optimized_modules: ClassVar[dict] = {"score": ("score_net",), "generator": ("generator",)}

    def __init__(self, shape, optimizer, metrics=None, score_steps: int = 2, sigma: float = 0.1, scheduler=None):
        super().__init__(optimizer=optimizer, metrics=metrics, scheduler=scheduler)
        self.automatic_optimization = False
        self.score_net = PixelScore(shape)
        self.generator = PixelGenerator(shape)
        self.score_steps, self.sigma = int(score_steps), float(sigma)
        self.net = self.score_net

    def training_step(self, batch, batch_idx):
        x = batch_tensor(batch)
        for _ in range(self.score_steps):
            self.manual_update("score", dsm(self.score_net, x, sigma=self.sigma).loss)
        fake = self.generator(x.shape[0])
        loss = (fake.mean(0) - x.mean(0)).pow(2).sum() + (fake.std(0) - x.std(0)).pow(2).sum()
        self.manual_update("generator", loss)
        self.log("train/generator_loss", loss.detach(), prog_bar=True)

    def sample(self, n, generator=None):
        return self.generator(n, generator=generator).clamp(0, 1)


class DtypeProbe(L.Callback):
    """Records the dtype of every floating tensor that enters any sub-module of the LightningModule, and
    writes them to ``<default_root_dir>/dtype_probe.json`` at the end of every stage."""

    def __init__(self):
        self.seen: set = set()
        self._handles = []

    def _hook(self, module, args):
        for a in args:
            if torch.is_tensor(a) and a.is_floating_point():
                self.seen.add((type(module).__name__, a.dtype))

    def setup(self, trainer, pl_module, stage):
        self.teardown(trainer, pl_module, stage)
        self._handles = [m.register_forward_pre_hook(self._hook) for m in pl_module.modules()]

    def teardown(self, trainer, pl_module, stage):
        for h in self._handles:
            h.remove()
        self._handles = []
        if trainer.is_global_zero:
            import json
            from pathlib import Path

            path = Path(trainer.default_root_dir) / "dtype_probe.json"
            old = json.loads(path.read_text()) if path.exists() else []
            new = sorted({*map(tuple, old), *((m, str(d)) for m, d in self.seen)})
            path.write_text(json.dumps(new))
