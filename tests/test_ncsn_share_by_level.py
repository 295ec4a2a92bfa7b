"""The NCSN's recurrence diagnostic looks at every noise level: ``src.lit.ncsn.diagnostic_levels`` and the per-level
study ``benchmarks/studies/ncsn_share_by_level.py`` (at NCSNv2's 95 levels the old cycle of 16 images saw only the
16 largest σ, where the share is smallest)."""

from __future__ import annotations

from itertools import pairwise
from types import SimpleNamespace

import pytest
import torch

from benchmarks.studies.ncsn_share_by_level import level_rows, summary
from src.deq.config import DEQConfig
from src.deq.diagnostics import recurrence_share
from src.lit.ncsn import VAL_CONTRACTION_POINTS, diagnostic_levels
from src.models.ncsn import NCSN, geometric_sigmas


@pytest.mark.parametrize("n, levels", [(16, 10), (10, 10), (64, 10)])
def test_enough_images_cycle_through_every_level(n, levels):
    assert diagnostic_levels(n, levels).tolist() == [j % levels for j in range(n)]


@pytest.mark.parametrize("n, levels", [(16, 95), (64, 95), (2, 3)])
def test_fewer_images_than_levels_spread_from_the_largest_to_the_smallest_sigma(n, levels):
    got = diagnostic_levels(n, levels).tolist()
    assert len(got) == n and got[0] == 0 and got[-1] == levels - 1
    assert all(b > a for a, b in pairwise(got))  # distinct, in order
    gaps = [b - a for a, b in pairwise(got)]
    assert max(gaps) - min(gaps) <= 1  # evenly spread
    assert diagnostic_levels(16, 95).tolist()[:3] == [0, 6, 13]


def test_summary_averages_the_levels_each_measure_looks_at():
    rows = [{"share_mean": i / 100, "iterations": 5.0 + (i == 94), "hit_cap": float(i == 3)} for i in range(95)]
    s = summary(rows)
    assert s["all_levels"] == pytest.approx(0.47)  # mean of 0…94
    assert s["old_diagnostic"] == pytest.approx(0.075)  # mean of 0…15: the 16 largest σ
    assert VAL_CONTRACTION_POINTS == 16  # the logged diagnostic's images, spread over the 95 levels
    assert s["spread_diagnostic"] == pytest.approx(sum(diagnostic_levels(16, 95).tolist()) / 1600)
    assert (s["high_sigma_third"], s["mid_sigma_third"], s["low_sigma_third"]) == pytest.approx((0.15, 0.465, 0.785))  # 0…30, 31…62, 63…94
    assert s["iterations_mean"] == pytest.approx(5 + 1 / 95) and s["hit_cap_levels"] == 1


def test_level_rows_measure_the_block_at_each_levels_perturbed_images():
    """Each row is recurrence_share of the net's own block at its input for x + σᵢz (the study's seeded noise)."""
    torch.manual_seed(0)
    sigmas = geometric_sigmas(2.0, 0.05, 4)
    net = NCSN(1, sigmas, arch="deq", ngf=4, deq=DEQConfig(block="normalized_residual", warm_start=False),
               conditioning="sigma").double()
    data = torch.rand(3, 1, 8, 8, dtype=torch.float64)
    module = SimpleNamespace(net=net, dtype=torch.float64, split_tensor=lambda split, n: data[:n])
    rows = level_rows(module, 3, seed=5, rate_every=2)
    assert [r["level"] for r in rows] == [0, 1, 2, 3]
    assert [("contraction_rate" in r) for r in rows] == [True, False, True, True]  # every 2nd and the last
    g = torch.Generator().manual_seed(5)
    for i, sigma in enumerate(sigmas.tolist()):
        z = torch.randn(data.shape, generator=g, dtype=data.dtype)
        labels = torch.full((3,), i, dtype=torch.long)
        expect = recurrence_share(net.deq_block(), net.deq_input(data + sigma * z, labels), labels, rate=False)
        assert rows[i]["share_mean"] == pytest.approx(expect["share_mean"], rel=1e-6)  # solver tol 1e-4
        assert 0 < rows[i]["share_mean"] < 1 and rows[i]["hit_cap"] == 0.0
