"""First and second directional derivatives of a batched function, by reverse-mode autograd only.

``jvp(u, x, v)`` is computed with the double-backward trick: ``g = (∂u/∂x)ᵀ w`` for a dummy ``w``, then
``∂g/∂w · v = (∂u/∂x) v``. Unlike ``torch.func`` or forward-mode AD this works through any twice
differentiable autograd graph, including the implicit DEQ Function (whose backward is differentiable but
which has no forward-mode rule; docs/deq.md §6, trap 7). Every result keeps its graph, so parameter gradients
through it are exact.
"""

from __future__ import annotations

import torch


def jvp(u: torch.Tensor, x: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """Jacobian-vector product (∂u/∂x) v for u computed from x (both with graph); differentiable."""
    if not u.requires_grad:
        return torch.zeros_like(u)
    w = torch.zeros_like(u, requires_grad=True)
    (g,) = torch.autograd.grad(u, x, w, create_graph=True, allow_unused=True)
    if g is None:  # u does not depend on x (e.g. the derivative of a linear feature map): the JVP is 0
        return torch.zeros_like(u)
    (out,) = torch.autograd.grad(g, w, v, create_graph=True)
    return out


def directional_derivatives(
    fn, x: torch.Tensor, directions: torch.Tensor, second: bool = True
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """Value, first and second directional derivatives of a per-sample function along per-row directions.

    ``x`` and ``directions`` are [N, D]; row n is differentiated along ``directions[n]``. Returns
    ``(u, D_v u, D_v² u)`` with u = fn(x) of shape [N, F]. Rows must be independent samples (a row's
    output depends only on that row's input), which lets one pass handle N different directions.
    """
    x = x.detach().requires_grad_(True)
    u = fn(x)
    t1 = jvp(u, x, directions)
    t2 = jvp(t1, x, directions) if second else None
    return u, t1, t2
