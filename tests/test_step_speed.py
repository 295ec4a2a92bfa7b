"""The faster DKEF step of issue #26 computes the same numbers (float64), and the step profiler's phases add up.

- exact SM's ``auto`` route replicates x on a CPU for a model declaring ``independent_rows`` within
  ``AUTO_REPLICATE_ROWS`` (else the loop), and gives the loop's loss and parameter gradients;
- one training step computing the inducing points' features once (``DKEF.shared_inducing_features``) gives
  the loss and every parameter gradient of the step that computes them twice;
- ``benchmarks/tools/profile_step.py`` attributes every profiled operator of a DKEF step to one phase, and the α fit,
  the score, the trace, the backward and the optimiser each get time.
"""

from __future__ import annotations

import contextlib
from pathlib import Path

import pytest
import torch

from src.deq.config import deq_setting
from src.lit.dkef import DKEFLitModule
from src.models.dkef import DKEF
from src.objectives.sm import AUTO_REPLICATE_ROWS, resolve_trace_route, sm

ROOT = Path(__file__).resolve().parents[1]
DEQ = {"enabled": True, "solver": "picard", "tol": 1e-12, "max_iter": 500, "phantom_steps": 30,
       "warm_start": False, "norm_lambda": 2.0, "backward": "phantom"}


def _dkef(kind: str) -> DKEF:
    torch.manual_seed(0)
    return DKEF(4, deq=deq_setting(DEQ) if kind == "deq" else None, depth=2, n_inducing=7, feature_dim=5, hidden=6,
                deq_width=6).double()


def _grads(module) -> dict[str, torch.Tensor]:
    return {n: p.grad.clone() for n, p in module.named_parameters() if p.grad is not None}


def test_auto_route_replicates_independent_rows_within_the_budget():
    cpu = torch.device("cpu")
    model = _dkef("mlp").with_alpha(torch.zeros(7, dtype=torch.float64))
    assert resolve_trace_route("auto", cpu, model, rows=16 * 11) == "replicate"
    assert resolve_trace_route("auto", cpu, model, rows=AUTO_REPLICATE_ROWS + 1) == "loop"
    assert resolve_trace_route("auto", cpu, model) == "loop"  # size unknown: the loop
    assert resolve_trace_route("auto", cpu, object(), rows=4) == "loop"  # rows not declared independent
    assert resolve_trace_route("auto", torch.device("cuda"), object(), rows=10**9) == "replicate"


@pytest.mark.parametrize("kind", ["mlp", "deq"])
def test_auto_route_gives_the_loops_loss_and_gradients(kind):
    net = _dkef(kind)
    x = torch.randn(9, 4, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    alpha = torch.randn(7, dtype=torch.float64, generator=torch.Generator().manual_seed(2))
    out = {}
    for route in ("auto", "loop"):
        net.zero_grad(set_to_none=True)
        res = sm(net.with_alpha(alpha), x, trace_route=route)
        res.loss.backward()
        out[route] = (res.per_sample.detach(), _grads(net))
    torch.testing.assert_close(out["auto"][0], out["loop"][0], rtol=0, atol=1e-11)
    assert out["auto"][1].keys() == out["loop"][1].keys() and out["auto"][1]
    for name, g in out["loop"][1].items():
        torch.testing.assert_close(out["auto"][1][name], g, rtol=1e-9, atol=1e-11, msg=name)


@pytest.mark.parametrize("kind", ["mlp", "deq"])
def test_shared_inducing_features_give_the_same_step(kind, monkeypatch):
    """The DKEF training objective (α on one half, exact SM on the other) with φ(inducing points) computed once
    against the same objective computing it for the fit and again for the loss."""
    torch.manual_seed(0)
    net = {"_target_": "src.models.dkef.DKEF", "n_inducing": 7, "feature_dim": 5, "hidden": 6, "deq_width": 6,
           "exact_route": "autograd"}
    module = DKEFLitModule(4, loss={"name": "sm"}, net=net, deq=DEQ if kind == "deq" else None,
                           depth=2).double()  # the jet route's step computes φ(z) once anyway
    x = torch.randn(12, 4, dtype=torch.float64, generator=torch.Generator().manual_seed(3))
    calls = []
    features = DKEF._all_features

    def counted(self, z):
        calls.append(z.shape[0])
        return features(self, z)

    monkeypatch.setattr(DKEF, "_all_features", counted)
    out = {}
    for shared in (True, False):
        if not shared:
            monkeypatch.setattr(DKEF, "shared_inducing_features", lambda self: contextlib.nullcontext())
        calls.clear()
        module.zero_grad(set_to_none=True)
        res = module.training_objective(x)
        res.loss.backward()
        out[shared] = (res.per_sample.detach(), _grads(module), calls.count(7))
    assert out[True][2] == 1 and out[False][2] == 2  # φ(inducing points): once shared, twice not
    torch.testing.assert_close(out[True][0], out[False][0], rtol=0, atol=1e-11)
    for name, g in out[False][1].items():
        torch.testing.assert_close(out[True][1][name], g, rtol=1e-9, atol=1e-11, msg=name)
    assert module.net._inducing_cache is None  # nothing (no graph) kept after the step


def test_profile_step_phases_cover_a_dkef_step():
    from benchmarks.tools import profile_step

    res = profile_step.profile_case("dkef/3-layer", warmup=1, timed=0, data_root=None, top=5)
    phases = res["phases_ms"]
    assert set(phases) == set(profile_step.PHASE_NAMES)
    assert sum(phases.values()) == pytest.approx(res["profiled_cpu_ms"])
    for name in ("α fit", "score s(x)", "Hessian trace / projections", "optimiser", "backward to the parameters"):
        assert phases[name] > 0, name
    assert phases["DEQ solver forward"] == 0  # no DEQ in the 3-layer features
    assert res["facts"]["data"] == "N(0, I_11)" and len(res["top_ops"]) == 5
