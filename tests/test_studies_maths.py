"""The exact checks of the DEQ-vs-FFN studies (Separation and Bias of Deep Equilibrium Models, Theorems 1, 3):
pure functions, no training."""

from __future__ import annotations

from fractions import Fraction

import numpy as np
import pytest
from scipy.optimize import minimize

from src.separation import implicit_bias as ib
from src.separation import regions as rg


# ---------------------------------------------------------------------------------- region counter
def _pl(points, values):
    """A scalar PL function by its values at knots, exact."""
    return rg.PiecewiseLinear(np.array([Fraction(p) for p in points], dtype=object),
                              np.array([[Fraction(v)] for v in values], dtype=object))


def test_region_counter_exact_on_hand_built_functions():
    # a hat with a collinear knot (not a breakpoint) and a repeated knot value: 3 regions
    f = _pl([0, Fraction(1, 4), Fraction(1, 2), Fraction(3, 4), 1], [0, 1, 2, 2, 2])
    assert rg.count_regions(f) == 2
    assert rg.breakpoints(f) == [Fraction(1, 2)]
    # relu(x - 1/3) + relu(x - 2/3) - relu(x - 2/3): the second kink cancels exactly
    W1, c1 = [[1], [1], [1]], [Fraction(-1, 3), Fraction(-2, 3), Fraction(-2, 3)]
    g = rg.relu_mlp([(W1, c1), ([[1, 1, -1]], [0])], exact=True)
    assert rg.count_regions(g) == 2 and rg.breakpoints(g) == [Fraction(1, 3)]
    # |x - 0.3| + relu(x - 0.7) on [0, 1]: breakpoints 0.3 and 0.7
    h = rg.relu_mlp([([[1], [-1], [1]], [Fraction(-3, 10), Fraction(3, 10), Fraction(-7, 10)]),
                     ([[1, 1, 1]], [0])], exact=True)
    assert rg.breakpoints(h) == [Fraction(3, 10), Fraction(7, 10)]
    # identity: one region; a constant: one region
    assert rg.count_regions(rg.PiecewiseLinear.identity()) == 1
    assert rg.count_regions(_pl([0, 1], [5, 5])) == 1


@pytest.mark.parametrize("k", [1, 2, 3, 5])
def test_region_counter_sawtooth(k):
    """k compositions of the tent map 2·min(x, 1 − x) = 2relu(x) − 4relu(x − 1/2): 2^k regions, float and exact."""
    # fold the read-out of each tent into the next layer's input: explicit network with k hidden layers
    net = [([[1], [1]], [0, Fraction(-1, 2)])]
    for _ in range(k - 1):
        net.append(([[2, -4], [2, -4]], [0, Fraction(-1, 2)]))
    net.append(([[2, -4]], [0]))
    for exact in (True, False):
        f = rg.relu_mlp(net if exact else [(np.array(W, float), np.array(c, float)) for W, c in net], exact=exact)
        assert rg.count_regions(f) == 2 ** k
    x = np.linspace(0, 1, 257)
    ref = x.copy()
    for _ in range(k):
        ref = 2 * np.minimum(ref, 1 - ref)
    np.testing.assert_allclose(rg.relu_mlp(net, exact=True)(x.tolist()).astype(float)[:, 0], ref, atol=1e-12)


@pytest.mark.parametrize("m", range(1, 9))
def test_theorem1_construction_has_2_to_the_m_regions(m):
    W, u, c = rg.theorem1_weights(m, exact=True)
    z = rg.relu_deq_unrolled(W, u, c, m, exact=True)  # W nilpotent: m Picard steps from 0 are the fixed point
    bps = rg.breakpoints(z, np.ones(m))
    assert len(bps) + 1 == 2 ** m
    assert bps == [Fraction(k, 2 ** m) for k in range(1, 2 ** m)]  # the dyadic rationals
    assert rg.count_regions(z) == 2 ** m  # the latent z* as a vector map too
    # one more Picard step changes nothing: it is the fixed point, and it matches the closed form
    x = np.linspace(0, 1, 2 ** (m + 2) + 1)
    np.testing.assert_array_equal(z(x.tolist()).astype(float), rg.theorem1_fixed_point(x, m))


@pytest.mark.parametrize("m", [2, 5, 12, 16])
def test_theorem1_convergence(m):
    odd = 2 * np.random.default_rng(m).integers(0, 2 ** m, 4096) + 1
    x = np.concatenate([[0.0, 1.0], odd / 2 ** (m + 1)])  # dyadic: float64 arithmetic is exact here
    its0, z_star = rg.picard_iterations_to_fixed_point(x, m, max_iter=m + 1)
    assert its0.max() <= m and its0.min() >= 0  # from z⁰ = 0: at most m iterations
    assert its0.max() == m
    its1, _ = rg.picard_iterations_to_fixed_point(x, m, z0=z_star)
    np.testing.assert_array_equal(rg.theorem1_map(z_star, x, m), z_star)  # the rebuttal's z⁰: one step, unchanged
    assert its1.max() == 0


def test_theorem1_through_the_shared_deq_block():
    import torch

    from src.deq.block import DenseDEQBlock
    from src.deq.config import DEQConfig

    m = 6
    W, u, c = rg.theorem1_weights(m)
    inj = torch.nn.Linear(1, m).double()
    block = DenseDEQBlock(1, m, injection=inj, activation="relu",
                          config=DEQConfig(norm="none", tol=0.0, max_iter=4 * m, warm_start=False)).double()
    with torch.no_grad():
        inj.weight.copy_(torch.tensor(u)[:, None])
        inj.bias.copy_(torch.tensor(c))
        block.weights[0].copy_(torch.tensor(W))
    x = np.linspace(0, 1, 2 ** (m + 2) + 1)
    z = block(torch.tensor(x)[:, None]).detach().numpy()
    np.testing.assert_array_equal(z, rg.theorem1_fixed_point(x, m))
    assert block.last_stats["converged"] and block.last_stats["iterations"] == m + 1  # m steps + 1 to see 0 residual


def test_dense_block_activation_and_norm_none_options():
    import pickle

    import torch

    from src.deq.block import DenseDEQBlock
    from src.deq.config import DEQConfig
    from src.deq.maps import dense_map

    torch.manual_seed(0)
    default = DenseDEQBlock(3, 5)
    assert default.phi is dense_map and default.activation == "softplus"  # defaults unchanged
    x = torch.randn(4, 3)
    for act in ("relu", "identity"):
        blk = DenseDEQBlock(3, 5, activation=act)
        blk2 = pickle.loads(pickle.dumps(blk))
        torch.testing.assert_close(blk(x), blk2(x))
        z = blk(x).detach()
        params = [p.detach() for p in blk.map_params(x)]
        pre = z @ params[1].T + params[0]
        torch.testing.assert_close(z, pre.clamp_min(0) if act == "relu" else pre, atol=1e-4, rtol=0)
    raw = DenseDEQBlock(3, 5, config=DEQConfig(norm="none"))
    assert raw.map_params(x)[1] is raw.weights[0]  # the weight as it is
    with pytest.raises(ValueError, match="activation"):
        DenseDEQBlock(3, 5, activation="tanh")


# --------------------------------------------------------------------------------------- Theorem 3
@pytest.fixture(scope="module")
def problem():
    return ib.regression_problem(n=4, d=10, k=2, seed=3)


def test_theorem3_closed_form_matches_fine_step_gd(problem):
    X, y, _ = problem
    b0 = np.ones(X.shape[1])
    errs = []
    for lr in (4e-3, 1e-3):
        out = ib.gd_diag_deq(X, y, b0, lr=lr, steps=int(20 / lr), record_every=int(0.5 / lr))
        err = max(np.abs(b ** -3 - (3 * X.T @ v + b0 ** -3)).max() for _, b, v in out["trajectory"])
        errs.append(err)
    assert errs[1] < 1e-2 and errs[1] < errs[0] / 3  # first order in the step size
    # the continuous flow (adaptive Runge-Kutta) follows the closed form to integration accuracy
    beta, v = ib.gradient_flow_diag_deq(X, y, b0, t_end=5.0)
    np.testing.assert_allclose(ib.closed_form_beta(X, v, b0), beta, rtol=1e-8)


def test_q_minimiser_kkt_and_flow_limit(problem):
    X, y, _ = problem
    b0 = np.linspace(0.8, 1.5, X.shape[1])
    beta_q, _lam, feas = ib.q_minimiser(X, y, b0)
    kkt = ib.q_kkt_residual(beta_q, X, y, b0)
    assert feas < 1e-10 and kkt["primal"] < 1e-10 and kkt["stationarity"] < 1e-10 and kkt["min_beta"] > 0
    # Q is convex on β > 0: KKT ⇒ global; an independent SLSQP solve agrees
    res = minimize(lambda b: ib.q_objective(b, b0), b0, jac=lambda b: ib.q_gradient(b, b0), method="SLSQP",
                   constraints=[{"type": "eq", "fun": lambda b: X @ b - y, "jac": lambda b: X}],
                   bounds=[(1e-3, None)] * len(b0), options={"ftol": 1e-14, "maxiter": 500})
    np.testing.assert_allclose(res.x, beta_q, atol=1e-5)
    # the gradient flow's limit is this minimiser (≤ 1e-6), and it is *not* a KKT point of the −sign form
    beta_gf, _ = ib.gradient_flow_diag_deq(X, y, b0, t_end=400.0)
    assert np.abs(beta_gf - beta_q).max() < 1e-6
    assert ib.q_kkt_residual(beta_gf, X, y, b0, sign=-1.0)["stationarity"] > 1e-2


def test_diag_net_bias(problem):
    X, y, _ = problem
    beta_h, _, feas = ib.hyperbolic_entropy_minimiser(X, y, alpha=0.5)
    assert feas < 1e-10
    out = ib.gd_diag_net(X, y, alpha=0.5, lr=2e-3, steps=20000)
    assert out["loss"] < 1e-12
    assert np.abs(out["beta"] - beta_h).max() < 5e-3
    np.testing.assert_allclose(X @ ib.min_l1(X, y), y, atol=1e-9)
