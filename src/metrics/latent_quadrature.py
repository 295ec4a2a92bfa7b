"""Exact log p(x) = log ∫ p(x|z) N(z; 0, I) dz for a low-dimensional latent, by quadrature on a grid.

The ground truth that AIS (:mod:`src.metrics.ais`) is checked against when the latent has 1–3 dimensions:
a Riemann sum over the cube [−R, R]^d with spacing h,

    log p(x) ≈ logsumexp_g (log N(z_g; 0, I) + log p(x|z_g)) + d·log h.

For an integrand that is smooth and negligible at the cube's faces this sum converges faster than any power
of h (it is the trapezoidal rule of a function vanishing with all its derivatives at the ends), so the sums
with spacings h and 2h agree to rounding when both resolve the posterior; :func:`grid_log_marginal` returns
both so that a caller can check it. Cost: (2R/h)^d evaluations of ``pairwise_log_likelihood``.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch


def grid_log_marginal(
    pairwise_log_likelihood: Callable[[torch.Tensor], torch.Tensor],
    latent_dim: int,
    *,
    half_width: float = 6.0,
    h: float = 0.02,
    chunk: int = 65536,
    dtype=torch.float64,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(log p(x) with spacing h, the same with spacing 2h)``, each ``[B]``.

    Args:
        pairwise_log_likelihood: ``z [G, d] -> [G, B]`` log p(x_b | z_g) for every grid point and data point
            (for a Bernoulli decoder: ``logits(z) @ xᵀ − softplus(logits(z)).sum(-1, keepdim=True)``).
        latent_dim: d (the grid has (2R/h)^d points: keep d ≤ 3).
        half_width: R; the prior mass outside the cube, ≤ 2d·N(R)-tail, must be negligible.
        h: grid spacing (the grid has an even number of points per axis so that every other point is the
            2h grid).
    """
    d = int(latent_dim)
    if not 1 <= d <= 3:
        raise ValueError(f"grid quadrature is for latent_dim 1-3, got {latent_dim}: use AIS")
    n = 2 * math.ceil(half_width / h)  # points per axis, even, centred on 0
    axis = (torch.arange(n, dtype=dtype) - (n - 1) / 2) * h
    mesh = torch.stack(torch.meshgrid(*([axis] * d), indexing="ij"), -1).reshape(-1, d)
    coarse = (torch.stack(torch.meshgrid(*([torch.arange(n) % 2 == 0] * d), indexing="ij"), -1)
              .all(-1).reshape(-1))
    fine_parts, coarse_parts = [], []
    with torch.no_grad():
        for start in range(0, mesh.shape[0], int(chunk)):
            zg = mesh[start:start + int(chunk)]
            log_prior = -0.5 * zg.pow(2).sum(-1) - 0.5 * d * math.log(2 * math.pi)
            f = pairwise_log_likelihood(zg).to(dtype) + log_prior[:, None]
            fine_parts.append(torch.logsumexp(f, 0))
            sel = coarse[start:start + int(chunk)]
            if bool(sel.any()):
                coarse_parts.append(torch.logsumexp(f[sel], 0))
    fine = torch.logsumexp(torch.stack(fine_parts), 0) + d * math.log(h)
    coarse_est = torch.logsumexp(torch.stack(coarse_parts), 0) + d * math.log(2 * h)
    return fine, coarse_est
