"""Annealed Langevin dynamics (src/sampling/annealed_langevin.py): the step convention and known Gaussian scores, in float64.

The step is the reference code's (NCSN/NCSNv2 ``anneal_Langevin_dynamics``): x ← x + αᵢ·s(x, i) + √(2αᵢ)·z
with αᵢ = ε·σᵢ²/σ_L², ε = ``step_lr``. The first two tests pin it one step at a time: the mean displacement
is ε·(σᵢ/σ_L)²·s and the noise variance 2ε·(σᵢ/σ_L)² (the paper's Alg. 1 form x + (α/2)·s + √α·z with α = ε
moves half as far: drift and variance ratios 0.5, ~100 standard errors away at these sample sizes).

Data N(μ, s²I) perturbed by N(0, σ²I) has the score s(x, i) = −(x − μ)/(s² + σᵢ²). With this linear score
every step x ← a·x + (1 − a)·μ + √(2α)·z, a = 1 − α/vᵢ, vᵢ = s² + σᵢ², keeps x Gaussian, so the mean and
variance of the samples follow exactly m ← a·m + (1 − a)·μ, V ← a²·V + 2α (and the denoising step
x ← x + σ_L²·s(x, L) maps m, V to c·m + (1 − c)·μ, c²·V with c = 1 − σ_L²/v_L), from U(0, 1)'s m = ½,
V = 1/12. The sampler must reproduce that recursion within 5 standard errors of N·D = 40 000 scalar samples
(SE of the mean √(V/ND), of the variance V·√(2/(ND − 1))).

The recursion itself, at NCSN's schedule (σ 1 → 0.01, L = 10, T = 100, ε = 2·10⁻⁵) and μ = 0.3, s = 0.2,
gives mean μ to 1e-12 and variance 0.04133 (1.033·s², 1.031·(s² + σ_L²)): at the small levels α is so
small (a = 1 − 5·10⁻⁴ at the last) that the 100 steps do not forget the previous level's extra variance —
the known bias of NCSN's short chains, asserted here to lie within 4 % of s². With enough steps per level
the chain reaches the last level's perturbed law N(μ, s² + σ_L²) up to the Euler step's stationary
variance v_L/(1 − α_L/(2v_L)) (test_long_chains_reach_the_perturbed_data_distribution).

``update="authors"`` (the DEQ paper authors' code's step): each level's first step is the step above, each later
one x + (2/3)·α·s + nₖ − nₖ₋₁/3. For N(0, v) at one level that is the ARMA(1,1) x' = a·x + e + θ·e_prev,
a = 1 − (2/3)·α/v, θ = −1/3, Var e = 2α, of stationary variance 2α·(1 + 2aθ + θ²)/(1 − a²) (→ (2/3)·v as
α → 0); the Euler step's is v/(1 − α/(2v)). Both are asserted against many independent chains at one level, and
the ARMA formula itself against the exact covariance recursion of (x, e_prev).
"""

from __future__ import annotations

import math

import pytest
import torch

from src.models.ncsn import geometric_sigmas
from src.sampling.annealed_langevin import annealed_langevin, langevin_step_sizes

MU, S = 0.3, 0.2
N, D = 10_000, 4


def gaussian_score(sigmas):
    def score(x, labels):
        var = S**2 + sigmas[labels].to(x.dtype) ** 2
        return -(x - MU) / var.reshape(-1, *([1] * (x.dim() - 1)))

    return score


def recursion(sigmas, n_steps, eps, denoise):
    m, v = 0.5, 1 / 12
    sig = sigmas.tolist()
    for s in sig:
        alpha = eps * (s / sig[-1]) ** 2  # independent of src.sampling.annealed_langevin's helper
        a = 1 - alpha / (S**2 + s**2)
        for _ in range(n_steps):
            m, v = a * m + (1 - a) * MU, a * a * v + 2 * alpha
    if denoise:
        c = 1 - sig[-1] ** 2 / (S**2 + sig[-1] ** 2)
        m, v = c * m + (1 - c) * MU, c * c * v
    return m, v


def test_each_step_moves_by_step_lr_times_the_score_with_noise_variance_twice_that():
    """Constant score c_i per level, T = 1: the increment at level i is ε(σᵢ/σ_L)²·cᵢ + √(2ε(σᵢ/σ_L)²)·z."""
    sigmas = torch.tensor([1.0, 0.5, 0.1], dtype=torch.float64)
    consts = [5.0, -8.0, 40.0]
    eps = 1e-3
    n = 100_000
    states = []
    x0 = torch.zeros(n, 1, dtype=torch.float64)
    annealed_langevin(lambda x, i: torch.full_like(x, 1.0) * torch.tensor(consts, dtype=x.dtype)[i].reshape(-1, 1),
                      x0, sigmas, n_steps_each=1, step_lr=eps, generator=torch.Generator().manual_seed(0),
                      on_level_end=lambda i, x: states.append(x.clone()))
    prev = x0
    for i, (x, c) in enumerate(zip(states, consts)):
        inc = (x - prev).reshape(-1)
        prev = x
        scale = eps * (sigmas[i] / sigmas[-1]).item() ** 2  # ε·(σᵢ/σ_L)²: 0.1, 0.025, 0.001
        drift, var = inc.mean().item(), inc.var().item()
        assert abs(drift - scale * c) < 5 * math.sqrt(2 * scale / n), (i, drift / (eps * c))
        assert abs(var - 2 * scale) < 5 * 2 * scale * math.sqrt(2 / (n - 1)), (i, var / (2 * eps))


def test_the_drift_is_the_score_at_the_current_point():
    """One step at the first of two levels from a fixed x with the linear score s(x) = −(x − μ)/v₁: the mean
    displacement per coordinate is ε(σ₁/σ_L)²·s(x), the residual variance 2ε(σ₁/σ_L)²."""
    sigmas = torch.tensor([0.4, 0.1], dtype=torch.float64)
    eps, n = 2e-4, 50_000
    start = torch.tensor([-1.0, 0.0, 0.3, 0.8, 2.5], dtype=torch.float64)
    x0 = start.expand(n, -1).clone()
    after = []
    annealed_langevin(gaussian_score(sigmas), x0, sigmas, n_steps_each=1, step_lr=eps,
                      generator=torch.Generator().manual_seed(1), on_level_end=lambda i, x: after.append(x.clone()))
    scale = eps * 16  # (0.4 / 0.1)²
    expected = scale * -(start - MU) / (S**2 + 0.4**2)
    inc = after[0] - x0
    se = math.sqrt(2 * scale / n)
    assert torch.all((inc.mean(0) - expected).abs() < 5 * se)
    assert torch.all((inc.var(0) - 2 * scale).abs() < 5 * 2 * scale * math.sqrt(2 / (n - 1)))


@pytest.mark.parametrize("denoise", [False, True], ids=["plain", "denoised"])
def test_annealed_langevin_recovers_a_gaussian(denoise):
    sigmas = geometric_sigmas(1.0, 0.01, 10)
    g = torch.Generator().manual_seed(0)
    x0 = torch.rand(N, D, generator=g, dtype=torch.float64)
    x = annealed_langevin(gaussian_score(sigmas), x0, sigmas, n_steps_each=100, step_lr=2e-5, denoise=denoise,
                          generator=g)
    m_ref, v_ref = recursion(sigmas, 100, 2e-5, denoise)
    n = x.numel()
    mean, var = x.mean().item(), x.var().item()
    assert abs(mean - m_ref) < 5 * math.sqrt(v_ref / n)
    assert abs(var - v_ref) < 5 * v_ref * math.sqrt(2 / (n - 1))
    # the recursion against the data distribution (derived in the module docstring)
    assert abs(m_ref - MU) < 1e-9
    assert S**2 < v_ref < 1.04 * S**2


def test_long_chains_reach_the_perturbed_data_distribution():
    """T = 300 steps per level (σ 0.5 → 0.05, L = 5, ε = 5·10⁻⁴) with the exact score of N(μ, s² + σᵢ²): the
    final samples are N(μ, s² + σ_L²) within 5 standard errors, up to the Euler step's stationary variance
    v_L/(1 − α_L/(2v_L)), 0.6 % above v_L here (each level's chain forgets its start: a^(2T) < 1e-3)."""
    sigmas = geometric_sigmas(0.5, 0.05, 5)
    eps, n = 5e-4, 20_000
    g = torch.Generator().manual_seed(3)
    x = annealed_langevin(gaussian_score(sigmas), torch.rand(n, 1, generator=g, dtype=torch.float64), sigmas,
                          n_steps_each=300, step_lr=eps, generator=g)
    v_last = S**2 + sigmas[-1].item() ** 2
    v_stat = v_last / (1 - eps / (2 * v_last))
    assert v_stat < 1.01 * v_last
    assert abs(x.mean().item() - MU) < 5 * math.sqrt(v_stat / n)
    assert abs(x.var().item() - v_stat) < 5 * v_stat * math.sqrt(2 / (n - 1))


def test_annealed_langevin_checks_its_arguments():
    with pytest.raises(ValueError):
        annealed_langevin(lambda x, i: x, torch.zeros(2, 1), [1.0, 0.1], n_steps_each=0)
    with pytest.raises(ValueError):
        annealed_langevin(lambda x, i: x, torch.zeros(2, 1), [1.0, -0.1])


def test_progress_is_called_once_per_langevin_step_and_changes_nothing():
    sigmas = geometric_sigmas(1.0, 0.01, 3)
    calls = []
    x0 = torch.rand(5, 2, generator=torch.Generator().manual_seed(4), dtype=torch.float64)
    x = annealed_langevin(gaussian_score(sigmas), x0, sigmas, n_steps_each=7, step_lr=1e-4, denoise=True,
                          generator=torch.Generator().manual_seed(5), progress=calls.append)
    same = annealed_langevin(gaussian_score(sigmas), x0, sigmas, n_steps_each=7, step_lr=1e-4, denoise=True,
                             generator=torch.Generator().manual_seed(5))
    assert calls == [1] * 21
    assert torch.equal(x, same)


def test_on_level_end_sees_each_level_of_the_chain():
    """The hook gets the state after each level's T steps: its mean and variance follow the recursion level by
    level (the diagnostics of benchmarks/studies/ncsn_sampler_drift.py rely on it), and it does not change the run."""
    sigmas = geometric_sigmas(1.0, 0.01, 4)
    seen = []
    x0 = torch.rand(N, D, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    x = annealed_langevin(gaussian_score(sigmas), x0, sigmas, n_steps_each=20, step_lr=1e-4,
                          generator=torch.Generator().manual_seed(2),
                          on_level_end=lambda i, xi: seen.append((i, xi.mean().item(), xi.var().item())))
    same = annealed_langevin(gaussian_score(sigmas), x0, sigmas, n_steps_each=20, step_lr=1e-4,
                             generator=torch.Generator().manual_seed(2))
    assert torch.equal(x, same)
    assert [i for i, _, _ in seen] == [0, 1, 2, 3]
    m, v = 0.5, 1 / 12
    for (i, mean, var), s in zip(seen, sigmas.tolist()):
        alpha = 1e-4 * (s / sigmas[-1].item()) ** 2
        a = 1 - alpha / (S**2 + s**2)
        for _ in range(20):
            m, v = a * m + (1 - a) * MU, a * a * v + 2 * alpha
        assert abs(mean - m) < 5 * math.sqrt(v / (N * D)), i
        assert abs(var - v) < 5 * v * math.sqrt(2 / (N * D - 1)), i
    assert seen[-1][1] == x.mean().item()


def euler_stationary_variance(alpha, v):
    return v / (1 - alpha / (2 * v))


def authors_stationary_variance(alpha, v):
    """The ARMA(1,1) x' = a·x + e + θ·e_prev's stationary variance, a = 1 − (2/3)·α/v, θ = −1/3, Var e = 2α."""
    a, theta = 1 - (2 / 3) * alpha / v, -1 / 3
    return 2 * alpha * (1 + 2 * a * theta + theta**2) / (1 - a * a)


@pytest.mark.parametrize("alpha_over_v", [0.1, 1e-4])
def test_the_authors_stationary_variance_is_the_exact_covariance_recursions_limit(alpha_over_v):
    """No sampling: the covariance of (x, e_prev) under x' = a·x + e − e_prev/3 iterated to its fixed point
    equals the closed form, which tends to (2/3)·v as α/v → 0 (a colder law, p^{3/2}), not to v."""
    v = 1.0
    alpha = alpha_over_v * v
    a = 1 - (2 / 3) * alpha / v
    vx, cxe, ve = 0.0, 0.0, 0.0
    for _ in range(int(40 / alpha_over_v)):
        vx, cxe, ve = a * a * vx + ve / 9 - (2 * a / 3) * cxe + 2 * alpha, 2 * alpha, 2 * alpha
    assert vx == pytest.approx(authors_stationary_variance(alpha, v), rel=1e-10)
    if alpha_over_v < 1e-3:
        assert authors_stationary_variance(alpha, v) == pytest.approx(2 / 3 * v, rel=1e-3)
        assert euler_stationary_variance(alpha, v) == pytest.approx(v, rel=1e-3)


@pytest.mark.parametrize("update,closed_form", [("euler", euler_stationary_variance),
                                                ("authors", authors_stationary_variance)])
def test_each_update_reaches_its_stationary_variance_at_one_level(update, closed_form):
    """One level (σ list of length 1), 40 000 independent chains, T = 300 steps with α/v = 0.1 (a^(2T) < 1e-17):
    the final variance is each rule's closed form within 5 standard errors v·√(2/(n − 1)) (3.5 %). The rules'
    values 1.053·v (Euler), 0.759·v (authors), and 1.55·v for the authors' 2/3 drift with its noise correlation
    dropped, are ≥ 8 standard errors apart: a swapped rule or a lost correlation fails."""
    sigma, n = 0.1, 40_000
    v = S**2 + sigma**2
    eps = 0.1 * v  # a single level: α = ε
    sigmas = torch.tensor([sigma], dtype=torch.float64)
    g = torch.Generator().manual_seed(11)
    x = annealed_langevin(gaussian_score(sigmas), torch.rand(n, 1, generator=g, dtype=torch.float64), sigmas,
                          n_steps_each=300, step_lr=eps, update=update, generator=g)
    target = closed_form(eps, v)
    se = target * math.sqrt(2 / (n - 1))
    assert abs(x.mean().item() - MU) < 5 * math.sqrt(target / n)
    assert abs(x.var().item() - target) < 5 * se
    a = 1 - (2 / 3) * eps / v
    others = {euler_stationary_variance(eps, v), authors_stationary_variance(eps, v), 2 * eps / (1 - a * a)}
    assert all(abs(other - target) > 8 * se for other in others - {target})


def authors_reference(score_fn, x0, sigmas, n_steps_each, step_lr, generator):
    """The authors' loop as their code writes it (x_old and n_old assigned after the update), exact thirds."""
    sig = sigmas.tolist()
    x, x_old, n_old = x0.clone(), None, None
    for i, s in enumerate(sig):
        alpha = step_lr * (s / sig[-1]) ** 2
        labels = torch.full((x.shape[0],), i, dtype=torch.long)
        for step in range(n_steps_each):
            noise = math.sqrt(2 * alpha) * torch.randn(x.shape, generator=generator, dtype=x.dtype)
            if step == 0:
                x_new = x + alpha * score_fn(x, labels) + noise
            else:
                x_new = (2 / 3) * alpha * score_fn(x, labels) + (4 / 3) * x - (1 / 3) * x_old + noise - n_old / 3
            x_old, n_old, x = x_new, noise, x_new
    return x


def test_the_authors_update_is_their_loop_and_starts_every_level_with_the_plain_step():
    """Against the literal loop over 3 levels × 4 steps (float64 rounding apart: their (4/3)·x − (1/3)·x_old);
    with T = 1 every step is a level's first, so the rule is the Euler step bit for bit; with T = 2 it is not."""
    sigmas = geometric_sigmas(1.0, 0.1, 3)
    x0 = torch.rand(500, 3, generator=torch.Generator().manual_seed(6), dtype=torch.float64)

    def run(update, t, seed=7):
        return annealed_langevin(gaussian_score(sigmas), x0, sigmas, n_steps_each=t, step_lr=1e-3, update=update,
                                 generator=torch.Generator().manual_seed(seed))

    ref = authors_reference(gaussian_score(sigmas), x0, sigmas, 4, 1e-3, torch.Generator().manual_seed(7))
    assert torch.allclose(run("authors", 4), ref, rtol=0, atol=1e-12)
    assert torch.equal(run("authors", 1), run("euler", 1))
    assert (run("authors", 2) - run("euler", 2)).abs().max() > 1e-3


def euler_before_the_update_option(score_fn, x0, sigmas, n_steps_each, step_lr, generator):
    """The sampler's loop as it was before ``update`` existed (no denoising)."""
    alphas = langevin_step_sizes(torch.as_tensor(sigmas, dtype=torch.float64), step_lr).tolist()
    x = x0.clone()
    for i, alpha in enumerate(alphas):
        labels = torch.full((x.shape[0],), i, dtype=torch.long)
        for _ in range(n_steps_each):
            z = torch.randn(x.shape, generator=generator, dtype=x.dtype)
            x = x + alpha * score_fn(x, labels) + (2 * alpha) ** 0.5 * z
    return x


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_the_euler_update_is_unchanged_bit_for_bit(dtype):
    sigmas = geometric_sigmas(1.0, 0.01, 4)
    x0 = torch.rand(64, 5, generator=torch.Generator().manual_seed(8), dtype=dtype)
    before = euler_before_the_update_option(gaussian_score(sigmas), x0, sigmas, 6, 5e-5, torch.Generator().manual_seed(9))
    for kwargs in ({}, {"update": "euler"}):
        now = annealed_langevin(gaussian_score(sigmas), x0, sigmas, n_steps_each=6, step_lr=5e-5,
                                generator=torch.Generator().manual_seed(9), **kwargs)
        assert torch.equal(now, before)


def test_an_unknown_update_is_refused_with_the_allowed_ones():
    with pytest.raises(ValueError, match="update='bdf': choose one of euler, authors"):
        annealed_langevin(lambda x, i: x, torch.zeros(2, 1), [1.0, 0.1], update="bdf")
