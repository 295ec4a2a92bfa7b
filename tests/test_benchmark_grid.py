"""The paper-table grid runner (benchmarks/run_grid.py): job lists, tables and target checks on known numbers."""

from __future__ import annotations

import importlib.util
import json
import shutil
from pathlib import Path

import pytest

SPEC = importlib.util.spec_from_file_location("run_grid", Path(__file__).resolve().parents[1] / "benchmarks" / "run_grid.py")
run_grid = importlib.util.module_from_spec(SPEC)
SPEC.loader.exec_module(run_grid)


class Args:
    datasets = "redwine,gaussian200"
    root = "../shared/data"
    epochs = None
    variants = False


def job(group, method, seed=0, **metrics):
    return {"group": group, "method": method, "seed": seed, "ok": True, "metrics": metrics}


def test_dkef_grid_has_the_papers_rows_with_their_overrides():
    jobs = run_grid.dkef_grid(Args())
    red = {j["method"]: j["overrides"] for j in jobs if j["group"] == "redwine"}
    assert list(red) == ["DSM", "CP", "SSM", "SSM-VR", "DEQ-SSM-VR", "SM 3-layer", "SM 8-layer", "SM 16-layer", "DEQ-SM"]
    assert {"experiment=dkef_uci", "data=redwine", "loss=ssm_vr", "deq=true"} <= set(red["DEQ-SSM-VR"])
    assert {"loss=sm", "deq=false", "depth=16"} <= set(red["SM 16-layer"])
    gauss = {j["method"]: j["overrides"] for j in jobs if j["group"] == "gaussian200"}
    assert list(gauss) == ["SM 3-layer", "SM 8-layer", "SM 16-layer", "DEQ-SM"]
    assert {"experiment=dkef_gaussian", "data.dim=200"} <= set(gauss["DEQ-SM"])
    Args.variants = True
    red = {j["method"]: j["overrides"] for j in run_grid.dkef_grid(Args()) if j["group"] == "redwine"}
    assert {"model.deq_width=30", "deq.phantom_steps=1"} <= set(red["DEQ-SM (width 30 K=1)"])
    Args.variants = False
    Args.datasets = "bogus"
    with pytest.raises(SystemExit, match="unknown data set 'bogus'"):
        run_grid.dkef_grid(Args())
    Args.datasets = "redwine,gaussian200"


def test_targets_are_checked_with_the_right_ratios_and_verdicts():
    mb = 1e6
    results = [
        job("redwine", "SM 3-layer", **{"test/sm_loss": -20.0, "test/log_likelihood": -14.0,
                                        "profile/saved_bytes_mean": 40 * mb, "profile/time_per_step_s": 0.2}),
        job("redwine", "SM 16-layer", **{"test/sm_loss": -25.0, "test/log_likelihood": -13.5,
                                         "profile/saved_bytes_mean": 200 * mb, "profile/time_per_step_s": 1.0}),
        job("redwine", "DEQ-SM", seed=0, **{"test/sm_loss": -30.0, "test/log_likelihood": -13.0,
                                            "profile/saved_bytes_mean": 42 * mb, "profile/time_per_step_s": 0.25}),
        job("redwine", "DEQ-SM", seed=1, **{"test/sm_loss": -32.0, "test/log_likelihood": -13.4,
                                            "profile/saved_bytes_mean": 46 * mb, "profile/time_per_step_s": 0.35}),
        job("gaussian200", "DEQ-SM", **{"test/sm_loss": -80.0, "test/log_likelihood": -295.0,
                                        "test/true_log_likelihood": -283.0, "test/fisher_divergence": 20.0}),
    ]
    lines = "\n".join(run_grid.target_lines(results))
    assert "redwine: DEQ-SM beats 16-layer on SM loss and LL — met (SM -31.00 vs -25.00; LL -13.20 vs -13.50)" in lines
    assert "DEQ / 3-layer = 1.10 (target ≤ 1.1: met)" in lines
    assert "DEQ / 16-layer = 0.22 (target ≤ 0.25: met)" in lines
    assert "time per step DEQ / 16-layer = 0.30 (target ≤ 0.3: met)" in lines
    assert "gap 12.00 nats (target ≤ 10: MISSED); Fisher divergence 20.00 (target ≤ 25.42: met)" in lines
    meta = {"command": "x", "machine": "m", "device": "cpu", "python": "3", "parallel_jobs": 1, "threads_per_job": 1}
    md = run_grid.to_markdown(results, run_grid.DKEF_COLUMNS, meta)
    row = next(r for r in md.splitlines() if r.startswith("| DEQ-SM | 2 |"))
    assert "-31.00 ± 1.41" in row and "44.0 ± 2.8" in row and row.endswith("-44.5 / -12.2 / 1.1 |")


RESULTS = Path(__file__).resolve().parents[1] / "benchmarks" / "results"


@pytest.mark.parametrize("grid", ["dkef", "nice"])
def test_committed_tables_are_rebuilt_exactly_from_their_json(grid):
    data = json.loads((RESULTS / f"{grid}.json").read_text())
    assert run_grid.render(data, grid) == (RESULTS / f"{grid}.md").read_text()


def test_render_rewrites_markdown_and_figures_from_the_json_alone(tmp_path):
    shutil.copy(RESULTS / "nice.json", tmp_path / "nice.json")
    run_grid.main(["nice", "--render", "--out", str(tmp_path)])
    assert (tmp_path / "nice.md").read_text() == (RESULTS / "nice.md").read_text()
    assert (tmp_path / "nice_mnist.png").stat().st_size > 1000
