"""The supervised family (DEQ vs feed-forward studies): every experiment config composes, trains a few steps
through src.train and writes its metrics and figure."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from src.runs.training import train
from tests.conftest import compose_train

TINY = ["logger=none", "callbacks=none", "trainer.enable_progress_bar=false", "trainer.max_epochs=1",
        "trainer.check_val_every_n_epoch=1"]


def _run(tmp_path, overrides):
    cfg = compose_train([*TINY, *overrides], output_dir=tmp_path)
    metrics = train(cfg)
    assert json.loads((tmp_path / "metrics.json").read_text())["test/mse"] == pytest.approx(metrics["test/mse"])
    return metrics


def test_linear_regions_construction(tmp_path, one_thread):
    m = _run(tmp_path, ["experiment=linear_regions", "deq=true", "data.task_kwargs.n_train=256"])
    assert m["test/regions"] == m["test/target_regions"] == 64
    assert m["test/linf"] == 0.0
    assert m["test/picard_iterations_from_zero_max"] == 6 and m["test/picard_iterations_from_rebuttal_init_max"] == 0
    assert (tmp_path / "regions.png").is_file()


def test_linear_regions_mlp_counts_its_regions(tmp_path, one_thread):
    m = _run(tmp_path, ["experiment=linear_regions", "deq=false", "depth=3", "data.task_kwargs.n_train=256"])
    assert m["test/neurons"] == 6 and 1 <= m["test/regions"] <= 16  # 2 hidden layers of 3 ReLUs: at most (3+1)^2


def test_region_counter_matches_a_random_mlp():
    from src.models.supervised import MLP
    from src.separation.regions import count_regions, relu_mlp

    torch.manual_seed(0)
    net = MLP(1, 1, hidden=8, depth=4).double()
    pl = relu_mlp(net.linear_layers(), 0.0, 1.0)
    x = np.random.default_rng(0).uniform(0, 1, 500)
    with torch.no_grad():
        ref = net(torch.tensor(x)[:, None]).numpy()
    np.testing.assert_allclose(pl(x), ref, atol=1e-12)
    assert 1 <= count_regions(pl) <= len(pl.knots) - 1


def test_implicit_bias_experiment(tmp_path, one_thread):
    m = _run(tmp_path, ["experiment=implicit_bias", "data.steps_per_epoch=200"])
    assert m["test/gradient_flow_gap_to_q_minimiser"] < 1e-6
    assert m["test/gradient_flow_closed_form_gap"] < 1e-6
    assert m["test/closed_form_gap_mirror"] < 3e-2  # first order in the step (lr = 1e-2)
    assert (tmp_path / "implicit_bias.png").is_file()


def test_gotu_experiment(tmp_path, one_thread):
    m = _run(tmp_path, ["experiment=gotu", "data.steps_per_epoch=20", "data.dim=6"])
    assert {"test/gotu_error", "test/gotu_error_unseen", "test/beta_frozen", "test/feature_participation"} <= set(m)
    assert (tmp_path / "features.npz").is_file() and (tmp_path / "gotu_features.png").is_file()


@pytest.mark.parametrize("exp,extra", [
    ("steep", ["data.dim=5", "data.task_kwargs.n_train=256", "deq=true"]),
    ("high_frequency", ["data.task_kwargs.n_train=256", "data.task_kwargs.n_test=512", "deq=true",
                        "data.steps_per_epoch=10"]),
])
def test_steep_and_signal_experiments(tmp_path, one_thread, exp, extra):
    m = _run(tmp_path, [f"experiment={exp}", *extra])
    assert m["test/deq_iterations"] > 0 and m["test/flops_per_forward"] > 0
    assert (tmp_path / ("steep.png" if exp == "steep" else "signal.png")).is_file()
    if exp == "steep":
        assert m["test/target_bisection_iterations"] == 20 and m["test/delta"] == 2.0 ** -5
    else:
        assert {"test/band_err_1", "test/band_err_24", "test/band_err_other"} <= set(m)


def test_supervised_param_matching():
    from src.deq.config import deq_setting
    from src.models.supervised import build_supervised_net, deq_params

    deq = {"enabled": True, "norm": "frobenius"}
    d = build_supervised_net(10, 1, deq=deq_setting(deq), width=32)
    f = build_supervised_net(10, 1, deq=deq_setting({"enabled": False}), depth=3, width=32, match="params")
    n_d, n_f = (sum(p.numel() for p in n.parameters()) for n in (d, f))
    assert n_d == deq_params(10, 1, 32) and abs(n_f - n_d) / n_d < 0.05
    with pytest.raises(ValueError, match="arch"):
        build_supervised_net(3, arch="resnet")
