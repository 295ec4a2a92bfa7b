"""Noise-conditional objectives (NCSN; Song & Ermon 2019), on the same interface as the others.

For noise levels σ_1 > … > σ_L, each sample draws a level i uniformly, is perturbed to x̃ = x + σ_i ε, and
the base objective is applied to the score network conditioned on i; per-sample losses are weighted by
σ_i^anneal_power (2 by default, so every level contributes on the same scale — NCSN's
``anneal_power``). DSM is special-cased so that its target uses each sample's own σ_i:

    dsm:      σ_i² · ½‖s(x̃, i) + ε/σ_i‖²
    other f:  σ_i² · f(s(·, i); x̃)       (e.g. ssm_vr: NCSN's ``anneal_sliced_score_estimation_vr``)

The conditioned model is ``LabelConditioned(model, labels)``: its ``score(x)`` calls
``model.score(x, labels)`` (and ``log_density(x)`` calls ``model.log_density(x, labels)`` when the model has
one). When a base objective replicates x along the batch (``sm`` with ``trace_route="replicate"``), the
labels are tiled to match (copy-major). Pass ``condition=`` to build the conditioned model differently.
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import torch
from torch import Tensor

from .base import ObjectiveOutput, check_sigma, has_log_density, has_score
from .dsm import dsm


class LabelConditioned:
    """A model-like view of ``model`` with its noise-level labels bound.

    ``states=True``: the view also offers ``score_states(x)`` = ``model.scores_along_solve(x, labels)`` (the scores
    read out from a DEQ's fixed-point correction states), so the objective is applied per state
    (:func:`~src.objectives.base.compute_score_states`)."""

    def __init__(self, model, labels: Tensor, states: bool = False):
        self.model = model
        self.labels = labels
        self.supports_torch_func = bool(getattr(model, "supports_torch_func", False))
        if has_score(model):
            self.score = self._score
        if has_log_density(model):
            self.log_density = self._log_density
        if states:
            if not callable(getattr(model, "scores_along_solve", None)):
                raise TypeError(f"{type(model).__name__} has no scores_along_solve(x, labels): it cannot give the "
                                "scores of fixed-point correction states")
            self.score_states = self._score_states

    def _score_states(self, x: Tensor) -> list:
        return self.model.scores_along_solve(x, self._aligned(x.shape[0]))

    def _aligned(self, n: int) -> Tensor:
        B = self.labels.shape[0]
        if n == B:
            return self.labels
        if n % B:
            raise ValueError(f"batch of {n} rows cannot be aligned with {B} labels")
        return self.labels.repeat(n // B)  # copy-major replication

    def _score(self, x: Tensor) -> Tensor:
        return self.model.score(x, self._aligned(x.shape[0]))

    def _log_density(self, x: Tensor) -> Tensor:
        return self.model.log_density(x, self._aligned(x.shape[0]))


def _base_function(objective: Callable) -> Callable:
    while isinstance(objective, functools.partial):
        objective = objective.func
    return objective


def noise_conditional(
    objective: Callable,
    model,
    x: Tensor,
    sigmas,
    *,
    labels: Tensor | None = None,
    eps: Tensor | None = None,
    anneal_power: float = 2.0,
    condition: Callable | None = None,
    generator: torch.Generator | None = None,
    create_graph: bool = True,
    **kw,
) -> ObjectiveOutput:
    """Apply ``objective`` in NCSN form over noise levels ``sigmas`` (see the module docstring).

    Args:
        objective: a base objective (``dsm``, ``ssm_vr``, ``ssm``, ``sm``, ...) or a ``functools.partial``
            of one, e.g. from :func:`~src.objectives.registry.get_objective`.
        model: has ``score(x, labels)`` (and/or ``log_density(x, labels)``).
        sigmas: the L noise levels (sequence or 1-D tensor, all > 0).
        labels: optional level index per sample ``[B]`` (long); drawn uniformly when None.
        eps: optional standard-normal noise, shape ``x.shape``.
        anneal_power: per-sample weight σ_i^anneal_power.
        condition: ``(model, labels) -> model-like``; default :class:`LabelConditioned`.
        **kw: passed to the base objective (e.g. ``n_projections``).

    Returns:
        ObjectiveOutput: ``per_sample`` weighted; ``parts`` are the base objective's (unweighted batch
        means) plus ``unweighted_loss``; ``states`` (each weighted the same way) when the conditioned model
        offers ``score_states`` (``condition=functools.partial(LabelConditioned, states=True)``).
    """
    sig_all = torch.as_tensor(sigmas, dtype=x.dtype, device=x.device).reshape(-1)
    if sig_all.numel() == 0:
        raise ValueError("sigmas must hold at least one noise level")
    check_sigma(sig_all, "sigmas")
    B = x.shape[0]
    if labels is None:
        labels = torch.randint(0, sig_all.numel(), (B,), device=x.device, generator=generator)
    elif labels.shape != (B,):
        raise ValueError(f"labels must have shape [B] = ({B},), got {tuple(labels.shape)}")
    if eps is None:
        eps = torch.randn(x.shape, dtype=x.dtype, device=x.device, generator=generator)
    sig = sig_all[labels]
    cond = (condition or LabelConditioned)(model, labels)
    if _base_function(objective) is dsm:
        out = objective(cond, x, sigma=sig, eps=eps, create_graph=create_graph, **kw)
    else:
        xt = x.detach() + sig.reshape(B, *([1] * (x.dim() - 1))) * eps
        out = objective(cond, xt, create_graph=create_graph, **kw)
    weighted = [_weighted(o, sig**anneal_power) for o in (out.states or [out])]
    return ObjectiveOutput(weighted[-1].loss, weighted[-1].per_sample, weighted[-1].parts,
                           states=weighted if out.states is not None else None)


def _weighted(out: ObjectiveOutput, weight: Tensor) -> ObjectiveOutput:
    per_sample = out.per_sample * weight
    parts = dict(out.parts)
    parts["unweighted_loss"] = out.loss
    return ObjectiveOutput(loss=per_sample.mean(), per_sample=per_sample, parts=parts)
