"""Synthetic supervised tasks of the DEQ-vs-FFN studies (*Separation and Bias of Deep Equilibrium Models on
Expressivity and Learning Dynamics*, NeurIPS 2024), as pure numpy: each ``make_<task>`` returns
``{"train": (x, y), "val": (x, y), "test": (x, y), "meta": {...}}`` with float64 arrays x [n, d], y [n, 1].
Choices the reviews leave open are documented in docs/separation.md.
"""

from __future__ import annotations

import itertools
import math

import numpy as np

from src.separation import implicit_bias, regions


def _rng(seed: int, stream: int) -> np.random.Generator:
    return np.random.default_rng(np.random.SeedSequence(int(seed), spawn_key=(int(stream),)))


def _col(y) -> np.ndarray:
    return np.asarray(y, dtype=np.float64).reshape(-1, 1)


# ------------------------------------------------------------------------------ Theorem 1: 2^m regions
def make_theorem1(m: int = 6, n_train: int = 2048, n_val: int = 512, seed: int = 0, **_) -> dict:
    """y = Σ_t z_t*(x) of the width-m ReLU DEQ (2^m linear regions on [0, 1]); train uniform, test the dyadic
    grid k/2^(m+4) (every breakpoint and 15 points between two)."""
    xs = [_rng(seed, s).uniform(0, 1, n) for s, n in ((0, n_train), (1, n_val))]
    xs.append(np.linspace(0, 1, 2 ** (int(m) + 4) + 1))
    out = {k: (x[:, None], _col(regions.theorem1_target(x, m))) for k, x in zip(("train", "val", "test"), xs)}
    out["meta"] = {"m": int(m), "regions": 2 ** int(m)}
    return out


# ------------------------------------------------------------------------------ Theorem 2: steep target
def steep_target(x: np.ndarray, delta: float) -> np.ndarray:
    """f_δ(x) = δ / (δ + 1 − x₁): rational, depends on x₁ only, f ∈ (δ/(1+δ), 1], f' ≤ 1/δ (at x₁ = 1)."""
    return delta / (delta + 1.0 - np.asarray(x)[:, 0])


def steep_fixed_point_map(z, x1, delta):
    """The scalar map whose fixed point is f_δ: z ↦ (x₁ − δ) z + δ (contraction rate x₁ − δ < 1)."""
    return (x1 - delta) * z + delta


def picard_vs_bisection(x1: float, delta: float, eps: float = 1e-6, max_iter: int = 10 ** 8) -> dict:
    """Iterations to an ε-accurate fixed point of :func:`steep_fixed_point_map`: Picard from z = 0 (rate
    x₁ − δ: ~ log(1/ε)/δ at x₁ = 1) vs bisection on g(z) = map(z) − z over [0, 1] (⌈log₂(1/ε)⌉)."""
    z_star = delta / (delta + 1.0 - x1)
    rate = x1 - delta
    # Picard from 0: |z_k − z*| = rate^k z*, closed form (the loop would take 2^20 steps at δ = 2^-20)
    picard = 0 if z_star <= eps else math.ceil(math.log(eps / z_star) / math.log(rate)) if rate > 0 else 1
    lo, hi, its = 0.0, 1.0, 0
    while hi - lo > eps and its < max_iter:
        mid = 0.5 * (lo + hi)
        if steep_fixed_point_map(mid, x1, delta) - mid > 0:
            lo = mid
        else:
            hi = mid
        its += 1
    return {"picard": int(picard), "bisection": its, "bisection_error": abs(0.5 * (lo + hi) - z_star)}


def _steep_x(rng, n: int, dim: int, delta: float) -> np.ndarray:
    """Uniform on [0, 1]^d except x₁: half uniform, half at log-uniform distance 1 − x₁ ∈ [δ/10, 1]."""
    x = rng.uniform(0, 1, (n, dim))
    half = n // 2
    x[:half, 0] = 1.0 - 10 ** rng.uniform(math.log10(delta) - 1, 0, half)
    return x


def make_steep(dim: int = 10, delta: float | None = None, n_train: int = 4096, n_val: int = 1024,
               n_test: int = 4096, seed: int = 0, **_) -> dict:
    """Theorem 2's steep target on [0, 1]^d; δ = 2^(−d) when ``delta`` is None (the rebuttal couples them)."""
    dim = int(dim)
    delta = 2.0 ** (-dim) if delta is None else float(delta)
    out = {}
    for k, (s, n) in zip(("train", "val", "test"), ((0, n_train), (1, n_val), (2, n_test))):
        x = _steep_x(_rng(seed, s), n, dim, delta)
        if k == "test":  # plus the exact peak and a log grid towards it
            x[:64, 0] = 1.0 - np.concatenate([[0.0], np.logspace(math.log10(delta) - 1, 0, 63)])
        out[k] = (x, _col(steep_target(x, delta)))
    out["meta"] = {"delta": delta, "dim": dim}
    return out


# ----------------------------------------------------------------- Theorem 3: over-parameterised regression
def make_regression(dim: int = 40, n_train: int = 10, k: int = 3, scale: float = 2.0, n_test: int = 512,
                    seed: int = 0, **_) -> dict:
    """X [N, d] (N ≤ d), y = Xβ*, β* = 1 + scale on k coordinates; val = the training points (the interpolation
    the flow converges to), test = fresh rows."""
    X, y, beta_true = implicit_bias.regression_problem(n_train, dim, k, seed=seed, scale=scale)
    Xt = (_rng(seed, 2).standard_normal((n_test, dim)) / np.sqrt(dim)).astype(np.float32).astype(np.float64)
    return {"train": (X, _col(y)), "val": (X, _col(y)), "test": (Xt, _col(Xt @ beta_true)),
            "meta": {"beta_true": beta_true}}


# --------------------------------------------------------------------- GOTU: generalisation on the unseen
def gotu_target(x: np.ndarray, coef: float = 2.0, support: int | None = None) -> np.ndarray:
    """f(x) = coef · (x₁ + … + x_support) on {−1, 1}^d (support None: all d coordinates): degree 1, the frozen x₁
    in its support."""
    x = np.asarray(x)
    return coef * x[:, : x.shape[1] if support is None else int(support)].sum(axis=1)


def make_gotu(dim: int = 10, coef: float = 2.0, support: int | None = None, frozen_value: float = 1.0,
              seed: int = 0, **_) -> dict:
    """Train on every point of {−1, 1}^d with x₁ = ``frozen_value`` (2^(d−1) points), validate on the same seen
    domain, test on the whole cube (2^d points; meta["unseen"] marks x₁ ≠ frozen_value)."""
    dim = int(dim)
    if dim > 16:
        raise ValueError(f"dim={dim} is too large for the whole cube (2^dim test points); use dim <= 16")
    cube = np.array(list(itertools.product((-1.0, 1.0), repeat=dim)))
    seen = cube[cube[:, 0] == frozen_value]
    y = lambda x: _col(gotu_target(x, coef, support))
    return {"train": (seen, y(seen)), "val": (seen, y(seen)), "test": (cube, y(cube)),
            "meta": {"unseen": cube[:, 0] != frozen_value, "coef": coef, "support": support}}


# ------------------------------------------------------------------------------------ high frequencies
def tones(t: np.ndarray, freqs=(1, 4, 12, 24), amps=None, phases=None) -> np.ndarray:
    """s(t) = Σ_k a_k sin(2π f_k t + φ_k) (integer f_k: periodic on [0, 1))."""
    freqs = np.asarray(freqs, dtype=np.float64)
    amps = np.ones_like(freqs) if amps is None else np.asarray(amps, dtype=np.float64)
    phases = np.zeros_like(freqs) if phases is None else np.asarray(phases, dtype=np.float64)
    t = np.asarray(t, dtype=np.float64)[:, None]
    return (amps * np.sin(2 * np.pi * freqs * t + phases)).sum(axis=1)


def make_signal(freqs=(1, 4, 12, 24), n_train: int = 1024, n_test: int = 4096, seed: int = 0, **_) -> dict:
    """A sum of tones on t ∈ [0, 1), input 2t − 1 ∈ [−1, 1); train on a uniform grid of n_train points, validate
    on the midpoints, test on a uniform grid of n_test points (so per-frequency errors are exact DFT bins)."""
    phases = _rng(seed, 0).uniform(0, 2 * np.pi, len(freqs))
    out = {}
    for k, t in (("train", np.arange(n_train) / n_train), ("val", (np.arange(n_train) + 0.5) / n_train),
                 ("test", np.arange(n_test) / n_test)):
        out[k] = ((2 * t - 1)[:, None], _col(tones(t, freqs, phases=phases)))
    out["meta"] = {"freqs": [float(f) for f in freqs]}
    return out


def band_errors(pred: np.ndarray, target: np.ndarray, freqs) -> dict:
    """Per-tone relative error |P̂(f) − T̂(f)| / |T̂(f)| (DFT of signals on a uniform grid of [0, 1)), and the
    residual energy outside the tones relative to the signal's (spurious content)."""
    P, T = np.fft.rfft(np.ravel(pred)), np.fft.rfft(np.ravel(target))
    out = {}
    idx = [round(f) for f in freqs]
    for f, i in zip(freqs, idx):
        out[f"{f:g}"] = float(abs(P[i] - T[i]) / max(abs(T[i]), 1e-300))
    mask = np.ones(len(T), dtype=bool)
    mask[idx] = False
    out["other"] = float(np.sum(np.abs((P - T)[mask]) ** 2) / np.sum(np.abs(T) ** 2))
    return out


TASKS = {"theorem1": make_theorem1, "steep": make_steep, "regression": make_regression, "gotu": make_gotu,
         "signal": make_signal}
