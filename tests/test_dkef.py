"""DKEF: the closed-form α fit against a brute-force exact SM loss (float64, independent autograd loop)."""

from __future__ import annotations

import pytest
import torch

from src.deq.config import deq_setting
from src.models.dkef import DKEF

DEQ = {"enabled": True, "solver": "picard", "tol": 1e-12, "max_iter": 500, "phantom_steps": 30,
       "warm_start": False, "norm_lambda": 2.0, "backward": "phantom"}


def brute_sm(model: DKEF, alpha: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """Mean over x of ½||∇ log p̃||² + Δ log p̃, with a Python loop over input dimensions."""
    x = x.clone().requires_grad_(True)
    logp = model.log_density(x, alpha=alpha)
    (s,) = torch.autograd.grad(logp.sum(), x, create_graph=True)
    lap = sum(torch.autograd.grad(s[:, i].sum(), x, create_graph=True)[0][:, i] for i in range(x.shape[1]))
    return (0.5 * s.pow(2).sum(-1) + lap).mean()


def brute_dsm(model, alpha, x, x_noisy, sigma):
    xn = x_noisy.clone().requires_grad_(True)
    (s,) = torch.autograd.grad(model.log_density(xn, alpha=alpha).sum(), xn, create_graph=True)
    return (0.5 * (s + (xn - x) / sigma**2).pow(2).sum(-1)).mean()


@pytest.fixture(params=["mlp", "linear", "deq"])
def model(request):
    """``linear``: a 1-layer (linear) feature map, whose second directional derivatives are exactly 0."""
    torch.manual_seed(0)
    deq = DEQ if request.param == "deq" else None
    depth = 1 if request.param == "linear" else 2
    return DKEF(4, deq=deq_setting(deq), depth=depth, n_inducing=7, feature_dim=5, hidden=6, deq_width=6).double()


def test_exact_fit_is_the_quadratic_of_the_sm_loss(model):
    x = torch.randn(9, 4, dtype=torch.float64)
    g, b, n = model.alpha_system(x, "exact")
    g, b = g / n, b / n
    zero = torch.zeros(7, dtype=torch.float64)
    j0 = brute_sm(model, zero, x)
    for seed in range(3):
        a = torch.randn(7, dtype=torch.float64, generator=torch.Generator().manual_seed(seed))
        quad = 0.5 * a @ g @ a + a @ b
        torch.testing.assert_close(brute_sm(model, a, x) - j0, quad, rtol=1e-9, atol=1e-10)


def test_fitted_alpha_minimises_regularised_loss_and_is_differentiable(model):
    x = torch.randn(9, 4, dtype=torch.float64)
    alpha = model.fit_alpha(x, "exact")
    lam = 10 ** model.log_lambda
    a = alpha.detach().requires_grad_(True)
    j = brute_sm(model, a, x) + 0.5 * lam.detach() * a.pow(2).sum()
    (grad,) = torch.autograd.grad(j, a)
    assert grad.abs().max() < 1e-8
    # gradient through α reaches the feature network and the inducing points
    alpha.sum().backward()
    assert model.inducing.grad.abs().sum() > 0
    assert all(p.grad is not None for p in model.features[0].parameters())


def test_dsm_fit_is_the_quadratic_of_the_dsm_loss(model):
    sigma = 0.3
    x = torch.randn(9, 4, dtype=torch.float64)
    torch.manual_seed(5)
    g, b, n = model.alpha_system(x, "dsm", sigma=sigma)
    torch.manual_seed(5)
    x_noisy = x + sigma * torch.randn_like(x)
    zero = torch.zeros(7, dtype=torch.float64)
    a = torch.randn(7, dtype=torch.float64)
    lhs = brute_dsm(model, a, x, x_noisy, sigma) - brute_dsm(model, zero, x, x_noisy, sigma)
    torch.testing.assert_close(lhs, 0.5 * a @ (g / n) @ a + a @ (b / n), rtol=1e-9, atol=1e-10)


def test_sliced_fit_is_unbiased_for_b():
    torch.manual_seed(1)
    model = DKEF(3, depth=2, n_inducing=5, feature_dim=4, hidden=5).double()
    x = torch.randn(6, 3, dtype=torch.float64)
    g, b, n = model.alpha_system(x, "exact")
    gs, bs, _ = model.alpha_system(x, "sliced", n_projections=4000)
    torch.testing.assert_close(bs / n, b / n, rtol=0.1, atol=0.05 * (b / n).abs().max().item())
    torch.testing.assert_close(gs / n, g / n, rtol=0.1, atol=0.05 * (g / n).abs().max().item())


def test_log_normalizer_of_base_only_matches_closed_form():
    """With α = 0, p̃ = q0 = exp(-||x||²/8): log Z = (D/2) log(2π·4)."""
    import math

    model = DKEF(3, depth=1, n_inducing=4)
    model.set_alpha(torch.zeros(4))
    log_z = model.log_normalizer(n_samples=20000, generator=torch.Generator().manual_seed(0))
    # proposal == q0 up to normalisation: importance weights are constant, so the estimate is exact
    assert abs(log_z.item() - 1.5 * math.log(2 * math.pi * 4)) < 1e-4


def test_unfitted_alpha_is_a_clear_error():
    model = DKEF(3, depth=1, n_inducing=4)
    with pytest.raises(RuntimeError, match="fit_alpha"):
        model.log_density(torch.randn(2, 3))


def test_exact_sm_of_alpha_is_the_exact_sm_loss(model):
    """The constant of the quadratic included: J(α) from G, b and the q0 term equals the brute-force loss."""
    x = torch.randn(9, 4, dtype=torch.float64)
    g, b = model.alpha_system_on(x, "exact", chunk=4)  # chunked means == one batch's means
    for seed in range(2):
        a = torch.randn(7, dtype=torch.float64, generator=torch.Generator().manual_seed(seed))
        torch.testing.assert_close(model.exact_sm_of_alpha(a, g, b, x), brute_sm(model, a, x), rtol=1e-9, atol=1e-10)


def test_refit_lambda_finds_the_validation_minimum_and_stores_alpha():
    """The reference's final stage: α from every fit point, log10 λ at the minimum of the validation exact SM
    loss (checked against a brute-force grid of that loss), the new λ and α stored in the model."""
    torch.manual_seed(1)
    model = DKEF(3, depth=2, n_inducing=6, feature_dim=4, hidden=5).double()
    fit, val = torch.randn(40, 3, dtype=torch.float64), 1.3 * torch.randn(30, 3, dtype=torch.float64)
    out = model.refit_lambda(fit, val, steps=3000, lr=0.02)
    g_fit, b_fit, n = model.alpha_system(fit, "exact")

    def brute_val(log_lam: float) -> float:
        alpha = -torch.linalg.solve(g_fit / n + 10**log_lam * torch.eye(6, dtype=torch.float64), b_fit / n)
        return float(brute_sm(model, alpha.detach(), val).detach())

    grid = torch.linspace(-6, 3, 361).tolist()
    best = min(grid, key=brute_val)
    assert abs(out["log10_lambda"] - best) < 0.05, (out, best)
    assert out["val_sm_loss"] <= out["val_sm_loss_before"] + 1e-12
    assert abs(out["val_sm_loss"] - brute_val(out["log10_lambda"])) < 1e-8
    assert out["log10_lambda_trained"] == -2.0
    assert model.log_lambda.item() == pytest.approx(out["log10_lambda"], abs=1e-6)
    torch.testing.assert_close(model.alpha, model.solve_alpha(g_fit / n, b_fit / n).detach(), rtol=1e-6, atol=1e-9)
    assert bool(model.alpha_fitted)
