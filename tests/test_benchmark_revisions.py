"""Benchmarks measure revisions side by side: a worker of a revision imports that revision's ``src`` (not the
working tree's), and the before/after table of ncsn_deq_cost reads each revision's rows."""

from __future__ import annotations

import subprocess
import sys

from benchmarks.lib.step_cases import ROOT, rev_env, rev_trees
from benchmarks.studies.ncsn_deq_cost import _revs_lines


def test_a_revision_worker_imports_the_revisions_src(tmp_path):
    tree = rev_trees(["HEAD"], tmp_path)["HEAD"]
    assert (tree / "src" / "deq" / "core.py").is_file() and (tree / "conf" / "train.yaml").is_file()
    code = "import src, benchmarks; print(src.__file__); print(benchmarks.__file__)"
    out = subprocess.run([sys.executable, "-c", code], cwd=tree, env=rev_env(tree, {"PATH": ""}), check=True,
                         capture_output=True, text=True).stdout.split()
    assert out[0].startswith(str(tree)) and out[1].startswith(str(ROOT / "benchmarks"))


def _row(s, mb, iters=None):
    return {"overrides": "deq=true", "s_per_step": s, "s_min": s * 0.9, "s_max": s * 1.2, "saved_MB": mb,
            "iterations": iters, "adjoint_iterations": None}


def test_before_after_table_gives_each_revisions_ratios():
    section = {"meta": {"base": "b", "command": "python -m x", "machine": "m", "rounds": 2, "warmup": 1,
                        "steps": 2, "clock": "cpu"},
               "revs": {"2e5ecdf (2e5ecdf)": {"ncsn/record": _row(2.0, 400.0, 6.0), "ncsn/explicit": _row(1.6, 375.0)},
                        "HEAD (abc1234)": {"ncsn/record": _row(1.8, 410.0, 6.5), "ncsn/explicit": _row(1.5, 375.0)}}}
    lines = _revs_lines(section, "## cost ({base})")
    record = next(line for line in lines if line.startswith("| ncsn/record"))
    cells = [c.strip() for c in record.strip("|").split("|")]
    # s/step before, after, after / before, MB before, after, after / before, x explicit before, after, iterations
    assert cells[2:4] == ["2.000 (1.800–2.400)", "1.800 (1.620–2.160)"]
    assert cells[4] == "0.90" and cells[5:8] == ["400.0", "410.0", "1.025"]
    assert cells[8:10] == ["1.25, 1.07", "1.20, 1.09"] and cells[10] == "6.0 / 6.5"
