"""Exact implicit derivatives of every order (Prop. 1, eqs. 8–9) against autograd through 300 unrolled steps.

Everything in float64. The reference unrolls z ← f(z; x) 300 times from 0 with autograd (the contraction
rate is ≤ 1/λ = 0.5, so the unrolled map equals the fixed point to machine precision), and differentiates
through it. The implicit block must match it for the score, the Hessian trace (a second derivative) and the
parameter gradients of an SM loss (third order) and a DSM loss, at memory independent of max_iter.
"""

from __future__ import annotations

import warnings

import pytest
import torch
import torch.nn.functional as F

from src.deq.block import ConvDEQBlock, DenseDEQBlock, NormalizedResidualDEQBlock, ResidualDEQBlock, dense_map
from src.deq.config import DEQConfig
from src.deq.implicit import fixed_point
from tests.derivative_checks import rel

TIGHT = {"tol": 1e-13, "max_iter": 400, "warm_start": False, "norm_lambda": 2.0, "backward": "implicit"}
REL = 1e-8
UNROLL = 300


pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py


class Unrolled(torch.nn.Module):
    """Autograd through ``steps`` Picard iterations of the same block: the reference derivative."""

    def __init__(self, block, steps=UNROLL):
        super().__init__()
        self.block, self.steps = block, steps

    def forward(self, x):
        return self.block.unroll(x, self.steps)


def make_energy(block, head):
    """Per-sample scalar log p̃(x) = wᵀ Softplus(A z*(x)) (a smooth head on the DEQ output)."""

    def energy(x):
        z = block(x).flatten(1)
        return F.softplus(z @ head[0]) @ head[1]

    return energy


def score(energy, x):
    (s,) = torch.autograd.grad(energy(x).sum(), x, create_graph=True)
    return s


def hessian_trace(s, x):
    sf, d = s.flatten(1), x[0].numel()
    return sum(torch.autograd.grad(sf[:, i].sum(), x, create_graph=True)[0].flatten(1)[:, i] for i in range(d))


def sm_loss(energy, x):
    x = x.clone().requires_grad_(True)
    s = score(energy, x)
    tr = hessian_trace(s, x)
    return (0.5 * s.flatten(1).pow(2).sum(1) + tr).mean(), s, tr


def dsm_loss(energy, x, noise, sigma=0.3):
    xt = (x + sigma * noise).requires_grad_(True)
    s = score(energy, xt)
    return 0.5 * (s + (xt - x) / sigma**2).flatten(1).pow(2).sum(1).mean()


def ssm_vr_loss(energy, x, v):
    """½‖s‖² + vᵀ∇ₓ(vᵀs) for a fixed projection v (eq. 4)."""
    x = x.clone().requires_grad_(True)
    s = score(energy, x)
    (grad_vs,) = torch.autograd.grad((s * v).sum(), x, create_graph=True)
    return (0.5 * s.flatten(1).pow(2).sum(1) + (grad_vs * v).flatten(1).sum(1)).mean()


def flat_grad(loss, params):
    return torch.cat([g.flatten() for g in torch.autograd.grad(loss, params)])


def dense(n_layers):
    return DenseDEQBlock(3, 5, n_layers=n_layers, config=DEQConfig(**TIGHT)), (3,)


def conv():
    return ConvDEQBlock(1, 2, kernel_size=3, config=DEQConfig(**TIGHT)), (1, 3, 3)


def residual():
    return ResidualDEQBlock(1, 2, kernel_size=3, config=DEQConfig(**TIGHT)), (1, 3, 3)


def normalized_residual():
    """The authors' normalized ResBlock map; kernels ×3 so that w = 2‖K₁‖_F‖K₂‖_F ≈ 12 at 2 channels (contraction
    rate 0.46), γ, β off their initial values so every parameter matters. Its reference unrolls 80 steps, not 300:
    0.46⁸⁰ ≈ 1e-27 is exact at float64 either way, and the norms' graph through 300 steps held 2.9 GB."""
    block = NormalizedResidualDEQBlock(2, 3, config=DEQConfig(**TIGHT))
    with torch.no_grad():
        block.kernel1.mul_(3.0)
        block.kernel2.mul_(3.0)
        for p in (block.gamma1, block.beta1, block.gamma2, block.beta2):
            p.add_(0.3 * torch.randn_like(p))
    return block, (2, 4, 4), 80


@pytest.mark.parametrize("build", [
    lambda: dense(1), lambda: dense(2), conv, residual,
    # the normalized-residual map's implicit backward to third order is in the default suite in
    # tests/test_deq_normalized_residual.py (score, Hessian trace, SM parameter gradient against a 40-step unroll)
    pytest.param(normalized_residual, marks=pytest.mark.slow)],
    ids=["dense1", "dense2", "conv", "residual", "normalized_residual"])
def test_implicit_matches_unrolled_reference_to_every_order(build):
    torch.manual_seed(0)
    block, shape, *unroll = build()  # a builder may name its reference's unroll length
    block = block.double()
    x = torch.randn(4, *shape, dtype=torch.float64)
    noise = torch.randn_like(x)
    n_out = block.state_shape(x)[1:]
    n_flat = int(torch.tensor(n_out).prod())
    head = [torch.randn(n_flat, 4, dtype=torch.float64, requires_grad=True),
            torch.randn(4, dtype=torch.float64, requires_grad=True)]
    params = [*block.parameters(), *head]
    implicit, reference = make_energy(block, head), make_energy(Unrolled(block, *unroll), head)

    loss_i, s_i, tr_i = sm_loss(implicit, x)
    loss_r, s_r, tr_r = sm_loss(reference, x)
    assert block.last_stats["converged"]
    assert rel(s_i, s_r) < REL
    assert rel(tr_i, tr_r) < REL
    assert rel(flat_grad(loss_i, params), flat_grad(loss_r, params)) < REL
    g_i = flat_grad(dsm_loss(implicit, x, noise), params)
    g_r = flat_grad(dsm_loss(reference, x, noise), params)
    assert rel(g_i, g_r) < REL
    v = torch.randint(0, 2, x.shape, generator=torch.Generator().manual_seed(5)).to(x) * 2 - 1
    g_i = flat_grad(ssm_vr_loss(implicit, x, v), params)
    g_r = flat_grad(ssm_vr_loss(reference, x, v), params)
    assert rel(g_i, g_r) < REL


def test_gradcheck_and_gradgradcheck_of_the_implicit_function():
    """Finite differences vs the Function's backward and the backward of its backward (w.r.t. c and W)."""
    torch.manual_seed(1)
    c = torch.randn(2, 3, dtype=torch.float64, requires_grad=True)
    w = (0.4 * torch.randn(3, 3, dtype=torch.float64)).requires_grad_(True)
    solver = {"method": "picard", "tol": 1e-14, "max_iter": 500, "stop_mode": "abs"}

    def f(c, w):
        return fixed_point(dense_map, torch.zeros(2, 3, dtype=torch.float64), (c, w / (2 * w.norm())), solver)

    assert torch.autograd.gradcheck(f, (c, w))
    assert torch.autograd.gradgradcheck(f, (c, w))


def test_gradcheck_of_the_block_in_x():
    torch.manual_seed(2)
    block = DenseDEQBlock(2, 4, n_layers=2, config=DEQConfig(**TIGHT)).double()
    x = torch.randn(3, 2, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(block, (x,))
    assert torch.autograd.gradgradcheck(block, (x,))


def saved_bytes_of_sm_step(max_iter):
    torch.manual_seed(3)
    cfg = DEQConfig(tol=0.0, max_iter=max_iter, warm_start=False, backward="implicit")
    block = DenseDEQBlock(3, 8, config=cfg).double()
    head = [torch.randn(8, 4, dtype=torch.float64), torch.randn(4, dtype=torch.float64)]
    x = torch.randn(6, 3, dtype=torch.float64)
    total = 0

    def pack(t):
        nonlocal total
        total += t.numel() * t.element_size()
        return t

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            loss, _, _ = sm_loss(make_energy(block, head), x)
            loss.backward()
    return total


def test_implicit_memory_does_not_grow_with_solver_iterations():
    small, large = saved_bytes_of_sm_step(10), saved_bytes_of_sm_step(100)
    assert abs(large - small) / small < 0.05, (small, large)


@pytest.mark.parametrize("layers", [1, 3])
def test_dense_map_products_are_its_jacobian(layers):
    """dense_map.linearize's hand-written J v and Jᵀ a (the adjoint solves' products) against autograd (float64)."""
    g = torch.Generator().manual_seed(0)
    r = lambda *s: torch.randn(*s, generator=g, dtype=torch.float64)
    z, inj = r(4, 6), r(4, 6)
    params = [0.5 * r(6, 6)]
    for _ in range(layers - 1):
        params += [0.5 * r(6, 6), r(6)]
    jac = torch.autograd.functional.jacobian(lambda u: dense_map(u, inj, *params), z).reshape(24, 24)
    jvp, vjp = dense_map.linearize(z, inj, *params)
    v, a = r(4, 6), r(4, 6)
    torch.testing.assert_close(jvp(v).reshape(-1), jac @ v.reshape(-1), rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(vjp(a).reshape(-1), jac.T @ a.reshape(-1), rtol=1e-12, atol=1e-12)
