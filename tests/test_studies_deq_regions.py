"""Linear regions of a ReLU DEQ with any W (src.separation.regions.relu_deq_pl, the counter of a *trained* DEQ on
Theorem 1's sawtooth target), and a DEQ trained on a small sawtooth through src.train."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from src.separation import regions as rg


@pytest.mark.parametrize("m", [3, 6, 9])
def test_walk_recovers_the_constructions_2_to_the_m_regions(m):
    """Theorem 1's nilpotent W through the pattern walk (float64): the exact counter's 2^m regions, breakpoints
    at k/2^m and the closed-form fixed point at every knot."""
    W, u, c = rg.theorem1_weights(m)
    pl = rg.relu_deq_pl(W, u, c, 0.0, 1.0)
    bps = np.array(rg.breakpoints(pl, np.ones(m)), dtype=np.float64)
    assert rg.count_regions(pl, np.ones(m)) == 2 ** m
    np.testing.assert_allclose(bps, np.arange(1, 2 ** m) / 2 ** m, rtol=0, atol=1e-12)
    np.testing.assert_allclose(pl.values, rg.theorem1_fixed_point(pl.knots, m), rtol=0, atol=1e-9)


@pytest.mark.parametrize("m", [4, 16, 32])
def test_walk_matches_the_fixed_point_of_a_contracting_dense_w(m):
    """A dense random W with ‖W‖₂ = 1/2 (a normalised DEQ's): the PL map equals Picard's fixed point between
    knots, and its pieces are the activation patterns seen on a fine grid (each change a knot)."""
    rng = np.random.default_rng(m)
    W = rng.standard_normal((m, m))
    W /= 2 * np.linalg.norm(W, 2)
    u, c = 4 * rng.standard_normal(m), rng.standard_normal(m)
    pl = rg.relu_deq_pl(W, u, c, 0.0, 1.0)
    x = rng.uniform(0, 1, 2000)
    np.testing.assert_allclose(pl(x), rg.relu_deq_fixed_point(W, u, c, x), rtol=0, atol=1e-12)
    grid = np.linspace(0, 1, 20_001)
    z = rg.relu_deq_fixed_point(W, u, c, grid)
    pattern = (z @ W.T + grid[:, None] * u + c) > 0
    changes = grid[1:][(pattern[1:] != pattern[:-1]).any(axis=1)]
    assert len(pl.knots) - 1 == len(changes) + 1 > 1
    inner = pl.knots[1:-1]
    assert np.all(np.abs(inner[:, None] - changes[None, :]).min(axis=1) <= 5e-5)  # each knot within a grid step


def test_picard_that_does_not_converge_raises():
    with pytest.raises(RuntimeError, match="did not converge"):
        rg.relu_deq_fixed_point(np.array([[2.0]]), np.array([1.0]), np.array([0.0]), [1.0], max_iter=50)


def test_deq_regions_of_a_dense_deqnet_match_its_forward(one_thread):
    """The analysis' PL map of a DEQNet whose (Frobenius-normalised) W is dense equals the network's own forward
    (its solver run to 1e-13): read-out, injection and normalisation taken as the forward takes them."""
    from src.deq.config import deq_setting
    from src.models.supervised import DEQNet
    from src.separation.analysis import deq_regions

    torch.manual_seed(0)
    deq = {"enabled": True, "norm": "frobenius", "norm_lambda": 2.0, "tol": 1e-13, "max_iter": 500,
           "warm_start": False, "solver": "picard"}
    net = DEQNet(1, 1, 8, deq=deq_setting(deq), family="supervised", n_layers=1, activation="relu").double()
    with torch.no_grad():
        net.block.injection.weight.mul_(6.0)  # many kinks on [0, 1]
    pl = deq_regions(net)
    assert pl is not None and rg.count_regions(pl) >= 3
    x = np.linspace(0, 1, 1001)
    with torch.no_grad():
        ref = net(torch.tensor(x)[:, None]).numpy()
    np.testing.assert_allclose(pl(x), ref, rtol=0, atol=1e-10)


def test_deq_trained_on_a_small_sawtooth(tmp_path, one_thread):
    """The trained-DEQ row of the regions study on a small case: Theorem 1's target with m = 2 (a 4-piece zigzag
    0 → 0 → 1 → ½ → 1 on [0, 1]; a constant's MSE is its variance 1/8), a width-16 ReLU DEQ from a random
    start, Frobenius-normalised, full-batch Adam 1e-2 for 1000 steps. Measured: MSE 0.022, L∞ 0.30, 3 regions
    (it fits three of the four pieces; exact implicit gradients instead of the phantom ones end at the same
    point). Stated fit: MSE < 0.03 (under a quarter of a constant's), L∞ < 0.35, and ≥ 3 regions counted on
    the trained weights (a wrong count of a dense W would be 1 or fail)."""
    from src.runs.training import train
    from tests.conftest import compose_train

    cfg = compose_train(["experiment=linear_regions", "deq=true", "model.construction=none", "deq.norm=frobenius",
                         "data.task_kwargs.m=2", "model.width=16", "data.task_kwargs.n_train=512",
                         "data.full_batch=true", "data.steps_per_epoch=100", "trainer.max_epochs=10",
                         "model.optimizer.lr=1e-2", "logger=none", "callbacks=none",
                         "trainer.enable_progress_bar=false"], output_dir=tmp_path)
    m = train(cfg)
    assert json.loads((tmp_path / "metrics.json").read_text())["test/regions"] == m["test/regions"]
    y = rg.theorem1_target(np.linspace(0, 1, 2 ** 12 + 1), 2)
    assert y.var() == pytest.approx(1 / 8, rel=1e-3)
    assert m["test/mse"] < 0.03 < 0.25 * y.var()
    assert m["test/linf"] < 0.35
    assert m["test/regions"] >= 3 and m["test/target_regions"] == 4
