"""The recurrence share (src/deq/diagnostics.py) on maps where it is known in closed form, and the one-pass
control (``deq.one_pass``): exactly an explicit network, derivatives of every order included."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from src.deq import DenseDEQBlock, DEQConfig, ResidualDEQBlock
from src.deq.block import DEQBlock
from src.deq.diagnostics import NEAR_INERT_SHARE, near_inert, recurrence_share
from src.deq.normalization import frobenius_normalize

TIGHT = {"tol": 1e-14, "stop_mode": "abs", "max_iter": 2000, "warm_start": False}


def scaled_identity_block(a: float, dim: int = 5, **cfg) -> DenseDEQBlock:
    """φ(z) = a·z + g(x) (identity activation, W = a·I, no normalization): z* = g/(1 − a), φ(0) = g, so the
    share ‖z* − φ(0)‖/‖z*‖ = a for every sample and the contraction rate is a."""
    torch.manual_seed(0)
    block = DenseDEQBlock(3, dim, config=DEQConfig(norm="none", **{**TIGHT, **cfg}), activation="identity").double()
    with torch.no_grad():
        block.weights[0].copy_(a * torch.eye(dim, dtype=torch.float64))
    return block


@pytest.mark.parametrize("a", [0.05, 0.5, 0.9])
def test_share_of_a_linear_map_is_its_slope(a):
    block = scaled_identity_block(a)
    x = torch.randn(7, 3, dtype=torch.float64)
    stats = recurrence_share(block, x)
    assert stats["share_mean"] == pytest.approx(a, abs=1e-10)
    assert stats["share_max"] == pytest.approx(a, abs=1e-10)
    assert stats["contraction_rate"] == pytest.approx(a, rel=1e-8)
    # Picard from 0: ‖z_k − z_{k−1}‖ = a^(k−1)‖g‖, stop at the first k with a^(k−1)·max‖g‖ ≤ 1e-14
    g_max = block.injection(x).norm(dim=1).max().item()
    expected_iterations = 1 + math.ceil(math.log(1e-14 / g_max) / math.log(a))
    assert abs(stats["iterations"] - expected_iterations) <= 5  # rounding near 1e-14 at a = 0.9
    assert stats["hit_cap"] == 0.0 and "branch_mean" not in stats
    assert near_inert(stats) == (a < NEAR_INERT_SHARE)


class _AdditiveLinearMap:
    """φ(z; g, a) = a·z + g: an additive injection with h(z) = a·z, so ‖h(z*)‖/‖g‖ = a/(1 − a)."""

    additive_injection = True

    def __call__(self, z, inj, a):
        return a * z + inj


class _AdditiveBlock(DEQBlock):
    def __init__(self, a: float, config: DEQConfig):
        super().__init__(config)
        self.a = torch.nn.Parameter(torch.tensor(a, dtype=torch.float64))
        self.phi = _AdditiveLinearMap()

    def state_shape(self, x):
        return tuple(x.shape)

    def map_params(self, x):
        return (x, self.a)


def test_branch_ratio_of_an_additive_map():
    a = 0.6
    block = _AdditiveBlock(a, DEQConfig(norm="none", **TIGHT))
    stats = recurrence_share(block, torch.randn(4, 2, 3, 3, dtype=torch.float64))
    assert stats["branch_mean"] == pytest.approx(a / (1 - a), rel=1e-10)
    assert stats["branch_max"] == pytest.approx(a / (1 - a), rel=1e-10)
    assert stats["share_mean"] == pytest.approx(a, abs=1e-10)


def test_a_solve_that_hits_the_cap_is_reported():
    block = scaled_identity_block(0.9, max_iter=4)
    stats = recurrence_share(block, torch.randn(3, 3, dtype=torch.float64), rate=False)
    assert stats["hit_cap"] == 1.0 and stats["iterations"] == 4.0 and "contraction_rate" not in stats
    with pytest.warns(RuntimeWarning, match="did not converge"):
        block(torch.randn(3, 3, dtype=torch.float64))
    assert block.last_stats["hit_cap"] is True


def test_diagnostic_is_pure():
    torch.manual_seed(1)
    block = ResidualDEQBlock(2, 3, config=DEQConfig(norm="spectral")).double()
    x = torch.randn(2, 2, 5, 5, dtype=torch.float64)
    block(x)
    buffers = {k: v.clone() for k, v in block.named_buffers()}
    params = {k: v.clone() for k, v in block.named_parameters()}
    warm = block.warm_start_state()
    stats = recurrence_share(block, x)
    assert "branch_mean" in stats and stats["share_mean"] > 0
    assert all(torch.equal(v, dict(block.named_buffers())[k]) for k, v in buffers.items())
    assert all(torch.equal(v, dict(block.named_parameters())[k]) for k, v in params.items())
    assert block.warm_start_state().keys() == warm.keys()
    assert all(torch.equal(v, block.warm_start_state()[k]) for k, v in warm.items())


def test_near_inert_threshold_and_one_pass_exemption():
    assert near_inert({"share_mean": 0.05, "iterations": 5.0})
    assert not near_inert({"share_mean": 0.2, "iterations": 5.0})
    assert not near_inert({"share_mean": 0.0, "iterations": 1.0, "one_pass": 1.0})


# ------------------------------------------------------------------------------------------ one-pass control
def explicit_two_layer(block: DenseDEQBlock, x: torch.Tensor) -> torch.Tensor:
    """The one-pass control written out by hand: φ(0) = Softplus(W₂ Softplus(W₁·0 + g(x)) + b₂)."""
    lam = block.config.norm_lambda
    w1 = frobenius_normalize(block.weights[0], lam)
    w2 = frobenius_normalize(block.weights[1], lam)
    h = F.softplus(torch.zeros(x.shape[0], block.width, dtype=x.dtype) @ w1.T + block.injection(x))
    return F.softplus(h @ w2.T + block.biases[0])


def _score_and_loss(fn, x, head):
    x = x.detach().clone().requires_grad_(True)
    energy = (fn(x) @ head).sum()
    (s,) = torch.autograd.grad(energy, x, create_graph=True)
    # a loss with the divergence (second order in x), as SM's
    div = sum(torch.autograd.grad(s[:, i].sum(), x, create_graph=True)[0][:, i] for i in range(x.shape[1]))
    return s, (0.5 * s.pow(2).sum(1) + div).mean()


@pytest.mark.parametrize("backward", ["phantom", "implicit"])
def test_one_pass_is_the_explicit_network_to_every_order(backward):
    torch.manual_seed(0)
    block = DenseDEQBlock(3, 6, n_layers=2, config=DEQConfig(one_pass=True, backward=backward)).double()
    with torch.no_grad():
        block.biases[0].normal_()
    head = torch.randn(6, dtype=torch.float64)
    x = torch.randn(5, 3, dtype=torch.float64)
    s_block, loss_block = _score_and_loss(block, x, head)
    grads_block = torch.autograd.grad(loss_block, list(block.parameters()))
    s_ref, loss_ref = _score_and_loss(lambda u: explicit_two_layer(block, u), x, head)
    grads_ref = torch.autograd.grad(loss_ref, list(block.parameters()))
    assert torch.allclose(s_block, s_ref, atol=1e-13, rtol=0)
    assert loss_block.item() == pytest.approx(loss_ref.item(), abs=1e-12)
    for gb, gr in zip(grads_block, grads_ref):
        assert torch.allclose(gb, gr, atol=1e-12, rtol=0)
    assert any(g.abs().max() > 1e-3 for g in grads_block)  # the check can fail: gradients flow
    assert block.last_stats == {"iterations": 1, "residual": 0.0, "converged": True, "hit_cap": False}
    assert block.warm_start_state() == {}
    assert recurrence_share(block, x)["share_mean"] == 0.0


def test_one_pass_differs_from_the_deq():
    torch.manual_seed(0)
    cfg = {"norm_lambda": 1.1, "tol": 1e-12, "stop_mode": "abs", "max_iter": 500}
    deq = DenseDEQBlock(3, 6, n_layers=2, config=DEQConfig(**cfg)).double()
    one = DenseDEQBlock(3, 6, n_layers=2, config=DEQConfig(one_pass=True, **cfg)).double()
    one.load_state_dict(deq.state_dict())
    x = torch.randn(4, 3, dtype=torch.float64)
    z_star, z_one = deq(x), one(x)
    share = recurrence_share(deq, x)["share_mean"]
    rel = ((z_star - z_one).norm(dim=1) / z_star.norm(dim=1)).mean().item()
    assert rel == pytest.approx(share, rel=1e-6) and share > 1e-3


def test_module_logs_every_block_and_warns_once_per_near_inert_block(recwarn):
    """The LightningModule's recurrence metrics (src/lit/deq_monitor.py): a key per block at the inputs the
    blocks last saw in training, equal to :func:`recurrence_share` there; the near-inert warning comes once per
    block and run, however often validation asks."""
    from hydra.utils import instantiate

    from src.deq.lookup import blocks_of
    from tests.conftest import FAST, compose_train

    cfg = compose_train([*FAST, "model=dkef", "loss=sm", "deq=true", "deq.norm=frobenius"])  # the paper's block
    module = instantiate(cfg.model, input_dim=int(cfg.data.dim))
    blocks = blocks_of(module)
    assert len(blocks) > 1
    torch.manual_seed(0)
    module._deq_inputs = {name: (torch.randn(8, int(cfg.data.dim)),) for name, _ in blocks}
    first = module.deq_recurrence_metrics("val")
    second = module.deq_recurrence_metrics("test")
    for name, block in blocks:
        expected = recurrence_share(block, *module._deq_inputs[name], rate=False)["share_mean"]
        assert first[f"val/deq_recurrence_share/{name}"] == pytest.approx(expected, rel=1e-6)
        assert second[f"test/deq_recurrence_share/{name}"] == pytest.approx(expected, rel=1e-6)
        assert f"val/deq_iterations/{name}" in first and f"val/deq_hit_cap/{name}" in first
    inert = [n for n, _ in blocks if first[f"val/deq_recurrence_share/{n}"] < NEAR_INERT_SHARE]
    assert inert  # the paper's Frobenius block at initialisation is near-inert (the finding)
    messages = [str(w.message) for w in recwarn if "near-inert" in str(w.message)]
    assert len(messages) == len(inert)  # the second call warned about none of them again
