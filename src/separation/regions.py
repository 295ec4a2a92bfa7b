"""Linear regions of 1-D ReLU networks, counted exactly, and the ReLU DEQ of *Separation and Bias of Deep
Equilibrium Models on Expressivity and Learning Dynamics* (NeurIPS 2024), Theorem 1 / Remark 1.

A continuous piecewise-linear (PL) map of one input x ∈ [a, b] is held as its values at a sorted list of
knots (:class:`PiecewiseLinear`); an affine map acts on the values, a ReLU inserts the zero crossings of
every component first. With ``fractions.Fraction`` knots and values (``exact=True``) every step is exact
rational arithmetic, so the count of regions has no tolerance at all; with floats it merges slopes that agree
to a relative tolerance (trained networks).

The Theorem 1 construction (as the authors' rebuttal gives it): width m, input x₁ ∈ [0, 1],
z = σ(W z + u x₁ − b) with W strictly lower-triangular, w_ti = −2^(t−i+1) (i < t), u_t = 2^t, b_t = 1,
σ = ReLU. Writing s_t = 2^t x₁ − Σ_{i<t} 2^(t−i+1) z_i, z_t = σ(s_t − 1) and s_{t+1} = 2 min(s_t, 2 − s_t):
s_t is the (t−1)-th iterate of the tent map on [0, 2] started at 2x₁. The breakpoints of z* are the points
where some s_t = 1, i.e. the dyadic rationals k/2^m, 0 < k < 2^m: 2^m linear regions, for z* and for the
read-out y = Σ_t z_t* (at a point where s_t = 1, z_t's slope jumps by ±2^t and z_{t+1}'s by −2^(t+2):
they never cancel).
"""

from __future__ import annotations

from dataclasses import dataclass
from fractions import Fraction

import numpy as np


def _as_object(a) -> np.ndarray:
    """An object array of Fractions (exact arithmetic)."""
    arr = np.asarray(a, dtype=object)
    return np.vectorize(lambda v: Fraction(v) if not isinstance(v, Fraction) else v, otypes=[object])(arr)


@dataclass
class PiecewiseLinear:
    """A continuous PL map [knots[0], knots[-1]] → R^k: ``values[i]`` at ``knots[i]``, linear in between."""

    knots: np.ndarray   # [n]
    values: np.ndarray  # [n, k]

    @property
    def exact(self) -> bool:
        return self.knots.dtype == object

    @classmethod
    def identity(cls, a=0, b=1, exact: bool = True) -> PiecewiseLinear:
        knots = _as_object([a, b]) if exact else np.array([a, b], dtype=np.float64)
        return cls(knots, knots.reshape(2, 1).copy())

    def affine(self, A, c=None) -> PiecewiseLinear:
        """x ↦ A v(x) + c (A: [k_out, k], c: [k_out])."""
        A = _as_object(A) if self.exact else np.asarray(A, dtype=np.float64)
        out = self.values @ A.T
        if c is not None:
            out = out + (_as_object(c) if self.exact else np.asarray(c, dtype=np.float64))
        return PiecewiseLinear(self.knots, out)

    def concat(self, other: PiecewiseLinear) -> PiecewiseLinear:
        """[v(x), w(x)] on the common refinement of both knot sets."""
        knots = _merge(self.knots, other.knots)
        return PiecewiseLinear(knots, np.concatenate([self(knots), other(knots)], axis=1))

    def __call__(self, xs) -> np.ndarray:
        """Values at the points ``xs`` (inside the domain), [len(xs), k]."""
        xs = np.asarray(xs, dtype=self.knots.dtype)
        idx = np.clip(np.searchsorted(self.knots, xs, side="right") - 1, 0, len(self.knots) - 2)
        x0, x1 = self.knots[idx], self.knots[idx + 1]
        t = ((xs - x0) / (x1 - x0))[:, None]
        return self.values[idx] * (1 - t) + self.values[idx + 1] * t

    def relu(self, mask=None) -> PiecewiseLinear:
        """max(0, v) on the components where ``mask`` is true (all by default), zero crossings inserted."""
        k = self.values.shape[1]
        mask = np.ones(k, dtype=bool) if mask is None else np.asarray(mask, dtype=bool)
        v0, v1 = self.values[:-1][:, mask], self.values[1:][:, mask]
        cross = (v0 * v1) < 0
        i, j = np.nonzero(cross)
        new = len(i) > 0
        if new:
            t = v0[i, j] / (v0[i, j] - v1[i, j])
            knots = _merge(self.knots, self.knots[i] + t * (self.knots[i + 1] - self.knots[i]))
            values = self(knots)
        else:
            knots, values = self.knots, self.values.copy()
        zero = Fraction(0) if self.exact else 0.0
        sub = values[:, mask]
        sub[sub < 0] = zero
        values[:, mask] = sub
        return PiecewiseLinear(knots, values)

    def slopes(self) -> np.ndarray:
        """Slope of every non-degenerate interval, [n_intervals, k]."""
        dx = self.knots[1:] - self.knots[:-1]
        keep = dx > 0
        return ((self.values[1:] - self.values[:-1])[keep]) / dx[keep][:, None]


def _merge(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    if a.dtype == object:
        return np.array(sorted(set(a.tolist()) | set(b.tolist())), dtype=object)
    return np.unique(np.concatenate([a, b]))


def breakpoints(pl: PiecewiseLinear, readout=None, rtol: float = 1e-9) -> list:
    """The points where ``readout @ v(x)`` (v itself when None) changes slope: exact for exact maps; for float
    maps two slopes count as equal when they differ by ≤ rtol × the largest slope magnitude."""
    f = pl if readout is None else pl.affine(np.atleast_2d(readout))
    dx = f.knots[1:] - f.knots[:-1]
    keep = np.nonzero(dx > 0)[0]
    s = f.slopes()
    if len(s) <= 1:
        return []
    if f.exact:
        change = [any(a != b for a, b in zip(s[i], s[i + 1])) for i in range(len(s) - 1)]
    else:
        scale = max(float(np.abs(s).max()), 1e-300)
        change = list((np.abs(s[1:] - s[:-1]) > rtol * scale).any(axis=1))
    return [f.knots[keep[i] + 1] for i, c in enumerate(change) if c]


def count_regions(pl: PiecewiseLinear, readout=None, rtol: float = 1e-9) -> int:
    """Number of maximal intervals on which ``readout @ v`` is affine (1 + breakpoints)."""
    return 1 + len(breakpoints(pl, readout, rtol))


# ------------------------------------------------------------------------------------------ networks
def relu_mlp(layers, a=0, b=1, exact: bool = False) -> PiecewiseLinear:
    """The PL map of a 1-input ReLU MLP on [a, b]: ``layers`` = [(W, c), …], ReLU after every layer but the
    last (the read-out)."""
    pl = PiecewiseLinear.identity(a, b, exact)
    for i, (W, c) in enumerate(layers):
        pl = pl.affine(W, c)
        if i < len(layers) - 1:
            pl = pl.relu()
    return pl


def relu_deq_unrolled(W, U, c, n_iter: int, a=0, b=1, exact: bool = True) -> PiecewiseLinear:
    """``n_iter`` Picard steps z ← ReLU(W z + U x + c) from z⁰ = 0 as one PL map of x ∈ [a, b] (components: z).

    For a nilpotent W (strictly triangular, W^m = 0) m steps reach the fixed point exactly, so this *is* z*.
    """
    m = len(W)
    W = _as_object(W) if exact else np.asarray(W, dtype=np.float64)
    U = (_as_object(U) if exact else np.asarray(U, dtype=np.float64)).reshape(m, 1)
    c = _as_object(c) if exact else np.asarray(c, dtype=np.float64)
    # state components [x, z_1..z_m]; x passes unchanged, z gets the DEQ map
    zero = Fraction(0) if exact else 0.0
    one = Fraction(1) if exact else 1.0
    A = np.full((m + 1, m + 1), zero, dtype=W.dtype)
    A[0, 0] = one
    A[1:, 0] = U[:, 0]
    A[1:, 1:] = W
    shift = np.concatenate([np.array([zero], dtype=W.dtype), c])
    x = PiecewiseLinear.identity(a, b, exact)
    state = PiecewiseLinear(x.knots, np.concatenate([x.values, np.full((2, m), zero, dtype=W.dtype)], axis=1))
    mask = np.arange(m + 1) > 0
    for _ in range(int(n_iter)):
        state = state.affine(A, shift).relu(mask)
    return PiecewiseLinear(state.knots, state.values[:, 1:])


def relu_deq_fixed_point(W, U, c, x, max_iter: int = 100_000, tol: float = 1e-13) -> np.ndarray:
    """z* [len(x), m] of z = ReLU(W z + U x + c) for scalar inputs x, by Picard iteration in float64 (it
    converges when the map contracts, e.g. ‖W‖₂ < 1, or when W is nilpotent); raises if it does not."""
    W, U, c = (np.asarray(a, dtype=np.float64) for a in (W, U, c))
    xu = np.asarray(x, dtype=np.float64).reshape(-1, 1) * U.reshape(1, -1) + c
    z = np.zeros_like(xu)
    for _ in range(int(max_iter)):
        new = np.maximum(z @ W.T + xu, 0.0)
        if np.abs(new - z).max() <= tol * max(1.0, np.abs(new).max()):
            return new
        z = new
    raise RuntimeError(f"Picard iteration of the ReLU DEQ did not converge in {max_iter} steps")


def relu_deq_pl(W, U, c, a: float = 0.0, b: float = 1.0, probe: float = 1e-9,
                max_pieces: int = 1_000_000) -> PiecewiseLinear:
    """The fixed point z*(x) of a 1-input ReLU DEQ z = ReLU(W z + U x + c) on [a, b] as a float PL map, for any
    W whose fixed point is unique and reached by Picard iteration (a trained DEQ's normalised W, ‖W‖₂ < 1, or a
    nilpotent W such as Theorem 1's).

    Walks [a, b] piece by piece. On a piece the activation pattern D (D_ii = 1 where neuron i is active) is
    fixed, so z* = D(W z* + U x + c) is affine: z*(x) = (I − DW)⁻¹ D (U x + c). The piece ends where a
    pre-activation p(x) = W z*(x) + U x + c (affine too) first changes sign against D. The next piece's
    pattern is read from the fixed point (:func:`relu_deq_fixed_point`) at ``probe`` × (b − a) past that end,
    so a piece shorter than that could be missed; within a piece the map is exact up to float rounding.
    """
    W, U, c = (np.asarray(v, dtype=np.float64) for v in (W, U, c))
    U = U.reshape(-1)
    m = len(c)
    eye = np.eye(m)
    h = probe * (b - a)
    knots, values = [], []
    x = float(a)
    while True:
        xp = min(x + h, 0.5 * (x + b))
        z = relu_deq_fixed_point(W, U, c, [xp])[0]
        active = (z @ W.T + xp * U + c) > 0
        D = np.diag(active.astype(np.float64))
        M = eye - D @ W
        slope, icpt = np.linalg.solve(M, D @ U), np.linalg.solve(M, D @ c)
        p1, p0 = W @ slope + U, W @ icpt + c  # pre-activation p(x) = p1 x + p0 on this piece
        sign = np.where(active, 1.0, -1.0)
        # the piece holds while sign·p ≥ 0: it ends at the first root beyond the probe of a component heading down
        down = sign * p1 < -1e-300
        roots = -p0[down] / p1[down]
        roots = roots[roots > xp]
        end = min(float(b), float(roots.min())) if len(roots) else float(b)
        if not knots:
            knots.append(x)
            values.append(slope * x + icpt)
        knots.append(end)
        values.append(slope * end + icpt)
        if end >= b:
            break
        if len(knots) > max_pieces:
            raise RuntimeError(f"more than {max_pieces} linear pieces on [{a}, {b}]")
        x = end
    return PiecewiseLinear(np.array(knots), np.array(values))


# ----------------------------------------------------------------------- Theorem 1's construction
def theorem1_weights(m: int, exact: bool = False):
    """(W [m, m], u [m], c [m]) of the rebuttal's construction: f(z; x₁) = ReLU(W z + u x₁ + c), c = −b = −1."""
    m = int(m)
    if m < 1:
        raise ValueError(f"m={m!r} is invalid: the width must be >= 1")
    if exact:
        W = np.full((m, m), Fraction(0), dtype=object)
        for t in range(m):
            for i in range(t):
                W[t, i] = Fraction(-(2 ** (t - i + 1)))
        u = np.array([Fraction(2 ** (t + 1)) for t in range(m)], dtype=object)
        return W, u, np.array([Fraction(-1)] * m, dtype=object)
    t, i = np.meshgrid(np.arange(1, m + 1), np.arange(1, m + 1), indexing="ij")
    W = np.where(i < t, -(2.0 ** (t - i + 1)), 0.0)
    return W, 2.0 ** np.arange(1, m + 1), -np.ones(m)


def theorem1_fixed_point(x, m: int) -> np.ndarray:
    """The closed-form fixed point z*(x) [len(x), m] (the rebuttal's initialisation, eq. 16): z_t = ReLU(s_t − 1),
    s_1 = 2x, s_{t+1} = 2 min(s_t, 2 − s_t)."""
    s = 2.0 * np.asarray(x, dtype=np.float64)
    out = np.empty((s.shape[0], int(m)))
    for t in range(int(m)):
        out[:, t] = np.maximum(s - 1.0, 0.0)
        s = 2.0 * np.minimum(s, 2.0 - s)
    return out


def theorem1_target(x, m: int) -> np.ndarray:
    """The scalar output y(x) = Σ_t z_t*(x) of the width-m construction (2^m linear regions on [0, 1])."""
    return theorem1_fixed_point(x, m).sum(axis=1)


def theorem1_map(z: np.ndarray, x, m: int) -> np.ndarray:
    """One application of the DEQ map f(z; x) = ReLU(W z + u x + c), z [n, m]."""
    W, u, c = theorem1_weights(m)
    return np.maximum(z @ W.T + np.asarray(x, dtype=np.float64)[:, None] * u + c, 0.0)


def picard_iterations_to_fixed_point(x, m: int, z0: np.ndarray | None = None, max_iter: int | None = None):
    """Per point, the number k of Picard steps after which z^k equals the fixed point exactly (and stays):
    0 when z0 already is z*. Returns (iterations [n], z* [n, m])."""
    x = np.asarray(x, dtype=np.float64)
    z_star = theorem1_fixed_point(x, m)
    z = np.zeros_like(z_star) if z0 is None else np.array(z0, dtype=np.float64)
    max_iter = 4 * int(m) if max_iter is None else int(max_iter)
    its = np.where((z == z_star).all(axis=1), 0, -1)
    for k in range(1, max_iter + 1):
        z = theorem1_map(z, x, m)
        hit = (z == z_star).all(axis=1) & (its < 0)
        its[hit] = k
    return its, z_star


def load_theorem1(net) -> None:
    """Set a :class:`src.models.supervised.DEQNet` (input 1, width m, one layer in f, ReLU, ``deq.norm=none``) to
    the construction, with the all-ones read-out (y = Σ_t z_t*)."""
    import torch

    block = net.block
    if block.in_dim != 1 or block.n_layers != 1 or block.activation != "relu" or block.config.norm != "none":
        raise ValueError("model.construction=theorem1 needs data.dim=1, depth=1, model.activation=relu and "
                         "deq.norm=none (the construction's W is not normalised: it converges because it is "
                         "nilpotent)")
    W, u, c = theorem1_weights(block.width)
    with torch.no_grad():
        dt = block.weights[0].dtype
        block.weights[0].copy_(torch.tensor(W, dtype=dt))
        block.injection.weight.copy_(torch.tensor(u, dtype=dt)[:, None])
        block.injection.bias.copy_(torch.tensor(c, dtype=dt))
        net.readout.weight.fill_(1.0)
        net.readout.bias.zero_()
