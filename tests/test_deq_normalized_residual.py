"""The paper authors' normalized-ResBlock DEQ map (``deq.block=normalized_residual``): phantom derivatives against
autograd through 40 unrolled iterations, in float64 (the implicit backward is checked to every order with the
other maps in tests/test_deq_implicit.py), the one-pass control, and its place in the NCSN."""

from __future__ import annotations

import functools

import pytest
import torch

from src.deq import DEQConfig
from src.deq.block import NormalizedResidualDEQBlock
from src.deq.diagnostics import recurrence_share
from src.deq.maps import instance_norm
from tests.derivative_checks import rel, sm_loss_and_grads

pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py


def make_block(**cfg) -> NormalizedResidualDEQBlock:
    torch.manual_seed(0)
    block = NormalizedResidualDEQBlock(2, 3, config=DEQConfig(**{"tol": 1e-13, "stop_mode": "abs", "max_iter": 400,
                                                                  "warm_start": False, **cfg})).double()
    with torch.no_grad():
        block.kernel1.mul_(3.0)
        block.kernel2.mul_(3.0)
        for p in (block.gamma1, block.beta1, block.gamma2, block.beta2):
            p.add_(0.3 * torch.randn_like(p))
    return block


@functools.lru_cache(maxsize=1)
def unrolled_reference():
    """The input, the head and the reference the phantom and implicit checks below compare with: score, Hessian trace
    and the SM loss's parameter gradient through 40 unrolled iterations of :func:`make_block`'s map (the same weights
    whatever its backward), computed once for the module — each test drew the same x and head after make_block."""
    block = make_block()
    x = torch.randn(3, 2, 4, 4, dtype=torch.float64)
    head = [torch.randn(32, 3, dtype=torch.float64, requires_grad=True), torch.randn(3, dtype=torch.float64)]
    params = [*block.parameters(), head[0]]
    return x, head, sm_loss_and_grads(lambda u: block.unroll(u, 40), x, head, params)


def test_instance_norm_matches_torch():
    torch.manual_seed(0)
    z, g, b = torch.randn(3, 4, 5, 5, dtype=torch.float64), torch.randn(4, dtype=torch.float64), torch.randn(4, dtype=torch.float64)
    ref = torch.nn.functional.instance_norm(z, weight=g, bias=b, eps=1e-5)
    assert torch.allclose(instance_norm(z, g, b), ref, atol=1e-12)


def test_phantom_with_many_steps_matches_the_unrolled_reference():
    """Alg. 1 with K = 30 phantom steps: error ~ ρ^30 < 1e-9 at ρ < 0.5 — the reference (40 unrolled steps:
    ρ⁴⁰ < 1e-12) to 1e-8 in score, Hessian trace (second order in x) and the SM loss's parameter gradient (third
    order). Measured (ρ = 0.46): ≤ 1.1e-16 off the reference, as K = 60 against 80 steps was, at half the cost."""
    block = make_block(backward="phantom", phantom_steps=30)
    x, head, (s_r, tr_r, g_r) = unrolled_reference()
    stats = recurrence_share(block, x)
    assert stats["contraction_rate"] < 0.5 and stats["share_mean"] > 0.01
    params = [*block.parameters(), head[0]]
    s_p, tr_p, g_p = sm_loss_and_grads(block, x, head, params)
    assert block.last_stats["converged"]
    assert rel(s_p, s_r) < 1e-8 and rel(tr_p, tr_r) < 1e-8 and rel(g_p, g_r) < 1e-8


def test_implicit_backward_matches_the_unrolled_reference_to_third_order():
    """The exact implicit backward (the record block's), whose adjoint solves step with the map's own J / Jᵀ
    products (:meth:`NormalizedResidualMap.linearize`): score, Hessian trace and the SM loss's parameter gradient
    (adjoint levels 1-3) against autograd through 40 unrolled iterations, float64."""
    block = make_block(backward="implicit")
    x, head, (s_r, tr_r, g_r) = unrolled_reference()
    params = [*block.parameters(), head[0]]
    s_i, tr_i, g_i = sm_loss_and_grads(block, x, head, params)
    assert rel(s_i, s_r) < 1e-8 and rel(tr_i, tr_r) < 1e-8 and rel(g_i, g_r) < 1e-8


def test_a_looser_backward_tol_stops_the_adjoint_solves_earlier_at_a_bias_it_bounds():
    """``deq.backward_tol``: the adjoint solves (levels 1-3 of the SM loss's parameter gradient) stop at their own
    relative rule while the forward solve keeps ``deq.tol``. Against the exact implicit backward (float64, every
    solve to 1e-13): fewer adjoint iterations (23 → 6), and score, Hessian trace and parameter gradient off by
    less than backward_tol (measured 1.7e-4, 3.3e-5, 2.1e-4) — and off at all, so the rule took effect."""
    x = torch.randn(3, 2, 4, 4, dtype=torch.float64)
    head = [torch.randn(32, 3, dtype=torch.float64, requires_grad=True), torch.randn(3, dtype=torch.float64)]
    out, iterations = {}, {}
    for b_tol in (None, 1e-3):
        block = make_block(backward="implicit", stop_mode="rel", backward_tol=b_tol)
        out[b_tol] = sm_loss_and_grads(block, x, head, [*block.parameters(), head[0]])
        iterations[b_tol] = block.last_backward_stats["iterations"]
        assert block.last_stats["residual"] < 1e-12  # the forward solve at deq.tol either way
    assert iterations[1e-3] < iterations[None]
    errors = [rel(a, b) for a, b in zip(out[1e-3], out[None])]
    assert all(1e-9 < e < 1e-3 for e in errors), errors


def test_a_negative_backward_tol_is_refused():
    with pytest.raises(ValueError, match="deq.backward_tol must be >= 0"):
        DEQConfig(backward="implicit", backward_tol=-1.0)


@pytest.mark.parametrize("recompute", [True, False])
def test_linearize_gives_autograds_jacobian_products(recompute):
    """J v and Jᵀ v written out by hand against torch.func.jvp and a VJP of the plain-op map, float64, at a
    random point with non-trivial norms (the map's products the implicit backward takes)."""
    from torch.func import jvp

    from src.deq.maps import NormalizedResidualMap

    block = make_block()
    x = torch.randn(2, 2, 4, 4, dtype=torch.float64)
    z = torch.randn(2, 2, 4, 4, dtype=torch.float64)
    params = [p.detach() for p in block.map_params(x)]
    phi, plain = NormalizedResidualMap(1, recompute=recompute), NormalizedResidualMap(1, recompute=False)
    j, jt = phi.linearize(z, *params)
    v = torch.randn_like(z)
    torch.testing.assert_close(j(v), jvp(lambda q: plain(q, *params), (z,), (v,))[1], rtol=1e-12, atol=1e-12)
    zz = z.clone().requires_grad_(True)
    (ref,) = torch.autograd.grad(plain(zz, *params), zz, v)
    torch.testing.assert_close(jt(v), ref, rtol=1e-12, atol=1e-12)
    assert (jt(v) - j(v)).norm() > 1e-3 * ref.norm()  # J is not symmetric: the two products differ


def test_phantom_with_two_steps_is_truncated():
    """The comparison above can fail: K = 2 misses the Neumann tail (ρ² ≫ 1e-8)."""
    block = make_block(backward="phantom", phantom_steps=2)
    x, head, (_, _, g_r) = unrolled_reference()
    params = [*block.parameters(), head[0]]
    _, _, g_p = sm_loss_and_grads(block, x, head, params)
    assert rel(g_p, g_r) > 1e-4


@pytest.mark.parametrize("backward", ["phantom", "implicit"])
def test_one_pass_is_one_explicit_pass(backward):
    block = make_block(backward=backward, one_pass=True)
    x = torch.randn(3, 2, 4, 4, dtype=torch.float64)
    head = [torch.randn(32, 3, dtype=torch.float64, requires_grad=True), torch.randn(3, dtype=torch.float64)]
    params = [*block.parameters(), head[0]]
    s_o, tr_o, g_o = sm_loss_and_grads(block, x, head, params)
    s_r, tr_r, g_r = sm_loss_and_grads(lambda u: block.unroll(u, 1), x, head, params)
    assert torch.allclose(s_o, s_r, atol=1e-13, rtol=0) and torch.allclose(tr_o, tr_r, atol=1e-12, rtol=0)
    assert torch.allclose(g_o, g_r, atol=1e-12, rtol=0)


def test_ncsn_builds_the_normalized_block_and_scores():
    from src.models.ncsn import NCSN, geometric_sigmas

    torch.manual_seed(0)
    net = NCSN(1, geometric_sigmas(1.0, 0.01, 3), arch="deq", ngf=4,
               deq=DEQConfig(block="normalized_residual"))
    assert isinstance(net.deq_block(), NormalizedResidualDEQBlock)
    x, labels = torch.rand(2, 1, 8, 8), torch.tensor([0, 2])
    s = net(x, labels)
    assert s.shape == x.shape and torch.isfinite(s).all()
    assert net.deq_block().last_stats["converged"]


@pytest.mark.parametrize("given", [{"norm": "spectral"}, {"norm": "frobenius", "norm_lambda": 2.0},
                                   {"norm_lambda": 1.5}])
def test_the_normalized_block_refuses_a_weight_norm_it_would_ignore(given):
    """The block divides by its own w, so deq.norm / deq.norm_lambda meant for the weight-normalised block must not
    pass silently (a decision arm once ran the normalised block under a 'spectral' label for that reason)."""
    with pytest.raises(ValueError, match="does not apply to deq.block=normalized_residual.*deq.block=null"):
        DEQConfig(block="normalized_residual", **given)
    cfg = DEQConfig(block="normalized_residual")
    assert (cfg.norm, cfg.norm_lambda) == (None, None)
    assert (DEQConfig().norm, DEQConfig().norm_lambda) == ("frobenius", 2.0)  # unset: the paper's §3.2 block
    assert (DEQConfig(norm="spectral", norm_lambda=1.5).norm, DEQConfig(norm_lambda=1.5).norm_lambda) == (
        "spectral", 1.5)


def test_ncsn_mnist_overrides_reach_the_block_they_name(tmp_path):
    from src.deq.config import deq_setting
    from tests.conftest import compose_train

    record = compose_train(["experiment=ncsn_mnist", "deq=true"], tmp_path / "a").deq
    assert deq_setting(record, "ncsn").block == "normalized_residual"
    spectral = deq_setting(compose_train(["experiment=ncsn_mnist", "deq=true", "deq.block=null", "deq.norm=spectral",
                                           "deq.norm_lambda=1.5"], tmp_path / "b").deq, "ncsn")
    assert (spectral.block, spectral.norm, spectral.norm_lambda) == (None, "spectral", 1.5)
    with pytest.raises(ValueError, match="deq.norm=spectral does not apply"):
        deq_setting(compose_train(["experiment=ncsn_mnist", "deq=true", "deq.norm=spectral"], tmp_path / "c").deq, "ncsn")


def test_checkpoints_saved_with_the_old_defaults_still_load():
    """Runs of the normalised block saved while deq.norm / deq.norm_lambda defaulted to frobenius / 2 store those
    unused defaults: read as unset. A stored non-default value was an ignored override and stays (loading fails)."""
    from omegaconf import OmegaConf

    from src.config.old_runs import clear_stale_norm_of_normalized_block

    old = OmegaConf.create({"deq": {"block": "normalized_residual", "norm": "frobenius", "norm_lambda": 2.0},
                            "model": {"deq": "${deq}"}})
    clear_stale_norm_of_normalized_block(old)
    assert (old.deq.norm, old.deq.norm_lambda, old.model.deq.norm) == (None, None, None)
    ignored = OmegaConf.create({"deq": {"block": "normalized_residual", "norm": "spectral", "norm_lambda": 1.5}})
    clear_stale_norm_of_normalized_block(ignored)
    assert (ignored.deq.norm, ignored.deq.norm_lambda) == ("spectral", 1.5)
    plain = OmegaConf.create({"deq": {"block": None, "norm": "frobenius", "norm_lambda": 2.0}})
    clear_stale_norm_of_normalized_block(plain)
    assert (plain.deq.norm, plain.deq.norm_lambda) == ("frobenius", 2.0)


def test_recomputing_norms_give_the_plain_maps_derivatives_to_third_order():
    """The map's ELU(IN(·)) by the recomputing norm (the default) against plain autograd ops, float64: value,
    the input derivative, an SM-type loss's parameter gradient (second order) and its input gradient (third)."""
    from src.deq.maps import NormalizedResidualMap

    block = make_block()
    x = torch.randn(2, 2, 4, 4, dtype=torch.float64)
    z = torch.randn(2, 2, 4, 4, dtype=torch.float64)
    params = block.map_params(x)
    head = torch.randn(32, dtype=torch.float64)

    def derivatives(recompute: bool):
        phi = NormalizedResidualMap(1, recompute=recompute)
        zz = z.clone().requires_grad_(True)
        out = phi(zz, *params)
        e = torch.tanh(out.flatten(1) @ head).sum()
        (gz,) = torch.autograd.grad(e, zz, create_graph=True)
        loss = gz.pow(2).sum()
        grads = torch.autograd.grad(loss, [block.kernel1, block.gamma1, block.kernel2, zz], create_graph=True)
        (third,) = torch.autograd.grad(grads[0].pow(2).sum(), zz)
        return [out, gz, *grads, third]

    for a, b in zip(derivatives(True), derivatives(False)):
        torch.testing.assert_close(a, b, rtol=1e-9, atol=1e-11)
