"""Exact implicit differentiation of a fixed point, to every order (paper Prop. 1, eqs. 8–9).

``fixed_point(phi, z0, params, solver)`` returns u* = φ(u*; p) solved under ``no_grad``, as the output of
an autograd Function whose backward is itself differentiable (docs/deq.md §6):

- backward, given ū: the adjoint v solves v = ū + (∂_u φ(u*; p))ᵀ v (eq. 8 transposed). That equation is
  again a fixed point, of ψ(v; ū, u*, p) = ū + (∂_u φ)ᵀ v (linear in v, contracting at the forward rate),
  so v is computed by the *same* Function applied to ψ; its own backward builds the adjoint of ψ, and so
  on: one level per derivative order (eq. 9 and beyond; the exact SM loss's parameter gradient needs 3).
- p̄ = (∂_p φ(u*; p))ᵀ v is a partial VJP taken w.r.t. fresh aliases ``p.view_as(p)`` while u* (saved as
  an *output*) stays attached, so p̄ is a composition of differentiable pieces and its derivatives are exact.

Each trap listed in docs/deq.md §6 is silent; this module avoids them by construction: no
``@once_differentiable`` (1), no hook-based adjoint (2), no ``detach`` of u* (3), the adjoint is a Function,
not a bare no-grad solve (4), ``enable_grad`` in backward (5), aliases instead of the original tensors (6).

Truncated higher orders (``exact_orders``): the adjoint of level k > ``exact_orders`` is not solved but taken as
the K-term Neumann series v = Σ_{j<K} ((∂_u φ)ᵀ)ʲ ū, differentiable by plain autograd (K = 1: v = ū, the
Jacobian-free step of Fung et al. 2022 at that level) — the phantom gradient (Alg. 1) of the adjoint fixed point.
With ``exact_orders=1`` and an SSM-VR loss the loss's own input derivative (order 1) is exact and only its
parameter gradient (order 2) is truncated, which skips the second-level solve (the largest single part of the
NCSN step: benchmarks/results/ncsn_deq_cost.md); on the NCSN's normalised block that biased gradient diverged
training, so it is an option, not a default.

Memory does not grow with solver iterations: the Function saves u* and p; each adjoint solve takes one product
with φ's Jacobian per iteration — the map's own products where it offers them (``linearize``), else a VJP on φ's
graph, built once, at odd levels and a forward-mode JVP (no graph) at even ones (:meth:`_Adjoint.prepare`).
"""

from __future__ import annotations

import inspect
import warnings
from collections.abc import Callable

import torch
from torch.profiler import record_function

from src.deq.solvers import SolverResult, solve

# Profiler labels (benchmarks/tools/profile_step.py groups a step's time by them; a no-op unless a profiler runs)
PHASE_SOLVE = "deq.solve"  # forward fixed-point solve (no autograd)
PHASE_IMPLICIT_BACKWARD = "deq.implicit_backward"  # the implicit Function's backward: adjoint solve + VJP in p
# ... with its nesting level in the label (a prefix match groups them all): the backward of level k is
# "deq.implicit_backward.level<k>" (its VJP in p and the nested solve), the adjoint solve of level k ≥ 1 inside it
# "deq.implicit_backward.solve.level<k>" — so a profiler trace tells the levels apart (benchmarks/studies/
# ncsn_deq_cost.py reads them).

Report = Callable[[int, SolverResult], None]  # (level, result): level 0 = forward solve, k ≥ 1 = k-th adjoint


class _Adjoint:
    """ψ(v; ū, u, *p) = ū + (∂_u φ(u; p))ᵀ v for a given φ (picklable: a plain object, no closure)."""

    def __init__(self, phi: Callable):
        self.phi = phi

    def __call__(self, v, u_bar, u, *params):
        """Differentiable evaluation, w.r.t. v, ū, u and p (used in backward and by the next level)."""
        with torch.enable_grad():
            if not u.requires_grad:
                u = u.detach().requires_grad_(True)
            out = self.phi(u, *params)
            (jtv,) = torch.autograd.grad(out, u, v, create_graph=True, allow_unused=True, materialize_grads=True)
        return u_bar + jtv

    def depth(self) -> tuple[int, Callable]:
        """(d, φ₀): this map is the level-d adjoint map of the base map φ₀ (d = 1: ψ of φ₀ itself)."""
        d, base = 1, self.phi
        while isinstance(base, _Adjoint):
            d, base = d + 1, base.phi
        return d, base

    def prepare(self, u_bar, u, *params) -> Callable:
        """v ↦ ψ(v) for the no-grad solve, each iteration one product with the base map's Jacobian.

        The level-d adjoint map is linear in v with the operator Jᵀ (d odd) or J (d even), J = ∂_u φ₀(u*; p) of
        the base map φ₀ at the forward fixed point — whatever the nesting, because ψ_{d−1} is linear in its own
        state. So the step is one VJP of φ₀ (d odd; its graph built once) or one forward-mode JVP of φ₀ (d even:
        no graph at all), instead of a (d−1)-times nested backward through the graphs of the levels below (at
        ncsn_mnist the level-2 solve of SSM-VR's parameter gradient took the largest share of the step:
        benchmarks/results/ncsn_deq_cost.md). Here ``u`` is v_{d−1} and ``params`` = (ū_{d−1}, v_{d−2}, …, ū₁,
        u*, *p). A base map may offer ``linearize(u*, *p) -> (J·, Jᵀ·)``, its own products written out (cheaper than
        autograd's generic ones: :meth:`src.deq.maps.NormalizedResidualMap.linearize`); one that forward mode
        cannot run (a custom autograd Function without a JVP rule) may offer ``forward_mode_map`` (the same map in
        plain ops); failing both, the JVP falls back to the double VJP.
        """
        d, base = self.depth()
        u_star, base_params = (u, params) if d == 1 else (params[2 * (d - 1) - 1], params[2 * (d - 1):])
        u_bar = u_bar.detach()
        if getattr(base, "linearize", None) is not None:  # the map's own J, Jᵀ products (e.g. NormalizedResidualMap)
            jvp, vjp = base.linearize(u_star.detach(), *(p.detach() for p in base_params))
            product = jvp if d % 2 == 0 else vjp
            return lambda v: u_bar + product(v)
        if d % 2 == 0:
            step = _jvp_step(getattr(base, "forward_mode_map", base), u_bar, u_star, base_params)
            if step is not None:
                return step
        with torch.enable_grad():
            leaf = u_star.detach().requires_grad_(True)
            out = base(leaf, *(p.detach() for p in base_params))
        if d % 2 == 0:  # J v as the VJP of u ↦ Jᵀu (the double-VJP trick): linear in u, so built once
            with torch.enable_grad():
                dummy = torch.zeros_like(out, requires_grad=True)
                (jt_dummy,) = torch.autograd.grad(out, leaf, dummy, create_graph=True)

            def step_j(v):
                (jv,) = torch.autograd.grad(jt_dummy, dummy, v, retain_graph=True)
                return u_bar + jv

            return step_j

        def step(v):
            (jtv,) = torch.autograd.grad(out, leaf, v, retain_graph=True, allow_unused=True, materialize_grads=True)
            return u_bar + jtv

        return step


# whether forward mode runs a map: tried once per map function or map class (maps of one class share their ops)
_FORWARD_MODE: dict[object, bool] = {}


def _jvp_step(base: Callable, u_bar, u_star, params) -> Callable | None:
    """v ↦ ū + J v by forward-mode AD of ``base`` at u* (None when forward mode cannot run it: tried on the first
    map function or class, then remembered, so the solve's hot path pays no trial product)."""
    from torch.func import jvp

    u_star = u_star.detach()
    detached = tuple(p.detach() for p in params)

    def step(v):
        return u_bar + jvp(lambda z: base(z, *detached), (u_star,), (v,))[1]

    kind = base if inspect.isfunction(base) else type(base)
    if kind not in _FORWARD_MODE:
        try:
            with warnings.catch_warnings():  # torch's own notice when the first forward-mode product loads its rules
                warnings.filterwarnings("ignore", category=DeprecationWarning, message=".*torch.jit.script.*")
                step(torch.zeros_like(u_star))
            _FORWARD_MODE[kind] = True
        except (RuntimeError, NotImplementedError):
            _FORWARD_MODE[kind] = False
    return step if _FORWARD_MODE[kind] else None


def _prepared(phi: Callable, params: tuple) -> Callable:
    if hasattr(phi, "prepare"):
        return phi.prepare(*params)
    return lambda z: phi(z, *params)


def _solved(phi: Callable, solvers: tuple, report: Report | None, level: int, z0: torch.Tensor,
            params: tuple) -> torch.Tensor:
    """The no-grad solve of level ``level`` (0: the forward, k ≥ 1: the k-th adjoint) in its profiler span."""
    label = PHASE_SOLVE if level == 0 else f"{PHASE_IMPLICIT_BACKWARD}.solve.level{level}"
    with torch.no_grad(), record_function(label):
        result = solve(_prepared(phi, params), z0, **solvers[min(level, 1)])
    if report is not None:
        report(level, result)
    return result.z


class _FixedPoint(torch.autograd.Function):
    """u* = φ(u*; p). Inputs: (φ, solvers, report, level, truncation, z0, *p). Output: u*.
    ``solvers``: ``(forward, adjoint)`` keyword arguments of :func:`solve`, for level 0 and for every adjoint level.
    ``truncation``: ``(exact_orders, terms)`` — adjoints of level > exact_orders are ``terms``-term Neumann series
    (``exact_orders`` None: every level solved)."""

    @staticmethod
    def forward(ctx, phi, solvers, report, level, truncation, z0, *params):
        u = _solved(phi, solvers, report, level, z0, params)
        ctx.phi, ctx.solvers, ctx.report, ctx.level, ctx.truncation = phi, solvers, report, level, truncation
        ctx.save_for_backward(u, *params)  # u as an output: it comes back attached to this node
        return u

    @staticmethod
    def backward(ctx, u_bar):
        u, *params = ctx.saved_tensors
        create_graph = torch.is_grad_enabled()  # True iff the caller asked for create_graph
        wanted = [i for i, need in enumerate(ctx.needs_input_grad[6:]) if need]
        exact_orders, terms = ctx.truncation
        with torch.enable_grad(), record_function(f"{PHASE_IMPLICIT_BACKWARD}.level{ctx.level}"):
            aliases = [p.view_as(p) for p in params]
            if exact_orders is not None and ctx.level + 1 > int(exact_orders):  # truncated: Neumann series
                psi = _Adjoint(ctx.phi)
                v = u_bar
                for _ in range(int(terms) - 1):
                    v = psi(v, u_bar, u, *aliases)
            elif not create_graph:  # first order only: the adjoint needs no derivative, so no Function saving it
                v = _solved(_Adjoint(ctx.phi), ctx.solvers, ctx.report, ctx.level + 1, u_bar.detach(),
                            (u_bar.detach(), u.detach(), *params))
            else:
                v = _FixedPoint.apply(_Adjoint(ctx.phi), ctx.solvers, ctx.report, ctx.level + 1, ctx.truncation,
                                      u_bar.detach(), u_bar, u, *aliases)
            out = ctx.phi(u, *aliases)  # partial VJP in p, u* held (and attached)
            grads = torch.autograd.grad(out, [aliases[i] for i in wanted], v, create_graph=create_graph,
                                        allow_unused=True)
        p_bar = [None] * len(params)
        for i, g in zip(wanted, grads):
            p_bar[i] = g
        return (None, None, None, None, None, None, *p_bar)


def fixed_point(phi: Callable, z0: torch.Tensor, params: tuple, solver: dict, report: Report | None = None,
                exact_orders: int | None = None, terms: int = 1, adjoint_solver: dict | None = None):
    """u* = φ(u*, *params), differentiable to every order w.r.t. ``params`` by implicit differentiation.

    ``phi(z, *params)`` must be a pure function of its tensor arguments; ``solver`` holds the keyword
    arguments of :func:`src.deq.solvers.solve`; ``report(level, result)`` is called after every solve
    (level 0 forward, level k ≥ 1 the k-th nested adjoint) for statistics and warnings. ``exact_orders``: the
    derivative orders solved exactly (None: all); the adjoints of higher orders are ``terms``-term Neumann series
    (see the module docstring). ``adjoint_solver``: the keyword arguments of every adjoint level's solve (None:
    ``solver``'s) — e.g. a looser stop rule for the linear adjoint fixed points, as torchdeq's ``b_tol``.
    """
    solvers = (solver, solver if adjoint_solver is None else adjoint_solver)
    return _FixedPoint.apply(phi, solvers, report, 0, (exact_orders, int(terms)), z0.detach(), *params)
