"""Annealed Langevin dynamics (src/samplers/annealed_langevin.py): the step convention and known Gaussian scores, in float64.

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
"""

from __future__ import annotations

import math

import pytest
import torch

from src.models.ncsn import geometric_sigmas
from src.samplers.annealed_langevin import annealed_langevin

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
        alpha = eps * (s / sig[-1]) ** 2  # independent of src.samplers.annealed_langevin's helper
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
