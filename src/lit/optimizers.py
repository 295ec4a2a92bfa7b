"""Optimisers from config (``model.optimizer``), never from code, for every LightningModule.

- one optimiser over every parameter: ``{name: adam, lr: 1e-3, weight_decay: 1e-12}`` (``name`` is any
  ``torch.optim`` class, default Adam; other keys are its arguments);
- several, by name: ``{score: {lr: 1e-4, params: [score_net]}, vae: {lr: 1e-4, params: [encoder, decoder]}}``
  — ``params`` lists sub-modules (attribute paths) of the LightningModule; every trainable parameter must
  belong to exactly one optimiser. A family that alternates updates sets ``automatic_optimization = False``
  and calls :meth:`OptimizersMixin.manual_update` (backward, clipping, step) per optimiser in its
  ``training_step``. Lightning refuses manual optimisation while ``trainer.gradient_clip_val`` is set, so
  ``src.train`` moves that setting into ``manual_clip`` and :meth:`OptimizersMixin.manual_update` applies it:
  the same clipping in either mode.

:class:`OptimizersMixin` is mixed into :class:`src.lit.base.DeqsmModule`; it reads ``self.optimizer_cfg`` and
``self.manual_clip``.
"""

from __future__ import annotations

import inspect
from collections.abc import Mapping

import torch

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


class OptimizersMixin:
    """``configure_optimizers`` and the manual-optimisation helpers of a :class:`src.lit.base.DeqsmModule`."""

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
