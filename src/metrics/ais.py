"""Annealed importance sampling (AIS) of log p(x) = log ∫ p(x|z) N(z; 0, I) dz for a decoder (paper §4.1).

The SSM-VAE's MNIST log-likelihood (*Efficient Score Matching with Deep Equilibrium Layers* §4.1, Table 1;
protocol of Song et al. 2019 after Wu et al. 2017, "On the quantitative analysis of decoder-based generative
models"): intermediate targets f_t(z) = log N(z; 0, I) + β_t log p(x|z), 0 = β_0 < … < β_T = 1 (sigmoid
schedule, δ = 4), one HMC transition K_t leaving f_t invariant per target (``leapfrog`` steps), ``n_chains``
chains per data point, log-weights log w = Σ_t (β_t − β_{t−1}) log p(x|z_{t−1}) (Neal 2001, eq. 3) and
log p̂(x) = logsumexp_c(log w_c) − log C.

Why the step size may not depend on a chain's own history
---------------------------------------------------------
E[w] = p(x) holds when K_1 … K_T are fixed in advance (Neal's extended-space argument pairs each forward
kernel with its reversal). Then E[log p̂] ≤ log p(x) (Jensen): a *stochastic lower bound*, tight as T grows.
A kernel chosen from the chain's own past breaks this. The previous rule here (each chain's step ×1.02 after
its own accept, ×0.98 after a reject) was measured on a 2-d latent Bernoulli decoder with exact log p(x) by
quadrature: +0.140 ± 0.030 nats *above* the truth at T = 1000 and +0.153 ± 0.030 at T = 3000, all 8
estimates above both times (the pilot rule: −0.073 ± 0.052 and −0.010 ± 0.019; ``benchmarks/results/ais_bias.md``). It also ignored
``target_accept``: accept and reject moved the step by the same factor, so it settled near 57 % whatever the
target.

The kernels here: one leapfrog step ε_t per target, shared by all chains of the call, adapted by the rule of
the SSM reference's evaluation code (after Wu et al.'s): an exponential average ā ← 0.9 ā + 0.1·(mean
acceptance at t), started at ``target_accept``; ε ×1.02 when ā > target, ×0.98 otherwise, clamped to
[1e-4, 0.5], starting from ``step_size``. The acceptance that drives it comes from (``adaptation``):

- ``"pilot"`` (default): ``pilot_chains`` extra chains per data point, run alongside with the same kernels and
  discarded. ε_t is a function of the pilot's random numbers only, which the estimating chains never touch,
  so given the pilot the kernels are fixed in advance and E[w] = p(x) exactly. The pilot chains are
  statistically copies of the estimating ones, so those accept at ``target_accept`` too (tested). Cost:
  ``pilot_chains / n_chains`` more decoder passes (25 % at the defaults 4 / 16).
- ``"global"`` (the reference's rule): the mean acceptance over all N = n_chains × batch estimating chains.
  ε_t then depends on every chain's past, its own included, so E[w] = p(x) no longer holds exactly. In
  practice: one chain moves ā by 0.1/N per step and changes ε only when that flips the ×1.02/×0.98
  decision (ā within 0.1/N of the target), so its kernel's dependence on its own path is O(1/N) — the
  per-chain rule is N = 1. Measured (``benchmarks/results/ais_bias.md``: 8 MNIST images, N = 128, T = 1000):
  mean error +0.002 ± 0.049 nats against the pilot's −0.073 ± 0.052 and the per-chain rule's +0.140 ±
  0.030 — a tie within the noise, so the default is the rule that is unbiased by construction. ``global``
  saves the pilot's extra passes; it is kept to reproduce the reference.
- ``"fixed"``: ε_t = ``step_size`` for every t (exactly unbiased, no tuning; the acceptance is whatever it is).

Cost per data point: T × leapfrog evaluations of log p(x|z) and its z-gradient for each of the C (+ pilot)
chains (the gradient at the accepted point is reused for the next target, whose energy differs only by β):
T = 1000, 10 leapfrog steps, 16 + 4 chains make 200 000 decoder forward+backward passes per image.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch

ADAPTATIONS = ("pilot", "global", "fixed")
STEP_MIN, STEP_MAX = 1e-4, 0.5  # the reference's clamp
STEP_INC, STEP_DEC, ACCEPT_SLOWNESS = 1.02, 0.98, 0.9  # the reference's adaptation constants


def sigmoid_schedule(n_steps: int, delta: float = 4.0, dtype=torch.float64) -> torch.Tensor:
    """β_0 = 0 … β_T = 1 (T = ``n_steps``), dense near both ends (Grosse et al. 2015)."""
    if int(n_steps) < 1:
        raise ValueError(f"AIS n_steps must be >= 1, got {n_steps}")
    t = torch.linspace(-delta, delta, int(n_steps) + 1, dtype=dtype)
    s = torch.sigmoid(t)
    return (s - s[0]) / (s[-1] - s[0])


def linear_schedule(n_steps: int, dtype=torch.float64) -> torch.Tensor:
    if int(n_steps) < 1:
        raise ValueError(f"AIS n_steps must be >= 1, got {n_steps}")
    return torch.linspace(0.0, 1.0, int(n_steps) + 1, dtype=dtype)


SCHEDULES = {"sigmoid": sigmoid_schedule, "linear": linear_schedule}


def _check_args(n_chains, leapfrog, step_size, target_accept, schedule, adaptation, pilot_chains) -> None:
    if schedule not in SCHEDULES:
        raise ValueError(f"AIS schedule={schedule!r} is unknown; valid: {', '.join(SCHEDULES)}")
    if adaptation not in ADAPTATIONS:
        raise ValueError(f"AIS adaptation={adaptation!r} is unknown; valid: {', '.join(ADAPTATIONS)}")
    if int(n_chains) < 1 or int(leapfrog) < 1:
        raise ValueError(f"AIS needs n_chains >= 1 and leapfrog >= 1, got {n_chains} and {leapfrog}")
    if not STEP_MIN <= float(step_size) <= STEP_MAX:
        raise ValueError(f"AIS step_size={step_size} is outside [{STEP_MIN}, {STEP_MAX}]")
    if not 0.0 < float(target_accept) < 1.0:
        raise ValueError(f"AIS target_accept={target_accept} must lie strictly between 0 and 1")
    if adaptation == "pilot" and int(pilot_chains) < 1:
        raise ValueError(f"AIS adaptation='pilot' needs pilot_chains >= 1, got {pilot_chains}")


def ais_log_likelihood(
    log_likelihood: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
    x: torch.Tensor,
    latent_dim: int,
    *,
    n_steps: int = 1000,
    n_chains: int = 16,
    leapfrog: int = 10,
    step_size: float = 0.05,
    target_accept: float = 0.65,
    schedule: str = "sigmoid",
    adaptation: str = "pilot",
    pilot_chains: int = 4,
    generator: torch.Generator | None = None,
    return_stats: bool = False,
    progress: Callable[[int], None] | None = None,
):
    """AIS estimate of log p(x) per data point ``[B]`` (see the module docstring).

    Args:
        log_likelihood: ``(x, z) -> [N]`` log p(x|z) for ``x`` ``[N, ...]`` and ``z`` ``[N, latent_dim]``,
            differentiable in z (e.g. :meth:`src.models.vae.Decoder.log_prob`).
        x: ``[B, ...]`` data points (one leapfrog step size is shared by the whole batch).
        n_steps: T intermediate distributions; n_chains: C estimating chains per point; leapfrog: steps per
            HMC move; step_size: the first leapfrog step ε_1 (and every ε_t with ``adaptation="fixed"``);
        target_accept: mean acceptance rate the step size is adapted to (``pilot`` / ``global``);
        adaptation: ``pilot`` (unbiased, default), ``global`` (the reference's rule), ``fixed``;
        pilot_chains: extra chains per point whose acceptance drives the step (``pilot`` only).
        return_stats: also return ``{"accept": mean acceptance of the estimating chains over all t,
            "accepts": theirs at each t, "pilot_accept": the mean of the chains driving the adaptation (None
            for ``fixed``), "step_size": the last ε, "step_sizes": [ε_1 … ε_T]}``. Early on, while the
            posterior is as wide as the prior, ε sits at its clamp 0.5 and moves accept more often than
            ``target_accept``.
        progress: called as ``progress(1)`` after each of the T annealing steps (e.g. a progress bar's update).
    """
    _check_args(n_chains, leapfrog, step_size, target_accept, schedule, adaptation, pilot_chains)
    B, C = x.shape[0], int(n_chains)
    P = int(pilot_chains) if adaptation == "pilot" else 0
    n_est = C * B  # rows [0, C·B): estimating chains, chain-major; rows [C·B, (C+P)·B): pilot chains
    xr = x.repeat(C + P, *([1] * (x.dim() - 1)))
    betas = SCHEDULES[schedule](n_steps).tolist()
    L, target = int(leapfrog), float(target_accept)
    z = torch.randn((C + P) * B, latent_dim, device=x.device, dtype=x.dtype, generator=generator)
    log_w = torch.zeros(n_est, device=x.device, dtype=torch.float64)
    eps, avg_accept = float(step_size), target
    steps, accepts, accept_adapt = [], [], 0.0

    def loglik_and_grad(zz):
        """log p(x|z) and its z-gradient; the energy of target t is ½|z|² − β_t·log p(x|z) (+ const)."""
        with torch.enable_grad():
            zz = zz.detach().requires_grad_(True)
            ll = log_likelihood(xr, zz)
            (g,) = torch.autograd.grad(ll.sum(), zz)
        return ll.detach(), g.detach()

    with torch.no_grad():
        ll, gll = loglik_and_grad(z)
        for t in range(1, len(betas)):
            beta = betas[t]
            log_w += (beta - betas[t - 1]) * ll[:n_est].double()
            # one HMC move leaving f_t invariant, leapfrog step eps (a number fixed before this move)
            p = torch.randn(z.shape, device=z.device, dtype=z.dtype, generator=generator)
            h0 = 0.5 * z.pow(2).sum(-1) - beta * ll + 0.5 * p.pow(2).sum(-1)
            zn, pn = z, p - 0.5 * eps * (z - beta * gll)
            for i in range(L):
                zn = zn + eps * pn
                ll1, gll1 = loglik_and_grad(zn)
                pn = pn - (eps if i < L - 1 else 0.5 * eps) * (zn - beta * gll1)
            h1 = 0.5 * zn.pow(2).sum(-1) - beta * ll1 + 0.5 * pn.pow(2).sum(-1)
            log_u = torch.rand(h0.shape, device=z.device, dtype=z.dtype, generator=generator).log()
            accept = (log_u < (h0 - h1)) & torch.isfinite(h1)
            z = torch.where(accept[:, None], zn, z)
            ll = torch.where(accept, ll1, ll)
            gll = torch.where(accept[:, None], gll1, gll)
            steps.append(eps)
            rate_est = float(accept[:n_est].double().mean())
            accepts.append(rate_est)
            if adaptation != "fixed":  # the step of the NEXT move, from the pilot's (or all) acceptances
                rate = float(accept[n_est:].double().mean()) if adaptation == "pilot" else rate_est
                accept_adapt += rate
                avg_accept = ACCEPT_SLOWNESS * avg_accept + (1.0 - ACCEPT_SLOWNESS) * rate
                eps = min(max(eps * (STEP_INC if avg_accept > target else STEP_DEC), STEP_MIN), STEP_MAX)
            if progress is not None:
                progress(1)
    est = torch.logsumexp(log_w.reshape(C, B), 0) - math.log(C)
    if return_stats:
        T = max(len(betas) - 1, 1)
        return est, {"accept": sum(accepts) / T, "accepts": accepts,
                     "pilot_accept": None if adaptation == "fixed" else accept_adapt / T,
                     "step_size": steps[-1], "step_sizes": steps}
    return est
