"""Curvature propagation (src/objectives/cp.py): the recorder, the exact Hessian decomposition it relies on,
unbiasedness on many element-wise ops, and the refusals that keep it from being silently wrong."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from src.objectives import CurvatureRecorder, cp, curvature_terms, sm
from tests.test_objectives import (
    DT,
    GaussianEnergy,
    MLPEnergy,
    _mc_check,
    _replicated,
    data,
    gaussian,
    param_grads,
)


def exact_hessian(model, x):
    xl = x.detach().requires_grad_(True)
    (s,) = torch.autograd.grad(model.log_density(xl).sum(), xl, create_graph=True)
    s = s.reshape(x.shape[0], -1)
    rows = [
        torch.autograd.grad(s[:, i].sum(), xl, retain_graph=True)[0].reshape(x.shape[0], -1)
        for i in range(s.shape[1])
    ]
    return torch.stack(rows, 1)  # [B, D, D]


def decomposed_hessian(model, x):
    """Σ_l J_lᵀ diag(M_l) J_l from the recorded ops (full matrix, not only its diagonal)."""
    xl, _, records, curv = curvature_terms(model, x, create_graph=False)
    B, D = x.shape[0], x[0].numel()
    H = torch.zeros(B, D, D, dtype=x.dtype)
    for r, m in zip(records, curv):
        u = r.u.reshape(B, -1)
        J = torch.stack(
            [
                torch.autograd.grad(u[:, k].sum(), xl, retain_graph=True)[0].reshape(B, D)
                for k in range(u.shape[1])
            ],
            1,
        )  # [B, K, D]
        H = H + torch.einsum("bki,bk,bkj->bij", J, m.detach().reshape(B, -1), J)
    return H, records


class Zoo(nn.Module):
    """Every supported element-wise nonlinearity, each weighted and summed into log p̃."""

    def __init__(self, d=3, hidden=5, seed=0):
        super().__init__()
        g = torch.Generator().manual_seed(seed)
        self.lin = nn.Linear(d, hidden).to(DT)
        with torch.no_grad():
            self.lin.weight.copy_(torch.randn(hidden, d, generator=g, dtype=DT) * 0.7)
            self.lin.bias.copy_(torch.randn(hidden, generator=g, dtype=DT) * 0.3)
        self.p = nn.Parameter(torch.tensor(0.7, dtype=DT))
        self.c = nn.Parameter(torch.tensor(1.3, dtype=DT))
        self.n_terms = len(self.terms(torch.zeros(1, hidden, dtype=DT)))
        self.w = nn.Parameter(torch.randn(self.n_terms, hidden, generator=g, dtype=DT) * 0.3)

    def terms(self, h):
        q = h**2 + 1
        return [
            F.softplus(h, beta=2.0),
            nn.Softplus()(h),
            torch.exp(0.3 * h),
            torch.log(F.softplus(h) + 1),
            torch.sigmoid(h),
            F.logsigmoid(h),
            torch.tanh(h),
            F.elu(h),
            F.celu(h, alpha=0.5),
            F.selu(h),
            F.silu(h),
            F.gelu(h),
            torch.sin(h),
            torch.cos(h),
            torch.sqrt(q),
            torch.rsqrt(q),
            torch.reciprocal(q),
            2.0 / q,
            torch.div(self.c, q),
            2 ** (0.1 * h),
            torch.pow(3.0, 0.1 * h),
            h**3,
            h * h,
            torch.square(h),
            torch.log1p(q),
            torch.expm1(0.2 * h),
            torch.erf(h),
            torch.sinh(0.2 * h),
            torch.cosh(0.2 * h),
            torch.exp2(0.2 * h),
            torch.log2(q),
            torch.log10(q),
            q**self.p,
            q.pow(0.5),
            F.relu(h),
            F.leaky_relu(h, 0.1),
            h.abs(),
            h.clamp(-0.5, 0.5),
            torch.tanh(torch.tanh(h)),
            (h / 3.0).sigmoid(),
        ]

    def log_density(self, x):
        h = self.lin(x.reshape(x.shape[0], -1))
        out = sum((t * w).sum(-1) for t, w in zip(self.terms(h), self.w))
        return out - 0.5 * (x.reshape(x.shape[0], -1) ** 2).sum(-1)


class Coupling(nn.Module):
    """NICE-like: additive coupling with a softplus MLP, diagonal scaling, standard-normal prior."""

    def __init__(self, d=4, seed=0):
        super().__init__()
        torch.manual_seed(seed)
        self.mlp = nn.Sequential(nn.Linear(d // 2, 6), nn.Softplus(), nn.Linear(6, d - d // 2)).to(DT)
        self.log_scale = nn.Parameter(0.1 * torch.randn(d, dtype=DT))

    def log_density(self, x):
        x = x.reshape(x.shape[0], -1)
        x1, x2 = x[:, : x.shape[1] // 2], x[:, x.shape[1] // 2 :]
        z = torch.cat([x1, x2 + self.mlp(x1)], dim=1) * torch.exp(self.log_scale)
        return -0.5 * (z**2).sum(-1) + self.log_scale.sum()


class ConvEnergy(nn.Module):
    """Image energy: conv, padding, pooling, indexing, softplus and a Gaussian base."""

    def __init__(self, seed=0):
        super().__init__()
        torch.manual_seed(seed)
        self.conv = nn.Conv2d(1, 3, 3, padding=1).to(DT)
        self.head = nn.Linear(3 * 2 * 2, 1, bias=False).to(DT)

    def log_density(self, x):
        h = F.avg_pool2d(F.softplus(self.conv(F.pad(x, (0, 0, 0, 0)))), 2)
        return self.head(F.softplus(h).flatten(1)).squeeze(-1) - 0.5 * (x**2).flatten(1).sum(-1)


class PhantomDEQEnergy(nn.Module):
    """z* = softplus(W z* + U x) solved without grad, then K = 2 attached steps (phantom gradient)."""

    def __init__(self, d=3, m=6, seed=0):
        super().__init__()
        g = torch.Generator().manual_seed(seed)
        W = torch.randn(m, m, generator=g, dtype=DT)
        self.W = nn.Parameter(0.5 * W / W.norm())
        self.U = nn.Parameter(torch.randn(m, d, generator=g, dtype=DT) / d**0.5)
        self.w = nn.Parameter(torch.randn(m, generator=g, dtype=DT))

    def log_density(self, x):
        inj = x @ self.U.T
        with torch.no_grad():
            z = torch.zeros_like(inj)
            for _ in range(40):
                z = F.softplus(z @ self.W.T + inj)
        for _ in range(2):
            z = F.softplus(z @ self.W.T + inj)
        return z @ self.w - 0.5 * (x**2).sum(-1)


MODELS = {
    "gaussian": (lambda: GaussianEnergy(*gaussian(4)), (4,)),
    "mlp": (lambda: MLPEnergy(4, hidden=8, depth=3), (4,)),
    "zoo": (lambda: Zoo(), (3,)),
    "coupling": (lambda: Coupling(), (4,)),
    "conv": (lambda: ConvEnergy(), (1, 4, 4)),
    "phantom_deq": (lambda: PhantomDEQEnergy(), (3,)),
}


@pytest.mark.parametrize("name", list(MODELS))
def test_recorded_decomposition_is_the_exact_hessian(name):
    make, shape = MODELS[name]
    model = make()
    x = data(3, *shape, seed=1)
    H_cp, records = decomposed_hessian(model, x)
    H = exact_hessian(model, x)
    assert records, "no nonlinearity recorded"
    torch.testing.assert_close(H_cp, H, rtol=0, atol=1e-10)
    assert H.abs().max() > 1e-2


def test_zoo_records_every_op_once():
    model = Zoo()
    _, _, records, _ = curvature_terms(model, data(2, 3))
    ops = [r.op for r in records]
    # one record per nonlinear term (piecewise-linear ones record nothing), plus the squares of q and the base
    assert "softplus" in ops and "square" in ops and "c/u" in ops and "c**u" in ops and "log_sigmoid" in ops
    # 40 terms − 4 piecewise-linear ones (relu, leaky_relu, abs, clamp) + the inner ops of q = h² + 1,
    # tanh(tanh), log(softplus) and the Gaussian base −½x²
    assert len(ops) == model.n_terms - 4 + 4


@pytest.mark.parametrize("name", ["zoo", "coupling", "conv", "phantom_deq"])
def test_cp_monte_carlo_mean_matches_exact_sm(name):
    torch.manual_seed(3)
    make, shape = MODELS[name]
    model = make()
    x = data(3, *shape, seed=2)
    exact = sm(model, x, create_graph=False).per_sample
    R = 2000
    est = cp(model, _replicated(x, R), create_graph=False).per_sample.reshape(R, 3)
    _mc_check(est, exact)


def test_cp_n_samples_reduces_variance_and_gradients_flow():
    torch.manual_seed(0)
    model = MLPEnergy(4, hidden=8)
    x = _replicated(data(2, 4), 500)
    v1 = cp(model, x, n_samples=1, create_graph=False).per_sample.reshape(500, 2).var(0)
    v8 = cp(model, x, n_samples=8, create_graph=False).per_sample.reshape(500, 2).var(0)
    assert (v8 < v1 / 4).all() and (v8 > v1 / 16).all()  # ~1/8
    grads = param_grads(model, cp(model, data(3, 4)).loss)
    assert all(torch.isfinite(g).all() for g in grads) and sum(g.abs().sum() for g in grads) > 0


def test_recorder_intercepts_softplus_in_every_spelling():
    x = data(2, 3).requires_grad_(True)
    lin = nn.Linear(3, 4).to(DT)
    with CurvatureRecorder(x) as rec:
        h = lin(x)
        F.softplus(h)
        nn.Softplus(beta=2.0)(h)
        torch.nn.functional.softplus(h, 1.0, 20.0)
        F.softplus(lin.weight)  # parameter only: does not depend on x, not recorded
        with torch.no_grad():
            F.softplus(h)  # grad disabled: not recorded
    assert [r.op for r in rec.records] == ["softplus"] * 3
    assert rec.depends(h) and not rec.depends(lin.weight)


def _energy(fn):
    class E(nn.Module):
        def log_density(self, x):
            return fn(x)

    return E()


@pytest.mark.parametrize(
    "fn, match",
    [
        (lambda x: x[:, 0] * x[:, 1], "two tensors that both depend on x"),
        (lambda x: (x @ x.T).diagonal(), "two tensors that both depend on x"),
        (lambda x: torch.einsum("bi,bi->b", x, x.tanh()), "two tensors that both depend on x"),
        (lambda x: torch.logsumexp(x, -1), "op 'logsumexp'"),
        (lambda x: F.softmax(x, -1)[:, 0], "op 'softmax'"),
        (lambda x: x.norm(dim=-1), "norm"),
        (lambda x: torch.pow(x, x).sum(-1), "x-dependent base and exponent"),
        (lambda x: (x.exp() / x.exp().sum(-1, keepdim=True))[:, 0], "numerator and denominator"),
        (lambda x: F.elu(x * 1.0, inplace=True).sum(-1), "in-place nonlinear"),
        (lambda x: F.elu(x * 1.0, 1.0, True).sum(-1), "in-place nonlinear"),
        (lambda x: (x * 1.0).exp_().sum(-1), "in-place nonlinear"),
        (lambda x: torch.tanh(x).add_(1).sum(-1), "modified in place"),
    ],
    ids=[
        "mul",
        "matmul",
        "einsum",
        "logsumexp",
        "softmax",
        "norm",
        "pow_xx",
        "div_xx",
        "elu_inplace_kw",
        "elu_inplace_pos",
        "exp_",
        "modified_after_record",
    ],
)
def test_cp_refuses_what_it_cannot_handle(fn, match):
    with pytest.raises(NotImplementedError, match=match):
        cp(_energy(fn), data(2, 3))


def test_cp_refuses_custom_autograd_function():
    from tests.test_objectives import CustomFunctionEnergy

    with pytest.raises(NotImplementedError, match="custom autograd.Function"):
        cp(CustomFunctionEnergy(4), data(2, 4))


def test_cp_affine_model_has_zero_trace():
    model = _energy(lambda x: (x @ torch.arange(3.0, dtype=DT)) + x.sum(-1))
    out = cp(model, data(2, 3))
    torch.testing.assert_close(out.parts["trace"], torch.tensor(0.0, dtype=DT))
