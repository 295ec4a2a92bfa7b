"""Optimisers and learning-rate schedulers from config, Hydra's ``_partial_`` idiom (as lightning-hydra-template).

``model.optimizer`` is a partial ``torch.optim`` class — every argument but the parameters::

    optimizer: {_target_: torch.optim.Adam, _partial_: true, lr: 1.0e-3, weight_decay: 1.0e-12}

(``model.optimizer._target_=torch.optim.SGD +model.optimizer.momentum=0.9`` swaps it from the command line), or
several such partials by name for a family that alternates updates (the SSM-VAE: ``{score: {...}, vae: {...}}``);
the family says which sub-modules each named optimiser updates (:attr:`OptimizersMixin.optimized_modules`), and
calls :meth:`OptimizersMixin.manual_update` (backward, clipping, step) per optimiser in its ``training_step``.
Lightning refuses manual optimisation while ``trainer.gradient_clip_val`` is set, so ``src.train`` moves that
setting into ``manual_clip`` and :meth:`OptimizersMixin.manual_update` applies it: the same clipping in either mode.

``model.scheduler`` (null: none) is a partial ``torch.optim.lr_scheduler`` class applied to each optimiser and
stepped per training step; its length argument (``T_max``, ``total_steps``, ``total_iters``), when the class takes
one and the config leaves it out, is the run's number of steps (``trainer.estimated_stepping_batches``), e.g.
``{_target_: torch.optim.lr_scheduler.CosineAnnealingLR, _partial_: true, eta_min: 1.0e-5}``.

Hydra builds the partials when it instantiates ``model``; a module built in code takes a ``functools.partial``
or the same mapping (instantiated here). :class:`OptimizersMixin` is mixed into :class:`src.lit.base.DeqsmModule`.
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable, Mapping
from typing import Any, ClassVar

import torch

from src.config.partials import partial_argument, partial_of, partial_target

OLD_SPELLING = ("model.optimizer={lr: …, name: adam} is the old spelling: give a partial torch.optim class, "
                "model.optimizer={_target_: torch.optim.Adam, _partial_: true, lr: …}")
LENGTH_ARGUMENTS = ("T_max", "total_steps", "total_iters")  # a scheduler's run length, filled in when left out


def _partial_of(spec: Any, where: str) -> Callable:
    return partial_of(spec, where, OLD_SPELLING)


def optimizer_factories(optimizer: Any) -> dict[str, Callable]:
    """``{name: partial optimiser}`` of the ``optimizer`` argument (a single one is named ``"main"``), each checked
    by :func:`check_optimizer`. None or an empty mapping: Adam with its defaults."""
    if optimizer is None or (isinstance(optimizer, Mapping) and not optimizer):
        optimizer = functools.partial(torch.optim.Adam)
    if isinstance(optimizer, Mapping) and "_target_" not in optimizer and all(
            isinstance(v, Mapping) or (callable(v) and not isinstance(v, (str, bytes))) for v in optimizer.values()):
        out = {str(k): _partial_of(v, f"model.optimizer.{k}") for k, v in optimizer.items()}
    else:
        out = {"main": _partial_of(optimizer, "model.optimizer")}
    for name, factory in out.items():
        check_optimizer(factory, optimizer_key(name, len(out)))
    return out


def optimizer_key(name: str, count: int) -> str:
    """The config key of optimiser ``name`` (``model.optimizer`` for a single one)."""
    return "model.optimizer" if name == "main" and count == 1 else f"model.optimizer.{name}"


def check_optimizer(factory: Callable, where: str = "model.optimizer") -> None:
    """A one-line ``ValueError`` naming the key (``where``) for a target that is not a ``torch.optim`` optimiser, an
    argument the class does not take, a value that is not a number, or lr <= 0 / weight_decay < 0 (at start-up:
    module construction)."""
    cls = getattr(factory, "func", factory)
    if not (isinstance(cls, type) and issubclass(cls, torch.optim.Optimizer)):
        raise ValueError(f"{where}._target_={getattr(cls, '__qualname__', cls)} is not a torch.optim optimiser "  # noqa: TRY004
                         "(e.g. torch.optim.Adam, torch.optim.SGD)")
    kwargs = dict(getattr(factory, "keywords", None) or {})
    accepted = set(inspect.signature(cls.__init__).parameters) - {"self", "params"}
    unknown = sorted(set(kwargs) - accepted)
    if unknown:
        raise ValueError(f"{where}: {cls.__name__} takes no argument {', '.join(unknown)}; "
                         f"its arguments: {', '.join(sorted(accepted))}")
    for key in ("lr", "weight_decay", "eps", "momentum"):
        if key in kwargs and not isinstance(kwargs[key], torch.Tensor):
            try:
                float(kwargs[key])
            except (TypeError, ValueError):
                raise ValueError(f"{where}.{key}={kwargs[key]!r} is not a number") from None
    if "lr" in kwargs and not float(kwargs["lr"]) > 0:
        raise ValueError(f"{where}.lr={float(kwargs['lr']):g} must be > 0 (e.g. 1e-3)")
    if float(kwargs.get("weight_decay", 0.0) or 0.0) < 0:
        raise ValueError(f"{where}.weight_decay={float(kwargs['weight_decay']):g} must be >= 0")


def scheduler_factory(scheduler: Any) -> Callable | None:
    """The partial scheduler of the ``scheduler`` argument (None: none), checked to be a ``torch.optim.lr_scheduler``
    class."""
    if scheduler is None:
        return None
    factory = _partial_of(scheduler, "model.scheduler")
    cls = getattr(factory, "func", factory)
    if not (isinstance(cls, type) and issubclass(cls, torch.optim.lr_scheduler.LRScheduler)):
        raise ValueError(f"model.scheduler._target_={getattr(cls, '__qualname__', cls)} is not a "  # noqa: TRY004
                         "torch.optim.lr_scheduler class (e.g. torch.optim.lr_scheduler.CosineAnnealingLR)")
    return factory


def optimizer_class(factory: Callable) -> type:
    """The optimiser class of a partial optimiser."""
    return partial_target(factory)


def optimizer_argument(factory: Callable, key: str, default: Any = None) -> Any:
    """An argument of a partial optimiser as configured (``default`` when left to the class's default)."""
    return partial_argument(factory, key, default)


class OptimizersMixin:
    """``configure_optimizers`` and the manual-optimisation helpers of a :class:`src.lit.base.DeqsmModule`; reads
    ``self.optimizer_factories``, ``self.scheduler_factory`` and ``self.manual_clip``."""

    # {optimiser name: sub-module paths it updates} of a family with several optimisers (None: one optimiser over
    # every trainable parameter); every trainable parameter must belong to exactly one.
    optimized_modules: ClassVar[Mapping[str, tuple[str, ...]] | None] = None

    def _params_of(self, name: str) -> list[torch.nn.Parameter]:
        if len(self.optimizer_factories) == 1 and self.optimized_modules is None:
            return [p for p in self.parameters() if p.requires_grad]
        modules = dict(self.optimized_modules or {})
        if name not in modules:
            raise ValueError(f"model.optimizer.{name}: {type(self).__name__} has the optimisers "
                             f"{', '.join(modules) or 'one (model.optimizer={_target_: …})'}")
        params = []
        for path in modules[name]:
            sub = self.get_submodule(path) if path else self
            params += [p for p in sub.parameters() if p.requires_grad]
        return params

    def configure_optimizers(self):
        """The configured optimisers (and schedulers, stepped per training step). None when the module has no
        trainable parameter (an evaluation-only model)."""
        if not any(p.requires_grad for p in self.parameters()):
            return None
        factories = self.optimizer_factories
        if self.optimized_modules is not None and set(factories) != set(self.optimized_modules):
            raise ValueError(f"model.optimizer: {type(self).__name__} needs one optimiser for each of "
                             f"{', '.join(self.optimized_modules)}, got {', '.join(factories)}")
        optimizers, owner = [], {}
        for name, factory in factories.items():
            params = self._params_of(name)
            for p in params:
                if id(p) in owner:
                    raise ValueError(f"a parameter belongs to two optimisers ({owner[id(p)]} and {name})")
                owner[id(p)] = name
            if not params:
                raise ValueError(f"{optimizer_key(name, len(factories))} has no trainable parameters")
            optimizers.append(factory(params))
        missing = [n for n, p in self.named_parameters() if p.requires_grad and id(p) not in owner]
        if missing:
            raise ValueError(f"parameters in no optimiser: {', '.join(missing[:5])}{' …' if len(missing) > 5 else ''}")
        if self.scheduler_factory is None:
            return optimizers[0] if len(optimizers) == 1 else optimizers
        cls = getattr(self.scheduler_factory, "func", self.scheduler_factory)
        given = set(getattr(self.scheduler_factory, "keywords", None) or {})
        accepted = set(inspect.signature(cls.__init__).parameters)
        length = {k: max(1, int(self.trainer.estimated_stepping_batches))
                  for k in LENGTH_ARGUMENTS if k in accepted and k not in given}
        schedulers = [{"scheduler": self.scheduler_factory(opt, **length), "interval": "step"} for opt in optimizers]
        return optimizers, schedulers

    def named_optimizer(self, name: str):
        """The (Lightning-wrapped) optimiser called ``name`` in the config (manual optimisation)."""
        names = list(self.optimizer_factories)
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
