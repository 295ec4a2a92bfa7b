"""DKEF's jet route (closed-form ∇k, Δk from the features' forward jets) against the autograd route (x replicated
D times, reverse passes), float64: the same α fit, loss and parameter gradients for explicit features (depth 3 and
16) and DEQ features (phantom and implicit backward), and the jets themselves against autograd."""

from __future__ import annotations

import copy

import pytest
import torch

from src.deq.config import deq_setting
from src.models.dkef import DKEF
from src.models.feature_jets import feature_jet, supports_jet
from src.objectives.sm import resolve_trace_route, sm

DEQ = {"enabled": True, "solver": "picard", "tol": 1e-13, "max_iter": 800, "phantom_steps": 3,
       "warm_start": False, "norm_lambda": 1.5, "backward": "phantom"}
CASES = {
    "mlp3": {"depth": 3},
    "mlp16": {"depth": 16},
    "deq_phantom": {"deq": deq_setting(DEQ)},
    "deq_phantom_2layers": {"deq": deq_setting(DEQ), "depth": 2},
    "deq_implicit": {"deq": deq_setting({**DEQ, "backward": "implicit"})},
}


def make(case: str, d: int = 5) -> DKEF:
    torch.manual_seed(0)
    model = DKEF(d, n_inducing=7, feature_dim=4, hidden=6, deq_width=6, **CASES[case]).double()
    with torch.no_grad():
        model.log_bandwidth.copy_(torch.tensor([0.3, 0.6, 1.0]))
        model.kernel_logits.copy_(torch.tensor([0.2, -0.1, 0.4]))
    return model


def step(model: DKEF, x: torch.Tensor):
    """A DKEF training step's loss (α on one half, exact SM on the other, src/lit/dkef.py) and its gradients."""
    model.zero_grad()
    with model.shared_inducing_features():
        alpha = model.fit_alpha(x[:6], "exact")
        out = sm(model.with_alpha(alpha), x[6:])
    out.loss.backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    return out, alpha.detach(), grads


def close(a, b, rtol=1e-9):
    return torch.allclose(a, b, rtol=rtol, atol=rtol * max(1.0, float(b.detach().abs().max())))


@pytest.mark.parametrize("case", list(CASES))
def test_jet_route_gives_the_autograd_route_loss_and_gradients(case):
    new = make(case)
    old = copy.deepcopy(new)
    old.exact_route = "autograd"
    assert new.uses_jets() and not old.uses_jets()
    x = torch.randn(12, 5, dtype=torch.float64)
    out_new, alpha_new, g_new = step(new, x)
    out_old, alpha_old, g_old = step(old, x)
    assert close(alpha_new, alpha_old)
    assert close(out_new.loss, out_old.loss), (float(out_new.loss), float(out_old.loss))
    for part in ("score_norm", "trace"):
        assert close(out_new.parts[part], out_old.parts[part])
    assert g_new.keys() == g_old.keys() and len(g_new) > 4
    for name in g_old:
        assert close(g_new[name], g_old[name]), (name, float((g_new[name] - g_old[name]).abs().max()))


@pytest.mark.parametrize("case", ["mlp3", "deq_phantom", "deq_implicit"])
def test_feature_jets_match_autograd(case):
    model = make(case)
    net = model.features[0]
    assert supports_jet(net)
    x = torch.randn(4, 5, dtype=torch.float64, requires_grad=True)
    u, j, lap = feature_jet(net, x)
    ref = net(x)
    assert close(u, ref)
    for f in range(ref.shape[1]):
        (g,) = torch.autograd.grad(ref[:, f].sum(), x, create_graph=True)
        assert close(j[:, :, f], g)
        second = sum(torch.autograd.grad(g[:, i].sum(), x, retain_graph=True)[0][:, i] for i in range(5))
        assert close(lap[:, f], second)


def test_evaluation_trace_and_auto_choice():
    model = make("mlp3")
    model.set_alpha(torch.randn(7, dtype=torch.float64))
    x = torch.randn(5, 5, dtype=torch.float64)
    assert resolve_trace_route("auto", x.device, model, rows=25, x=x) == "model"
    new = sm(model, x, create_graph=False)
    assert not new.loss.requires_grad
    model.exact_route = "autograd"
    assert resolve_trace_route("auto", x.device, model, rows=25, x=x) == "replicate"
    old = sm(model, x, create_graph=False)
    assert close(new.per_sample, old.per_sample)


def test_jet_route_is_refused_where_it_does_not_apply():
    with pytest.raises(ValueError, match="exact_route"):
        DKEF(3, exact_route="fast")
    with pytest.raises(ValueError, match="trace_route='model'"):
        sm(torch.nn.Linear(3, 1), torch.randn(2, 3), trace_route="model")



@pytest.mark.parametrize("case", ["mlp3", "deq_phantom", "deq_implicit"])
def test_training_step_with_both_halves_in_one_pass_is_the_two_call_step(case):
    """src/lit/dkef.py's exact-SM step (α fit and loss from one jet pass) against fit_alpha + sm (autograd)."""
    from src.lit.dkef import DKEFLitModule

    keys = dict(CASES[case])
    torch.manual_seed(0)
    net = {"_target_": "src.models.dkef.DKEF", "n_inducing": 7, "feature_dim": 4, "hidden": 6, "deq_width": 6}
    module = DKEFLitModule(5, loss={"name": "sm", "trace_route": "auto"}, net=net, **keys).double()
    x = torch.randn(12, 5, dtype=torch.float64)
    assert module._fused_exact_sm(x)
    fused = module.training_objective(x)
    fused.loss.backward()
    g_fused = {n: p.grad.clone() for n, p in module.named_parameters() if p.grad is not None}
    module.zero_grad()
    module.net.exact_route = "autograd"
    assert not module._fused_exact_sm(x)
    ref = module.training_objective(x)
    ref.loss.backward()
    assert close(fused.loss, ref.loss)
    for part in ("score_norm", "trace"):
        assert close(fused.parts[part], ref.parts[part])
    for name, p in module.named_parameters():
        if p.grad is not None:
            assert close(g_fused[name], p.grad), name


def _jet_map_inputs(shared: bool, n: int = 4, d: int = 3, w: int = 5):
    g = torch.Generator().manual_seed(1)
    r = lambda *s: torch.randn(*s, generator=g, dtype=torch.float64)
    state = r(n, d + 2, w)
    j_inj = r(d, w) if shared else r(n, d, w)
    return state, (r(n, w), j_inj, r(n, w), 0.4 * r(w, w))


@pytest.mark.parametrize("shared", [True, False])
def test_jet_map_products_are_its_jacobian(shared):
    """JetMap.linearize's hand-written J v and Jᵀ a against the autograd Jacobian of the jet map (float64)."""
    from src.models.feature_jets import JetMap

    state, params = _jet_map_inputs(shared)
    jet_map = JetMap()
    jac = torch.autograd.functional.jacobian(lambda s: jet_map(s, *params), state)  # [N, D+2, W, N, D+2, W]
    jac = jac.reshape(state.numel(), state.numel())
    jvp, vjp = jet_map.linearize(state, *params)
    v, a = torch.randn_like(state), torch.randn_like(state)
    assert close(jvp(v).reshape(-1), jac @ v.reshape(-1), rtol=1e-12)
    assert close(vjp(a).reshape(-1), jac.T @ a.reshape(-1), rtol=1e-12)
    assert JetMap(2).linearize is None  # several layers: the generic autograd products


@pytest.mark.parametrize("shared", [True, False])
def test_direct_jet_fixed_point_is_the_jet_maps_fixed_point(shared):
    """jet_fixed_point (the linear jet equations iterated at z*) against 400 Picard steps of the whole jet map."""
    from src.models.feature_jets import JetMap, jet_fixed_point

    state, (inj, j_inj, l_inj, w1) = _jet_map_inputs(shared)
    jet_map, s = JetMap(), torch.zeros_like(state)
    for _ in range(400):  # contraction ≤ 0.4 ‖W‖-scaled: converged to machine precision
        s = jet_map(s, inj, j_inj, l_inj, w1)
    direct = jet_fixed_point(s[:, 0], (inj, j_inj, l_inj), w1, {"tol": 1e-14, "max_iter": 400, "stop_mode": "abs"})
    assert close(direct, s, rtol=1e-11)
    assert float((jet_map(direct, inj, j_inj, l_inj, w1) - direct).abs().max()) < 1e-12
