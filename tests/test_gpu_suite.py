"""benchmarks/tools/gpu_suite.py --dry-run: the GPU suite's code path on the CPU at tiny sizes.

One dry run (in-process; its two ``python -m src.train`` jobs are subprocesses, as on a GPU) writes the JSON and
markdown: every part is there, every row measured with finite positive figures (the CPU has no CUDA peak, and the
file says so with null), the markdown names every row, and nothing in either file shows a path of this machine.
"""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest

from benchmarks.tools import gpu_suite

ROOT = Path(__file__).resolve().parents[1]

pytestmark = pytest.mark.usefixtures("one_thread")


def positive(x) -> bool:
    return isinstance(x, (int, float)) and math.isfinite(x) and x > 0


def test_dry_run_writes_every_part(tmp_path, mnist_root):
    out = tmp_path / "res"
    res = gpu_suite.main(["--dry-run", "--root", str(mnist_root), "--out", str(out)])
    saved = json.loads((out / "gpu_suite.json").read_text())
    md = (out / "gpu_suite.md").read_text()
    assert saved == json.loads(json.dumps(res))
    assert set(saved["parts"]) == {"memory", "ddp", "fid"} and saved["meta"]["dry_run"] is True

    rows = saved["parts"]["memory"]["rows"]
    assert [(r["table"], r["method"]) for r in rows] == [(t, m) for t, m, _ in gpu_suite.memory_rows()]
    assert len(rows) == 7
    for r in rows:
        assert r["status"] == "ok", (r["method"], r.get("note"))
        assert all(positive(r[k]) for k in ("params", "graph_MB", "s_per_iter", "repeats")), r
        assert r["peak_cuda_MB"] is None  # no CUDA device: no peak, not a made-up one
        assert f"| {r['table']} | {r['method']} |" in md
    # the graph grows with the explicit depth (Aug(16) > Aug(8) > SSM VAE; RefineNet > TwoRes) and the NCSN
    # score's graph is part of its step's
    g = {r["method"]: r["graph_MB"] for r in rows}
    assert g["Aug(16)-SSM VAE"] > g["Aug(8)-SSM VAE"] > g["SSM VAE"]
    assert g["SSM-VR NCSN (RefineNet)"] > g["TwoRes-SSM-VR NCSN (DEQ off)"]
    assert all(0 < r["score_graph_MB"] < r["graph_MB"] for r in rows if r["table"] == "Table 5")

    points = saved["parts"]["ddp"]["points"]
    assert [p["devices"] for p in points] == [1]
    p = points[0]
    assert p["status"] == "ok", p.get("note")
    assert positive(p["s_per_step"]) and p["images_per_s"] == pytest.approx(2 / p["s_per_step"])
    assert p["world_size"] == 1 and p["steps"] == 2 and p["speedup"] == 1.0
    assert "trainer=ddp" in p["command"] and f"`{p['command']}`" in md

    fid = saved["parts"]["fid"]
    assert fid["status"] == "ok", fid.get("note")
    assert positive(fid["fid"]) and fid["fid_n_samples"] == 8 and fid["global_step"] == 2
    assert all(positive(fid[k]) for k in ("wall_s", "fit_s", "test_s", "s_per_step"))
    assert f"`{fid['command']}`" in md and f"FID **{fid['fid']:.1f}** on n = 8" in md

    text = json.dumps(saved) + md
    assert "<data dir>" in saved["meta"]["command"] and "data.root=<data dir>" in fid["command"]
    for private in (str(mnist_root), str(ROOT), str(tmp_path)):
        assert private not in text, private


def test_no_cuda_and_no_dry_run_exits_with_one_line():
    if __import__("torch").cuda.is_available():
        pytest.skip("a CUDA device is present")
    proc = subprocess.run([sys.executable, "-m", "benchmarks.tools.gpu_suite", "--budget-s", "10"],
                          check=False, capture_output=True, text=True, cwd=ROOT, timeout=120)
    assert proc.returncode == 1
    assert proc.stderr.strip().splitlines() == [
        "gpu_suite: no CUDA device found; run it on a GPU machine, or pass --dry-run to check it on the CPU"]
