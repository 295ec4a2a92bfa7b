"""Exact implicit differentiation of a fixed point, to every order (paper Prop. 1, eqs. 8–9).

``fixed_point(phi, z0, params, solver)`` returns u* = phi(u*, *params) solved under ``no_grad``, as the
output of an autograd Function whose backward is itself differentiable:

- backward, given ū: the adjoint v solves v = ū + (∂_u φ(u*; p))ᵀ v. That equation is again a fixed point,
  of ψ(v; ū, u*, p) = ū + (∂_u φ)ᵀ v (linear in v, contracting at the forward rate), so v is computed by
  the *same* Function applied to ψ; its own backward then builds the adjoint of ψ, and so on — one level
  per derivative order (exact SM needs three).
- p̄ = (∂_p φ(u*; p))ᵀ v is a partial VJP taken w.r.t. fresh aliases ``p.view_as(p)`` while u* (saved as
  an *output*) stays attached to the graph, so p̄ is a composition of differentiable pieces and its own
  derivatives are exact (DESIGN §2; each trap listed there is silent).

Memory does not grow with solver iterations: only u* and the parameters are saved.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from src.deq.solvers import solve


class _Adjoint:
    """ψ(v; ū, u, *p) = ū + (∂_u φ(u; p))ᵀ v, for a given φ (picklable: no closures)."""

    def __init__(self, phi: Callable):
        self.phi = phi

    def __call__(self, v, u_bar, u, *params):
        need_graph = torch.is_grad_enabled()  # False inside the solver, True when differentiated
        with torch.enable_grad():
            u_in = u if (need_graph and u.requires_grad) else u.detach().requires_grad_(True)
            p_in = params if need_graph else tuple(p.detach() for p in params)
            out = self.phi(u_in, *p_in)
            (jtv,) = torch.autograd.grad(out, u_in, v, create_graph=need_graph)
        return u_bar + jtv


class _FixedPoint(torch.autograd.Function):
    @staticmethod
    def forward(ctx, phi, solver, stats, z0, *params):
        with torch.no_grad():
            result = solve(lambda z: phi(z, *params), z0, **solver)
        if stats is not None:
            stats["iterations"] = result.iterations
            stats["residual"] = float(result.residual.max()) if result.residual.numel() else 0.0
            stats["converged"] = result.converged
        u = result.z
        ctx.phi, ctx.solver = phi, solver
        ctx.save_for_backward(u, *params)
        return u

    @staticmethod
    def backward(ctx, u_bar):
        u, *params = ctx.saved_tensors
        phi, solver = ctx.phi, ctx.solver
        with torch.enable_grad():
            # adjoint solve with the same Function: exact to every further order
            v = _FixedPoint.apply(_Adjoint(phi), solver, None, torch.zeros_like(u_bar), u_bar, u, *params)
            aliases = [p.view_as(p) for p in params]
            out = phi(u, *aliases)
            wanted = [i for i, p in enumerate(aliases) if p.requires_grad]
            grads = torch.autograd.grad(
                out, [aliases[i] for i in wanted], v, create_graph=True, allow_unused=True
            )
        p_bar = [None] * len(params)
        for i, g in zip(wanted, grads):
            p_bar[i] = g
        return (None, None, None, None, *p_bar)


def fixed_point(phi: Callable, z0: torch.Tensor, params: tuple, solver: dict, stats: dict | None = None):
    """u* = phi(u*, *params), differentiable to every order w.r.t. params by implicit differentiation."""
    return _FixedPoint.apply(phi, solver, stats, z0.detach(), *params)
