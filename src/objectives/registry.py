"""Name → objective, for configs (``conf/loss/<name>.yaml``): ``get_objective(name, **kwargs)``.

The returned callable is a picklable ``functools.partial``; call it as ``objective(model, x)`` and override
per call, e.g. ``objective(model, x, create_graph=False)`` for evaluation.
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable

from .base import ObjectiveOutput, check_positive_int, check_projection, check_sigma
from .conditional import noise_conditional
from .cp import cp
from .dsm import dsm
from .mle import mle
from .sm import check_trace_route, sm
from .ssm import ssm, ssm_vr

OBJECTIVES: dict[str, Callable[..., ObjectiveOutput]] = {
    "sm": sm,
    "ssm": ssm,
    "ssm_vr": ssm_vr,
    "dsm": dsm,
    "cp": cp,
    "mle": mle,
}

_VALIDATORS = {
    "n_projections": lambda v: check_positive_int("n_projections", v),
    "n_samples": lambda v: check_positive_int("n_samples", v),
    "max_copies_per_pass": lambda v: v if v is None else check_positive_int("max_copies_per_pass", v),
    "projection": check_projection,
    "sigma": check_sigma,
    "trace_route": check_trace_route,
}


def _accepted(fn) -> set[str]:
    params = inspect.signature(fn).parameters.values()
    return {p.name for p in params if p.kind is inspect.Parameter.KEYWORD_ONLY}


def get_objective(name: str, **kwargs) -> Callable[..., ObjectiveOutput]:
    """The objective ``name`` with its hyper-parameters bound: ``fn(model, x) -> ObjectiveOutput``.

    Keyword arguments are checked here (unknown names and bad values raise ``ValueError``), e.g.
    ``get_objective("ssm_vr", n_projections=2, projection="gaussian")``, ``get_objective("sm",
    trace_route="replicate")``, ``get_objective("dsm", sigma=0.1)``.

    ``sigmas=[...]`` (optionally ``anneal_power=``) turns any score objective into its noise-conditional
    NCSN form (:func:`~src.objectives.conditional.noise_conditional`); with ``dsm`` the level replaces
    ``sigma``.
    """
    if not isinstance(name, str) or name.lower() not in OBJECTIVES:
        raise ValueError(f"unknown objective {name!r}; valid names: {', '.join(OBJECTIVES)}")
    name = name.lower()
    fn = OBJECTIVES[name]
    kwargs = dict(kwargs)
    sigmas = kwargs.pop("sigmas", None)
    anneal_power = kwargs.pop("anneal_power", None)
    allowed = _accepted(fn) - {"v", "eps", "generator"}
    unknown = sorted(set(kwargs) - allowed)
    if unknown:
        valid = sorted(allowed) + ([] if name == "mle" else ["sigmas", "anneal_power"])
        raise ValueError(
            f"objective {name!r} got unknown argument(s) {unknown}; it accepts: {', '.join(valid)}"
        )
    for key, value in kwargs.items():
        if key in _VALIDATORS:
            _VALIDATORS[key](value)
    if anneal_power is not None and sigmas is None:
        raise ValueError("anneal_power is only used with sigmas=[...] (noise-conditional form)")
    if sigmas is None:
        return functools.partial(fn, **kwargs)
    if name == "mle":
        raise ValueError("sigmas=[...] (noise-conditional form) does not apply to mle")
    if name == "dsm" and "sigma" in kwargs:
        raise ValueError("dsm with sigmas=[...] draws one level per sample; do not also pass sigma")
    sigmas = list(sigmas) if not isinstance(sigmas, (int, float)) else [sigmas]
    if not sigmas:
        raise ValueError("sigmas must hold at least one noise level")
    for s in sigmas:
        check_sigma(s, "sigmas")
    extra = {} if anneal_power is None else {"anneal_power": float(anneal_power)}
    return functools.partial(noise_conditional, functools.partial(fn, **kwargs), sigmas=sigmas, **extra)
