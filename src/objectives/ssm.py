"""Sliced score matching (Song et al. 2019), paper eqs. 3 and 4.

    SSM    (eq. 3):  ½ (vᵀ s(x))² + vᵀ ∇ₓ(vᵀ s(x))
    SSM-VR (eq. 4):  ½ ‖s(x)‖²    + vᵀ ∇ₓ(vᵀ s(x))

with projections v, E[v vᵀ] = I: Rademacher (the reference code's choice for DKEF and NICE) or standard
Gaussian (its choice for the VAE score estimator and NCSN). Unit-normalized projections (the reference's
n-particle ``sliced_score_matching``, which scales the loss by 1/D) are deliberately not offered: with
E[vvᵀ] = I both objectives are unbiased estimators of the exact SM loss (eq. 1) in the same units.

Each projection costs one extra reverse pass; ``n_projections`` M > 1 averages M independent projections
per sample. A model that offers ``score_states`` (a DEQ's fixed-point correction states) gets the objective per
state, with the same x and projections (``ObjectiveOutput.states``; one more reverse pass per state).
"""

from __future__ import annotations

import torch
from torch import Tensor
from torch.profiler import record_function

from .base import (
    PHASE_TRACE,
    ObjectiveOutput,
    as_projections,
    check_positive_int,
    check_projection,
    compute_score,
    compute_score_states,
    draw_projections,
    finalize,
    flat,
    grad_wrt,
    make_leaf,
    needs_autograd,
)


def _sliced(model, x, n_projections, projection, create_graph, v, generator):
    """[(s, ½(vᵀs)², vᵀ∇ₓ(vᵀs))] averaged over the projections: one entry for the model's score, or one per score
    of ``model.score_states`` (the same leaf x and the same projections v for every state)."""
    check_positive_int("n_projections", n_projections)
    check_projection(projection)
    xl = make_leaf(x)
    states = compute_score_states(model, xl)
    scores = [flat(s) for s in states] if states is not None else [flat(compute_score(model, xl, create_graph=True))]
    v = (
        draw_projections(n_projections, scores[-1], projection, generator)
        if v is None
        else as_projections(v, n_projections, x)
    )
    out = []
    for s in scores:
        proj_sq = torch.zeros(s.shape[0], dtype=s.dtype, device=s.device)
        quad = torch.zeros_like(proj_sq)
        with record_function(PHASE_TRACE):
            for m in range(n_projections):
                vs = (s * v[m]).sum(-1)  # vᵀs, [B]
                g = flat(grad_wrt(vs.sum(), xl, create_graph=create_graph))  # ∇ₓ(vᵀs)
                proj_sq = proj_sq + 0.5 * vs**2
                quad = quad + (g * v[m]).sum(-1)  # vᵀ ∇ₓ(vᵀs) = vᵀ (∇ₓ s) v
        out.append((s, proj_sq / n_projections, quad / n_projections))
    return out, states is not None


def _with_states(outs: list, along: bool) -> ObjectiveOutput:
    """The last output, carrying every state's output when the scores came from ``score_states``."""
    last = outs[-1]
    return ObjectiveOutput(last.loss, last.per_sample, last.parts, states=outs) if along else last


@needs_autograd
def ssm(
    model,
    x: Tensor,
    *,
    n_projections: int = 1,
    projection: str = "rademacher",
    create_graph: bool = True,
    v: Tensor | None = None,
    generator: torch.Generator | None = None,
):
    """Sliced score matching, paper eq. 3: per sample ``½(vᵀs)² + vᵀ∇ₓ(vᵀs)``, averaged over projections.

    Args:
        n_projections: M independent projections per sample (each one extra reverse pass).
        projection: ``"rademacher"`` or ``"gaussian"`` (both E[vvᵀ] = I).
        v: optional given projections ``[B, ...]`` (M = 1) or ``[M, B, ...]``; drawn when None.
        generator: optional ``torch.Generator`` for the draw.

    Returns:
        ObjectiveOutput with parts ``proj_score_norm`` (mean ½(vᵀs)²) and ``trace`` (mean vᵀ∇ₓs v).
    """
    outs, along = _sliced(model, x, n_projections, projection, create_graph, v, generator)
    return _with_states([finalize(proj_sq + quad, {"proj_score_norm": proj_sq.mean(), "trace": quad.mean()},
                                  create_graph) for _, proj_sq, quad in outs], along)


@needs_autograd
def ssm_vr(
    model,
    x: Tensor,
    *,
    n_projections: int = 1,
    projection: str = "rademacher",
    create_graph: bool = True,
    v: Tensor | None = None,
    generator: torch.Generator | None = None,
):
    """Variance-reduced sliced score matching, paper eq. 4: per sample ``½‖s‖² + vᵀ∇ₓ(vᵀs)``.

    The ½‖s‖² term is exact; only the trace is estimated (averaged over ``n_projections``). Arguments as
    :func:`ssm`.

    Returns:
        ObjectiveOutput with parts ``score_norm`` (mean ½‖s‖²) and ``trace`` (mean vᵀ∇ₓs v).
    """
    outs, along = _sliced(model, x, n_projections, projection, create_graph, v, generator)
    return _with_states([finalize(0.5 * (s**2).sum(-1) + quad, {"score_norm": 0.5 * (s**2).sum(-1).mean(),
                                                                 "trace": quad.mean()}, create_graph)
                         for s, _, quad in outs], along)
