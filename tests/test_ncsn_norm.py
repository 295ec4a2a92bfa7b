"""The recomputing instance norm++ (+ ELU) of src/layers/instance_norm.py against the plain autograd map, float64:
values, first derivatives, the create_graph second derivatives SSM / SSM-VR differentiate, finite
differences (gradcheck / gradgradcheck), and the saved bytes it promises."""

from __future__ import annotations

import pytest
import torch

from src.callbacks.profiling import SavedTensorsMeter
from src.layers.instance_norm import instance_norm_plus, norm_act

pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py


def _inputs(per_sample: bool, bias: bool, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    B, C, H, W = 3, 5, 4, 6
    x = torch.randn(B, C, H, W, generator=g, dtype=torch.float64) * 2 + torch.randn(B, C, 1, 1, generator=g,
                                                                                   dtype=torch.float64)
    shape = (B, C) if per_sample else (C,)
    rows = [1 + 0.3 * torch.randn(shape, generator=g, dtype=torch.float64) for _ in range(2)]
    if bias:
        rows.append(0.5 * torch.randn(shape, generator=g, dtype=torch.float64))
    return [t.requires_grad_(True) for t in (x, *rows)]


CASES = [(per_sample, bias, act) for per_sample in (True, False) for bias in (True, False) for act in (True, False)]
IDS = [f"{'rows' if p else 'shared'}-{'bias' if b else 'nobias'}-{'elu' if a else 'noact'}" for p, b, a in CASES]


def _both(inputs, act):
    x, *rows = inputs
    plain = norm_act(x, *rows, act=act, recompute=False)
    fused = norm_act(x, *rows, act=act, recompute=True)
    return plain, fused


@pytest.mark.parametrize("per_sample,bias,act", CASES, ids=IDS)
def test_recomputed_norm_matches_plain_to_second_order(per_sample, bias, act):
    inputs = _inputs(per_sample, bias)
    plain, fused = _both(inputs, act)
    assert torch.allclose(plain, fused, rtol=1e-12, atol=1e-12)
    g = torch.Generator().manual_seed(1)
    u = torch.randn(plain.shape, generator=g, dtype=torch.float64)
    # first derivatives, with the graph kept (what SSM-VR's vᵀ∇ₓ(vᵀs) does)
    d_plain = torch.autograd.grad(plain, inputs, u, create_graph=True)
    d_fused = torch.autograd.grad(fused, inputs, u, create_graph=True)
    for a, b in zip(d_plain, d_fused):
        assert torch.allclose(a, b, rtol=1e-12, atol=1e-12)
    # second derivatives: a scalar of the first derivatives and of the output, differentiated to every input
    w = [torch.randn(t.shape, generator=g, dtype=torch.float64) for t in inputs]

    def objective(out, ds):
        return 0.5 * (out**2).sum() + sum((d * wi).sum() for d, wi in zip(ds, w))

    s_plain = torch.autograd.grad(objective(plain, d_plain), inputs)
    s_fused = torch.autograd.grad(objective(fused, d_fused), inputs)
    for a, b in zip(s_plain, s_fused):
        assert torch.allclose(a, b, rtol=1e-10, atol=1e-10)
        assert a.abs().max() > 1e-3  # the second-order terms are there to compare


def test_float32_statistics_are_stable():
    """The two-pass statistics in float32 on channels whose mean is 10⁴ times their spread: still the float64
    value to float32 precision (a one-pass E[x²] − E[x]² would lose every digit here)."""
    g = torch.Generator().manual_seed(2)
    x64 = 50.0 + 0.005 * torch.randn(2, 4, 8, 8, generator=g, dtype=torch.float64)
    rows64 = [1 + 0.1 * torch.randn(2, 4, generator=g, dtype=torch.float64) for _ in range(3)]
    ref = norm_act(x64, *rows64, act=True, recompute=False)
    with torch.no_grad():
        out = norm_act(x64.float(), *(r.float() for r in rows64), act=True)
    assert torch.allclose(out.double(), ref, atol=2e-3)


def test_recomputed_norm_gradcheck_and_gradgradcheck():
    x, gamma, alpha, beta = _inputs(True, True, seed=3)
    x = x[:2, :3, :3, :4].detach().requires_grad_(True)
    rows = [r[:2, :3].detach().requires_grad_(True) for r in (gamma, alpha, beta)]

    def f(x, *rows):
        return norm_act(x, *rows, act=True, recompute=True)

    assert torch.autograd.gradcheck(f, (x, *rows))
    assert torch.autograd.gradgradcheck(f, (x, *rows))


def test_plain_reference_is_instance_norm_plus():
    """The plain map is NCSN's formula (per-channel loop, biased spatial, unbiased channel variance)."""
    x, gamma, alpha, beta = (t.detach() for t in _inputs(True, True, seed=4))
    out = instance_norm_plus(x, gamma, alpha, beta)
    eps = 1e-5
    for b in range(x.shape[0]):
        mu = x[b].mean(dim=(1, 2))
        mhat = (mu - mu.mean()) / torch.sqrt(mu.var() + eps)
        for c in range(x.shape[1]):
            xhat = (x[b, c] - mu[c]) / torch.sqrt(x[b, c].var(unbiased=False) + eps)
            ref = gamma[b, c] * (xhat + alpha[b, c] * mhat[c]) + beta[b, c]
            assert torch.allclose(out[b, c], ref, rtol=1e-12, atol=1e-12)


def _elementary(x, gamma, alpha, beta, eps=1e-5):
    """ELU(instance norm++) from elementary ops only (no fused norm or ELU kernel): every order exact."""
    mu = x.mean(dim=(2, 3), keepdim=True)
    xhat = (x - mu) / torch.sqrt(((x - mu) ** 2).mean(dim=(2, 3), keepdim=True) + eps)
    m = mu[..., 0, 0]
    mhat = (m - m.mean(dim=-1, keepdim=True)) / torch.sqrt(m.var(dim=-1, keepdim=True) + eps)
    n = gamma[..., None, None] * (xhat + (alpha * mhat)[..., None, None]) + beta[..., None, None]
    return torch.where(n > 0, n, torch.expm1(n))


def test_third_derivative_is_exact():
    """Each backward recomputes through the same function, so even a third derivative is exact: it matches the
    elementary-op formula. (The plain map's is not: F.instance_norm's third derivative differs from it by 5e-2
    here, measured with torch 2.13; no objective takes a third derivative.)"""
    inputs = _inputs(True, True, seed=5)
    res = []
    for out in (norm_act(*inputs, act=True, recompute=True), _elementary(*inputs)):
        (d,) = torch.autograd.grad(out.sum(), inputs[0], create_graph=True)
        (dd,) = torch.autograd.grad((d**2).sum(), inputs[0], create_graph=True)
        res.append(torch.autograd.grad((dd**2).sum(), inputs))
    for a, b in zip(*res):
        assert torch.allclose(a, b, rtol=1e-10, atol=1e-10)
        assert a.abs().max() > 1e-3


def test_recomputed_norm_saves_its_input_only():
    """Over a forward and its create_graph backward (one SSM-VR step's graph) the recomputing map keeps x and the
    incoming gradient (+ the [B, C] rows); the plain map keeps 7 full-size tensors."""
    x = torch.randn(2, 16, 32, 32, requires_grad=True)
    rows = [torch.ones(2, 16, requires_grad=True) for _ in range(3)]
    full = x.numel() * x.element_size()
    saved = {}
    for recompute in (True, False):
        with SavedTensorsMeter() as meter:
            out = norm_act(x, *rows, act=True, recompute=recompute)
            torch.autograd.grad(out, x, torch.randn_like(out), create_graph=True)
        saved[recompute] = meter.bytes / full
    assert 2 <= saved[True] < 2.01
    assert saved[False] > 6
