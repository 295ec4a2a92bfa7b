"""The implicit backward with truncated higher orders (``deq.exact_orders``), float64: with enough Neumann terms it
is the exact implicit derivative; with one term at order 2 it is the gradient of an independent reference built
by hand (z* by 300 unrolled iterations, the order-1 adjoint by a dense linear solve, held fixed in one step of its
own fixed-point map, as the truncation defines)."""

from __future__ import annotations

import pytest
import torch

from src.deq.block import DenseDEQBlock
from src.deq.config import DEQConfig

pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py


def make_block(**cfg) -> DenseDEQBlock:
    torch.manual_seed(0)
    return DenseDEQBlock(3, 5, config=DEQConfig(tol=1e-14, stop_mode="abs", max_iter=500, warm_start=False,
                                                backward="implicit", norm_lambda=2.0, **cfg)).double()


def loss_and_grads(block, x, h):
    """L = ‖∇ₓ(hᵀz*(x))‖² summed over samples: an order-1 derivative inside the loss (as SSM-VR's trace), so
    its parameter gradient is an order-2 derivative through the DEQ."""
    x = x.clone().requires_grad_(True)
    s = (block(x) @ h).sum()
    (gx,) = torch.autograd.grad(s, x, create_graph=True)
    loss = gx.pow(2).sum()
    return loss, torch.autograd.grad(loss, list(block.parameters()))


def test_many_terms_equal_the_exact_implicit_derivatives():
    x, h = torch.randn(4, 3, dtype=torch.float64), torch.randn(5, dtype=torch.float64)
    exact_loss, exact = loss_and_grads(make_block(), x, h)
    trunc_loss, trunc = loss_and_grads(make_block(exact_orders=1, phantom_steps=120), x, h)
    assert trunc_loss.item() == pytest.approx(exact_loss.item(), rel=1e-12)
    for a, b in zip(trunc, exact):
        torch.testing.assert_close(a, b, rtol=1e-9, atol=1e-12)


def test_one_term_at_order_two_matches_the_hand_built_reference():
    x, h = torch.randn(4, 3, dtype=torch.float64), torch.randn(5, dtype=torch.float64)
    block = make_block(exact_orders=1, phantom_steps=1)
    loss, grads = loss_and_grads(block, x, h)
    exact_loss, exact = loss_and_grads(make_block(), x, h)
    assert loss.item() == pytest.approx(exact_loss.item(), rel=1e-12)  # order 1 (the loss's value) stays exact

    ref_block = make_block()
    params = list(ref_block.parameters())
    xr = x.clone().requires_grad_(True)
    u = ref_block.unroll(x, 300)  # z*(θ) at the fixed x: depends on θ, not on xr
    p = ref_block.map_params(xr)
    out = ref_block.phi(u, *p)
    loss_ref = 0.0
    for i in range(x.shape[0]):  # the order-1 adjoint v* = (I − Jᵀ)⁻¹ h per sample, by a dense solve (detached)
        jac = torch.autograd.functional.jacobian(lambda z, i=i: ref_block.phi(z, *[q[i:i + 1] if q.shape[0] == 4
                                                                                    else q for q in p]),
                                                 u[i:i + 1].detach()).reshape(5, 5).detach()
        v_star = torch.linalg.solve(torch.eye(5, dtype=torch.float64) - jac.T, h)
        # one step of the adjoint's own map from v*: v = h + J(u*(θ), θ)ᵀ v*, its value v*, its θ-dependence one step
        ui = u[i:i + 1]
        (jtv,) = torch.autograd.grad(ref_block.phi(ui, *[q[i:i + 1] if q.shape[0] == 4 else q
                                                       for q in ref_block.map_params(x[i:i + 1])]), ui,
                                     v_star[None], create_graph=True)
        v = h[None] + jtv
        (gx,) = torch.autograd.grad(out[i:i + 1], xr, v, create_graph=True)
        loss_ref = loss_ref + gx.pow(2).sum()
    assert loss_ref.item() == pytest.approx(loss.item(), rel=1e-10)
    ref = torch.autograd.grad(loss_ref, params)
    for a, b, e in zip(grads, ref, exact):
        torch.testing.assert_close(a, b, rtol=1e-8, atol=1e-11)
    # and the truncation is a real approximation here: it differs from the exact gradient
    assert max((a - e).abs().max().item() for a, e in zip(grads, exact)) > 1e-4


def test_exact_orders_refused_without_the_implicit_backward():
    with pytest.raises(ValueError, match="deq.exact_orders=1 applies to deq.backward=implicit"):
        DEQConfig(exact_orders=1)
    with pytest.raises(ValueError, match="deq.exact_orders must be >= 0"):
        DEQConfig(exact_orders=-1, backward="implicit")
