"""LightningModule for noise-conditional score networks (NCSN) with a DEQ residual block (paper §4.4, App. D.4).

Training (automatic optimisation): each sample draws a noise level i uniformly from σ₁ > … > σ_L (geometric,
held by the network as a buffer), is perturbed to x̃ = x + σᵢε, and the configured objective (``loss=ssm_vr``,
the paper's, or ``loss=dsm``) is applied to s(·, i), σᵢ²-weighted (:func:`src.objectives.conditional.
noise_conditional`, NCSN's ``anneal_power`` 2).

Validation: the σ²-weighted DSM loss with seeded noise and levels (``val/dsm_loss``, what checkpoints
monitor) and, for a DEQ network, ``val/deq_contraction_rate`` on validation images at every level, with the
base module's phantom-truncation warning for SSM-VR / SSM. Test: the ``noise_conditional`` metric
(σ²-weighted DSM and SSM-VR losses per level and overall), ``fid`` (samples from
:meth:`NCSNLitModule.sample`, EMA weights when EMA is on), and for a DEQ network ``test/deq_contraction_rate``
(‖∂f/∂z‖₂ at the fixed point, one test image per noise level) and ``test/deq_forward_iterations``. Samples:
annealed Langevin dynamics (:mod:`src.sampling.annealed_langevin`) from uniform noise; ``samples.png`` at the end of the test.
"""

from __future__ import annotations

import functools
from collections.abc import Mapping, Sequence
from typing import Any

import torch

from src.config.partials import partial_argument
from src.config.values import plain
from src.deq.lookup import blocks_of
from src.lit.base import ScoreMatchingModule, batch_tensor
from src.lit.nets import net_factory
from src.models.ncsn import DEQ_ARCHS, NCSN, geometric_sigmas
from src.objectives.conditional import LabelConditioned, noise_conditional
from src.objectives.registry import get_objective
from src.runtime import progress
from src.runtime.rng import seeded_rng
from src.sampling.annealed_langevin import UPDATES, annealed_langevin

TRAIN_LOSSES = ("dsm", "ssm_vr", "ssm")
SAMPLING_DEFAULTS = {"n_steps_each": 100, "step_lr": 2e-5, "denoise": False, "update": "euler"}
VAL_CONTRACTION_POINTS = 16  # validation images for val/deq_contraction_rate (levels spread: diagnostic_levels)


def diagnostic_levels(n: int, num_levels: int) -> torch.Tensor:
    """The noise level (index into σ₁ > … > σ_L) of each of ``n`` diagnostic images: every level in turn when
    ``n >= L`` (image j at level j mod L), else ``n`` levels spread evenly from σ₁ to σ_L. The recurrence share
    and the contraction rate depend on σ; at NCSNv2's 95 levels the cycle of 16 images covered only σ₁ … σ₁₆
    (16.9 → 5.3, inputs that are nearly all noise), so the logged share missed the levels that draw the digits
    (benchmarks/results/ncsn_share_by_level.md)."""
    if n >= num_levels:
        return torch.arange(n) % num_levels
    return torch.linspace(0, num_levels - 1, n, dtype=torch.float64).round().long()


class NCSNLitModule(ScoreMatchingModule):
    """See the module docstring. ``net``: ``model.net`` (the ``model/net`` group: ``twores``, ``refinenet``, ``mdeq``),
    a partial :class:`src.models.ncsn.NCSN` (its architecture and sizes); the module adds the image channels, the
    noise levels of ``noise``, ``centered_input`` (``pixel_range``), the parsed ``deq`` setting and ``depth``."""

    family = "ncsn"
    default_net = NCSN
    default_loss, train_losses = "ssm_vr", TRAIN_LOSSES  # noise-conditional forms only
    ignored_loss_keys = ("sigma",)  # dsm: every sample's own noise level replaces the fixed sigma
    outputs_score = True  # s(x, i) directly: DSM has no derivative through the DEQ, SSM-VR's divergence has
    deq_input_rows = 0  # no training inputs kept: deq_contraction_rates measures on seeded validation images

    def __init__(
        self,
        data_shape: Sequence[int],
        loss: Mapping,
        net: Any = None,
        deq: Mapping | None = None,
        depth: int | None = None,
        pixel_range: str = "unit",
        noise: Mapping | None = None,
        anneal_power: float = 2.0,
        sampling: Mapping | None = None,
        n_samples_grid: int = 64,
        val_seed: int = 0,
        optimizer: Any = None, scheduler: Any = None,
        metrics: Mapping | None = None,
        monitor: str | None = "val/dsm_loss",
        monitor_mode: str | None = "min",
    ):
        loss, deq, noise, sampling, metrics = (plain(c) for c in (loss, deq, noise, sampling, metrics))
        net = net_factory(net if net is not None else NCSN)
        uses_deq = partial_argument(net, "arch", "deq") in DEQ_ARCHS  # model/net=refinenet: no DEQ, ignores deq
        super().__init__(optimizer=optimizer, scheduler=scheduler, metrics=metrics, monitor=monitor, monitor_mode=monitor_mode,
                         loss=loss, deq=deq if uses_deq else None)
        self.save_hyperparameters(ignore=["optimizer", "scheduler", "net"])  # partials: not hyper-parameters
        self.anneal_power = float(anneal_power)
        noise = {"sigma_begin": 1.0, "sigma_end": 0.01, "num_classes": 10, **(noise or {})}
        sigmas = geometric_sigmas(float(noise["sigma_begin"]), float(noise["sigma_end"]), int(noise["num_classes"]))
        if pixel_range not in ("unit", "symmetric"):
            raise ValueError(f"pixel_range={pixel_range!r}: unit | symmetric")
        self.pixel_range = pixel_range
        self.data_shape = tuple(int(s) for s in data_shape)
        self.net = self.build_net(net, channels=self.data_shape[0], sigmas=sigmas, deq=self.deq, depth=depth,
                                  centered_input=pixel_range == "unit")
        unknown = set(sampling or {}) - set(SAMPLING_DEFAULTS)
        if unknown:
            raise ValueError(f"model.sampling: unknown key(s) {sorted(unknown)}; valid: {', '.join(SAMPLING_DEFAULTS)}")
        self.sampling = {**SAMPLING_DEFAULTS, **(sampling or {})}
        if self.sampling["update"] not in UPDATES:
            raise ValueError(f"model.sampling.update={self.sampling['update']!r}: choose one of {', '.join(UPDATES)}")
        self.n_samples_grid, self.val_seed = int(n_samples_grid), int(val_seed)

    @property
    def noise_levels(self) -> torch.Tensor:
        return self.net.sigmas

    # ------------------------------------------------------------------ training and validation
    def training_objective(self, x: torch.Tensor):
        """The configured objective in its noise-conditional form (σᵢ^anneal_power-weighted, a level per sample);
        :meth:`ScoreMatchingModule.training_step` logs and returns it. With ``deq.correction_states`` = n > 0 the
        objective is applied to each of the n scores of :meth:`src.models.ncsn.NCSN.scores_along_solve` (one
        forward, the same levels, noise and projections) and the step trains their weighted sum."""
        states = self.deq is not None and int(self.deq.correction_states) > 0  # fixed-point correction
        return noise_conditional(self.objective, self.net, x, self.net.sigmas, anneal_power=self.anneal_power,
                                 condition=functools.partial(LabelConditioned, states=True) if states else None)

    def validation_step(self, batch, batch_idx):
        super().validation_step(batch, batch_idx)
        x = self.model_tensor(batch_tensor(batch))
        # the same levels and noise every epoch
        with seeded_rng(self.val_seed + 7919 * batch_idx, x.device), torch.enable_grad():
            out = noise_conditional(get_objective("dsm"), self.eval_model(), x, self.net.sigmas,
                                    anneal_power=self.anneal_power, create_graph=False)
        self.log("val/dsm_loss", out.loss.detach(), prog_bar=True, on_epoch=True, batch_size=x.shape[0])

    def deq_contraction_rates(self) -> dict[str, float]:
        """The DEQ map's contraction rate on the first ``VAL_CONTRACTION_POINTS`` validation images perturbed at
        the levels of :func:`diagnostic_levels` (seeded, so the same each validation; what
        ``val/deq_contraction_rate`` logs)."""
        blocks = blocks_of(self)
        if not blocks:
            return {}
        rate, _ = self.deq_contraction(self.split_tensor("val", VAL_CONTRACTION_POINTS))
        return {blocks[0][0]: rate}

    def deq_diagnostic_inputs(self) -> dict[str, tuple]:
        """The block's inputs (y, labels) at the seeded validation images of ``deq_contraction_rates``."""
        blocks = blocks_of(self)
        if not blocks:
            return {}
        return {blocks[0][0]: self._deq_block_inputs(self.split_tensor("val", VAL_CONTRACTION_POINTS))}

    def _deq_block_inputs(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        labels = diagnostic_levels(x.shape[0], self.net.sigmas.numel()).to(x.device)
        g = torch.Generator(device="cpu").manual_seed(self.val_seed)
        eps = torch.randn(x.shape, generator=g, dtype=x.dtype).to(x.device)
        xt = x + self.net.sigmas.to(x.dtype)[labels].reshape(-1, *([1] * (x.dim() - 1))) * eps
        with torch.no_grad():
            return self.net.deq_input(xt, labels), labels

    # ------------------------------------------------------------------ test extras
    def deq_contraction(self, x: torch.Tensor) -> tuple[float, int]:
        """Contraction rate of the learned DEQ map at its fixed point and forward solver iterations, on
        images ``x`` perturbed at the noise levels of :func:`diagnostic_levels` (seeded noise)."""
        block = self.net.deq_block()
        y, labels = self._deq_block_inputs(x)
        with torch.no_grad():
            block(y, labels)
            iterations = int(block.last_stats["iterations"])
        return block.contraction_rate(y, labels), iterations

    def deq_diagnostics(self, n: int = 64) -> dict[str, float]:
        """``test/deq_contraction_rate`` and ``test/deq_forward_iterations`` on ``n`` test images."""
        if self.net.deq_block() is None:
            return {}
        rate, iterations = self.deq_contraction(self.split_tensor("test", n))
        return {"test/deq_contraction_rate": rate, "test/deq_forward_iterations": float(iterations)}

    def on_test_epoch_end(self):
        super().on_test_epoch_end()
        extra = self.deq_diagnostics()
        for key, value in extra.items():
            self.log(key, value)
        self.test_results.update(extra)
        # the sampler behind test/fid and samples.png, beside the figures (a short sampler's FID is not the paper's)
        self.test_results.update({"test/langevin_n_steps_each": float(self.sampling["n_steps_each"]),
                                  "test/langevin_step_lr": float(self.sampling["step_lr"]),
                                  "test/langevin_levels": float(self.net.sigmas.numel())})

    # ------------------------------------------------------------------ samples
    def sample(self, n: int, generator: torch.Generator | None = None) -> torch.Tensor:
        """Annealed Langevin dynamics (``model.sampling``) from uniform noise on the pixel range, shown as a
        progress task of levels × steps (:mod:`src.runtime.progress`; silent without a progress bar)."""
        x0 = torch.rand((n, *self.data_shape), generator=generator, device=self.device, dtype=self.dtype)
        if self.pixel_range == "symmetric":
            x0 = 2 * x0 - 1
        was_training = self.net.training
        self.net.eval()
        steps = int(self.sampling["n_steps_each"])
        try:
            with progress.phase(self, f"Langevin sampling of {n} images (levels × steps)",
                                self.net.sigmas.numel() * steps) as advance:
                return annealed_langevin(self.net.score, x0, self.net.sigmas.to(self.dtype), n_steps_each=steps,
                                         step_lr=float(self.sampling["step_lr"]),
                                         denoise=bool(self.sampling["denoise"]),
                                         update=str(self.sampling["update"]), generator=generator,
                                         progress=advance)
        finally:
            self.net.train(was_training)
