"""The high-dimensional Gaussian of the DKEF scalability experiment (paper Table 3; docs/data.md §2).

Data are i.i.d. samples of N(0, I_D); the default sizes are 4860/600/540 train/val/test (the reference's
``HighDim`` used 4860/540/600 — the same total; the paper's order is kept). The ground truth is known:

    log p(x) = −½‖x‖² − (D/2) log 2π,        ∇ₓ log p(x) = −x,

so the test log-likelihood and the Fisher divergence ½E‖s_θ(x) − s(x)‖² can be computed exactly.

Each split is drawn from its own stream (``np.random.SeedSequence(seed).spawn``-style keys 0/1/2), so a
split's points do not change when another split's size does. The global RNGs are never touched.
"""

from __future__ import annotations

import math

import numpy as np
import torch

DEFAULT_SIZES = (4860, 600, 540)


def _check_dim(dim: int) -> int:
    if isinstance(dim, bool) or int(dim) != dim or int(dim) < 1:
        raise ValueError(f"dim={dim!r} is invalid: the Gaussian's dimension must be an integer >= 1")
    return int(dim)


def sample_gaussian(n: int, dim: int, seed: int = 0, stream: int = 0) -> np.ndarray:
    """``n`` samples of N(0, I_dim) as float32 [n, dim], from stream ``stream`` of ``seed``."""
    dim = _check_dim(dim)
    if int(n) < 0:
        raise ValueError(f"n={n!r} is invalid: the number of samples must be >= 0")
    rng = np.random.default_rng(np.random.SeedSequence(int(seed), spawn_key=(int(stream),)))
    return rng.standard_normal((int(n), dim)).astype(np.float32)


def gaussian_splits(
    dim: int,
    n_train: int = DEFAULT_SIZES[0],
    n_val: int = DEFAULT_SIZES[1],
    n_test: int = DEFAULT_SIZES[2],
    seed: int = 0,
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(train, val, test) float32 samples of N(0, I_dim); each split from its own stream of ``seed``."""
    for label, n in (("n_train", n_train), ("n_val", n_val), ("n_test", n_test)):
        if isinstance(n, bool) or int(n) != n or int(n) < 1:
            raise ValueError(f"{label}={n!r} is invalid: it must be an integer >= 1")
    return tuple(sample_gaussian(n, dim, seed, stream=k) for k, n in enumerate((n_train, n_val, n_test)))


def true_log_density(x: torch.Tensor) -> torch.Tensor:
    """Normalised log N(x; 0, I_D) per row of ``x`` [..., D] → [...] (in x's dtype and device)."""
    d = x.shape[-1]
    return -0.5 * x.pow(2).sum(dim=-1) - 0.5 * d * math.log(2 * math.pi)


def true_score(x: torch.Tensor) -> torch.Tensor:
    """∇ₓ log N(x; 0, I) = −x."""
    return -x
