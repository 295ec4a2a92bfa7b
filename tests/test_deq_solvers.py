"""Fixed-point solvers (picard, anderson, broyden), config validation and the weight normalization (§3.2)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from src.deq.block import DenseDEQBlock
from src.deq.config import DEQConfig
from src.deq.normalization import conv_lipschitz_factor, frobenius_normalize
from src.deq.solvers import anderson, broyden, picard, solve

METHODS = ("picard", "anderson", "broyden")


pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py


def random_map(norm_lambda=2.0, width=32, batch=8, aligned=False, seed=0):
    """z ↦ f(z; x) of a random dense block. ``aligned``: W ≈ 11ᵀ and a large injection bias, so
    ‖W̃‖_2 ≈ ‖W̃‖_F/λ and Softplus' slope ≈ 1: the contraction rate is close to 1/λ (slow)."""
    torch.manual_seed(seed)
    block = DenseDEQBlock(4, width, config=DEQConfig(norm_lambda=norm_lambda)).double()
    if aligned:
        with torch.no_grad():
            block.weights[0].copy_(torch.ones(width, width) + 0.1 * torch.randn(width, width))
            block.injection.bias.fill_(3.0)
    x = torch.randn(batch, 4, dtype=torch.float64)
    return block.fixed_point_map(x), torch.zeros(batch, width, dtype=torch.float64)


@pytest.mark.parametrize("method", METHODS)
@pytest.mark.parametrize("stop_mode", ["abs", "rel"])
def test_solvers_reach_the_tolerance(method, stop_mode):
    f, z0 = random_map()
    tol = 1e-10
    res = solve(f, z0, method=method, tol=tol, max_iter=200, stop_mode=stop_mode)
    assert res.converged and res.iterations < 200
    assert res.residual.shape == (z0.shape[0],)
    true = (f(res.z) - res.z).flatten(1).norm(dim=1)  # recomputed at the returned point
    bound = tol * f(res.z).flatten(1).norm(dim=1) if stop_mode == "rel" else tol
    assert (true <= bound).all()
    assert not res.z.requires_grad


@pytest.mark.parametrize("method", METHODS)
def test_solvers_handle_image_shaped_states_and_float32(method):
    torch.manual_seed(0)
    w = torch.randn(3, 3, 3, 3)
    w = w / (2 * conv_lipschitz_factor(w) * w.norm())
    c = torch.randn(2, 3, 5, 5)

    def f(z):
        return F.softplus(F.conv2d(z, w, padding=1) + c)

    res = solve(f, torch.zeros(2, 3, 5, 5), method=method, tol=1e-5, max_iter=100, stop_mode="abs")
    assert res.converged and res.z.shape == (2, 3, 5, 5) and res.z.dtype == torch.float32
    assert (f(res.z) - res.z).flatten(1).norm(dim=1).max() <= 1e-5


def test_acceleration_beats_picard_when_the_contraction_is_slow():
    f, z0 = random_map(norm_lambda=1.05, aligned=True)
    its = {m: solve(f, z0, method=m, tol=1e-8, max_iter=2000, stop_mode="abs").iterations for m in METHODS}
    assert its["picard"] > 200  # rate ≈ 0.95
    assert its["anderson"] < its["picard"] / 5
    assert its["broyden"] < its["picard"] / 5


def test_solvers_are_importable_on_their_own_and_report_non_convergence():
    f, z0 = random_map(norm_lambda=1.05, aligned=True)
    for fn in (picard, anderson, broyden):
        res = fn(f, z0, tol=1e-12, max_iter=5)
        assert not res.converged and res.iterations == 5 and (res.residual > 1e-12).any()


def test_unknown_solver_is_rejected():
    f, z0 = random_map()
    with pytest.raises(ValueError, match="picard"):
        solve(f, z0, method="newton", tol=1e-5, max_iter=10)


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"norm_lambda": 1.0}, r"deq.norm_lambda=1.0 is invalid: it must be > 1"),
        ({"norm_lambda": 0.5}, r"must be > 1"),
        ({"solver": "newton"}, r"picard, anderson, broyden"),
        ({"backward": "exact"}, r"phantom, implicit"),
        ({"stop_mode": "max"}, r"abs, rel"),
        ({"max_iter": 0}, r"deq.max_iter must be >= 1"),
        ({"phantom_steps": 0}, r"deq.phantom_steps must be >= 1"),
        ({"tol": -1e-5}, r"deq.tol must be >= 0"),
        ({"anderson_m": 0}, r"deq.anderson_m must be >= 1"),
    ],
)
def test_config_validation_is_actionable(kwargs, message):
    with pytest.raises(ValueError, match=message):
        DEQConfig(**kwargs)


def test_block_rejects_zero_layers():
    with pytest.raises(ValueError, match="n_layers"):
        DenseDEQBlock(3, 4, n_layers=0)


def test_frobenius_normalization_bounds_the_spectral_norm():
    torch.manual_seed(0)
    w = torch.randn(20, 20, dtype=torch.float64)
    wn = frobenius_normalize(w, 2.0)
    assert abs(wn.norm().item() - 0.5) < 1e-6
    assert torch.linalg.matrix_norm(wn, 2) < 0.5
    with pytest.raises(ValueError, match="norm_lambda must be > 1"):
        frobenius_normalize(w, 1.0)


def conv_operator_norm(kernel, size=32, iters=200):
    """Power iteration on convᵀconv (zero padding, stride 1) for the operator norm of the convolution."""
    v = torch.ones(1, kernel.shape[1], size, size, dtype=kernel.dtype)
    for _ in range(iters):
        u = F.conv_transpose2d(F.conv2d(v, kernel, padding=1), kernel, padding=1)
        v = u / u.norm()
    return F.conv2d(v, kernel, padding=1).norm().item()


def test_plain_frobenius_normalization_of_a_conv_kernel_is_not_a_contraction():
    """The paper's W/(λ‖W‖_F) bounds a 3×3 convolution only by 3/λ; the sqrt(k·k) factor restores 1/λ."""
    kernel = torch.ones(1, 1, 3, 3, dtype=torch.float64)
    paper = conv_operator_norm(frobenius_normalize(kernel, 2.0))
    safe = conv_operator_norm(frobenius_normalize(kernel, 2.0, scale=conv_lipschitz_factor(kernel)))
    assert paper > 1.45  # → 1.5 as the image grows
    assert safe < 0.5
