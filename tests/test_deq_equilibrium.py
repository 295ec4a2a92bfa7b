"""The public equilibrium function (src/deq/core.py), float64, against independent references: a long
unroll of the map (exact derivatives of every order in the limit), dense Jacobians (the phantom gradient's K-term
Neumann series, Prop. 2), and hand-run Picard iterates (the fixed-point correction states)."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from src.deq import DEQConfig, equilibrium
from src.deq.core import correction_weights, jacobian_penalty
from src.deq.maps import dense_map

D, W = 3, 5


def _problem(seed: int = 0):
    """x [4, D], U [W, D], W̃ [W, W] with ‖W̃‖₂ ≤ ½: f(z; x, U, W̃) = softplus(W̃ z + x Uᵀ) contracts at ≤ ½."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(4, D, generator=g, dtype=torch.float64, requires_grad=True)
    u = torch.randn(W, D, generator=g, dtype=torch.float64, requires_grad=True)
    w = torch.randn(W, W, generator=g, dtype=torch.float64)
    w = (w / (2 * torch.linalg.matrix_norm(w, 2))).requires_grad_(True)
    return x, u, w


def f(z, x, u, w):
    return dense_map(z, x @ u.T, w)


def _unroll(x, u, w, steps=200):
    z = torch.zeros(x.shape[0], W, dtype=torch.float64)
    for _ in range(steps):
        z = f(z, x, u, w)
    return z


def _config(**kw):
    return DEQConfig(**{"tol": 1e-14, "stop_mode": "abs", "max_iter": 400, **kw})


def _first_and_second(z_of, x, u, w):
    """(∂/∂(x, U, W̃) of Σ z·c, and ∂/∂(U, W̃) of ‖∂/∂x Σ z²‖²): first- and second-order derivatives."""
    c = torch.linspace(-1, 1, W, dtype=torch.float64)
    z = z_of(x, u, w)
    first = torch.autograd.grad((z * c).sum(), (x, u, w), retain_graph=True)
    (gx,) = torch.autograd.grad(z.pow(2).sum(), x, create_graph=True)
    second = torch.autograd.grad(gx.pow(2).sum(), (u, w))
    return z.detach(), first, second


def test_implicit_value_and_derivatives_of_first_and_second_order_match_a_long_unroll():
    x, u, w = _problem()
    cfg = _config(backward="implicit")
    z, first, second = _first_and_second(lambda *p: equilibrium(f, torch.zeros(4, W, dtype=torch.float64), p, cfg)[0],
                                         x, u, w)
    z_ref, first_ref, second_ref = _first_and_second(_unroll, x, u, w)
    torch.testing.assert_close(z, z_ref, rtol=0, atol=1e-12)
    for ours, ref in zip(first + second, first_ref + second_ref):
        torch.testing.assert_close(ours, ref, rtol=1e-9, atol=1e-11)


def test_implicit_info_records_the_forward_and_the_adjoint_solves():
    x, u, w = _problem()
    z, info = equilibrium(f, torch.zeros(4, W, dtype=torch.float64), (x, u, w), _config(backward="implicit"))
    assert info.converged and not info.hit_cap and 5 < info.iterations < 400 and info.residual < 1e-13
    assert info.backward == {}  # no backward yet
    z.sum().backward()
    assert info.backward["solves"] == 1 and info.backward["converged"] and info.backward["residual"] < 1e-13
    torch.testing.assert_close(info.z_star, z.detach(), rtol=0, atol=0)


def test_phantom_first_derivative_is_the_k_term_neumann_series_of_dense_jacobians():
    """Alg. 1 from z*: ∂z_K/∂x = Σ_{k<K} Jᵏ ∂f/∂x, J = ∂f/∂z at z* (Prop. 2), by dense Jacobians."""
    x, u, w = _problem()
    for k in (1, 3):
        z, _ = equilibrium(f, torch.zeros(4, W, dtype=torch.float64), (x, u, w), _config(phantom_steps=k))
        (ours,) = torch.autograd.grad(z.sum(), x)
        z_star = _unroll(x, u, w).detach()
        for i in range(4):
            jz = torch.autograd.functional.jacobian(lambda zz, i=i: f(zz, x[i:i + 1], u, w), z_star[i:i + 1]).reshape(W, W)
            jx = torch.autograd.functional.jacobian(lambda xx, i=i, zs=z_star: f(zs[i:i + 1], xx, u, w), x[i:i + 1]).reshape(W, D)
            series = sum(torch.linalg.matrix_power(jz, j) for j in range(k)) @ jx
            torch.testing.assert_close(ours[i], series.sum(0), rtol=1e-10, atol=1e-12)


def test_phantom_derivatives_of_both_orders_approach_the_implicit_ones_as_k_grows():
    x, u, w = _problem()
    zeros = torch.zeros(4, W, dtype=torch.float64)
    _, first, second = _first_and_second(lambda *p: equilibrium(f, zeros, p, _config(phantom_steps=60))[0], x, u, w)
    _, first_ref, second_ref = _first_and_second(_unroll, x, u, w)
    for ours, ref in zip(first + second, first_ref + second_ref):
        torch.testing.assert_close(ours, ref, rtol=1e-9, atol=1e-11)
    _, first2, _ = _first_and_second(lambda *p: equilibrium(f, zeros, p, _config(phantom_steps=2))[0], x, u, w)
    assert (first2[0] - first_ref[0]).abs().max() > 1e-4  # K = 2 truncates: the test above can fail


def test_warm_start_is_the_callers_state():
    x, u, w = _problem()
    cfg = _config()
    z, cold = equilibrium(f, torch.zeros(4, W, dtype=torch.float64), (x, u, w), cfg)
    _, warm = equilibrium(f, z.detach(), (x, u, w), cfg)
    assert warm.iterations <= 2 < cold.iterations


def _picard_iterates(x, u, w, n):
    z, out = torch.zeros(4, W, dtype=torch.float64), []
    with torch.no_grad():
        for _ in range(n):
            z = f(z, x, u, w)
            out.append(z)
    return out


@pytest.mark.parametrize("backward", ["phantom", "implicit"])
def test_correction_states_are_phantom_steps_from_the_iterates_along_the_trajectory(backward):
    """n = 3 states of a 12-evaluation solve: the iterates after 4, 8 and 12 evaluations, each followed by K = 2
    steps of f with autograd from its detached value (values and input gradients, by hand); the last is z."""
    x, u, w = _problem()
    cfg = DEQConfig(tol=0.0, stop_mode="abs", max_iter=12, correction_states=3, backward=backward, phantom_steps=2)
    z, info = equilibrium(f, torch.zeros(4, W, dtype=torch.float64), (x, u, w), cfg)  # warn=None: silent
    assert info.iterations == 12 and info.hit_cap
    iterates = _picard_iterates(x, u, w, 12)
    assert len(info.states) == 3 and info.states[-1] is z
    for state, k in zip(info.states[:-1], (4, 8)):
        ref = f(f(iterates[k - 1], x, u, w), x, u, w)
        torch.testing.assert_close(state, ref, rtol=0, atol=1e-15)
        (ours,) = torch.autograd.grad(state.sum(), x)
        (expected,) = torch.autograd.grad(ref.sum(), x)
        torch.testing.assert_close(ours, expected, rtol=0, atol=1e-14)
    if backward == "phantom":
        torch.testing.assert_close(z, f(f(iterates[11], x, u, w), x, u, w), rtol=0, atol=1e-15)
    else:
        torch.testing.assert_close(z, iterates[11], rtol=0, atol=0)
    assert correction_weights(3, 0.8) == pytest.approx([0.64, 0.8, 1.0])


def test_correction_states_after_an_early_stop_are_the_final_iterate_and_off_without_gradients():
    x, u, w = _problem()
    cfg = _config(correction_states=4, max_iter=400)
    z, info = equilibrium(f, torch.zeros(4, W, dtype=torch.float64), (x, u, w), cfg)
    assert info.iterations < 100 and len(info.states) == 4  # states at 100, 200, 300, 400: past the stop
    for state in info.states:
        torch.testing.assert_close(state, z, rtol=0, atol=1e-15)
    with torch.no_grad():
        assert equilibrium(f, torch.zeros(4, W, dtype=torch.float64), (x, u, w), cfg)[1].states is None
    assert equilibrium(f, torch.zeros(4, W, dtype=torch.float64), (x, u, w), cfg, correction=False)[1].states is None


def test_penalty_in_the_info_matches_the_dense_jacobian():
    x, u, w = _problem()
    torch.manual_seed(3)
    _, info = equilibrium(f, torch.zeros(4, W, dtype=torch.float64), (x, u, w), _config(), penalty=True)
    torch.manual_seed(3)
    eps = torch.randn(4, W, dtype=torch.float64)
    ref = 0.0
    for i in range(4):
        jz = torch.autograd.functional.jacobian(lambda zz, i=i: f(zz, x[i:i + 1], u, w), info.z_star[i:i + 1])
        ref += (eps[i] @ jz.reshape(W, W)).pow(2).sum().item()
    assert info.jacobian_penalty.item() == pytest.approx(ref / eps.numel(), rel=1e-12)
    assert jacobian_penalty(f, info.z_star, (x, u, w), eps=eps).item() == pytest.approx(ref / eps.numel(), rel=1e-12)
    (gw,) = torch.autograd.grad(info.jacobian_penalty, w)
    assert gw.abs().max() > 0


def test_adjoint_settings_are_the_backward_keys_else_the_forwards():
    x, u, w = _problem()
    cfg = _config(backward="implicit", backward_max_iter=3, backward_solver="anderson", backward_tol=0.0)
    assert cfg.solver_kwargs(adjoint=True)["method"] == "anderson" and cfg.solver_kwargs()["method"] == "picard"
    z, info = equilibrium(f, torch.zeros(4, W, dtype=torch.float64), (x, u, w), cfg)
    z.sum().backward()
    assert info.backward["iterations"] == 3 and info.backward["hit_cap"] and not info.backward["converged"]
    assert info.converged and info.iterations > 3  # the forward keeps deq.max_iter


@pytest.mark.parametrize(("keys", "message"), [
    ({"backward_solver": "newton"}, "deq.backward_solver='newton' is unknown"),
    ({"backward_stop_mode": "max"}, "deq.backward_stop_mode='max' is unknown"),
    ({"backward_max_iter": 0}, "deq.backward_max_iter must be >= 1"),
    ({"anderson_lam": -1e-3}, "deq.anderson_lam must be in"),
    ({"broyden_memory": 0}, "deq.broyden_memory must be >= 1"),
    ({"correction_states": 200}, "deq.correction_states must be in"),
    ({"correction_gamma": 0.0}, "deq.correction_gamma must be in"),
    ({"correction_states": 2, "one_pass": True}, "deq.correction_states does not apply"),
    ({"norm": "weight"}, "deq.norm='weight' is unknown"),
])
def test_refusals_are_one_line(keys, message):
    with pytest.raises(ValueError, match=message) as err:
        DEQConfig(**keys)
    assert "\n" not in str(err.value)


def test_a_users_own_module_as_the_map():
    """The docs/deq.md example: an nn.Module's parameters passed as params get implicit gradients."""

    class Cell(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(W, W).double()
            with torch.no_grad():
                self.lin.weight.mul_(0.3 / torch.linalg.matrix_norm(self.lin.weight, 2))

        def forward(self, z, x, weight, bias):
            return torch.tanh(nn.functional.linear(z, weight, bias) + x)

    cell = Cell()
    x = torch.randn(4, W, dtype=torch.float64)
    z, info = equilibrium(cell, torch.zeros_like(x), (x, cell.lin.weight, cell.lin.bias), _config(backward="implicit"))
    z.sum().backward()
    zz = torch.zeros_like(x)
    for _ in range(200):
        zz = cell(zz, x, cell.lin.weight, cell.lin.bias)
    (ref,) = torch.autograd.grad(zz.sum(), cell.lin.weight)
    torch.testing.assert_close(cell.lin.weight.grad, ref, rtol=1e-9, atol=1e-12)
    assert info.converged


def test_state_dict_keys_of_the_normalised_blocks_are_the_checkpoints():
    from src.deq import DenseDEQBlock, ResidualDEQBlock

    dense = DenseDEQBlock(3, 4, n_layers=2, config=DEQConfig(norm="spectral"))
    assert set(dense.state_dict()) == {"injection.weight", "injection.bias", "weights.0", "weights.1", "biases.0",
                                       "sn_u0", "sn_u1"}
    conv = ResidualDEQBlock(2, 2, config=DEQConfig(norm="spectral"))
    assert {k for k in conv.state_dict() if k.startswith("sn_u")} == {"sn_u_kernel1", "sn_u_kernel2"}
    assert not any(k.startswith("sn_u") for k in ResidualDEQBlock(2, 2, config=DEQConfig()).state_dict())


def test_a_registered_norm_is_a_valid_deq_norm_and_builds_blocks():
    from src.deq import DenseDEQBlock, register_norm
    from src.deq.normalization import _NORMS, Norm

    class Halve(Norm):
        def __call__(self, module, buffer, weight):
            return weight / (2 * torch.linalg.matrix_norm(weight, 2))

    register_norm("halve_test", dense=Halve)
    try:
        block = DenseDEQBlock(3, 4, config=DEQConfig(norm="halve_test")).double()
        (w,) = block.map_params(torch.randn(2, 3, dtype=torch.float64))[1:]
        assert torch.linalg.matrix_norm(w, 2).item() == pytest.approx(0.5, rel=1e-12)
        from src.deq import ConvDEQBlock

        with pytest.raises(ValueError, match="deq.norm='halve_test' is not available for convolutional"):
            ConvDEQBlock(2, 2, config=DEQConfig(norm="halve_test"))
    finally:
        _NORMS.pop("halve_test")


@pytest.mark.filterwarnings("ignore:DEQ block 'deq'")  # tol 0: the solve runs its 6 evaluations on purpose
def test_a_training_block_returns_its_correction_states_in_last_info_and_evaluation_none():
    from src.deq import DenseDEQBlock, correction_weights

    torch.manual_seed(0)
    block = DenseDEQBlock(3, 5, config=DEQConfig(correction_states=2, max_iter=6, tol=0.0, stop_mode="abs",
                                                 warm_start=False)).double()
    x = torch.randn(4, 3, dtype=torch.float64, requires_grad=True)
    block.train()
    z = block(x)
    states = block.last_info.states
    assert len(states) == 2 and states[-1] is z
    loss = sum(w * s.pow(2).sum() for w, s in zip(correction_weights(2, block.config.correction_gamma), states))
    (gx,) = torch.autograd.grad(loss, x)
    assert torch.isfinite(gx).all() and gx.abs().max() > 0
    params = block.map_params(x)
    z3 = torch.zeros(4, 5, dtype=torch.float64)
    with torch.no_grad():
        for _ in range(3):
            z3 = block.phi(z3, *params)
    torch.testing.assert_close(states[0], block.phi(block.phi(z3, *params), *params), rtol=0, atol=1e-14)
    block.eval()
    block(x)
    assert block.last_info.states is None


def test_the_normalized_map_with_autograd_products_gives_the_same_implicit_gradient():
    from src.deq import NormalizedResidualDEQBlock
    from src.deq.maps import NormalizedResidualMap

    torch.manual_seed(0)
    block = NormalizedResidualDEQBlock(2, config=DEQConfig(block="normalized_residual", backward="implicit",
                                                           tol=1e-9, max_iter=400, warm_start=False)).double()
    x = torch.randn(2, 2, 4, 4, dtype=torch.float64)
    (hand,) = torch.autograd.grad(block(x).pow(2).sum(), block.kernel1)
    block.phi = NormalizedResidualMap(block.phi.padding, hand_products=False)
    assert block.phi.linearize is None
    (auto,) = torch.autograd.grad(block(x).pow(2).sum(), block.kernel1)
    torch.testing.assert_close(hand, auto, rtol=1e-9, atol=1e-12)
