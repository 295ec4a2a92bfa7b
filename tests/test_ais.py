"""AIS of log p(x) (src/metrics/ais.py, paper §4.1's MNIST log-likelihood) against a closed form: a
linear-Gaussian decoder x = W z + b + σ n, z ~ N(0, I), so p(x) = N(x; b, W Wᵀ + σ² I)."""

from __future__ import annotations

import pytest
import torch

from src.metrics.ais import ais_log_likelihood, sigmoid_schedule

pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py


def linear_gaussian(dz=2, dx=5, sigma=0.6, seed=0):
    g = torch.Generator().manual_seed(seed)
    W = torch.randn(dx, dz, generator=g, dtype=torch.float64)
    b = torch.randn(dx, generator=g, dtype=torch.float64)

    def log_lik(x, z):
        return torch.distributions.Normal(z @ W.T + b, sigma).log_prob(x).sum(-1)

    marginal = torch.distributions.MultivariateNormal(b, W @ W.T + sigma**2 * torch.eye(dx, dtype=torch.float64))
    x = b + torch.randn(6, dx, generator=g, dtype=torch.float64) @ \
        torch.linalg.cholesky(W @ W.T + sigma**2 * torch.eye(dx, dtype=torch.float64)).T
    return log_lik, marginal, x


def test_sigmoid_schedule_ends():
    b = sigmoid_schedule(10)
    assert b[0] == 0 and b[-1] == 1 and bool((b[1:] > b[:-1]).all())


def test_ais_recovers_the_linear_gaussian_log_likelihood():
    """200 intermediate distributions, 16 chains, 10 leapfrog steps: every point's estimate within 0.1 nats of
    the closed form (log p(x) ≈ −6 … −12 here; measured max 0.07, mean 0.04), and well above the T = 1 estimate (plain importance sampling
    from the prior with 16 samples), which is far off for these peaked posteriors."""
    log_lik, marginal, x = linear_gaussian()
    truth = marginal.log_prob(x)
    g = torch.Generator().manual_seed(1)
    est, stats = ais_log_likelihood(log_lik, x, 2, n_steps=200, n_chains=16, leapfrog=10, generator=g,
                                    return_stats=True)
    assert est.shape == truth.shape
    assert (est - truth).abs().max() < 0.1, (est, truth)
    assert (est - truth).abs().mean() < 0.06, (est, truth)
    assert 0.4 < stats["accept"] < 0.95
    crude = ais_log_likelihood(log_lik, x, 2, n_steps=1, n_chains=16, leapfrog=10,
                               generator=torch.Generator().manual_seed(1))
    assert (crude - truth).abs().max() > 5 * (est - truth).abs().max()
