"""Exact score matching (paper eq. 1; Hyvärinen 2005).

    J(θ) = E_x [ ½‖s_θ(x)‖² + tr ∇ₓ s_θ(x) ],   s_θ = ∇ₓ log p̃_θ

per sample, **not** divided by D — the "SM loss" every table of the paper reports.

The trace needs the D diagonal entries of the Hessian of log p̃ (or of the Jacobian of the score). Four
routes compute the same numbers (agreement to ~1e-15 in float64; identical parameter gradients):

``"loop"``       D reverse passes ``∂s_i/∂x`` (the reference implementation; works through anything
                 twice differentiable, the implicit DEQ Function included).
``"replicate"``  x is repeated D times along the batch (copy-major: row ``c·B + b`` is copy c of sample
                 b); the copies are independent samples, so ONE reverse pass of ``Σ_c Σ_b s_c(x_{c,b})``
                 gives every diagonal entry. Works through an implicit DEQ (where ``vmap`` and
                 ``is_grads_batched`` fail: ``aten::detach`` has no batching rule, docs/deq.md §6 trap 7).
                 Needs a model whose rows do not interact (no batch statistics) and costs D× the batch
                 in memory; ``max_copies_per_pass`` bounds it (then ⌈D / max_copies_per_pass⌉ forward
                 and reverse passes).
``"func"``       ``torch.func``: ``vjp`` of the score and ``vmap`` over the D basis directions. Only for
                 models ``torch.func`` can transform (plain autograd ops; no custom Function without a
                 vmap rule, no ``.item()``/data-dependent control flow).
``"batched"``    one ``torch.autograd.grad(..., is_grads_batched=True)`` (the DEQ authors' route); same
                 limitation as ``"func"``.
``"model"``      the model's own exact ``score_and_trace(x) -> (s [B, D], tr [B])`` (a closed form: DKEF's
                 feature jets, src/models/dkef.py); only for models that have it.
``"auto"``       ``"model"`` when the model has ``score_and_trace`` and its ``own_trace_route(x)`` says yes;
                 else ``"func"`` when the model declares ``supports_torch_func = True`` (an explicit network
                 that torch.func can transform); otherwise ``"replicate"`` on CUDA; on CPU ``"replicate"``
                 when the model declares ``independent_rows = True`` (a row's output depends on that row
                 only: DKEF, NICE) and the replicated batch D × B has at most ``AUTO_REPLICATE_ROWS`` rows,
                 else ``"loop"``.

Measured (``benchmarks/results/objectives.md``; float32, one training step = objective + backward to the
parameters; MLP energies with Softplus, DKEF-sized = hidden 30 × 3 layers at batch 128, NICE-sized = hidden
1000 × 5 layers at batch 16 on CPU / 128 on CUDA; all routes agree to ≤1e-12 in float64):

* one CPU thread: ``func`` is the fastest route on explicit MLPs (1.3–3.5× faster than the loop, e.g.
  DKEF-sized D=100: 34 vs 119 ms; NICE-sized D=200: 1.75 vs 3.9 s), except DKEF-sized D=784 (1.5 vs
  1.2 s). ``replicate`` is no faster than the loop on CPU (and 6× slower at D=784, memory bound);
  ``batched`` sits between.
* H100: the loop is serial and slow (DKEF-sized D=784: 2.9 s; NICE-sized D=784: 4.8 s), while
  ``replicate`` (14 ms; 328 ms) and ``func`` (13 ms; 160 ms, half the memory of replicate) are 30–200×
  faster; ``batched`` is 5–10× slower than those two.

Hence ``"auto"``: ``func`` where the model says torch.func works, otherwise the route that works through
anything twice differentiable (the implicit DEQ included): ``replicate`` on CUDA, the loop on CPU (where
replicating a large batch does not pay and multiplies the memory by D) — except for small replicated batches
of models whose rows are independent, where one pass beats D of them: a step of CPU work on a few thousand rows
costs little more than on a few (benchmarks/results/speed.md: DKEF's reference exact-SM step, D × B = 176).
"""

from __future__ import annotations

import torch
from torch import Tensor
from torch.profiler import record_function

from .base import (
    PHASE_TRACE,
    check_positive_int,
    compute_score,
    finalize,
    flat,
    grad_wrt,
    has_log_density,
    has_score,
    make_leaf,
    needs_autograd,
)

TRACE_ROUTES = ("auto", "loop", "replicate", "func", "batched", "model")


def check_trace_route(route: str) -> str:
    if route not in TRACE_ROUTES:
        raise ValueError(f"trace_route must be one of {TRACE_ROUTES}, got {route!r}")
    return route


# "auto" on a CPU: replicate (one pass) when the model declares independent rows and the replicated batch has at
# most this many rows (D × B); the loop otherwise. DKEF at the reference protocol (D = 11, 16 points: 176 rows):
# this alone made its training step 1.7× faster with DEQ features, 2.1× with the 3-layer ones (interleaved A/B on
# one thread; the whole step before and after: benchmarks/results/speed.md).
AUTO_REPLICATE_ROWS = 4096


def has_own_trace(model, x: Tensor | None = None) -> bool:
    """Whether the model offers its own exact score and trace for ``x`` (route ``"model"``)."""
    if not callable(getattr(model, "score_and_trace", None)):
        return False
    prefers = getattr(model, "own_trace_route", None)
    return x is None or prefers is None or bool(prefers(x))


def resolve_trace_route(route: str, device: torch.device, model=None, rows: int | None = None,
                        x: Tensor | None = None) -> str:
    """The concrete route for ``route`` ("auto" resolved; see the module docstring). ``rows``: D × B, the size
    of the replicated batch (the CPU choice between ``replicate`` and ``loop`` needs it); ``x``: the batch (the
    model's ``own_trace_route(x)`` decides ``"model"``)."""
    check_trace_route(route)
    if route == "model" and not has_own_trace(model):
        raise ValueError(f"trace_route='model' needs a model with score_and_trace(x); {type(model).__name__} has "
                         "none: use trace_route='auto'")
    if route != "auto":
        return route
    if x is not None and has_own_trace(model, x):
        return "model"
    if getattr(model, "supports_torch_func", False):
        return "func"
    if torch.device(device).type == "cuda":
        return "replicate"
    if getattr(model, "independent_rows", False) and rows is not None and rows <= AUTO_REPLICATE_ROWS:
        return "replicate"
    return "loop"


# ------------------------------------------------------------------------------------------------ routes
def _trace_loop(model, x, create_graph):
    xl = make_leaf(x)
    s = flat(compute_score(model, xl, create_graph=True))
    tr = torch.zeros(s.shape[0], dtype=s.dtype, device=s.device)
    for i in range(s.shape[1]):
        g = grad_wrt(s[:, i].sum(), xl, create_graph=create_graph)
        tr = tr + flat(g)[:, i]
    return s, tr


def _trace_batched(model, x, create_graph):
    xl = make_leaf(x)
    s = flat(compute_score(model, xl, create_graph=True))
    B, D = s.shape
    if not s.requires_grad:
        return s, torch.zeros(B, dtype=s.dtype, device=s.device)
    eye = torch.eye(D, dtype=s.dtype, device=s.device).unsqueeze(1).expand(D, B, D)
    try:
        (h,) = torch.autograd.grad(
            s,
            xl,
            grad_outputs=eye,
            is_grads_batched=True,
            create_graph=create_graph,
            retain_graph=True,
            allow_unused=True,
            materialize_grads=True,
        )
    except RuntimeError as err:
        raise RuntimeError(
            f"trace_route='batched' failed for {type(model).__name__} ({err}); use trace_route='replicate' "
            "or 'loop', which work through any twice-differentiable model (implicit DEQ included)"
        ) from err
    return s, h.reshape(D, B, D).diagonal(dim1=0, dim2=2).sum(-1)


def _replicate(x: Tensor, k: int) -> Tensor:
    """``[B, ...] -> [k·B, ...]``, copy-major (row c·B + b is copy c of sample b), as a fresh leaf."""
    return (
        x.detach().unsqueeze(0).expand(k, *x.shape).reshape(k * x.shape[0], *x.shape[1:]).requires_grad_(True)
    )


def _trace_replicate(model, x, create_graph, max_copies_per_pass):
    B, D = x.shape[0], x[0].numel()
    per_pass = (
        D
        if max_copies_per_pass is None
        else min(D, check_positive_int("max_copies_per_pass", max_copies_per_pass))
    )
    s0 = None
    tr = 0.0
    for start in range(0, D, per_pass):
        k = min(per_pass, D - start)
        xr = _replicate(x, k)
        sr = flat(compute_score(model, xr, create_graph=True)).reshape(k, B, D)
        if s0 is None:
            s0 = sr[0]
        copy = torch.arange(k, device=x.device)
        direction = copy + start
        picked = sr[copy, :, direction]  # [k, B]: ∂-free entries s_j(x_copy j)
        g = grad_wrt(picked.sum(), xr, create_graph=create_graph)
        tr = tr + flat(g).reshape(k, B, D)[copy, :, direction].sum(0)
    return s0, tr


def _trace_func(model, x, create_graph):
    from torch.func import grad as fgrad
    from torch.func import vjp, vmap

    B, D = x.shape[0], x[0].numel()
    if has_score(model):
        score_fn = model.score
    elif has_log_density(model):

        def score_fn(z):
            return fgrad(lambda q: model.log_density(q).sum())(z)

    else:
        raise TypeError(f"{type(model).__name__} has neither score(x) nor log_density(x)")
    basis = torch.eye(D, dtype=x.dtype, device=x.device).unsqueeze(1).expand(D, B, D).reshape(D, *x.shape)
    try:
        s, vjp_fn = vjp(score_fn, x.detach())
        (rows,) = vmap(vjp_fn)(basis)  # rows[k, b] = ∂s_k/∂x of sample b
    except RuntimeError as err:
        raise RuntimeError(
            f"trace_route='func' failed for {type(model).__name__}: torch.func cannot transform it ({err}). "
            "Use trace_route='replicate' or 'loop', which work through any twice-differentiable model "
            "(implicit DEQ included)"
        ) from err
    s = flat(s)
    tr = rows.reshape(D, B, D).diagonal(dim1=0, dim2=2).sum(-1)
    if not create_graph:
        s, tr = s.detach(), tr.detach()
    return s, tr


def _trace_model(model, x, create_graph):
    with torch.enable_grad() if create_graph else torch.no_grad():
        s, tr = model.score_and_trace(x)
    return flat(s), tr


def hessian_trace(
    model,
    x: Tensor,
    *,
    trace_route: str = "auto",
    create_graph: bool = True,
    max_copies_per_pass: int | None = None,
) -> tuple[Tensor, Tensor]:
    """Score and exact trace ``tr ∇ₓ s(x)`` per sample: ``(s [B, D], tr [B])``. See the module docstring."""
    route = resolve_trace_route(trace_route, x.device, model, rows=x.shape[0] * x[0].numel(), x=x)
    with record_function(PHASE_TRACE):
        if route == "model":
            return _trace_model(model, x, create_graph)
        if route == "loop":
            return _trace_loop(model, x, create_graph)
        if route == "replicate":
            return _trace_replicate(model, x, create_graph, max_copies_per_pass)
        if route == "func":
            return _trace_func(model, x, create_graph)
        return _trace_batched(model, x, create_graph)


@needs_autograd
def sm(
    model,
    x: Tensor,
    *,
    create_graph: bool = True,
    trace_route: str = "auto",
    max_copies_per_pass: int | None = None,
):
    """Exact score matching, paper eq. 1: per sample ``½‖s(x)‖² + tr ∇ₓ s(x)``, not divided by D.

    Args:
        model: ``log_density(x) -> [B]`` and/or ``score(x) -> x.shape``.
        x: data batch ``[B, D]`` or ``[B, C, H, W]`` (no grad needed).
        create_graph: True to train (graph kept to the parameters); False to evaluate (detached).
        trace_route: ``"auto" | "loop" | "replicate" | "func" | "batched" | "model"`` (module docstring).
        max_copies_per_pass: ``"replicate"`` only: at most this many copies of x per pass.

    Returns:
        ObjectiveOutput with parts ``score_norm`` (mean ½‖s‖²) and ``trace`` (mean tr ∇ₓ s).
    """
    check_trace_route(trace_route)
    s, tr = hessian_trace(
        model, x, trace_route=trace_route, create_graph=create_graph, max_copies_per_pass=max_copies_per_pass
    )
    return sm_from_score_and_trace(s, tr, create_graph)


def sm_from_score_and_trace(s: Tensor, tr: Tensor, create_graph: bool = True):
    """Eq. 1 per sample from the score ``s [B, D]`` and the trace ``tr [B]``: the output of :func:`sm`."""
    score_norm = 0.5 * (s**2).sum(-1)
    return finalize(score_norm + tr, {"score_norm": score_norm.mean(), "trace": tr.mean()}, create_graph)
