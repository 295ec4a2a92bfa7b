"""Classes the config names and a module completes: Hydra's ``_partial_: true`` idiom (as lightning-hydra-template).

A config key such as ``model.net`` or ``model.optimizer`` holds ``{_target_: <class or function>, _partial_: true,
<its arguments>}``; Hydra builds it into a ``functools.partial`` when it instantiates ``model``, and the
LightningModule calls it with what only it knows (the data's dimensions, the parsed DEQ setting, the parameters to
optimise). A module built in code may take the partial or the same mapping: :func:`partial_of` reads both.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Mapping
from typing import Any


def partial_of(spec: Any, where: str, hint: str) -> Callable:
    """A ``functools.partial`` (or any callable) as it is; a ``{_target_: …}`` mapping instantiated as a partial;
    anything else refused in one line naming ``where`` (the config key), followed by ``hint`` (what to write)."""
    if callable(spec) and not isinstance(spec, Mapping):
        return spec
    if isinstance(spec, Mapping) and "_target_" in spec:
        from hydra.errors import InstantiationException
        from hydra.utils import instantiate

        from src.config.values import plain

        try:
            return instantiate(plain(spec), _partial_=True)
        except InstantiationException as exc:  # an unknown _target_ path: Hydra's message, on one line
            raise ValueError(f"{where}._target_={spec['_target_']}: {str(exc).splitlines()[0]}") from None
    raise ValueError(f"{where}={spec!r}: {hint}")


def partial_target(factory: Callable) -> Callable:
    """The class (or function) a partial builds."""
    return getattr(factory, "func", factory)


def partial_parameters(factory: Callable) -> dict[str, inspect.Parameter]:
    """The parameters of the class's ``__init__`` (without ``self``) or of the function a partial builds."""
    target = partial_target(factory)
    signature = inspect.signature(target.__init__ if isinstance(target, type) else target)
    return {k: p for k, p in signature.parameters.items() if k != "self"}


def partial_argument(factory: Callable, key: str, default: Any = None) -> Any:
    """An argument of a partial as configured, else the target's own default (``default`` when it has none)."""
    kwargs = getattr(factory, "keywords", None) or {}
    if key in kwargs:
        return kwargs[key]
    param = partial_parameters(factory).get(key)
    return default if param is None or param.default is inspect.Parameter.empty else param.default


def partial_config(factory: Callable) -> dict[str, Any]:
    """``{_target_: <dotted path>, _partial_: true, <arguments>}`` of a partial: what a config would hold (plain
    values, for a checkpoint's hyper-parameters)."""
    target = partial_target(factory)
    return {"_target_": f"{target.__module__}.{target.__qualname__}", "_partial_": True,
            **dict(getattr(factory, "keywords", None) or {})}
