"""Score-matching objectives (src/objectives): closed forms, trace routes, unbiasedness, validation.

Everything in float64 on small models; the Gaussian energy has known μ, Σ so every loss has a closed form.
"""

from __future__ import annotations

import pickle

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from src.objectives import (
    OBJECTIVES,
    compute_score,
    cp,
    dsm,
    get_objective,
    hessian_trace,
    mle,
    noise_conditional,
    sm,
    ssm,
    ssm_vr,
)

DT = torch.float64
ROUTES = ("loop", "replicate", "func", "batched")


# ------------------------------------------------------------------------------------------------ models
class GaussianEnergy(nn.Module):
    """log p̃(x) = −½ (x−μ)ᵀ Σ⁻¹ (x−μ) = −½ ‖A(x−μ)‖², AᵀA = Σ⁻¹ (affine ops + pow, so CP sees it)."""

    def __init__(self, mu: torch.Tensor, cov: torch.Tensor):
        super().__init__()
        self.prec = torch.linalg.inv(cov)
        self.mu = nn.Parameter(mu.clone())
        self.A = nn.Parameter(torch.linalg.cholesky(self.prec).T.contiguous())

    def log_density(self, x):
        u = (x.reshape(x.shape[0], -1) - self.mu) @ self.A.T
        return -0.5 * (u**2).sum(-1)


class GaussianScore(nn.Module):
    """Score network with the Gaussian score −Σ⁻¹(x−μ) (no log_density)."""

    def __init__(self, mu, cov):
        super().__init__()
        self.mu = nn.Parameter(mu.clone())
        self.P = nn.Parameter(torch.linalg.inv(cov))

    def score(self, x):
        return (-(x.reshape(x.shape[0], -1) - self.mu) @ self.P).reshape(x.shape)


class MLPEnergy(nn.Module):
    """Softplus MLP energy with a Gaussian base: non-constant Hessian."""

    def __init__(self, d, hidden=16, depth=2, seed=0):
        super().__init__()
        g = torch.Generator().manual_seed(seed)
        layers, w = [], d
        for _ in range(depth):
            lin = nn.Linear(w, hidden).to(DT)
            with torch.no_grad():
                lin.weight.copy_(torch.randn(hidden, w, generator=g, dtype=DT) / w**0.5)
                lin.bias.copy_(torch.randn(hidden, generator=g, dtype=DT) * 0.5)
            layers += [lin, nn.Softplus()]
            w = hidden
        self.net = nn.Sequential(*layers)
        self.out = nn.Linear(hidden, 1, bias=False).to(DT)
        with torch.no_grad():
            self.out.weight.copy_(torch.randn(1, hidden, generator=g, dtype=DT))

    def log_density(self, x):
        x = x.reshape(x.shape[0], -1)
        return self.out(self.net(x)).squeeze(-1) - 0.5 * (x**2).sum(-1)


class MLPScore(nn.Module):
    """A score network s(x) = V tanh(W x + b) − x whose Jacobian is not symmetric."""

    def __init__(self, d, hidden=12, seed=1):
        super().__init__()
        g = torch.Generator().manual_seed(seed)
        self.W = nn.Parameter(torch.randn(hidden, d, generator=g, dtype=DT) / d**0.5)
        self.b = nn.Parameter(torch.randn(hidden, generator=g, dtype=DT))
        self.V = nn.Parameter(torch.randn(d, hidden, generator=g, dtype=DT) / hidden**0.5)

    def score(self, x):
        xf = x.reshape(x.shape[0], -1)
        return (torch.tanh(xf @ self.W.T + self.b) @ self.V.T - xf).reshape(x.shape)


def gaussian(d=5, seed=0):
    g = torch.Generator().manual_seed(seed)
    m = torch.randn(d, d, generator=g, dtype=DT)
    cov = m @ m.T / d + 0.5 * torch.eye(d, dtype=DT)
    mu = torch.randn(d, generator=g, dtype=DT)
    return mu, cov


def data(b, *shape, seed=0):
    return torch.randn(b, *shape, generator=torch.Generator().manual_seed(seed), dtype=DT)


def params(model):
    return [p for p in model.parameters() if p.requires_grad]


def param_grads(model, loss):
    return torch.autograd.grad(loss, params(model), allow_unused=True, materialize_grads=True)


# ----------------------------------------------------------------------------------------- closed forms
@pytest.mark.parametrize("route", ROUTES)
@pytest.mark.parametrize("kind", ["energy", "score"])
@pytest.mark.parametrize("shape", [(5,), (1, 1, 5)])
def test_sm_gaussian_closed_form(route, kind, shape):
    mu, cov = gaussian(5)
    model = GaussianEnergy(mu, cov) if kind == "energy" else GaussianScore(mu, cov)
    x = data(7, *shape)
    P = torch.linalg.inv(cov)
    r = x.reshape(7, -1) - mu
    expected = 0.5 * ((r @ P) ** 2).sum(-1) - torch.trace(P)  # ½(x−μ)ᵀΣ⁻²(x−μ) − tr Σ⁻¹
    out = sm(model, x, trace_route=route)
    assert out.per_sample.shape == (7,)
    torch.testing.assert_close(out.per_sample, expected, rtol=0, atol=1e-10)
    torch.testing.assert_close(out.loss, expected.mean(), rtol=0, atol=1e-10)
    torch.testing.assert_close(out.parts["trace"], -torch.trace(P).expand(7).mean(), rtol=0, atol=1e-10)
    torch.testing.assert_close(
        out.parts["score_norm"], (0.5 * ((r @ P) ** 2).sum(-1)).mean(), rtol=0, atol=1e-10
    )


@pytest.mark.parametrize("projection", ["rademacher", "gaussian"])
def test_ssm_and_ssm_vr_closed_form_given_v(projection):
    mu, cov = gaussian(5)
    model = GaussianEnergy(mu, cov)
    x = data(6, 5)
    P = torch.linalg.inv(cov)
    g = torch.Generator().manual_seed(3)
    v = torch.randn(3, 6, 5, generator=g, dtype=DT)
    if projection == "rademacher":
        v = v.sign()
    s = -(x - mu) @ P
    vs = (v * s).sum(-1)  # [3, 6]
    vPv = torch.einsum("mbi,ij,mbj->mb", v, P, v)
    exp_ssm = (0.5 * vs**2 - vPv).mean(0)
    exp_vr = 0.5 * (s**2).sum(-1) - vPv.mean(0)
    torch.testing.assert_close(
        ssm(model, x, n_projections=3, projection=projection, v=v).per_sample, exp_ssm, rtol=0, atol=1e-10
    )
    torch.testing.assert_close(
        ssm_vr(model, x, n_projections=3, projection=projection, v=v).per_sample, exp_vr, rtol=0, atol=1e-10
    )
    # one projection given as [B, D]; and the score-network path
    torch.testing.assert_close(
        ssm_vr(GaussianScore(mu, cov), x, v=v[0]).per_sample,
        0.5 * (s**2).sum(-1) - vPv[0],
        rtol=0,
        atol=1e-10,
    )
    # the generator makes the draw reproducible, and the drawn projections have the requested law
    a = ssm(model, x, n_projections=2, projection=projection, generator=torch.Generator().manual_seed(9))
    b = ssm(model, x, n_projections=2, projection=projection, generator=torch.Generator().manual_seed(9))
    torch.testing.assert_close(a.per_sample, b.per_sample, rtol=0, atol=0)


@pytest.mark.parametrize("kind", ["energy", "score"])
def test_dsm_closed_form_given_eps(kind):
    mu, cov = gaussian(5)
    model = GaussianEnergy(mu, cov) if kind == "energy" else GaussianScore(mu, cov)
    P = torch.linalg.inv(cov)
    x, eps = data(6, 5), data(6, 5, seed=1)
    for sigma in (0.1, torch.tensor([0.1, 0.2, 0.3, 0.5, 1.0, 2.0], dtype=DT)):
        sig = sigma if isinstance(sigma, float) else sigma[:, None]
        xt = x + sig * eps
        expected = 0.5 * ((-(xt - mu) @ P + (xt - x) / sig**2) ** 2).sum(-1)
        out = dsm(model, x, sigma=sigma, eps=eps)
        torch.testing.assert_close(out.per_sample, expected, rtol=1e-12, atol=1e-10)


# ---------------------------------------------------------------------------------------- trace routes
@pytest.mark.parametrize(
    "make, shape",
    [(lambda: MLPEnergy(6), (6,)), (lambda: MLPEnergy(6, depth=3), (2, 3)), (lambda: MLPScore(6), (1, 2, 3))],
    ids=["mlp_energy", "mlp_energy_3layer_image", "mlp_score_image"],
)
def test_trace_routes_agree_values_and_parameter_gradients(make, shape):
    model = make()
    x = data(5, *shape)
    ref = sm(model, x, trace_route="loop")
    ref_g = param_grads(model, ref.loss)
    variants = [{"trace_route": r} for r in ROUTES[1:]]
    variants.append({"trace_route": "replicate", "max_copies_per_pass": 4})
    for kw in variants:
        out = sm(model, x, **kw)
        torch.testing.assert_close(out.per_sample, ref.per_sample, rtol=0, atol=1e-10, msg=str(kw))
        for g, gr in zip(param_grads(model, out.loss), ref_g):
            torch.testing.assert_close(g, gr, rtol=0, atol=1e-10, msg=str(kw))
    # the trace is really there: it differs from ½‖s‖² alone and matches an autograd Hessian
    xl = x.detach().reshape(5, -1).requires_grad_(True)
    s = compute_score(model, xl.reshape(x.shape)).reshape(5, -1)
    tr = sum(torch.autograd.grad(s[:, i].sum(), xl, retain_graph=True)[0][:, i] for i in range(6))
    torch.testing.assert_close(ref.parts["trace"], tr.mean(), rtol=0, atol=1e-12)
    assert tr.abs().min() > 1e-3


def test_auto_route_is_loop_on_cpu_and_hessian_trace_shapes():
    model = MLPEnergy(4)
    x = data(3, 4)
    s, tr = hessian_trace(model, x, trace_route="auto")
    assert s.shape == (3, 4) and tr.shape == (3,)
    torch.testing.assert_close(
        sm(model, x).per_sample, sm(model, x, trace_route="loop").per_sample, rtol=0, atol=0
    )
    from src.objectives.sm import resolve_trace_route

    assert resolve_trace_route("auto", torch.device("cpu"), model) == "loop"
    assert resolve_trace_route("auto", torch.device("cuda"), model) == "replicate"
    model.supports_torch_func = True  # an explicit network may declare that torch.func works on it
    assert resolve_trace_route("auto", torch.device("cpu"), model) == "func"
    assert resolve_trace_route("loop", torch.device("cuda"), model) == "loop"
    torch.testing.assert_close(sm(model, x).per_sample, sm(model, x, trace_route="loop").per_sample)


class _DifferentiableSoftplus(torch.autograd.Function):
    """A custom Function with a twice-differentiable backward but no vmap rule (like the implicit DEQ)."""

    @staticmethod
    def forward(ctx, u):
        ctx.save_for_backward(u)
        return F.softplus(u)

    @staticmethod
    def backward(ctx, g):
        (u,) = ctx.saved_tensors
        return g * torch.sigmoid(u)


class CustomFunctionEnergy(MLPEnergy):
    def log_density(self, x):
        x = x.reshape(x.shape[0], -1)
        h = _DifferentiableSoftplus.apply(self.net[0](x))
        return self.out(torch.tanh(h)).squeeze(-1) - 0.5 * (x**2).sum(-1)


def test_replicate_works_through_custom_function_where_func_fails():
    model = CustomFunctionEnergy(4)
    x = data(3, 4)
    ref = sm(model, x, trace_route="loop")
    rep = sm(model, x, trace_route="replicate")
    torch.testing.assert_close(rep.per_sample, ref.per_sample, rtol=0, atol=1e-12)
    with pytest.raises(RuntimeError, match="trace_route='func' failed.*replicate"):
        sm(model, x, trace_route="func")


# ------------------------------------------------------------------------------------- evaluation mode
@pytest.mark.parametrize("name", ["sm", "ssm", "ssm_vr", "dsm", "cp"])
def test_create_graph_false_is_detached_and_equal(name):
    model = MLPEnergy(4)
    x = data(5, 4)
    gen = lambda: torch.Generator().manual_seed(4)
    kw = {} if name == "sm" else {"generator": gen()}
    train = OBJECTIVES[name](model, x, create_graph=True, **kw)
    kw = {} if name == "sm" else {"generator": gen()}
    ev = OBJECTIVES[name](model, x, create_graph=False, **kw)
    assert train.loss.requires_grad
    assert not ev.loss.requires_grad and not ev.per_sample.requires_grad
    assert all(not v.requires_grad for v in ev.parts.values())
    torch.testing.assert_close(ev.per_sample, train.per_sample.detach(), rtol=0, atol=1e-12)


@pytest.mark.parametrize("route", ROUTES)
def test_sm_eval_routes_detached(route):
    model = MLPScore(4)
    x = data(3, 4)
    out = sm(model, x, trace_route=route, create_graph=False)
    assert not out.loss.requires_grad
    torch.testing.assert_close(
        out.per_sample, sm(model, x, trace_route="loop").per_sample.detach(), rtol=0, atol=1e-12
    )


def test_objectives_run_under_no_grad_but_refuse_inference_mode():
    model = MLPEnergy(4)
    x = data(3, 4)
    with torch.no_grad():
        out = sm(model, x, create_graph=False)
    torch.testing.assert_close(out.per_sample, sm(model, x).per_sample.detach())
    with torch.inference_mode(), pytest.raises(RuntimeError, match="inference_mode=False"):
        sm(model, x)


# ------------------------------------------------------------------------------------------ unbiasedness
def _mc_check(estimates: torch.Tensor, exact: torch.Tensor):
    """estimates [R, B] i.i.d. over R; exact [B]. Batch mean within 3 SE, each sample within 4 SE."""
    R = estimates.shape[0]
    mean, se = estimates.mean(0), estimates.std(0) / R**0.5
    assert (se > 0).all()
    z = (mean - exact) / se
    assert z.abs().max() < 4, z
    bm = estimates.mean(1)
    zb = (bm.mean() - exact.mean()) / (bm.std() / R**0.5)
    assert zb.abs() < 3, zb


def _replicated(x, R):
    return x.unsqueeze(0).expand(R, *x.shape).reshape(R * x.shape[0], *x.shape[1:])


@pytest.mark.parametrize("name", ["ssm", "ssm_vr", "cp"])
@pytest.mark.parametrize("which", ["gaussian", "mlp"])
def test_monte_carlo_mean_matches_exact_sm(name, which):
    torch.manual_seed({"ssm": 0, "ssm_vr": 1, "cp": 2}[name] + (10 if which == "mlp" else 0))
    model = GaussianEnergy(*gaussian(5)) if which == "gaussian" else MLPEnergy(5, hidden=16, depth=2)
    x = data(4, 5, seed=5)
    exact = sm(model, x, create_graph=False).per_sample
    R = 3000
    est = OBJECTIVES[name](model, _replicated(x, R), create_graph=False).per_sample.reshape(R, 4)
    _mc_check(est, exact)


@pytest.mark.parametrize("name", ["ssm_vr", "cp"])
def test_monte_carlo_parameter_gradient_matches_exact_sm(name):
    torch.manual_seed(7)
    model = MLPEnergy(4, hidden=8, depth=2)
    x = data(3, 4, seed=6)
    exact = torch.cat([g.reshape(-1) for g in param_grads(model, sm(model, x).loss)])
    K, R = 24, 300
    gs = []
    for _ in range(K):
        out = OBJECTIVES[name](model, _replicated(x, R))
        gs.append(torch.cat([g.reshape(-1) for g in param_grads(model, out.loss)]))
    gs = torch.stack(gs)
    z = (gs.mean(0) - exact) / (gs.std(0) / K**0.5).clamp_min(1e-12)
    assert z.abs().max() < 5, z
    assert (gs.mean(0) - exact).norm() < 0.1 * exact.norm()


# ------------------------------------------------------------------------------------------------- mle
def test_mle_needs_log_likelihood():
    with pytest.raises(
        ValueError,
        match=r"loss=mle needs a model with a tractable likelihood \(e.g. model=nice\); MLPEnergy has none",
    ):
        mle(MLPEnergy(3), data(2, 3))

    class Normal(nn.Module):
        def __init__(self):
            super().__init__()
            self.loc = nn.Parameter(torch.zeros(3, dtype=DT))

        def log_likelihood(self, x):
            return torch.distributions.Normal(self.loc, 1.0).log_prob(x).sum(-1)

    x = data(4, 3)
    out = mle(Normal(), x, sigma=3)  # extra keywords are ignored
    torch.testing.assert_close(
        out.per_sample, 0.5 * (x**2).sum(-1) + 1.5 * torch.log(torch.tensor(2 * torch.pi, dtype=DT))
    )
    assert out.loss.requires_grad and not mle(Normal(), x, create_graph=False).loss.requires_grad


# ------------------------------------------------------------------------------------------ registry
def test_get_objective_names_kwargs_and_validation():
    assert set(OBJECTIVES) == {"sm", "ssm", "ssm_vr", "dsm", "cp", "mle"}
    with pytest.raises(
        ValueError, match="unknown objective 'foo'; valid names: sm, ssm, ssm_vr, dsm, cp, mle"
    ):
        get_objective("foo")
    bad = [
        ("ssm", {"n_projections": 0}, "n_projections must be an integer >= 1"),
        ("ssm_vr", {"n_projections": 1.5}, "n_projections must be an integer >= 1"),
        ("cp", {"n_samples": 0}, "n_samples must be an integer >= 1"),
        ("dsm", {"sigma": -1.0}, "sigma must be a number > 0"),
        ("dsm", {"sigma": 0}, "sigma must be a number > 0"),
        ("ssm", {"projection": "sphere"}, "projection must be one of"),
        ("sm", {"trace_route": "fast"}, "trace_route must be one of"),
        ("sm", {"max_copies_per_pass": 0}, "max_copies_per_pass must be an integer >= 1"),
        ("sm", {"n_projections": 2}, r"objective 'sm' got unknown argument\(s\) \['n_projections'\]"),
        ("ssm_vr", {"sigmas": [1.0]}, r"unknown argument\(s\) \['sigmas'\]"),  # noise_conditional's
    ]
    for name, kw, msg in bad:
        with pytest.raises(ValueError, match=msg):
            get_objective(name, **kw)
    # direct calls validate too
    with pytest.raises(ValueError, match="n_projections"):
        ssm(MLPEnergy(3), data(2, 3), n_projections=0)
    with pytest.raises(ValueError, match="sigma"):
        dsm(MLPEnergy(3), data(2, 3), sigma=-0.5)
    # bound objectives work, are picklable and accept per-call overrides
    model, x = MLPEnergy(3), data(4, 3)
    for name, kw in [
        ("sm", {"trace_route": "replicate"}),
        ("ssm_vr", {"n_projections": 2}),
        ("dsm", {"sigma": 0.2}),
        ("cp", {"n_samples": 2}),
        ("ssm", {"projection": "gaussian"}),
    ]:
        fn = pickle.loads(pickle.dumps(get_objective(name.upper() if name == "sm" else name, **kw)))
        out = fn(model, x, create_graph=False)
        assert out.per_sample.shape == (4,) and torch.isfinite(out.loss) and not out.loss.requires_grad


# ------------------------------------------------------------------------------------ noise-conditional
class CondGaussianScore(nn.Module):
    """s(x, i) = −(x − μ)/(1 + σ_i²): the exact score of N(μ, I) convolved with N(0, σ_i² I)."""

    def __init__(self, mu, sigmas):
        super().__init__()
        self.mu = nn.Parameter(mu.clone())
        self.register_buffer("sigmas", torch.as_tensor(sigmas, dtype=DT))

    def score(self, x, labels):
        var = (1 + self.sigmas[labels] ** 2).reshape(-1, *([1] * (x.dim() - 1)))
        return -(x - self.mu) / var


def test_noise_conditional_dsm_and_ssm_vr_closed_forms():
    sigmas = [1.0, 0.5, 0.1]
    mu = torch.tensor([0.3, -0.2, 0.1, 0.0], dtype=DT)
    model = CondGaussianScore(mu, sigmas)
    x, eps = data(5, 4), data(5, 4, seed=2)
    labels = torch.tensor([0, 1, 2, 1, 0])
    sig = torch.tensor(sigmas, dtype=DT)[labels][:, None]
    xt = x + sig * eps
    s = -(xt - mu) / (1 + sig**2)
    exp_dsm = sig[:, 0] ** 2 * 0.5 * ((s + eps / sig) ** 2).sum(-1)
    out = noise_conditional(dsm, model, x, sigmas, labels=labels, eps=eps)
    torch.testing.assert_close(out.per_sample, exp_dsm, rtol=1e-12, atol=1e-12)
    # a bound objective from the registry, as the NCSN module applies it
    out = noise_conditional(get_objective("dsm"), model, x, sigmas, labels=labels, eps=eps)
    torch.testing.assert_close(out.per_sample, exp_dsm, rtol=1e-12, atol=1e-12)
    # exact sm and ssm_vr at the perturbed points, weighted by σ²; replicate route tiles the labels
    exp_sm = sig[:, 0] ** 2 * (0.5 * (s**2).sum(-1) - 4 / (1 + sig[:, 0] ** 2))
    for route in ("loop", "replicate", "func"):
        out = noise_conditional(
            get_objective("sm", trace_route=route), model, x, sigmas, labels=labels, eps=eps
        )
        torch.testing.assert_close(out.per_sample, exp_sm, rtol=1e-12, atol=1e-12)
    v = data(5, 4, seed=3).sign()
    exp_vr = sig[:, 0] ** 2 * (0.5 * (s**2).sum(-1) - (v**2).sum(-1) / (1 + sig[:, 0] ** 2))
    out = noise_conditional(ssm_vr, model, x, sigmas, labels=labels, eps=eps, v=v)
    torch.testing.assert_close(out.per_sample, exp_vr, rtol=1e-12, atol=1e-12)
    assert "unweighted_loss" in out.parts and out.loss.requires_grad
    # drawn labels cover the levels; anneal_power=0 removes the weighting
    out = noise_conditional(
        dsm, model, data(64, 4), sigmas, anneal_power=0.0, generator=torch.Generator().manual_seed(0)
    )
    torch.testing.assert_close(out.loss, out.parts["unweighted_loss"])


def test_score_only_model_errors_are_clear():
    with pytest.raises(TypeError, match="neither score"):
        sm(object(), data(2, 3))
    with pytest.raises(TypeError, match="cp needs an energy model"):
        cp(MLPScore(3), data(2, 3))


def test_objective_from_config_is_the_one_factory():
    """The families' objective factory: defaults, the family's allowed losses, dropped and bound keys."""
    from src.objectives.registry import objective_from_config

    name, kw, fn = objective_from_config(None, default="ssm_vr", family="ncsn")
    assert (name, kw) == ("ssm_vr", {}) and fn.func is ssm_vr
    with pytest.raises(ValueError, match=r"model=ncsn trains with loss=dsm\|ssm_vr; got loss=sm"):
        objective_from_config({"name": "sm"}, default="dsm", family="ncsn", allowed=("dsm", "ssm_vr"))
    name, kw, fn = objective_from_config({"name": "dsm", "sigma": 0.1}, default="dsm", family="ncsn",
                                         ignored=("sigma",))
    assert kw == {} and fn.keywords == {}
    # bound only where the objective takes the key, and None leaves the config's value
    _, kw, _ = objective_from_config({"name": "ssm", "projection": "rademacher"}, default="ssm", family="vae",
                                     bound={"projection": "gaussian"})
    assert kw == {"projection": "gaussian"}
    _, kw, _ = objective_from_config({"name": "ssm", "projection": "rademacher"}, default="ssm", family="vae",
                                     bound={"projection": None})
    assert kw == {"projection": "rademacher"}
    _, kw, _ = objective_from_config({"name": "dsm", "sigma": 0.2}, default="ssm", family="vae",
                                     bound={"projection": "gaussian"})
    assert kw == {"sigma": 0.2}
    with pytest.raises(ValueError, match="n_projections must be an integer >= 1"):
        objective_from_config({"name": "ssm", "n_projections": 0}, default="ssm", family="dkef")
