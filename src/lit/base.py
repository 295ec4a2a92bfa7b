"""The LightningModule base of every model family: the training and evaluation loop, metrics, samples.

:class:`DeqsmModule` holds what every family shares; a family subclass holds only its training logic.

Concerns kept in their own modules and mixed in: optimisers from config (:mod:`src.lit.optimizers`), the DEQ
contraction monitor (:mod:`src.lit.deq_monitor`), the save/resume hooks of an exact resume (:mod:`src.lit.resume`).
The base keeps the training and evaluation loop.

Evaluation (``model.metrics``, see :mod:`src.metrics.registry`): pluggable metrics updated per batch
and reduced across DDP ranks; the validation metrics feed checkpointing (``optimized_metric``), the test
metrics land in ``test_results`` and ``metrics.json``.

Samples: a generative family implements :meth:`DeqsmModule.sample` (model space); :meth:`sample_pixels`
maps samples to images through the data contract for grids and FID.

Data and dtype: the module reads data only through the contract of :mod:`src.data.contract`, and every
tensor it takes from the data module is cast to the module's dtype and device (:meth:`model_tensor`), so
``trainer.precision=64-true`` runs end to end in float64.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import lightning.pytorch as L
import torch

from src.config.values import plain
from src.data.contract import ScoreDataModule, require_contract
from src.deq.config import DEQConfig, deq_setting
from src.deq.core import correction_weights
from src.lit.deq_monitor import DEQMonitorMixin
from src.lit.nets import complete_net, net_factory, net_hparams
from src.lit.optimizers import OptimizersMixin, optimizer_factories, scheduler_factory
from src.lit.resume import ResumeHooksMixin
from src.metrics.registry import build_metrics
from src.objectives.base import ObjectiveOutput, weighted_states_loss
from src.objectives.registry import objective_from_config


def batch_tensor(batch: Any) -> torch.Tensor:
    """The data tensor of a batch (plain tensor, or the first element of a tuple/list)."""
    return batch[0] if isinstance(batch, (tuple, list)) else batch


class NonFiniteLossError(FloatingPointError):
    pass


class DeqsmModule(OptimizersMixin, DEQMonitorMixin, ResumeHooksMixin, L.LightningModule):
    """Base of every family (see the module docstring). Subclasses set ``self.net`` (from ``model.net`` with
    :meth:`build_net`) and may override:

    - ``eval_model()``: the object the score-based metrics differentiate (``log_density`` and/or ``score``);
    - ``log_likelihood_metrics(x) -> {name: [B]}`` and ``log_likelihood_constants() -> {key: float}``;
    - ``sample(n, generator) -> [n, *data_shape]`` for generative families;
    - ``loss_differentiates_through_deq()`` and ``deq_contraction_rates()`` (see the module docstring).
    """

    net: torch.nn.Module
    family: str | None = None  # the model family (src.deq.config.DEPTH_RULES): what deq and depth may say
    # The run's DEQ setting, parsed once from the ``deq`` config group where the module is built (__init__): a
    # DEQConfig, or None for explicit layers. The family hands it to its network; nothing below parses it again.
    deq: DEQConfig | None = None
    # The family's network class (or builder): what model.net builds when a module built in code is given none.
    default_net: Any = None
    # The training objective (model.loss), built once here from the config by
    # src.objectives.registry.objective_from_config; a family without one (the supervised studies) sets None.
    default_loss: str | None = None  # the family's objective when model.loss names none
    train_losses: tuple[str, ...] | None = None  # the objectives the family trains with (None: every one)
    ignored_loss_keys: tuple[str, ...] = ()  # loss-config keys the family replaces (NCSN: sigma)

    def __init__(self, optimizer: Any = None, metrics: Mapping | None = None,
                 monitor: str | None = None, monitor_mode: str | None = None,
                 loss: Mapping | None = None, loss_bound: Mapping | None = None, deq: Mapping | None = None,
                 deq_enabled: bool | None = None, scheduler: Any = None):
        """``monitor`` / ``monitor_mode``: the family's default ``optimized_metric`` (conf/train.yaml reads
        them from the model config); the module itself only records them. ``loss``: the ``model.loss`` config,
        built into ``self.objective`` (with ``self.loss_name``, ``self.loss_kwargs``) when the family has a
        ``default_loss``; ``loss_bound``: hyper-parameters the family sets over the config's (the VAE's
        projection). ``deq``: the ``deq`` config group, parsed here once into ``self.deq``
        (:func:`src.deq.config.deq_setting`, which refuses what the family cannot run); ``deq_enabled``: True for
        a family whose architecture is a DEQ by its own choice (the supervised ``model.arch=deq``).
        ``optimizer`` / ``scheduler``: partial ``torch.optim`` classes (``model.optimizer``, ``model.scheduler``:
        :mod:`src.lit.optimizers`), checked here so that a bad setting stops the run at start-up in one line."""
        super().__init__()
        self.monitor, self.monitor_mode = monitor, monitor_mode
        self.loss_name: str | None = None
        self.loss_kwargs: dict[str, Any] = {}
        self.objective = None
        if self.default_loss is not None:
            self.loss_name, self.loss_kwargs, self.objective = objective_from_config(
                plain(loss), default=self.default_loss, family=type(self).__name__,
                allowed=self.train_losses, ignored=self.ignored_loss_keys, bound=loss_bound)
        self.deq = deq_setting(deq, self.family, loss=self.loss_name, enabled=deq_enabled)
        self.optimizer_factories = optimizer_factories(optimizer)
        self.scheduler_factory = scheduler_factory(scheduler)
        self.eval_metrics = build_metrics(plain(metrics))
        self.manual_clip: dict[str, Any] = {}
        self.n_samples_grid = 0  # generative families: samples.png of this many samples at the end of the test
        self.test_results: dict[str, float] = {}
        self._data: ScoreDataModule | None = None
        self._deq_inputs: dict[str, tuple] = {}
        self._deq_hooks: list = []

    # ------------------------------------------------------------------ network
    def build_net(self, net: Any, **given: Any):
        """The family's network from ``model.net`` (a partial class, :mod:`src.lit.nets`; None: ``default_net`` with
        its own defaults), completed by ``given`` (what the module knows: data dimensions, ``deq=self.deq``,
        ``depth``). The net's config is kept as the ``net`` hyper-parameter (plain values)."""
        factory = net_factory(net if net is not None else type(self).default_net)  # (a function: not bound)
        self.hparams["net"] = net_hparams(factory)
        return complete_net(factory, **given)

    # ------------------------------------------------------------------ data and dtype
    def datamodule(self) -> ScoreDataModule:
        """The run's data module, checked against the data contract."""
        trainer = getattr(self, "_trainer", None)
        dm = getattr(trainer, "datamodule", None) if trainer is not None else None
        if dm is None and self._data is not None:
            return self._data
        return require_contract(dm, type(self).__name__)

    def attach_datamodule(self, datamodule: ScoreDataModule) -> None:
        """Use ``datamodule`` outside a Trainer (scripts, benchmarks)."""
        self._data = require_contract(datamodule, type(self).__name__)

    def model_tensor(self, t: torch.Tensor) -> torch.Tensor:
        """``t`` in this module's floating dtype and on its device (data enter the model only this way)."""
        return t.to(device=self.device, dtype=self.dtype if t.is_floating_point() else t.dtype)

    def split_tensor(self, split: str, n: int | None = None) -> torch.Tensor:
        return self.model_tensor(self.datamodule().split_tensor(split, n))

    def check_finite(self, loss: torch.Tensor, what: str = "training") -> None:
        if not torch.isfinite(loss):
            raise NonFiniteLossError(
                f"non-finite {what} loss ({loss.item()}) at global step {self.global_step}; {self._resume_hint()}. "
                "Try a smaller model.optimizer lr, a larger deq.norm_lambda, or gradient clipping "
                "(trainer.gradient_clip_val)."
            )

    # ------------------------------------------------------------------ evaluation
    def eval_model(self):
        """The object the score-based metrics differentiate (exposes log_density and/or score)."""
        return self.net

    def log_likelihood_metrics(self, x: torch.Tensor) -> dict[str, torch.Tensor]:
        raise NotImplementedError(f"{type(self).__name__} has no likelihood: switch model.metrics.log_likelihood off")

    def log_likelihood_constants(self) -> dict[str, float]:
        return {}

    def _stage_metrics(self, stage: str):
        return [m for m in self.eval_metrics.values() if stage in m.stages]

    def _metrics_start(self, stage: str) -> None:
        dm = self.datamodule()
        for m in self._stage_metrics(stage):
            m.reset()
            m.setup(self, dm)

    def _metrics_update(self, batch, stage: str) -> None:
        x = self.model_tensor(batch_tensor(batch))
        for m in self._stage_metrics(stage):
            m.update(self, x, stage)

    def _metrics_end(self, stage: str) -> dict[str, float]:
        results: dict[str, float] = {}
        for m in self._stage_metrics(stage):
            results.update(m.compute(self, stage))
        for key, value in results.items():
            # already reduced across ranks by torchmetrics: log the value as it is
            self.log(key, float(value), prog_bar=key == f"{stage}/sm_loss", rank_zero_only=False)
        return results

    def on_validation_epoch_start(self):
        self._metrics_start("val")

    def validation_step(self, batch, batch_idx):
        self._metrics_update(batch, "val")

    def on_validation_epoch_end(self):
        self._metrics_end("val")
        self.log_deq_contraction()

    def on_test_epoch_start(self):
        self.test_results = {}
        self._metrics_start("test")

    def test_step(self, batch, batch_idx):
        self._metrics_update(batch, "test")

    def on_test_epoch_end(self):
        self.test_results = self._metrics_end("test")
        self.test_results.update(self.deq_recurrence_metrics("test"))
        for m in self._stage_metrics("test"):  # per-point lists (paired comparisons): metrics.json only, not logged
            self.test_results.update(m.point_values())

    # ------------------------------------------------------------------ samples
    def sample(self, n: int, generator: torch.Generator | None = None) -> torch.Tensor | None:
        """``n`` samples in model space ``[n, *data_shape]``; None for a family that does not generate."""
        return None

    @torch.no_grad()
    def sample_pixels(self, n: int, seed: int = 0) -> torch.Tensor | None:
        """``n`` samples as images ``[n, C, H, W]`` in [0, 1] on the CPU (sample grids, FID), or None."""
        dm = self.datamodule()
        if not dm.is_image:
            return None
        g = torch.Generator(device=self.device).manual_seed(int(seed))
        y = self.sample(n, generator=g)
        if y is None:
            return None
        return dm.to_pixels(y).float().cpu()

    def on_test_end(self) -> None:
        # the tested weights (best checkpoint; EMA-averaged when EMA is on), once, on global rank 0
        if self.trainer.is_global_zero and self.n_samples_grid > 0:
            self.save_sample_grid(self.n_samples_grid)

    def save_sample_grid(self, n: int = 64, name: str = "samples.png"):
        """Write ``n`` samples as a PNG grid into the run directory (and to the loggers that take images)."""
        images = self.sample_pixels(n)
        if images is None or self._trainer is None:
            return None
        from pathlib import Path

        from src.sampling.grids import log_image, save_image_grid

        path = save_image_grid(images, Path(self.trainer.default_root_dir) / name)
        log_image(self.trainer, "samples", path)
        return path

class ScoreMatchingModule(DeqsmModule):
    """A family trained by one score-matching objective (``model.loss``, :mod:`src.objectives`) with one
    optimiser and Lightning's automatic optimisation. ``training_objective`` may be overridden (DKEF fits α
    on half the batch; NCSN applies the objective in its noise-conditional form)."""

    default_loss = "sm"

    def training_objective(self, x: torch.Tensor) -> ObjectiveOutput:
        return self.objective(self.net, x)

    def training_step(self, batch, batch_idx):
        """The objective's loss (``train/loss``) plus the DEQ's Jacobian penalty; when the objective returns the
        fixed-point correction states' outputs (``out.states``), the loss trained is their weighted sum
        Σ_i γ^(n−i) ℓ_i (Bai et al. 2022, §3.3; :func:`src.deq.core.correction_weights`), logged as
        ``train/correction_loss``, while ``train/loss`` stays the fixed point's."""
        x = batch_tensor(batch)
        with self.deq_forwards() as infos:
            out = self.training_objective(x)
        self.check_finite(out.loss, f"training (loss={self.loss_name})")
        self.log("train/loss", out.loss, prog_bar=True, on_step=True, on_epoch=True, batch_size=x.shape[0])
        for name, value in out.parts.items():
            self.log(f"train/{name}", value, on_step=False, on_epoch=True, batch_size=x.shape[0])
        loss = out.loss
        if out.states is not None:
            loss = weighted_states_loss(out.states, correction_weights(len(out.states), self.deq.correction_gamma))
            self.check_finite(loss, f"training (fixed-point correction, loss={self.loss_name})")
            self.log("train/correction_loss", loss, on_step=True, on_epoch=True, batch_size=x.shape[0])
        return self.with_deq_penalty(loss, x.shape[0], infos)
