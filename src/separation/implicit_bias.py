"""Implicit bias of the diagonal linear DEQ (*Separation and Bias of Deep Equilibrium Models on Expressivity
and Learning Dynamics*, Theorem 3) beside the diagonal linear network's, as pure float64 numpy/scipy.

Model. The diagonal linear DEQ z = diag(w) z + x has the fixed point z* = x / (1 − w); with the all-ones
read-out its output is βᵀx with β = 1 / (1 − w) (w = 0 ⇒ β = 1). Loss L = ½‖Xβ − y‖², X [N, d], N ≤ d.
Gradient flow on w gives β̇ = −(Xᵀr) ⊙ β⁴, r = Xβ − y, hence the closed form

    β(t) = (3 Xᵀ v(t) + β(0)^(−3))^(−1/3),      v(t) = ∫₀ᵗ r(s) ds.

Its limit satisfies Xβ = y and β^(−3) − β(0)^(−3) ∈ range(Xᵀ): the KKT conditions of

    min Q₊(β) = Σᵢ [ 1/(2βᵢ²) + βᵢ(0)^(−3) βᵢ ]   s.t.  Xβ = y,  β > 0,

(∇Q₊ = −β^(−3) + β(0)^(−3)): a Bregman divergence to β(0) of the potential Σ 1/(6βᵢ²). Note the sign: the
form with −βᵢ(0)^(−3) βᵢ (as the reviews transcribe Theorem 3) has ∇ = −β^(−3) − β(0)^(−3), which the flow's
limit does not zero on range(Xᵀ)'s complement; it is also unbounded below on β > 0 (q(x) → −∞ as x → ∞).
:func:`q_kkt_residual` measures both.

Diagonal linear network (Woodworth et al., 2020): β = u⊙u − v⊙v from u = v = α: arcsinh(β / (2α²)) ∈
range(Xᵀ), the KKT conditions of min Σ α² q(βᵢ/α²), q(z) = 2 − √(4 + z²) + z arcsinh(z/2) (ℓ₁ as α → 0,
ℓ₂ as α → ∞).
"""

from __future__ import annotations

import numpy as np
from scipy.integrate import solve_ivp
from scipy.optimize import linprog

# ------------------------------------------------------------------------------------ diagonal DEQ


def beta_of_w(w: np.ndarray) -> np.ndarray:
    return 1.0 / (1.0 - np.asarray(w, dtype=np.float64))


def closed_form_beta(X: np.ndarray, v: np.ndarray, beta0: np.ndarray) -> np.ndarray:
    """β = (3Xᵀv + β(0)^(−3))^(−1/3) (Theorem 3's trajectory), v [..., N] → β [..., d]."""
    a = 3.0 * np.asarray(v) @ X + np.asarray(beta0, dtype=np.float64) ** -3
    return np.cbrt(1.0 / a)


def gd_diag_deq(X, y, beta0, lr: float, steps: int, record_every: int = 0):
    """Plain gradient descent on w of the diagonal linear DEQ, float64.

    Returns ``{"beta", "v", "loss", "trajectory": [(step, β, v), …]}``; v is the left Riemann sum
    Σ_k lr · r_k (the Euler discretisation of ∫ r), so ``closed_form_beta(X, v, beta0)`` is the closed form
    evaluated along the GD path (error O(lr))."""
    X = np.asarray(X, dtype=np.float64)
    y = np.asarray(y, dtype=np.float64)
    w = 1.0 - 1.0 / np.asarray(beta0, dtype=np.float64)
    v = np.zeros(X.shape[0])
    traj = []
    for k in range(int(steps) + 1):
        beta = beta_of_w(w)
        if record_every and k % int(record_every) == 0:
            traj.append((k, beta.copy(), v.copy()))
        if k == int(steps):
            break
        r = X @ beta - y
        w = w - lr * (X.T @ r) * beta ** 2  # ∂L/∂w = (Xᵀr) ⊙ ∂β/∂w = (Xᵀr) ⊙ β²
        v = v + lr * r
    return {"beta": beta, "v": v, "loss": 0.5 * float(np.sum((X @ beta - y) ** 2)), "trajectory": traj}


def gradient_flow_diag_deq(X, y, beta0, t_end: float, rtol: float = 1e-12, atol: float = 1e-14):
    """Gradient flow β̇ = −(Xᵀr) β⁴, v̇ = r integrated to ``t_end`` by an adaptive 8th-order Runge–Kutta
    (DOP853): the continuous-time reference. Returns (β(t_end), v(t_end))."""
    X = np.asarray(X, dtype=np.float64)
    y = np.asarray(y, dtype=np.float64)
    d, n = X.shape[1], X.shape[0]

    def rhs(_t, s):
        beta = s[:d]
        r = X @ beta - y
        return np.concatenate([-(X.T @ r) * beta ** 4, r])

    s0 = np.concatenate([np.asarray(beta0, dtype=np.float64) * np.ones(d), np.zeros(n)])
    sol = solve_ivp(rhs, (0.0, float(t_end)), s0, method="DOP853", rtol=rtol, atol=atol)
    if not sol.success:
        raise RuntimeError(f"gradient-flow integration failed: {sol.message}")
    return sol.y[:d, -1], sol.y[d:, -1]


def q_objective(beta, beta0, sign: float = 1.0) -> float:
    """Q(β) = Σ 1/(2βᵢ²) + sign · βᵢ(0)^(−3) βᵢ (sign = +1: the flow's potential; −1: the transcribed form)."""
    beta = np.asarray(beta, dtype=np.float64)
    return float(np.sum(0.5 / beta ** 2 + sign * np.asarray(beta0, dtype=np.float64) ** -3 * beta))


def q_gradient(beta, beta0, sign: float = 1.0) -> np.ndarray:
    beta = np.asarray(beta, dtype=np.float64)
    return -beta ** -3 + sign * np.asarray(beta0, dtype=np.float64) ** -3 * np.ones_like(beta)


def _dual_newton(X, y, beta_of, jac_weight, lam0=None, tol=1e-13, max_iter=200, feasible=None):
    """Newton on the dual of min Q s.t. Xβ = y when ∇Q(β) = Xᵀλ inverts to β = beta_of(Xᵀλ):
    F(λ) = X beta_of(Xᵀλ) − y = 0, F' = X diag(jac_weight(Xᵀλ)) Xᵀ (positive definite), with backtracking."""
    X = np.asarray(X, dtype=np.float64)
    y = np.asarray(y, dtype=np.float64)
    lam = np.zeros(X.shape[0]) if lam0 is None else np.asarray(lam0, dtype=np.float64)
    F = X @ beta_of(X.T @ lam) - y
    for _ in range(int(max_iter)):
        if np.linalg.norm(F) <= tol * max(1.0, np.linalg.norm(y)):
            break
        J = (X * jac_weight(X.T @ lam)) @ X.T
        step = np.linalg.solve(J, F)
        t = 1.0
        while t > 1e-12:
            cand = lam - t * step
            g = X.T @ cand
            if feasible is None or feasible(g):
                with np.errstate(over="ignore", invalid="ignore"):
                    Fc = X @ beta_of(g) - y
                    better = bool(np.all(np.isfinite(Fc)) and np.linalg.norm(Fc) < np.linalg.norm(F))
                if better:
                    lam, F = cand, Fc
                    break
            t *= 0.5
        else:
            raise RuntimeError("dual Newton: no feasible step")
    return beta_of(X.T @ lam), lam, float(np.linalg.norm(F))


def q_minimiser(X, y, beta0, tol: float = 1e-13):
    """argmin Q₊(β) s.t. Xβ = y, β > 0, solved on its own (dual Newton on the KKT system, no gradient descent).

    Stationarity −β^(−3) + β(0)^(−3) = Xᵀλ gives β(λ) = (β(0)^(−3) − Xᵀλ)^(−1/3) (needs the bracket > 0).
    Returns (β, λ, ‖Xβ − y‖)."""
    b0 = np.asarray(beta0, dtype=np.float64) * np.ones(np.asarray(X).shape[1])
    a0 = b0 ** -3

    def beta_of(g):
        return np.cbrt(1.0 / (a0 - g))

    def weight(g):
        return (a0 - g) ** (-4.0 / 3.0) / 3.0

    return _dual_newton(X, y, beta_of, weight, tol=tol, feasible=lambda g: bool(np.all(a0 - g > 0)))


def q_kkt_residual(beta, X, y, beta0, sign: float = 1.0) -> dict:
    """KKT residuals of min Q_sign s.t. Xβ = y at β: stationarity ‖∇Q − Xᵀμ‖ / ‖∇Q‖ with μ the least-squares
    multiplier, primal ‖Xβ − y‖, and min βᵢ (must be > 0)."""
    X = np.asarray(X, dtype=np.float64)
    g = q_gradient(beta, beta0, sign)
    mu, *_ = np.linalg.lstsq(X.T, g, rcond=None)
    return {"stationarity": float(np.linalg.norm(g - X.T @ mu) / max(np.linalg.norm(g), 1e-300)),
            "primal": float(np.linalg.norm(X @ beta - np.asarray(y))), "min_beta": float(np.min(beta)),
            "multiplier": mu}


# ------------------------------------------------------------------------------ diagonal linear network


def gd_diag_net(X, y, alpha: float, lr: float, steps: int):
    """GD on the diagonal linear network β = u⊙u − v⊙v from u = v = α (β(0) = 0), loss ½‖Xβ − y‖²."""
    X = np.asarray(X, dtype=np.float64)
    y = np.asarray(y, dtype=np.float64)
    u = np.full(X.shape[1], float(alpha))
    v = u.copy()
    for _ in range(int(steps)):
        g = X.T @ (X @ (u * u - v * v) - y)
        u, v = u - lr * 2 * u * g, v + lr * 2 * v * g
    beta = u * u - v * v
    return {"beta": beta, "loss": 0.5 * float(np.sum((X @ beta - y) ** 2))}


def hyperbolic_entropy_minimiser(X, y, alpha: float, tol: float = 1e-13):
    """argmin Σ α² q(βᵢ/α²) s.t. Xβ = y (the diagonal linear network's implicit bias): β(λ) = 2α² sinh(Xᵀλ)."""
    a2 = float(alpha) ** 2
    return _dual_newton(X, y, lambda g: 2 * a2 * np.sinh(g), lambda g: 2 * a2 * np.cosh(g), tol=tol)


def min_l1(X, y) -> np.ndarray:
    """argmin ‖β‖₁ s.t. Xβ = y (linear program)."""
    X = np.asarray(X, dtype=np.float64)
    d = X.shape[1]
    res = linprog(np.ones(2 * d), A_eq=np.hstack([X, -X]), b_eq=np.asarray(y, dtype=np.float64),
                  bounds=[(0, None)] * (2 * d), method="highs")
    if not res.success:
        raise RuntimeError(f"min-l1 LP failed: {res.message}")
    return res.x[:d] - res.x[d:]


def min_l2(X, y) -> np.ndarray:
    return np.linalg.pinv(np.asarray(X, dtype=np.float64)) @ np.asarray(y, dtype=np.float64)


def density(beta, rel: float = 1e-3) -> dict:
    """Sparsity measures of a vector: ℓ₁, participation ratio (‖β‖₁/‖β‖₂)²/d ∈ (0, 1], fraction of entries with
    |βᵢ| > rel · max|β|."""
    b = np.abs(np.asarray(beta, dtype=np.float64))
    return {"l1": float(b.sum()), "participation": float(b.sum() ** 2 / max(b.size * (b ** 2).sum(), 1e-300)),
            "active_fraction": float(np.mean(b > rel * b.max()))}


def regression_problem(n: int, d: int, k: int, seed: int = 0, scale: float = 2.0):
    """An over-parameterised regression (N ≤ d): X ~ N(0, 1/d) entries... rounded to float32 values, y = Xβ*
    with β* = 1 + ``scale`` on k coordinates (positive, as the diagonal DEQ's β stays positive)."""
    if n > d:
        raise ValueError(f"n={n} > d={d}: Theorem 3 needs an over-parameterised problem (N <= d)")
    rng = np.random.default_rng(seed)
    X = (rng.standard_normal((n, d)) / np.sqrt(d)).astype(np.float32).astype(np.float64)
    beta_true = np.ones(d)
    beta_true[rng.choice(d, size=k, replace=False)] += scale
    y = (X @ beta_true).astype(np.float32).astype(np.float64)
    return X, y, beta_true
