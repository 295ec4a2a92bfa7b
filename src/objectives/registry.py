"""Name → objective, for configs (``conf/loss/<name>.yaml``): ``get_objective(name, **kwargs)``.

The returned callable is a picklable ``functools.partial``; call it as ``objective(model, x)`` and override
per call, e.g. ``objective(model, x, create_graph=False)`` for evaluation.
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable, Mapping

from .base import ObjectiveOutput, check_positive_int, check_projection, check_sigma
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
    trace_route="replicate")``, ``get_objective("dsm", sigma=0.1)``. The noise-conditional (NCSN) form of any
    of them is :func:`~src.objectives.conditional.noise_conditional` applied to the bound objective.
    """
    if not isinstance(name, str) or name.lower() not in OBJECTIVES:
        raise ValueError(f"unknown objective {name!r}; valid names: {', '.join(OBJECTIVES)}")
    name = name.lower()
    fn = OBJECTIVES[name]
    allowed = accepted_arguments(name)
    unknown = sorted(set(kwargs) - allowed)
    if unknown:
        raise ValueError(
            f"objective {name!r} got unknown argument(s) {unknown}; it accepts: {', '.join(sorted(allowed))}"
        )
    for key, value in kwargs.items():
        if key in _VALIDATORS:
            _VALIDATORS[key](value)
    return functools.partial(fn, **kwargs)


def accepted_arguments(name: str) -> set[str]:
    """The hyper-parameters objective ``name`` takes from a config (its keyword-only arguments, less the
    per-call ones)."""
    return _accepted(OBJECTIVES[name]) - {"v", "eps", "generator"}


def objective_from_config(loss: Mapping | None, *, default: str, family: str,
                          allowed: tuple[str, ...] | None = None, ignored: tuple[str, ...] = (),
                          bound: Mapping | None = None) -> tuple[str, dict, Callable[..., ObjectiveOutput]]:
    """A family's training objective from its ``model.loss`` config (``{name: …, <hyper-parameters>}``):
    ``(name, hyper-parameters, bound objective)``. The one place a LightningModule builds its objective
    (:class:`src.lit.base.DeqsmModule` calls it once, from the config).

    Args:
        loss: the config mapping; None means ``{name: default}``.
        default: the family's objective when the config names none.
        family: the family's name, for the error message.
        allowed: the objectives the family can train with (None: every registered one).
        ignored: config keys the family replaces and drops (NCSN: ``sigma``, each sample's own noise level).
        bound: hyper-parameters the family sets over the config's, for the objectives that take them (the
            VAE's ``model.projection`` for SSM / SSM-VR); a None value leaves the config's.
    """
    spec = {str(k): v for k, v in dict(loss or {}).items()}
    name = str(spec.pop("name", default)).lower()
    if allowed is not None and name not in allowed:
        raise ValueError(f"model={family} trains with loss={'|'.join(allowed)}; got loss={name}")
    if name not in OBJECTIVES:
        raise ValueError(f"unknown objective {name!r}; valid names: {', '.join(OBJECTIVES)}")
    for key in ignored:
        spec.pop(key, None)
    takes = accepted_arguments(name)
    spec.update({k: v for k, v in dict(bound or {}).items() if k in takes and v is not None})
    return name, spec, get_objective(name, **spec)
