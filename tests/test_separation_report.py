"""benchmarks/studies/separation_report.py: the seed grid (one job per model and seed, seed 0 = the default command),
the aggregation of seeds into mean ± sd, and the committed report rebuilt from its JSON."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from benchmarks.studies import separation_report as sr

ROOT = Path(__file__).resolve().parents[1]


def test_grid_has_every_trained_job_once_per_seed():
    jobs = sr.grid(set(sr.STUDIES), (0, 1, 2))
    names = {(j["study"], j["name"]) for j in jobs}
    for study, name in names:
        seeds = sorted(j["seed"] for j in jobs if (j["study"], j["name"]) == (study, name))
        deterministic = name == "DEQ (hand-built, m = 6)" or name.startswith("diagonal linear") and study == "gotu"
        assert seeds == ([0] if deterministic else [0, 1, 2]), name
    assert {"DEQ width 6 (trained)", "DEQ width 64 (trained, reference)"} <= {n for _, n in names}
    assert len({sr.slug(j) for j in jobs}) == len(jobs)  # one run directory per job
    for j in jobs:
        extra = [o for o in j["overrides"] if o.startswith(("seed=", "data.seed="))]
        assert extra == ([] if j["seed"] == 0 else [f"seed={j['seed']}", f"data.seed={j['seed']}"])
    trained = next(j for j in jobs if j["name"] == "DEQ width 6 (trained)" and j["seed"] == 0)
    assert {"deq=true", "model.construction=none", "deq.norm=frobenius"} <= set(trained["overrides"])


def _job(name, seed, **metrics):
    return {"study": "signal", "name": name, "seed": seed, "command": f"cmd {name} {seed}",
            "run_dir": f"runs/{name}{seed}", "wall_s": 10.0 + seed, "metrics": metrics}


def test_merge_seeds_mean_and_sample_sd():
    jobs = [_job("A", 0, **{"test/mse": 1.0, "test/linf": 4.0}), _job("B", 0, **{"test/mse": 5.0}),
            _job("A", 1, **{"test/mse": 2.0, "test/linf": float("nan")}), _job("A", 2, **{"test/mse": 6.0}),
            {"study": "signal", "name": "B", "seed": 1, "command": "x", "run_dir": "y", "error": "boom"}]
    a, b = sr.merge_seeds(jobs)
    assert (a["name"], b["name"]) == ("A", "B") and a["seeds"] == [0, 1, 2] and a["failed_seeds"] == []
    assert a["metrics"]["test/mse"] == pytest.approx(3.0)
    assert a["sd"]["test/mse"] == pytest.approx(math.sqrt(((1 - 3) ** 2 + (2 - 3) ** 2 + (6 - 3) ** 2) / 2))
    assert a["metrics"]["test/linf"] == 4.0 and a["sd"]["test/linf"] == 0.0  # nan and missing skipped
    assert a["command"] == "cmd A 0" and a["run_dir"] == "runs/A0" and a["wall_s"] == [10.0, 11.0, 12.0]
    assert a["by_seed"][1]["test/mse"] == 2.0
    assert b["seeds"] == [0] and b["failed_seeds"] == [1] and b["metrics"]["test/mse"] == 5.0
    assert sr._pm(a, "test/mse") == "3 ± 2.6" and sr._pm(b, "test/mse") == "5" and sr._pm(a, "nothing") == "—"
    assert sr._pm(a, "test/linf") == "4"  # one finite value: no ± (sd of one value is not an sd)
    assert sr._per_seed(a, b, "test/mse") == (1, 1)  # seed 0 only is common: 1 < 5


def test_merge_seeds_reads_a_json_written_before_seeds():
    old = _job("A", 0, **{"test/mse": 1.0})
    del old["seed"]
    (rec,) = sr.merge_seeds([old])
    assert rec["seeds"] == [0] and sr._pm(rec, "test/mse") == "1"


def test_committed_report_is_its_json_rendered():
    """separation.md is a pure function of separation.json and the template (``--render`` reproduces it)."""
    out = ROOT / "benchmarks" / "results"
    payload = json.loads((out / "separation.json").read_text())
    if not any("seed" in j for j in payload["jobs"]):
        pytest.skip("the committed separation.json predates the seeded report")
    md = sr.markdown(payload["jobs"], payload["exact"], payload["figures"], payload["meta"])
    assert md == (out / "separation.md").read_text()
