"""The LightningModule base of every model family: optimisers, evaluation metrics, samples, exact resume.

:class:`DeqsmModule` holds what every family shares; a family subclass holds only its training logic.

Optimisers (``model.optimizer``), from config, never from code:

- one optimiser over every parameter: ``{name: adam, lr: 1e-3, weight_decay: 1e-12}`` (``name`` is any
  ``torch.optim`` class, default Adam; other keys are its arguments);
- several, by name: ``{score: {lr: 1e-4, params: [score_net]}, vae: {lr: 1e-4, params: [encoder, decoder]}}``
  — ``params`` lists sub-modules (attribute paths) of the LightningModule; every trainable parameter must
  belong to exactly one optimiser. A family that alternates updates sets ``automatic_optimization = False``
  and calls :meth:`DeqsmModule.manual_update` (backward, clipping, step) per optimiser in its
  ``training_step``. Lightning refuses manual optimisation while ``trainer.gradient_clip_val`` is set, so
  ``src.train`` moves that setting into :attr:`DeqsmModule.manual_clip` and :meth:`manual_update` applies
  it: the same clipping in either mode.

Evaluation (``model.metrics``, see :mod:`src.metrics.evaluation`): pluggable metrics updated per batch
and reduced across DDP ranks; the validation metrics feed checkpointing (``optimized_metric``), the test
metrics land in ``test_results`` and ``metrics.json``.

Samples: a generative family implements :meth:`DeqsmModule.sample` (model space); :meth:`sample_pixels`
maps samples to images through the data contract for grids and FID.

DEQ contraction (every family with a DEQ block): a forward pre-hook keeps the first ``deq_input_rows`` rows of
the last training input each DEQ block saw (a family that measures elsewhere sets 0: NCSN); at the end of each
validation the block's contraction rate ‖∂f/∂z‖₂ at that input's fixed point is logged
(``val/deq_contraction_rate``, the largest over blocks, and ``val/deq_contraction_rate/<block>`` when there are
several), and :meth:`DeqsmModule.check_phantom_truncation` warns when the phantom backward truncates a loss
that differentiates through the DEQ by more than ``src.deq.block.PHANTOM_TRUNCATION_WARN``.

Data and dtype: the module reads data only through the contract of :mod:`src.data.contract`, and every
tensor it takes from the data module is cast to the module's dtype and device (:meth:`model_tensor`), so
``trainer.precision=64-true`` runs end to end in float64.
"""

from __future__ import annotations

import random
import warnings
from collections.abc import Mapping
from typing import Any

import lightning.pytorch as L
import numpy as np
import torch

from src.checkpoints import NonFiniteCheckpointError, newest_checkpoint, nonfinite_entries
from src.configs import plain as as_plain
from src.data.contract import ScoreDataModule, require_contract
from src.deq.block import PHANTOM_TRUNCATION_WARN, DEQBlock, phantom_truncation
from src.metrics.evaluation import build_metrics
from src.objectives.base import ObjectiveOutput
from src.objectives.registry import objective_from_config


def batch_tensor(batch: Any) -> torch.Tensor:
    """The data tensor of a batch (plain tensor, or the first element of a tuple/list)."""
    return batch[0] if isinstance(batch, (tuple, list)) else batch


class NonFiniteLossError(FloatingPointError):
    pass


def capture_rng_states() -> dict:
    """The process's Python, numpy, torch (and CUDA) RNG states as tensors and plain Python values, so that a
    checkpoint holding them loads with ``weights_only=True`` (src.checkpoints)."""
    name, key, pos, has_gauss, cached = np.random.get_state(legacy=True)
    states = {"python": random.getstate(),
              "numpy": {"bit_generator": str(name), "key": torch.from_numpy(key.astype(np.int64)), "pos": int(pos),
                        "has_gauss": int(has_gauss), "cached_gaussian": float(cached)},
              "torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        states["cuda"] = torch.cuda.get_rng_state_all()
    return states


def restore_rng_states(states: dict) -> None:
    """Restore :func:`capture_rng_states`'s states (also the numpy tuple older checkpoints hold)."""
    random.setstate(tuple(tuple(s) if isinstance(s, list) else s for s in states["python"]))
    state = states["numpy"]
    if isinstance(state, dict):
        state = (state["bit_generator"], np.asarray(state["key"], dtype=np.int64).astype(np.uint32), state["pos"],
                 state["has_gauss"], state["cached_gaussian"])
    np.random.set_state(state)
    torch.set_rng_state(states["torch"])
    if "cuda" in states and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(states["cuda"])


_OPTIMIZER_KEYS = {"lr", "weight_decay", "betas", "eps", "momentum", "name", "amsgrad"}


def is_single_optimizer(cfg: Mapping) -> bool:
    """A flat mapping of optimiser arguments (``{lr: …}``) rather than ``{name: {lr: …, params: […]}}``."""
    return not cfg or not all(isinstance(v, Mapping) for v in cfg.values()) or bool(set(cfg) & _OPTIMIZER_KEYS)


SCHEDULERS = ("cosine",)


def _optimizer_classes() -> dict[str, type]:
    return {n.lower(): getattr(torch.optim, n) for n in dir(torch.optim)
            if isinstance(getattr(torch.optim, n), type) and issubclass(getattr(torch.optim, n), torch.optim.Optimizer)
            and getattr(torch.optim, n) is not torch.optim.Optimizer}


def optimizer_arguments(spec: Mapping, where: str = "model.optimizer") -> tuple[type, dict]:
    """The ``torch.optim`` class and its keyword arguments of one optimiser spec, checked: a one-line
    ``ValueError`` naming the key (``where``) for an unknown optimiser, an argument the class does not take, a
    value that is not a number, or lr <= 0 / weight_decay < 0. Called at start-up (module construction) and
    again by :func:`make_optimizer`."""
    import inspect

    spec = dict(spec)
    spec.pop("params", None)
    spec.pop("scheduler", None)
    name = str(spec.pop("name", "adam"))
    classes = _optimizer_classes()
    if name.lower() not in classes:
        raise ValueError(f"{where}.name={name!r} is not a torch.optim optimiser; valid: "
                         f"{', '.join(sorted(classes))}")
    cls = classes[name.lower()]
    accepted = set(inspect.signature(cls.__init__).parameters) - {"self", "params"}
    unknown = sorted(set(spec) - accepted)
    if unknown:
        raise ValueError(f"{where}: {cls.__name__} takes no argument {', '.join(unknown)}; "
                         f"its arguments: {', '.join(sorted(accepted))}")
    for key in ("lr", "weight_decay", "eps", "momentum"):
        if key in spec:
            try:
                spec[key] = float(spec[key])
            except (TypeError, ValueError):
                raise ValueError(f"{where}.{key}={spec[key]!r} is not a number") from None
    spec.setdefault("lr", 1e-3)
    if not spec["lr"] > 0:
        raise ValueError(f"{where}.lr={spec['lr']:g} must be > 0 (e.g. 1e-3)")
    if spec.get("weight_decay", 0.0) < 0:
        raise ValueError(f"{where}.weight_decay={spec['weight_decay']:g} must be >= 0")
    if "betas" in spec:
        spec["betas"] = tuple(float(b) for b in spec["betas"])
    return cls, spec


def make_optimizer(params, spec: Mapping, where: str = "model.optimizer") -> torch.optim.Optimizer:
    """``torch.optim.<name>(params, **rest)`` from a config mapping (default Adam, lr 1e-3), checked by
    :func:`optimizer_arguments`."""
    cls, kwargs = optimizer_arguments(spec, where)
    return cls(params, **kwargs)


class DeqsmModule(L.LightningModule):
    """Base of every family (see the module docstring). Subclasses set ``self.net`` and may override:

    - ``eval_model()``: the object the score-based metrics differentiate (``log_density`` and/or ``score``);
    - ``log_likelihood_metrics(x) -> {name: [B]}`` and ``log_likelihood_constants() -> {key: float}``;
    - ``sample(n, generator) -> [n, *data_shape]`` for generative families;
    - ``loss_differentiates_through_deq()`` and ``deq_contraction_rates()`` (see the module docstring).
    """

    net: torch.nn.Module
    deq_input_rows = 16  # rows of the last training input kept per DEQ block for its contraction rate (0: none)
    outputs_score = False  # the network outputs the score itself (not an energy): see loss_differentiates_through_deq
    # The training objective (model.loss), built once here from the config by
    # src.objectives.registry.objective_from_config; a family without one (the supervised studies) sets None.
    default_loss: str | None = None  # the family's objective when model.loss names none
    train_losses: tuple[str, ...] | None = None  # the objectives the family trains with (None: every one)
    ignored_loss_keys: tuple[str, ...] = ()  # loss-config keys the family replaces (NCSN: sigma)

    def __init__(self, optimizer: Mapping | None = None, metrics: Mapping | None = None,
                 monitor: str | None = None, monitor_mode: str | None = None,
                 loss: Mapping | None = None, loss_bound: Mapping | None = None):
        """``monitor`` / ``monitor_mode``: the family's default ``optimized_metric`` (conf/train.yaml reads
        them from the model config); the module itself only records them. ``loss``: the ``model.loss`` config,
        built into ``self.objective`` (with ``self.loss_name``, ``self.loss_kwargs``) when the family has a
        ``default_loss``; ``loss_bound``: hyper-parameters the family sets over the config's (the VAE's
        projection)."""
        super().__init__()
        self.monitor, self.monitor_mode = monitor, monitor_mode
        self.loss_name: str | None = None
        self.loss_kwargs: dict[str, Any] = {}
        self.objective = None
        if self.default_loss is not None:
            self.loss_name, self.loss_kwargs, self.objective = objective_from_config(
                as_plain(loss), default=self.default_loss, family=type(self).__name__,
                allowed=self.train_losses, ignored=self.ignored_loss_keys, bound=loss_bound)
        self.optimizer_cfg = dict(as_plain(optimizer) or {})
        for name, spec in self.optimizer_specs().items():  # bad optimiser settings: one line, at start-up
            optimizer_arguments(spec, self._optimizer_key(name))
        self.eval_metrics = build_metrics(as_plain(metrics))
        self.manual_clip: dict[str, Any] = {}
        self.n_samples_grid = 0  # generative families: samples.png of this many samples at the end of the test
        self.test_results: dict[str, float] = {}
        self._data: ScoreDataModule | None = None
        self._deq_inputs: dict[str, tuple] = {}
        self._deq_hooks: list = []

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

    # ------------------------------------------------------------------ optimisers
    def optimizer_specs(self) -> dict[str, dict]:
        """``{name: spec}`` of the configured optimisers (a single one is named ``"main"``)."""
        cfg = self.optimizer_cfg
        if is_single_optimizer(cfg):
            return {"main": dict(cfg)}
        return {name: dict(spec) for name, spec in cfg.items()}

    def _optimizer_key(self, name: str) -> str:
        """The config key of optimiser ``name`` (``model.optimizer`` for a single one)."""
        return "model.optimizer" if is_single_optimizer(self.optimizer_cfg) else f"model.optimizer.{name}"

    def _params_of(self, name: str, spec: Mapping) -> list[torch.nn.Parameter]:
        paths = spec.get("params")
        if paths is None:
            return [p for p in self.parameters() if p.requires_grad]
        params = []
        for path in [paths] if isinstance(paths, str) else paths:
            try:
                sub = self.get_submodule(path) if path else self
            except AttributeError:
                raise ValueError(f"model.optimizer.{name}.params: {type(self).__name__} has no sub-module "
                                 f"{path!r}") from None
            params += [p for p in sub.parameters() if p.requires_grad]
        return params

    def configure_optimizers(self):
        """The configured optimisers; ``scheduler: cosine`` in a spec anneals its learning rate to 1 % over
        the run (per step). None when the module has no trainable parameter (an evaluation-only model)."""
        if not any(p.requires_grad for p in self.parameters()):
            return None
        specs = self.optimizer_specs()
        optimizers, owner = [], {}
        for name, spec in specs.items():
            params = self._params_of(name, spec)
            for p in params:
                if id(p) in owner:
                    raise ValueError(f"a parameter belongs to two optimisers ({owner[id(p)]} and {name}): "
                                     "make the model.optimizer.*.params lists disjoint")
                owner[id(p)] = name
            if not params:
                raise ValueError(f"model.optimizer.{name} has no trainable parameters")
            optimizers.append(make_optimizer(params, spec, self._optimizer_key(name)))
        missing = [n for n, p in self.named_parameters() if p.requires_grad and id(p) not in owner]
        if missing:
            raise ValueError(f"parameters in no optimiser: {', '.join(missing[:5])}"
                             f"{' …' if len(missing) > 5 else ''}; add their module to a model.optimizer.*.params")
        schedulers = []
        for (name, spec), opt in zip(specs.items(), optimizers):
            kind = spec.get("scheduler")
            if kind is None:
                continue
            if kind not in SCHEDULERS:
                raise ValueError(f"model.optimizer scheduler={kind!r} is unknown; valid: {', '.join(SCHEDULERS)}")
            steps = max(1, int(self.trainer.estimated_stepping_batches))
            lr = opt.param_groups[0]["lr"]
            schedulers.append({"scheduler": torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=steps,
                                                                                       eta_min=lr * 1e-2),
                               "interval": "step"})
        if schedulers:
            return optimizers, schedulers
        return optimizers[0] if len(optimizers) == 1 else optimizers

    def named_optimizer(self, name: str):
        """The (Lightning-wrapped) optimiser called ``name`` in the config (manual optimisation)."""
        names = list(self.optimizer_specs())
        opts = self.optimizers()
        opts = opts if isinstance(opts, list) else [opts]
        return opts[names.index(name)]

    def manual_update(self, name: str, loss: torch.Tensor) -> None:
        """One update of optimiser ``name`` on ``loss``: zero_grad, backward, clipping (as configured), step."""
        self.check_finite(loss, name)
        opt = self.named_optimizer(name)
        opt.zero_grad()
        self.manual_backward(loss)
        if self.manual_clip.get("gradient_clip_val"):
            self.clip_gradients(opt, gradient_clip_val=float(self.manual_clip["gradient_clip_val"]),
                                gradient_clip_algorithm=self.manual_clip.get("gradient_clip_algorithm") or "norm")
        opt.step()

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

        from src.callbacks.samples import log_image, save_image_grid

        path = save_image_grid(images, Path(self.trainer.default_root_dir) / name)
        log_image(self.trainer, "samples", path)
        return path

    # ------------------------------------------------------------------ DEQ contraction, phantom truncation
    def loss_differentiates_through_deq(self) -> bool:
        """Whether the training loss's value contains a derivative w.r.t. the data through the DEQ, so that the
        phantom backward (Alg. 1) truncates the loss itself, not only its parameter gradient. An energy / density
        model's score is ∇ₓ log p through the DEQ: every score-matching loss does, MLE does not (NICE's additive
        couplings have unit Jacobian determinant). A score network (``outputs_score``: NCSN, the VAE's estimator)
        is differentiated only by the divergence of SSM / SSM-VR / SM, not by DSM."""
        name = self.loss_name
        return not (name == "mle" or (self.outputs_score and name == "dsm"))

    def on_fit_start(self) -> None:
        self._deq_inputs = {}
        if not self.deq_input_rows:  # the family measures its rate on other inputs (NCSN: validation images)
            return
        for name, block in self._deq_blocks():
            self._deq_hooks.append(block.register_forward_pre_hook(self._deq_input_hook(name)))

    def on_fit_end(self) -> None:
        for handle in self._deq_hooks:
            handle.remove()
        self._deq_hooks = []

    def _deq_input_hook(self, name: str):
        rows = self.deq_input_rows

        def keep(block, args):
            if block.training:  # training forwards only; the first rows, detached, copied (not a view)
                self._deq_inputs[name] = tuple(a.detach()[:rows].clone() if torch.is_tensor(a) and a.dim() else a
                                               for a in args)
        return keep

    def deq_contraction_rates(self) -> dict[str, float]:
        """{block name: ‖∂f/∂z‖₂ at the fixed point} of each DEQ block, at the last training input it saw
        (:meth:`src.deq.block.DEQBlock.contraction_rate`); blocks that have not seen one are left out."""
        return {name: block.contraction_rate(*self._deq_inputs[name])
                for name, block in self._deq_blocks() if name in self._deq_inputs}

    def deq_diagnostic_inputs(self) -> dict[str, tuple]:
        """{block name: the inputs (x, *cond) its recurrence share is measured at}: the last training input."""
        return {name: self._deq_inputs[name] for name, _ in self._deq_blocks() if name in self._deq_inputs}

    def deq_recurrence_metrics(self, stage: str = "val") -> dict[str, float]:
        """``{stage}/deq_recurrence_share[/<block>]`` (‖z* − φ(0)‖/‖z*‖, mean over samples), ``…_max``,
        ``{stage}/deq_branch_ratio`` (residual maps: ‖h(z*)‖/‖g‖), ``{stage}/deq_iterations`` and
        ``{stage}/deq_hit_cap`` of each DEQ block (:func:`src.deq.diagnostics.recurrence_share`) at
        :meth:`deq_diagnostic_inputs`; one warning per near-inert block."""
        from src.deq.diagnostics import NEAR_INERT_SHARE, near_inert, recurrence_share

        blocks = dict(self._deq_blocks())
        out: dict[str, float] = {}
        for name, inputs in self.deq_diagnostic_inputs().items():
            stats = recurrence_share(blocks[name], *inputs, rate=False)
            suffix = f"/{name}" if len(blocks) > 1 else ""
            for key, logged in (("share_mean", "recurrence_share"), ("share_max", "recurrence_share_max"),
                                ("branch_mean", "branch_ratio"), ("iterations", "iterations"),
                                ("hit_cap", "hit_cap")):
                if key in stats:
                    out[f"{stage}/deq_{logged}{suffix}"] = stats[key]
            if near_inert(stats):
                warnings.warn(f"{type(self).__name__}: DEQ block '{name}' is near-inert: its fixed point is within "
                              f"{stats['share_mean']:.1%} of one explicit pass φ(0) (< {NEAR_INERT_SHARE:.0%}), so "
                              "it is in effect an explicit network (a tighter deq.norm / deq.norm_lambda helps).",
                              RuntimeWarning, stacklevel=2)
        return out

    def log_deq_recurrence(self) -> None:
        """Log :meth:`deq_recurrence_metrics` at validation (largest over ranks)."""
        for key, value in self.deq_recurrence_metrics("val").items():
            self.log(key, value, sync_dist=True, reduce_fx="max")

    def log_deq_contraction(self) -> None:
        """Log ``val/deq_contraction_rate`` (largest over blocks; per block too when there are several) and warn
        when it makes the phantom backward truncate the loss (:meth:`check_phantom_truncation`); then the
        recurrence share of every block (:meth:`log_deq_recurrence`)."""
        self.log_deq_recurrence()
        rates = self.deq_contraction_rates()
        if not rates:
            return
        self.log("val/deq_contraction_rate", max(rates.values()), sync_dist=True, reduce_fx="max")
        if len(rates) > 1:
            for name, rate in rates.items():
                self.log(f"val/deq_contraction_rate/{name}", rate, sync_dist=True, reduce_fx="max")
        blocks = dict(self._deq_blocks())
        for name, rate in rates.items():
            self.check_phantom_truncation(rate, blocks[name])

    def check_phantom_truncation(self, rate: float, block=None) -> float | None:
        """Warn when the phantom backward of ``block`` (default: the only DEQ block) truncates a loss that
        differentiates through the DEQ by more than ``PHANTOM_TRUNCATION_WARN`` at the contraction ``rate``
        (:func:`src.deq.block.phantom_truncation`); returns the bound, or None when it does not apply (no DEQ,
        the implicit backward, which is exact, or a loss with no derivative through the DEQ)."""
        if block is None:
            blocks = self._deq_blocks()
            if len(blocks) != 1:
                return None
            block = blocks[0][1]
        if block.config.backward != "phantom" or not self.loss_differentiates_through_deq():
            return None
        k = int(block.config.phantom_steps)
        bound = phantom_truncation(rate, k)
        if bound > PHANTOM_TRUNCATION_WARN:
            warnings.warn(
                f"{type(self).__name__}: DEQ block '{block.name}' contracts at {rate:.3f}, so the phantom gradient "
                f"with K = {k} (deq.phantom_steps) truncates the training loss's derivative through the DEQ by up "
                f"to {bound:.0%}; the network can lower that truncated loss while the exact one rises. Use "
                "deq.backward=implicit (exact) or raise deq.phantom_steps until ρᴷ/(1 − ρ) is small.",
                RuntimeWarning, stacklevel=2)
        return bound

    # ------------------------------------------------------------------ exact resume
    def _deq_blocks(self):
        return [(name, m) for name, m in self.named_modules() if isinstance(m, DEQBlock)]

    def configure_callbacks(self):
        """:class:`~src.callbacks.rng.EvaluationRngGuard`: validation leaves the training RNG where it found it."""
        from src.callbacks.rng import EvaluationRngGuard

        return [EvaluationRngGuard()]

    def _resume_hint(self) -> str:
        """Where to resume from: the newest checkpoint of this run (every one on disk is finite)."""
        trainer = getattr(self, "_trainer", None)
        folders = [getattr(cb, "dirpath", None) for cb in (trainer.checkpoint_callbacks if trainer else [])]
        newest = newest_checkpoint(folders)
        if newest is None:
            return "no checkpoint of this run was written yet"
        return f"the newest finite checkpoint is {newest} (resume with ckpt_path={newest})"

    def on_save_checkpoint(self, checkpoint: dict) -> None:
        """Also save RNG states and DEQ warm-start fixed points, so a resumed run continues exactly; refuse to
        save non-finite parameters, optimiser, EMA or warm-start states (on every rank: DDP stops together)."""
        checkpoint["deqsm_family"] = type(self).__name__  # named when a checkpoint is given to another family
        checkpoint["deqsm_rng_states"] = capture_rng_states()
        checkpoint["deqsm_warm_start"] = {name: m.warm_start_state() for name, m in self._deq_blocks()}
        bad = nonfinite_entries(checkpoint)
        if bad:
            raise NonFiniteCheckpointError(
                f"the state at global step {checkpoint.get('global_step', self.global_step)} is not finite "
                f"({', '.join(bad[:3])}{' …' if len(bad) > 3 else ''}): no checkpoint written; "
                f"{self._resume_hint()}. Try a smaller model.optimizer lr, a larger deq.norm_lambda, or gradient "
                "clipping (trainer.gradient_clip_val)."
            )

    def on_train_start(self) -> None:
        # The training loader's position (src.data.resumable) is restored by Lightning only when it builds the
        # loader after loading the checkpoint; a scheduler sized by trainer.estimated_stepping_batches
        # (scheduler: cosine) makes it build the loader earlier, in configure_optimizers, and the saved position
        # was then never applied (measured: the resumed epoch restarted at its first batch). Apply it now,
        # before the first batch is drawn (the resumable loader reads its position lazily).
        fit_loop = self.trainer.fit_loop
        if getattr(fit_loop, "_combined_loader_states_to_load", None):
            fit_loop._load_combined_loader_states()

    def on_load_checkpoint(self, checkpoint: dict) -> None:
        trainer = getattr(self, "_trainer", None)
        if trainer is not None:
            # Lightning loads the weights before its precision plugin converts the module (Trainer._run restores,
            # then sets the strategy up): with trainer.precision=64-true the float64 weights would pass through
            # float32 parameters and lose their low bits (measured: 1e-7 relative). Convert first (in place).
            trainer.precision_plugin.convert_module(self)
        if "deqsm_rng_states" in checkpoint:
            restore_rng_states(checkpoint["deqsm_rng_states"])
        states = checkpoint.get("deqsm_warm_start", {})
        for name, m in self._deq_blocks():
            if name in states:
                m.load_warm_start_state(states[name])


class ScoreMatchingModule(DeqsmModule):
    """A family trained by one score-matching objective (``model.loss``, :mod:`src.objectives`) with one
    optimiser and Lightning's automatic optimisation. ``training_objective`` may be overridden (DKEF fits α
    on half the batch; NCSN applies the objective in its noise-conditional form)."""

    default_loss = "sm"

    def training_objective(self, x: torch.Tensor) -> ObjectiveOutput:
        return self.objective(self.net, x)

    def training_step(self, batch, batch_idx):
        x = batch_tensor(batch)
        out = self.training_objective(x)
        self.check_finite(out.loss, f"training (loss={self.loss_name})")
        self.log("train/loss", out.loss, prog_bar=True, on_step=True, on_epoch=True, batch_size=x.shape[0])
        for name, value in out.parts.items():
            self.log(f"train/{name}", value, on_step=False, on_epoch=True, batch_size=x.shape[0])
        return out.loss
