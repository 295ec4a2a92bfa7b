"""Annealed Langevin dynamics (src/sampling.py) on a known Gaussian score.

Data N(μ, s²I) perturbed by N(0, σ²I) has the score s(x, i) = −(x − μ)/(s² + σᵢ²). With this linear score
every Langevin step x ← a·x + (1 − a)·μ + √α·z, a = 1 − α/(2vᵢ), vᵢ = s² + σᵢ², keeps x Gaussian, so the
mean and variance of the samples follow exactly m ← a·m + (1 − a)·μ, V ← a²·V + α (and the denoising
step x ← x + σ_L²·s(x, L) maps m, V to c·m + (1 − c)·μ, c²·V with c = 1 − σ_L²/v_L), from U(0, 1)'s
m = ½, V = 1/12. The sampler must reproduce that recursion within 5 standard errors of N·D = 40 000 scalar
samples (SE of the mean √(V/ND), of the variance V·√(2/(ND − 1))).

The recursion itself, at NCSN's schedule (σ 1 → 0.01, L = 10, T = 100, ε = 2·10⁻⁵) and μ = 0.3, s = 0.2,
gives mean μ to 1e-12 and variance 0.04252 (1.063·s², 1.060·(s² + σ_L²)): at the small levels α is so
small (a = 1 − 2.5·10⁻⁴ at the last) that the 100 steps do not forget the previous level's extra variance —
the known bias of NCSN's short chains, asserted here to lie within 7 % of s².
"""

from __future__ import annotations

import math

import pytest
import torch

from src.models.ncsn import geometric_sigmas
from src.sampling import annealed_langevin

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
        alpha = eps * (s / sig[-1]) ** 2  # independent of src.sampling's helper
        a = 1 - alpha / (2 * (S**2 + s**2))
        for _ in range(n_steps):
            m, v = a * m + (1 - a) * MU, a * a * v + alpha
    if denoise:
        c = 1 - sig[-1] ** 2 / (S**2 + sig[-1] ** 2)
        m, v = c * m + (1 - c) * MU, c * c * v
    return m, v


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
    assert S**2 < v_ref < 1.07 * S**2


def test_annealed_langevin_checks_its_arguments():
    with pytest.raises(ValueError):
        annealed_langevin(lambda x, i: x, torch.zeros(2, 1), [1.0, 0.1], n_steps_each=0)
    with pytest.raises(ValueError):
        annealed_langevin(lambda x, i: x, torch.zeros(2, 1), [1.0, -0.1])


def test_on_level_end_sees_each_level_of_the_chain():
    """The hook gets the state after each level's T steps: its mean and variance follow the recursion level by
    level (the diagnostics of benchmarks/ncsn_sampler_drift.py rely on it), and it does not change the run."""
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
        a = 1 - alpha / (2 * (S**2 + s**2))
        for _ in range(20):
            m, v = a * m + (1 - a) * MU, a * a * v + alpha
        assert abs(mean - m) < 5 * math.sqrt(v / (N * D)), i
        assert abs(var - v) < 5 * v * math.sqrt(2 / (N * D - 1)), i
    assert seen[-1][1] == x.mean().item()
