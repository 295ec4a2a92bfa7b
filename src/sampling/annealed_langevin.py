"""Annealed Langevin dynamics (NCSN; Song & Ermon 2019), the sampler of the paper's §4.4 NCSN runs.

For the noise levels σ₁ > … > σ_L, from x₀ (NCSN: uniform noise), at each level i the step size is
αᵢ = ε·σᵢ²/σ_L² (ε = ``step_lr``) and T steps of Langevin dynamics are run with the noise-conditional
score s(x, i):

    x ← x + αᵢ·s(x, i) + √(2αᵢ)·z,   z ~ N(0, I)

— the Euler–Maruyama step of dx = s(x) dt + √2 dW with time step αᵢ, whose stationary law is the one with
score s. This is the step of the reference code (NCSN's and NCSNv2's ``anneal_Langevin_dynamics``; the DEQ
authors' NCSN takes the same αᵢ and this step at each level's first step only, see ``update`` below), and every
published step size (ε = 2·10⁻⁵, T = 100 for NCSN on CIFAR-10) is in it.
The NCSN paper's Algorithm 1 writes the same update as x + (α/2)·s + √α·z: its α is twice the code's, so
ε here is half the α_paper·σ_L²/σᵢ² of that pseudo-code. (Before this was settled the project took the
paper's form with ε in place of α_paper, i.e. half the reference's step for the same number.)

``update="authors"`` runs instead the step of the DEQ paper authors' NCSN code (their ``ncsn/models/__init__.py``,
``anneal_Langevin_dynamics``): the first step of every level is the step above, each later one is the
BDF2-looking rewrite

    x_new = (2/3)·αᵢ·s(x, i) + (4/3)·x − (1/3)·x_old + nₖ − (1/3)·n_old,   nₖ = √(2αᵢ)·zₖ,

followed by x_old ← x_new and n_old ← nₖ. Because x_old is assigned after the update it equals the current x
at the next step, so the rule is in effect x_{k+1} = x_k + (2/3)·αᵢ·s(x_k) + nₖ − (1/3)·n_{k−1}: two thirds of
the drift, with MA(1)-correlated noise. That is not a discretisation of the Langevin SDE with the same stationary
law: for a Gaussian N(0, v) at a fixed level it is the ARMA(1,1) x_{k+1} = a·x_k + e_k − e_{k−1}/3,
a = 1 − 2α/(3v), Var e = 2α, with stationary variance 2α·(1 + 2aθ + θ²)/(1 − a²) (θ = −1/3), which tends to
(2/3)·v as α → 0 — it samples p^{3/2}, a colder law, where the Euler step's stationary variance is
v/(1 − α/(2v)) → v. Their code writes the constants as 0.6667, 1.3333, 0.3333; here they are exact thirds.

The optional final denoising step (Tweedie; Jolicoeur-Martineau et al. 2020, used by NCSNv2) replaces x by
x + σ_L²·s(x, L) — the posterior mean of the clean image at the last level.
A pure function of the score: the caller chooses the weights (EMA or not) and the device.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

ScoreFn = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]  # (x [B, …], labels [B] long) -> score [B, …]
UPDATES = ("euler", "authors")  # the Langevin step: Euler–Maruyama, or the DEQ authors' code's (module docstring)


def langevin_step_sizes(sigmas: torch.Tensor, step_lr: float) -> torch.Tensor:
    """αᵢ = ε·σᵢ²/σ_L² (NCSN's anneal_Langevin_dynamics): the drift coefficient of level i's step."""
    sigmas = torch.as_tensor(sigmas, dtype=torch.float64)
    return float(step_lr) * (sigmas / sigmas[-1]) ** 2


@torch.no_grad()
def annealed_langevin(score_fn: ScoreFn, x0: torch.Tensor, sigmas: Sequence[float] | torch.Tensor, *,
                      n_steps_each: int = 100, step_lr: float = 2e-5, denoise: bool = False,
                      update: str = "euler", generator: torch.Generator | None = None,
                      on_level_end: Callable[[int, torch.Tensor], None] | None = None,
                      progress: Callable[[int], None] | None = None) -> torch.Tensor:
    """Run annealed Langevin dynamics from ``x0`` and return the final samples (see the module docstring).

    Args:
        score_fn: ``(x, labels) -> s(x, labels)``, labels the level index per sample.
        x0: the starting points ``[B, …]`` (NCSN: U(0, 1) images).
        sigmas: the L noise levels, decreasing.
        n_steps_each: T, steps per level (≥ 1).
        step_lr: ε, the step size at the last level in the reference code's convention: level i moves by
            αᵢ·s with αᵢ = ε·σᵢ²/σ_L² and adds noise of variance 2αᵢ.
        denoise: add the final denoising step x + σ_L²·s(x, L).
        update: ``"euler"`` (the Euler–Maruyama step of the references) or ``"authors"`` (the DEQ authors'
            code's step: 2/3 of the drift with MA(1) noise after each level's first step; a colder law).
        generator: for the Langevin noise (reproducible samples).
        on_level_end: called as ``on_level_end(i, x)`` after the T steps of level i (diagnostics of the
            trajectory, e.g. ``benchmarks/studies/ncsn_sampler_drift.py``); it must not change ``x``.
        progress: called as ``progress(1)`` after every Langevin step (L·T calls in all; e.g. a progress
            bar's ``update``). The denoising step is not counted.
    """
    if update not in UPDATES:
        raise ValueError(f"annealed Langevin update={update!r}: choose one of {', '.join(UPDATES)}")
    if int(n_steps_each) < 1 or float(step_lr) <= 0:
        raise ValueError(f"annealed Langevin needs n_steps_each >= 1 and step_lr > 0, got {n_steps_each}, {step_lr}")
    sig = torch.as_tensor(sigmas, dtype=torch.float64).reshape(-1)
    if sig.numel() == 0 or bool((sig <= 0).any()):
        raise ValueError("annealed Langevin needs at least one positive noise level")
    alphas = langevin_step_sizes(sig, step_lr).tolist()
    x = x0.clone()
    for i, alpha in enumerate(alphas):
        labels = torch.full((x.shape[0],), i, dtype=torch.long, device=x.device)
        noise_scale = (2 * alpha) ** 0.5
        for step in range(int(n_steps_each)):
            noise = noise_scale * torch.randn(x.shape, generator=generator, device=x.device, dtype=x.dtype)
            if update == "euler":
                x = x + alpha * score_fn(x, labels) + noise
            elif step == 0:  # authors: every level starts with the plain step
                x, noise_old = x + alpha * score_fn(x, labels) + noise, noise
            else:  # authors: x_old is the current x (assigned after each update in their code)
                x, noise_old = x + (2 / 3) * alpha * score_fn(x, labels) + noise - noise_old / 3, noise
            if progress is not None:
                progress(1)
        if on_level_end is not None:
            on_level_end(i, x)
    if denoise:
        labels = torch.full((x.shape[0],), sig.numel() - 1, dtype=torch.long, device=x.device)
        x = x + float(sig[-1]) ** 2 * score_fn(x, labels)
    return x
