"""DKEF's kernels' DEQ feature networks as one stacked DEQ (src/models/stacked_features.py) against the same
networks one by one, float64: values, jets (u, J, L), parameter gradients, the x-derivatives of the every-order
path, the blocks' spectral probes, warm starts and records, the monitor's hooks, and the training step."""

from __future__ import annotations

import copy

import pytest
import torch

from src.deq.config import deq_setting
from src.models.dkef import DKEF
from src.models.feature_jets import feature_jet
from src.models.stacked_features import stackable, stacked_features, stacked_jets
from tests.derivative_checks import rel, sm_loss_and_grads

DEQ = {"enabled": True, "solver": "picard", "tol": 1e-13, "max_iter": 400, "phantom_steps": 5, "warm_start": True,
       "norm": "spectral", "norm_lambda": 2.0, "backward": "phantom"}
BOUND = 1e-10


def make(d: int = 4, **deq) -> DKEF:
    torch.manual_seed(0)
    model = DKEF(d, deq=deq_setting({**DEQ, **deq}), n_inducing=9, feature_dim=5, deq_width=7).double()
    with torch.no_grad():
        for net in model.features:  # biases away from 0, so the read-out biases' gradients are not ~0 noise
            net.readout.bias.normal_()
            net.block.injection.bias.normal_()
    return model


def pair(**deq):
    stacked = make(**deq)
    alone = copy.deepcopy(stacked)
    alone.stack_kernels = False
    assert stacked.stacked() and not alone.stacked()
    return stacked, alone


def flat_grads(loss, module):
    """The gradient w.r.t. every parameter of ``module`` but the read-out biases (k(x, z) is shift-invariant in u:
    their gradient is 0 up to rounding), as one vector; zeros where a parameter is not used."""
    params = [p for n, p in module.named_parameters() if "readout.bias" not in n]
    grads = torch.autograd.grad(loss, params, allow_unused=True, materialize_grads=True)
    return torch.cat([g.flatten() for g in grads])


def probe(shape, seed):
    return torch.randn(shape, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)


@pytest.mark.parametrize("norm", ["spectral", "frobenius"])
def test_stacked_jets_are_the_jets_one_by_one(norm):
    stacked, alone = pair(norm=norm)
    x = probe((6, 4), 1)
    u, j, lap = stacked_jets(stacked.features, x)
    ref = [feature_jet(net, x) for net in alone.features]
    for got, want in zip((u, j, lap), zip(*ref)):
        assert rel(got, torch.stack(want)) < BOUND
    weights = [probe(t.shape, 2 + i) for i, t in enumerate((u, j, lap))]
    loss = sum((t * w).sum() for t, w in zip((u, j, lap), weights))
    loss_ref = sum((torch.stack(t) * w).sum() for t, w in zip(zip(*ref), weights))
    assert rel(flat_grads(loss, stacked.features), flat_grads(loss_ref, alone.features)) < BOUND
    for a, b in zip(stacked.features, alone.features):  # each block's power step, warm start and record
        assert rel(a.block.sn_u0, b.block.sn_u0) < BOUND if norm == "spectral" else True
        assert rel(a.block.initial_state(x, x), b.block.initial_state(x, x)) < BOUND
        assert a.block.last_stats["converged"] and a.block.last_stats["residual"] < 1e-12
    # the stacked solve runs until every kernel's rows meet the rule: at least each block's own count
    assert stacked.features[0].block.last_stats["iterations"] >= max(
        b.block.last_stats["iterations"] for b in alone.features)


@pytest.mark.parametrize("first_order", [True, False])
def test_stacked_features_are_the_features_one_by_one(first_order):
    stacked, alone = pair()
    x = probe((8, 4), 3)
    u = stacked_features(stacked.features, x, first_order=first_order)
    ref = torch.stack([net(x) for net in alone.features])
    assert rel(u, ref) < BOUND
    w = probe(u.shape, 4)
    assert rel(flat_grads((u * w).sum(), stacked.features), flat_grads((ref * w).sum(), alone.features)) < BOUND


def test_every_order_path_gives_the_x_derivatives_one_by_one():
    """The stacked map under src.deq.core.equilibrium (phantom steps by autograd): score, Hessian trace and the
    SM loss's parameter gradient (first to third order) as the blocks give them one by one."""
    stacked, alone = pair()
    x = probe((5, 4), 5)
    head = (probe((15, 6), 6), probe((6,), 7))

    def params(model):
        return [p for n, p in model.features.named_parameters() if "readout.bias" not in n]

    got = sm_loss_and_grads(lambda v: stacked_features(stacked.features, v).transpose(0, 1), x, head,
                            params(stacked))
    want = sm_loss_and_grads(lambda v: torch.stack([net(v) for net in alone.features]).transpose(0, 1), x, head,
                             params(alone))
    for a, b in zip(got, want):
        assert rel(a, b) < BOUND


def test_first_order_paths_refuse_a_second_order():
    stacked, _ = pair()
    x = probe((3, 4), 8)
    u = stacked_features(stacked.features, x, first_order=True)
    w = stacked.features[0].block.weights[0]
    with pytest.raises(RuntimeError, match="differentiable once"):
        torch.autograd.grad(u.pow(2).sum(), w, create_graph=True)
    (g,) = torch.autograd.grad(u.pow(2).sum(), w)  # first order: fine
    assert g.norm() > 0


def test_training_step_is_the_one_by_one_step():
    """A DKEF training step's exact SM (α on one half, the loss on the other, the inducing points' features shared;
    stacked, they come from the jets' own solve and phantom steps): loss, gradients and warm starts of the stacked
    kernels against the blocks one by one, two steps in a row (the second from the first's warm starts). The
    spectral probes are held (eval mode): the one-by-one route takes a power step at each of its two feature calls,
    the stacked one once a step (``test_one_power_step_per_training_step``)."""
    stacked, alone = pair()
    stacked.eval()
    alone.eval()
    for seed in (9, 10):
        x = probe((10, 4), seed)
        out = []
        for model in (stacked, alone):
            with model.shared_inducing_features():
                s, tr = model.fit_and_exact_sm(x[:5], x[5:])
                loss = (0.5 * s.pow(2).sum(-1) + tr).mean()
            out.append((loss, flat_grads(loss, model)))
        assert rel(out[0][0], out[1][0]) < BOUND
        assert rel(out[0][1], out[1][1]) < BOUND
        for a, b in zip(stacked.features, alone.features):
            for shape in ((10, 7), (9, 7)):  # the jets' rows and the inducing points'
                assert rel(a.block._warm[shape], b.block._warm[shape]) < BOUND


def test_one_power_step_per_training_step():
    """In training the stacked step normalizes each block's weights once (one spectral power step), so the jets and
    the inducing points' features use the same Ŵ; the probes are where one power step takes the blocks' own."""
    stacked, alone = pair()
    for r, (a, b) in enumerate(zip(stacked.features, alone.features)):  # weights moved since the probes settled
        step = 0.3 * probe(tuple(a.block.weights[0].shape), 20 + r)
        with torch.no_grad():
            a.block.weights[0].add_(step)
            b.block.weights[0].add_(step)
    x = probe((10, 4), 9)
    with stacked.shared_inducing_features():
        stacked.fit_and_exact_sm(x[:5], x[5:])
    for a, b in zip(stacked.features, alone.features):
        b.block.map_weights()  # one training call: one power step
        assert rel(a.block.sn_u0, b.block.sn_u0) < BOUND


def test_block_hooks_see_the_stacked_forward():
    """The DEQ monitor keeps a block's last training input by a forward pre-hook, forward_infos collects records by
    a forward hook: the stacked value path runs both, as block(x) would."""
    from src.deq.lookup import forward_infos

    stacked, _ = pair()
    seen = []
    handle = stacked.features[1].block.register_forward_pre_hook(lambda b, args: seen.append(args[0]))
    with forward_infos(stacked) as infos:
        stacked._inducing_features()
    handle.remove()
    assert len(seen) == 1 and seen[0] is stacked.inducing
    assert [name for name, _ in infos] == [f"features.{r}.block" for r in range(3)]
    assert all(info is net.block.last_info for (_, info), net in zip(infos, stacked.features))


@pytest.mark.parametrize("deq,depth", [({"backward": "implicit"}, None), ({}, 2), ({"injection": "softplus"}, None),
                                       ({"jacobian_penalty": 0.1}, None)])
def test_other_feature_networks_go_one_by_one(deq, depth):
    torch.manual_seed(0)
    model = DKEF(3, deq=deq_setting({**DEQ, **deq}), depth=depth, n_inducing=4, feature_dim=3, deq_width=5)
    assert not stackable(model.features) and not model.stacked()
    assert not stackable(DKEF(3, depth=3).features)


def test_shared_inducing_features_are_every_order_where_a_caller_needs_it():
    """The jet route takes the inducing points' features first-order (the written-out backward); a later
    log-density in the same step (an autograd route; CP walks its graph) gets the every-order ones, the same
    numbers."""
    stacked, _ = pair()
    stacked.eval()  # no power step per call: both forms see the same normalized weights
    x = probe((6, 4), 11)

    def custom_nodes(t):
        seen, stack, found = set(), [t.grad_fn], []
        while stack:
            node = stack.pop()
            if node is None or node in seen:
                continue
            seen.add(node)
            found += [type(node).__name__] if "PhantomSteps" in type(node).__name__ else []
            stack += [f for f, _ in node.next_functions]
        return found

    with stacked.shared_inducing_features():
        first = stacked._inducing_features(first_order=True)
        assert custom_nodes(first) and stacked._inducing_features(first_order=True) is first
        every = stacked._inducing_features()
        assert not custom_nodes(every) and rel(every, first) < BOUND
        assert stacked._inducing_features(first_order=True) is every  # every order serves a first-order caller
        assert not custom_nodes(stacked.log_density(x, alpha=probe((9,), 12)))
