"""Fixed-point correction in the NCSN's training step (Bai et al. 2022, §3.3): the loss trained is
Σ_i γ^(n−i) ℓ(score of state i), each state read out through the layers after the DEQ block, with the same levels,
noise and projections; checked in float64 against states built by hand from a Picard run, and bit for bit unchanged
when off."""

from __future__ import annotations

import warnings

import pytest
import torch

from src.deq.config import deq_setting
from src.deq.core import correction_weights
from src.lit.ncsn import NCSNLitModule
from src.objectives.base import weighted_states_loss
from src.objectives.conditional import noise_conditional

pytestmark = pytest.mark.usefixtures("one_thread")

SHAPE, LEVELS, MAX_ITER, K = (1, 8, 8), 3, 6, 2


def tiny(arch: str, loss: str, states: int, gamma: float = 0.7, **deq) -> NCSNLitModule:
    cfg = {"enabled": True, "solver": "picard", "tol": 0.0, "stop_mode": "abs", "max_iter": MAX_ITER,
           "backward": "phantom", "phantom_steps": K, "warm_start": False, "correction_states": states,
           "correction_gamma": gamma, "norm": "frobenius", "norm_lambda": 1.05,
           "block": None, **deq}
    torch.manual_seed(0)
    net = {"_target_": "src.models.ncsn.NCSN", "arch": arch, "ngf": 4, "scales": 2}
    lit = NCSNLitModule(SHAPE, {"name": loss}, net=net, deq=cfg,
                        noise={"sigma_begin": 1.0, "sigma_end": 0.1, "num_classes": LEVELS}).double()
    lit.train()
    return lit


def batch():
    return torch.rand(3, *SHAPE, generator=torch.Generator().manual_seed(1), dtype=torch.float64)


def step(lit, x, seed=5):
    torch.manual_seed(seed)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # self.log outside a Trainer
        return lit.training_step(x, 0)


def hand_scores(lit, x, labels, n):
    """The n correction states' scores built by hand: Picard iterates of the block's map from zeros (no_grad) at
    evaluations ⌈max_iter·i/n⌉, each followed by K steps of the map with autograd, read out by the layers after the
    block written out here."""
    net = lit.net
    block = net.deq_block()
    h = net.begin(2 * x - 1)
    y = (net.trunk.res_in if net.arch == "mdeq" else net.res_in)(h, labels)
    params = block.map_params(y, labels)
    z = torch.zeros(block.state_shape(y), dtype=x.dtype)
    iterates = []
    with torch.no_grad():
        for t in range(1, MAX_ITER + 1):
            z = block.phi(z, *params)
            iterates.append(z)
    keep = [-(-MAX_ITER * i // n) for i in range(1, n + 1)]
    scores = []
    for k in keep:
        s = iterates[k - 1].detach()
        for _ in range(K):
            s = block.phi(s, *params)
        if net.arch == "mdeq":
            r = net.trunk.refine(block.branches(s, y), labels, y.shape[2:])
        else:
            r = net.res_out(s.reshape(y.shape), labels)
            l1 = r
            for b in net.down:
                r = b(r, labels)
            r = net.refine[1]([l1, net.refine[0]([r], labels, r.shape[2:])], labels, l1.shape[2:])
        out = net.end(net.end_norm(r, labels, act=True))
        scores.append(out / net.sigmas.to(x.dtype)[labels].reshape(-1, 1, 1, 1))
    return scores


def hand_loss(lit, x, loss, n, gamma, seed=5):
    """Σ_i γ^(n−i) · mean σ² ℓ_i, with the levels, noise and projections drawn in the training step's order."""
    torch.manual_seed(seed)
    sig_all = lit.net.sigmas.to(x.dtype)
    labels = torch.randint(0, LEVELS, (x.shape[0],))
    eps = torch.randn(x.shape, dtype=x.dtype)
    sig = sig_all[labels].reshape(-1, 1, 1, 1)
    xt = (x + sig * eps).requires_grad_(True)
    scores = hand_scores(lit, xt, labels, n)
    v = torch.randn(1, x.shape[0], x[0].numel(), dtype=x.dtype).sign()[0].reshape(x.shape) if loss == "ssm_vr" else None
    losses = []
    for s in scores:
        if loss == "dsm":
            per = 0.5 * (s + eps / sig).pow(2).flatten(1).sum(-1)
        else:
            (g,) = torch.autograd.grad((s * v).sum(), xt, create_graph=True)
            per = 0.5 * s.pow(2).flatten(1).sum(-1) + (g * v).flatten(1).sum(-1)
        losses.append((per * sig.flatten() ** 2).mean())
    weights = [gamma ** (n - i) for i in range(1, n + 1)]
    return sum(w * ell for w, ell in zip(weights, losses)), losses


@pytest.mark.parametrize("loss", ["ssm_vr", "dsm"])
@pytest.mark.parametrize("arch", ["deq", "mdeq"])
def test_correction_loss_and_gradient_match_the_hand_built_weighted_sum(arch, loss):
    n, gamma = 3, 0.7
    lit, x = tiny(arch, loss, n, gamma), batch()
    trained = step(lit, x)
    params = [p for p in lit.parameters() if p.requires_grad]
    got = torch.autograd.grad(trained, params, allow_unused=True, materialize_grads=True)
    ref, losses = hand_loss(lit, x, loss, n, gamma)
    assert trained.item() == pytest.approx(ref.item(), rel=1e-10)
    # the states' losses differ by more than the tolerance (an untrained tail barely sees the block: ~1e-8)
    assert abs(losses[0].item() - losses[-1].item()) > 1e-9 * abs(losses[-1].item())
    want = torch.autograd.grad(ref, params, allow_unused=True, materialize_grads=True)
    num = sum(float((a - b).pow(2).sum()) for a, b in zip(got, want)) ** 0.5
    den = sum(float(b.pow(2).sum()) for b in want) ** 0.5
    assert den > 0 and num / den < 1e-10


@pytest.mark.parametrize("arch", ["deq", "mdeq"])
def test_the_objective_gives_one_output_per_state_and_the_fixed_point_loss_is_the_uncorrected_one(arch):
    x = batch()
    on, off = tiny(arch, "ssm_vr", 2, 0.8), tiny(arch, "ssm_vr", 0)
    torch.manual_seed(5)
    out = on.training_objective(x)
    assert len(out.states) == 2 and out.states[-1].loss is out.loss
    torch.manual_seed(5)
    plain = off.training_objective(x)
    assert plain.states is None
    assert out.loss.item() == pytest.approx(plain.loss.item(), rel=1e-12)
    weighted = weighted_states_loss(out.states, correction_weights(2, 0.8))
    assert weighted.item() == pytest.approx(0.8 * out.states[0].loss.item() + out.loss.item(), rel=1e-12)


@pytest.mark.parametrize("arch", ["deq", "mdeq"])
def test_without_correction_the_step_is_unchanged_bit_for_bit(arch):
    """correction_states=0: the training step's loss and gradients are those of the objective applied to the
    network as before (the default label view, one score)."""
    lit, x = tiny(arch, "ssm_vr", 0), batch()
    loss = step(lit, x)
    got = torch.autograd.grad(loss, list(lit.parameters()), allow_unused=True)
    torch.manual_seed(5)
    ref = noise_conditional(lit.objective, lit.net, x, lit.net.sigmas, anneal_power=2.0).loss
    want = torch.autograd.grad(ref, list(lit.parameters()), allow_unused=True)
    assert torch.equal(loss, ref)
    assert all((a is None and b is None) or torch.equal(a, b) for a, b in zip(got, want))


@pytest.mark.parametrize("arch", ["deq", "mdeq"])
def test_evaluation_and_sampling_see_no_states(arch):
    lit, x = tiny(arch, "ssm_vr", 2), batch()
    labels = torch.tensor([0, 1, 2])
    lit.eval()
    with torch.no_grad():
        scores = lit.net.scores_along_solve(x, labels)
        assert len(scores) == 1 and torch.equal(scores[0], lit.net(x, labels))
        assert lit.net.deq_block().last_info.states is None
    lit.train()
    scores = lit.net.scores_along_solve(x, labels)
    assert len(scores) == 2 and torch.allclose(scores[-1], lit.net(x, labels), rtol=0, atol=1e-12)


def test_families_without_the_correction_refuse_it():
    for family in ("vae", "dkef", "nice", "supervised"):
        with pytest.raises(ValueError, match=r"model=ncsn only, not model=" + family):
            deq_setting({"enabled": True, "correction_states": 2}, family)
    assert deq_setting({"enabled": True, "correction_states": 2}, "ncsn").correction_states == 2
