"""UCI preprocessing of the DKEF experiments (docs/data.md §1), as pure numpy functions.

The pipeline of :func:`preprocess` (every step seeded from ``seed``; the global numpy/torch RNGs are never
used or touched):

1. **Dequantisation** (wine only): column j gets ``U(−1, 1) · g_j`` added, where g_j is the median gap
   between the sorted distinct values of column j (:func:`median_gaps`, :func:`dequantize`).
2. **Shuffle** the rows with ``np.random.RandomState(seed).permutation(N)``, which is the same permutation
   as the reference's ``np.random.seed(2019); np.random.shuffle(data)`` (:func:`shuffle_rows`).
3. **Split** into contiguous train / val / test blocks, in that order (:func:`split_sizes`):
   ``"paper"``: 70/20/10 — n_test = N // 10, n_val = N // 5, n_train = the rest;
   ``"reference"`` (``dkef_runner.load_and_whiten``): n_test = min(1000, N // 10),
   n_val = min(1000, (N − n_test) // 10), n_train = the rest.
4. **PCA whitening** z = (x − μ) · V · diag(1/sd) (:class:`Whitening`, :func:`fit_whitening`), where
   x_c = x − μ has the thin SVD x_c = U diag(s) Vᵀ over the n fitting rows and sd = s / √n, so the fitting
   rows come out with mean 0 and (1/n) Σ z zᵀ = I exactly (ddof = 0, as the reference's
   ``vt.T / s * sqrt(n)``; no ε). Columns of V are sign-normalised (largest |entry| positive) so the
   result does not depend on the LAPACK build. ``whiten_on="train"`` (default) fits μ, V, sd on the
   training rows only, so nothing about val/test leaks into the training data; ``whiten_on="all"`` fits on
   every row, test included, as the reference code does (it uses the first 10⁴ rows; all three UCI sets
   have fewer, so this is the same).
5. **Noise**: N(0, noise_std²) is added once to each split, after whitening (reference: 0.05).

The fitted :class:`Whitening` is returned so a user can map model space back to data units
(:meth:`Whitening.inverse`); log-densities in data units differ by ``Whitening.log_abs_det`` (= log|det W|).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

SPLITS = ("paper", "reference")
WHITEN_ON = ("train", "all")
DEFAULT_SEED = 2019

# independent streams derived from `seed` (spawn keys of np.random.SeedSequence)
_STREAM_DEQUANTIZE, _STREAM_NOISE = 0, 1


def _stream(seed: int, key: int) -> np.random.Generator:
    return np.random.default_rng(np.random.SeedSequence(int(seed), spawn_key=(key,)))


def _as_2d(data: np.ndarray) -> np.ndarray:
    data = np.asarray(data, dtype=np.float64)
    if data.ndim != 2:
        raise ValueError(f"expected a 2-D array [N, D], got shape {data.shape}")
    return data


# ---------------------------------------------------------------------------------------------- dequantise
def median_gaps(data: np.ndarray) -> np.ndarray:
    """Per column, the median gap between its sorted distinct values (0 for a column with one value)."""
    data = _as_2d(data)
    gaps = np.zeros(data.shape[1])
    for j in range(data.shape[1]):
        distinct = np.unique(data[:, j])
        if distinct.size > 1:
            gaps[j] = np.median(np.diff(distinct))
    return gaps


def dequantize(data: np.ndarray, rng: np.random.Generator | int) -> np.ndarray:
    """``data + U(−1, 1) · median_gaps(data)`` (a new float64 array; ``data`` is not modified)."""
    data = _as_2d(data)
    rng = rng if isinstance(rng, np.random.Generator) else np.random.default_rng(rng)
    return data + rng.uniform(-1.0, 1.0, size=data.shape) * median_gaps(data)


# ------------------------------------------------------------------------------------------- shuffle, split
def shuffle_rows(data: np.ndarray, seed: int = DEFAULT_SEED) -> tuple[np.ndarray, np.ndarray]:
    """(data[perm], perm) with the reference's permutation for ``seed`` (global RNG state untouched)."""
    data = np.asarray(data)
    perm = np.random.RandomState(int(seed)).permutation(data.shape[0])
    return data[perm], perm


def split_sizes(n: int, split: str = "paper") -> tuple[int, int, int]:
    """(n_train, n_val, n_test) for ``n`` rows under the ``"paper"`` or ``"reference"`` rule."""
    n = int(n)
    if split == "paper":
        n_test, n_val = n // 10, n // 5
    elif split == "reference":
        n_test = min(1000, n // 10)
        n_val = min(1000, (n - n_test) // 10)
    else:
        raise ValueError(f"split={split!r} is invalid: choose one of {', '.join(SPLITS)}")
    n_train = n - n_val - n_test
    if min(n_train, n_val, n_test) < 1:
        raise ValueError(
            f"{n} rows are too few for a {split!r} split into train/val/test ({n_train}/{n_val}/{n_test})"
        )
    return n_train, n_val, n_test


def split_rows(data: np.ndarray, split: str = "paper") -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Contiguous (train, val, test) blocks of ``data``, in that order (test = the last rows)."""
    n_train, n_val, _ = split_sizes(len(data), split)
    return data[:n_train], data[n_train : n_train + n_val], data[n_train + n_val :]


# ---------------------------------------------------------------------------------------------- whitening
@dataclass(frozen=True)
class Whitening:
    """z = (x − mean) @ matrix, and back x = z @ inverse_matrix + mean (matrix = V · diag(1/sd))."""

    mean: np.ndarray  # [D]
    matrix: np.ndarray  # [D, D]
    inverse_matrix: np.ndarray = field(repr=False)  # [D, D] = diag(sd) · Vᵀ

    def __call__(self, x: np.ndarray) -> np.ndarray:
        return (np.asarray(x, dtype=np.float64) - self.mean) @ self.matrix

    apply = __call__

    def inverse(self, z: np.ndarray) -> np.ndarray:
        """Map whitened points back to data units."""
        return np.asarray(z, dtype=np.float64) @ self.inverse_matrix + self.mean

    @property
    def log_abs_det(self) -> float:
        """log |det matrix|: log p_data(x) = log p_white(z) + log_abs_det."""
        return float(np.linalg.slogdet(self.matrix)[1])


def fit_whitening(data: np.ndarray, rcond: float = 1e-12) -> Whitening:
    """PCA whitening fitted on ``data`` (float64; no ε); raises ValueError when ``data`` is rank-deficient."""
    data = _as_2d(data)
    n, d = data.shape
    mean = data.mean(axis=0)
    _, s, vt = np.linalg.svd(data - mean, full_matrices=False)
    if s.size < d or s[-1] <= rcond * s[0]:
        raise ValueError(
            f"cannot whiten: the {n} fitting rows span fewer than D={d} dimensions (singular values "
            f"{s.min() if s.size else 0:.3g}..{s.max() if s.size else 0:.3g}); "
            "a constant or duplicate column?"
        )
    v = vt.T
    flip = np.sign(v[np.abs(v).argmax(axis=0), np.arange(d)])
    v = v * flip
    sd = s / np.sqrt(n)
    return Whitening(mean=mean, matrix=v / sd, inverse_matrix=sd[:, None] * v.T)


# ---------------------------------------------------------------------------------------------- the pipeline
@dataclass(frozen=True)
class PreprocessedSplits:
    train: np.ndarray  # float32 [n_train, D]
    val: np.ndarray  # float32 [n_val, D]
    test: np.ndarray  # float32 [n_test, D]
    whitening: Whitening  # fitted map from (dequantised) data units to the model space, before the noise
    permutation: np.ndarray  # row i of train+val+test (concatenated) is row permutation[i] of the input

    @property
    def sizes(self) -> tuple[int, int, int]:
        return len(self.train), len(self.val), len(self.test)

    @property
    def dim(self) -> int:
        return int(self.train.shape[1])


def preprocess(
    data: np.ndarray,
    *,
    dequantize_data: bool = False,
    seed: int = DEFAULT_SEED,
    split: str = "paper",
    whiten_on: str = "train",
    noise_std: float = 0.05,
) -> PreprocessedSplits:
    """Dequantise (optional), shuffle, split, PCA-whiten and add noise; see the module docstring."""
    data = _as_2d(data)
    if whiten_on not in WHITEN_ON:
        raise ValueError(f"whiten_on={whiten_on!r} is invalid: choose one of {', '.join(WHITEN_ON)}")
    if not (noise_std >= 0 and np.isfinite(noise_std)):
        raise ValueError(f"noise_std={noise_std!r} is invalid: it must be a finite number >= 0")
    if not np.all(np.isfinite(data)):
        raise ValueError("the data contain NaN or infinite values")
    split_sizes(len(data), split)  # validates `split` before any work

    if dequantize_data:
        data = dequantize(data, _stream(seed, _STREAM_DEQUANTIZE))
    data, perm = shuffle_rows(data, seed)
    parts = split_rows(data, split)
    whitening = fit_whitening(parts[0] if whiten_on == "train" else data)
    noise_rng = _stream(seed, _STREAM_NOISE)
    out = []
    for part in parts:
        z = whitening(part)
        if noise_std > 0:
            z = z + noise_rng.normal(0.0, noise_std, size=z.shape)
        out.append(z.astype(np.float32))
    return PreprocessedSplits(*out, whitening=whitening, permutation=perm)
