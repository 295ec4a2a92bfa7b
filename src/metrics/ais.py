"""Annealed importance sampling (AIS) of log p(x) = log ∫ p(x|z) N(z; 0, I) dz for a decoder (paper §4.1).

The SSM-VAE's MNIST log-likelihood (*Efficient Score Matching with Deep Equilibrium Layers* §4.1, Table 1;
protocol of Song et al. 2019 after Wu et al. 2017, "On the quantitative analysis of decoder-based generative
models"): intermediate targets f_t(z) = log p(z) + β_t log p(x|z), 0 = β_0 < … < β_T = 1 (sigmoid schedule,
δ = 4), one HMC transition per target (``leapfrog`` steps) with a step size adapted per chain towards an
acceptance rate of ``target_accept`` (×1.02 after an accepted move, ×0.98 otherwise, clamped), ``n_chains``
independent chains per data point. log p̂(x) = logsumexp_c(log w_c) − log C is a stochastic lower bound of
log p(x) (Jensen), tight as T grows.

Cost per data point: T × (leapfrog + 1) evaluations of log p(x|z) and its gradient, for each of the C chains:
the defaults T = 1000, 10 leapfrog steps, 16 chains make 176 000 decoder forward+backward passes per image.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch


def sigmoid_schedule(n_steps: int, delta: float = 4.0, dtype=torch.float64) -> torch.Tensor:
    """β_0 = 0 … β_T = 1 (T = ``n_steps``), dense near both ends (Grosse et al. 2015)."""
    if int(n_steps) < 1:
        raise ValueError(f"AIS n_steps must be >= 1, got {n_steps}")
    t = torch.linspace(-delta, delta, int(n_steps) + 1, dtype=dtype)
    s = torch.sigmoid(t)
    return (s - s[0]) / (s[-1] - s[0])


def linear_schedule(n_steps: int, dtype=torch.float64) -> torch.Tensor:
    return torch.linspace(0.0, 1.0, int(n_steps) + 1, dtype=dtype)


SCHEDULES = {"sigmoid": sigmoid_schedule, "linear": linear_schedule}


def _std_normal_log_prob(z: torch.Tensor) -> torch.Tensor:
    return -0.5 * z.pow(2).sum(-1) - 0.5 * z.shape[-1] * math.log(2 * math.pi)


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
    generator: torch.Generator | None = None,
    return_stats: bool = False,
):
    """AIS estimate of log p(x) per data point ``[B]`` (see the module docstring).

    Args:
        log_likelihood: ``(x, z) -> [N]`` log p(x|z) for ``x`` ``[N, ...]`` and ``z`` ``[N, latent_dim]``,
            differentiable in z (e.g. :meth:`src.models.vae.Decoder.log_prob`).
        x: ``[B, ...]`` data points.
        n_steps: T intermediate distributions; n_chains: C chains per point; leapfrog: steps per HMC move;
        step_size: initial leapfrog step; target_accept: acceptance rate the step size adapts to.
        return_stats: also return ``{"accept": mean acceptance rate, "step_size": final mean step size}``.
    """
    if schedule not in SCHEDULES:
        raise ValueError(f"AIS schedule={schedule!r} is unknown; valid: {', '.join(SCHEDULES)}")
    B, C = x.shape[0], int(n_chains)
    xr = x.repeat(C, *([1] * (x.dim() - 1)))  # chain-major [C·B, ...]
    betas = SCHEDULES[schedule](n_steps).tolist()
    z = torch.randn(C * B, latent_dim, device=x.device, dtype=x.dtype, generator=generator)
    eps = torch.full((C * B, 1), float(step_size), device=x.device, dtype=x.dtype)
    log_w = torch.zeros(C * B, device=x.device, dtype=torch.float64)
    accepted = 0.0

    def energy_and_grad(zz, beta):
        with torch.enable_grad():
            zz = zz.detach().requires_grad_(True)
            ll = log_likelihood(xr, zz)
            u = -(_std_normal_log_prob(zz) + beta * ll)
            (g,) = torch.autograd.grad(u.sum(), zz)
        return u.detach(), g.detach(), ll.detach()

    with torch.no_grad():
        _, _, ll = energy_and_grad(z, 0.0)
        for t in range(1, len(betas)):
            beta = betas[t]
            log_w += (beta - betas[t - 1]) * ll.double()
            # one HMC move leaving f_t invariant
            u0, g, _ = energy_and_grad(z, beta)
            p = torch.randn(z.shape, device=z.device, dtype=z.dtype, generator=generator)
            h0 = u0 + 0.5 * p.pow(2).sum(-1)
            zn, pn = z, p - 0.5 * eps * g
            for i in range(int(leapfrog)):
                zn = zn + eps * pn
                u1, g, ll1 = energy_and_grad(zn, beta)
                pn = pn - (eps if i < int(leapfrog) - 1 else 0.5 * eps) * g
            h1 = u1 + 0.5 * pn.pow(2).sum(-1)
            log_u = torch.rand(h0.shape, device=z.device, dtype=z.dtype, generator=generator).log()
            accept = (log_u < (h0 - h1)) & torch.isfinite(h1)
            z = torch.where(accept[:, None], zn, z)
            ll = torch.where(accept, ll1, ll)
            eps = torch.where(accept[:, None], eps * 1.02, eps * 0.98).clamp(1e-4, 0.5)
            accepted += float(accept.double().mean())
    est = torch.logsumexp(log_w.reshape(C, B), 0) - math.log(C)
    if return_stats:
        return est, {"accept": accepted / max(len(betas) - 1, 1), "step_size": float(eps.mean())}
    return est
