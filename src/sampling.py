"""Annealed Langevin dynamics (NCSN; Song & Ermon 2019, Alg. 1), the sampler of the paper's §4.4 NCSN runs.

For the noise levels σ₁ > … > σ_L, from x₀ (NCSN: uniform noise), at each level i the step size is
αᵢ = ε·σᵢ²/σ_L² and T steps of Langevin dynamics are run with the noise-conditional score s(x, i):

    x ← x + (αᵢ/2)·s(x, i) + √αᵢ·z,   z ~ N(0, I)

(ε = 2·10⁻⁵, T = 100 in NCSN). The optional final denoising step (Tweedie; Jolicoeur-Martineau et al. 2020,
used by NCSNv2) replaces x by x + σ_L²·s(x, L) — the posterior mean of the clean image at the last level.
A pure function of the score: the caller chooses the weights (EMA or not) and the device.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

ScoreFn = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]  # (x [B, …], labels [B] long) -> score [B, …]


def langevin_step_sizes(sigmas: torch.Tensor, step_lr: float) -> torch.Tensor:
    """αᵢ = ε·σᵢ²/σ_L² (NCSN's anneal_Langevin_dynamics)."""
    sigmas = torch.as_tensor(sigmas, dtype=torch.float64)
    return float(step_lr) * (sigmas / sigmas[-1]) ** 2


@torch.no_grad()
def annealed_langevin(score_fn: ScoreFn, x0: torch.Tensor, sigmas: Sequence[float] | torch.Tensor, *,
                      n_steps_each: int = 100, step_lr: float = 2e-5, denoise: bool = False,
                      generator: torch.Generator | None = None,
                      on_level_end: Callable[[int, torch.Tensor], None] | None = None) -> torch.Tensor:
    """Run annealed Langevin dynamics from ``x0`` and return the final samples (see the module docstring).

    Args:
        score_fn: ``(x, labels) -> s(x, labels)``, labels the level index per sample.
        x0: the starting points ``[B, …]`` (NCSN: U(0, 1) images).
        sigmas: the L noise levels, decreasing.
        n_steps_each: T, steps per level (≥ 1).
        step_lr: ε, the step size at the last level.
        denoise: add the final denoising step x + σ_L²·s(x, L).
        generator: for the Langevin noise (reproducible samples).
        on_level_end: called as ``on_level_end(i, x)`` after the T steps of level i (diagnostics of the
            trajectory, e.g. ``benchmarks/ncsn_sampler_drift.py``); it must not change ``x``.
    """
    if int(n_steps_each) < 1 or float(step_lr) <= 0:
        raise ValueError(f"annealed Langevin needs n_steps_each >= 1 and step_lr > 0, got {n_steps_each}, {step_lr}")
    sig = torch.as_tensor(sigmas, dtype=torch.float64).reshape(-1)
    if sig.numel() == 0 or bool((sig <= 0).any()):
        raise ValueError("annealed Langevin needs at least one positive noise level")
    alphas = langevin_step_sizes(sig, step_lr).tolist()
    x = x0.clone()
    for i, alpha in enumerate(alphas):
        labels = torch.full((x.shape[0],), i, dtype=torch.long, device=x.device)
        for _ in range(int(n_steps_each)):
            z = torch.randn(x.shape, generator=generator, device=x.device, dtype=x.dtype)
            x = x + (alpha / 2) * score_fn(x, labels) + alpha**0.5 * z
        if on_level_end is not None:
            on_level_end(i, x)
    if denoise:
        labels = torch.full((x.shape[0],), sig.numel() - 1, dtype=torch.long, device=x.device)
        x = x + float(sig[-1]) ** 2 * score_fn(x, labels)
    return x
