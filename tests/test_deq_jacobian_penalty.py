"""The Jacobian regulariser of a DEQ block (Bai, Koltun & Kolter 2021; ``deq.jacobian_penalty``): its value and
parameter gradient against the closed form of a dense Softplus map in float64, its row subset, its expectation,
and how it enters a training loss."""

from __future__ import annotations

import pytest
import torch

from src.deq.block import DenseDEQBlock, NormalizedResidualDEQBlock
from src.deq.config import DEQConfig
from src.deq.normalization import frobenius_normalize


def _dense(rows: int = 0, gamma: float = 0.5, backward: str = "phantom") -> DenseDEQBlock:
    torch.manual_seed(0)
    config = DEQConfig(tol=1e-12, max_iter=400, backward=backward, jacobian_penalty=gamma,
                       jacobian_penalty_rows=rows, norm_lambda=1.5)
    return DenseDEQBlock(3, 6, config=config).double()


def _closed_form(block: DenseDEQBlock, x: torch.Tensor, z_star: torch.Tensor, eps: torch.Tensor) -> torch.Tensor:
    """f(z) = softplus(W̃z + g(x)) ⇒ εᵀJ = (ε ⊙ sigmoid(W̃z + g))ᵀ W̃: ‖εᵀJ‖² / n, by hand."""
    w = frobenius_normalize(block.weights[0], block.config.norm_lambda)
    u = z_star @ w.T + block.injection(x)
    return ((eps * torch.sigmoid(u)) @ w).pow(2).sum() / eps.numel()


def test_value_and_parameter_gradient_match_the_closed_form_in_float64():
    block = _dense()
    x = torch.randn(5, 3, dtype=torch.float64)
    z_star = block(x).detach()
    eps = torch.randn(5, 6, dtype=torch.float64)
    ours = block.jacobian_penalty(x, z_star, eps=eps)
    ref = _closed_form(block, x, z_star, eps)
    assert ours.item() == pytest.approx(ref.item(), rel=1e-12)
    params = [block.weights[0], block.injection.weight, block.injection.bias]
    g_ours = torch.autograd.grad(ours, params)
    g_ref = torch.autograd.grad(ref, params)
    for a, b in zip(g_ours, g_ref):
        torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-12)


def test_gradient_reaches_the_input_through_the_injection():
    block = _dense()
    x = torch.randn(4, 3, dtype=torch.float64, requires_grad=True)
    z_star = block(x).detach()
    eps = torch.randn(4, 6, dtype=torch.float64)
    (g_ours,) = torch.autograd.grad(block.jacobian_penalty(x, z_star, eps=eps), x)
    (g_ref,) = torch.autograd.grad(_closed_form(block, x, z_star, eps), x)
    torch.testing.assert_close(g_ours, g_ref, rtol=1e-10, atol=1e-12)


def test_rows_limit_the_estimate_to_the_first_samples():
    block = _dense(rows=2)
    x = torch.randn(5, 3, dtype=torch.float64)
    z_star = block(x).detach()
    eps = torch.randn(2, 6, dtype=torch.float64)
    ours = block.jacobian_penalty(x, z_star, eps=eps)
    assert ours.item() == pytest.approx(_closed_form(block, x[:2], z_star[:2], eps).item(), rel=1e-12)


def test_expectation_is_the_frobenius_norm_per_entry():
    """E‖εᵀJ‖²/n = ‖J‖_F² / d per sample (Hutchinson): the mean over 4000 probes within 3 % of the exact value."""
    block = _dense()
    x = torch.randn(3, 3, dtype=torch.float64)
    z_star = block(x).detach()
    exact = 0.0
    for i in range(3):
        jac = torch.autograd.functional.jacobian(lambda z, i=i: block.phi(z, *block.map_params(x[i:i + 1])),
                                                 z_star[i:i + 1])
        exact += jac.reshape(6, 6).pow(2).sum().item()
    exact /= 3 * 6
    torch.manual_seed(1)
    draws = torch.stack([block.jacobian_penalty(x, z_star).detach() for _ in range(4000)])
    assert draws.mean().item() == pytest.approx(exact, rel=0.03)


@pytest.mark.parametrize("backward", ["phantom", "implicit"])
def test_training_forward_records_gamma_times_the_penalty_at_the_fixed_point(backward):
    block = _dense(gamma=0.5, backward=backward)
    x = torch.randn(4, 3, dtype=torch.float64)
    block.train()
    z = block(x)
    torch.manual_seed(7)
    eps = torch.randn(4, 6, dtype=torch.float64)
    torch.manual_seed(7)
    block.reset_warm_start()
    z = block(x)
    recorded = block.last_info.jacobian_penalty
    expected = 0.5 * _closed_form(block, x, z.detach(), eps)
    assert recorded.item() == pytest.approx(expected.item(), rel=1e-8)
    block.eval()
    block(x)
    assert block.last_info.jacobian_penalty is None  # evaluation records none


def test_penalties_of_several_forwards_are_averaged_per_block():
    """Two training forwards inside ``forward_infos`` (DKEF calls its features on the data and the inducing
    points): the monitor adds γ × the mean of their penalties, as recorded in their info records."""
    from src.deq.lookup import forward_infos
    from src.lit.deq_monitor import DEQMonitorMixin

    block = _dense(gamma=0.5)
    block.train()
    with forward_infos(block) as infos:
        block(torch.randn(4, 3, dtype=torch.float64))
        block(torch.randn(5, 3, dtype=torch.float64))
    assert [name for name, _ in infos] == ["", ""]
    terms = [info.jacobian_penalty for _, info in infos]
    monitor = DEQMonitorMixin()
    logged = {}
    monitor.log = lambda name, value, **kw: logged.__setitem__(name, value)
    total = monitor.with_deq_penalty(torch.tensor(1.0, dtype=torch.float64), 4, infos)
    assert total.item() == pytest.approx(1.0 + 0.5 * (terms[0] + terms[1]).item(), rel=1e-12)
    assert logged["train/deq_jacobian_penalty"].item() == pytest.approx(total.item() - 1.0, rel=1e-12)
    block(torch.randn(4, 3, dtype=torch.float64))  # outside: the hooks are gone
    assert len(infos) == 2


def test_no_penalty_without_gradients_or_when_off():
    block = _dense(gamma=0.0)
    block.train()
    block(torch.randn(4, 3, dtype=torch.float64))
    assert block.last_info.jacobian_penalty is None
    block = _dense(gamma=1.0)
    with torch.no_grad():
        block(torch.randn(4, 3, dtype=torch.float64))
    assert block.last_info.jacobian_penalty is None


def test_refused_values():
    with pytest.raises(ValueError, match="deq.jacobian_penalty must be >= 0"):
        DEQConfig(jacobian_penalty=-1)
    with pytest.raises(ValueError, match="deq.jacobian_penalty_rows must be >= 0"):
        DEQConfig(jacobian_penalty_rows=-2)
    with pytest.raises(ValueError, match="deq.one_pass=true"):
        DEQConfig(jacobian_penalty=1.0, one_pass=True)


def test_normalized_residual_block_penalty_matches_autograd_jacobian():
    """The NCSN block of record: ‖εᵀJ‖²/n against the explicit Jacobian of its map (float64, 2 samples)."""
    torch.manual_seed(0)
    block = NormalizedResidualDEQBlock(2, config=DEQConfig(block="normalized_residual", tol=1e-8,
                                                           jacobian_penalty=1.0, jacobian_penalty_rows=0)).double()
    x = torch.randn(2, 2, 4, 4, dtype=torch.float64)
    z_star = block(x).detach()
    eps = torch.randn(2, 2, 4, 4, dtype=torch.float64)
    ours = block.jacobian_penalty(x, z_star, eps=eps).item()
    params = block.map_params(x)
    jac = torch.autograd.functional.jacobian(lambda z: block.phi(z, *params), z_star).reshape(64, 64)
    ref = (eps.reshape(1, 64) @ jac).pow(2).sum().item() / 64
    assert ours == pytest.approx(ref, rel=1e-10)


def test_dkef_training_loss_carries_the_penalty_and_takes_the_autograd_route():
    """A DKEF with a penalised DEQ: the jet route (which bypasses the block's forward) is not taken, and the
    training step returns the objective plus the logged γ × penalty, whose gradient reaches the DEQ weights."""
    from src.deq.lookup import blocks_of
    from src.lit.dkef import DKEFLitModule

    torch.manual_seed(0)
    module = DKEFLitModule(3, loss={"name": "sm"}, deq={"enabled": True, "jacobian_penalty": 2.0,
                                                        "jacobian_penalty_rows": 0}, depth=None,
                           net={"_target_": "src.models.dkef.DKEF", "n_inducing": 8, "deq_width": 6})
    assert not module.net.jets_supported()
    module.train()
    logged = {}
    module.log = lambda name, value, **kw: logged.__setitem__(name, value)
    total = module.training_step(torch.randn(16, 3), 0)
    penalty = logged["train/deq_jacobian_penalty"]
    assert penalty.item() > 0
    assert total.item() == pytest.approx((logged["train/loss"] + penalty).item(), rel=1e-6)
    weight = blocks_of(module)[0][1].weights[0]
    (with_penalty,) = torch.autograd.grad(total, weight, retain_graph=True)
    (objective_only,) = torch.autograd.grad(logged["train/loss"], weight)
    assert (with_penalty - objective_only).abs().max().item() > 1e-6
    assert all(b.last_info.jacobian_penalty is not None for _, b in blocks_of(module))  # recorded, not stashed
