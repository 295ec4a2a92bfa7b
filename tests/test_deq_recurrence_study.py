"""benchmarks/studies/deq_recurrence.py: its run-directory layout, the rows it reads from finished jobs, and
``report`` (tables from finished jobs, nothing run) followed by ``--render`` (the same markdown from the JSON)."""

from __future__ import annotations

import json

from benchmarks.studies import deq_recurrence as study


def _finish(work, grid, job, metrics):
    rd = study.run_dir(work / grid, job)
    rd.mkdir(parents=True)
    (rd / "metrics.json").write_text(json.dumps(metrics))


def test_decision_grid_has_four_arms_per_seed_in_its_run_directories(tmp_path):
    jobs = study.jobs("decision")
    assert {(j["family"], j["arm"]) for j in jobs} == {
        (f, a) for f in ("dkef", "nice") for a in ("deq_record", "deq_paper", "one_pass", "explicit")}
    assert len(jobs) == 2 * 4 * len(study.SEEDS)
    one_pass = next(j for j in jobs if j["family"] == "nice" and j["arm"] == "one_pass")
    assert one_pass["overrides"].endswith(f"{study.RECORD['nice']} deq.one_pass=true")
    assert study.run_dir(tmp_path, one_pass) == tmp_path / "nice" / "one_pass_seed0"
    assert {j["steps"] for j in study.jobs("decision", "full") if j["family"] == "dkef"} == {2700}


def test_report_reads_finished_jobs_only_and_render_rebuilds_the_table(tmp_path):
    work, out = tmp_path / "work", tmp_path / "out"
    record = next(j for j in study.jobs("decision") if j["family"] == "dkef" and j["arm"] == "deq_record")
    _finish(work, "decision_short", record, {  # three blocks: the row holds their mean
        "val/deq_recurrence_share/k0": 0.2, "val/deq_recurrence_share/k1": 0.3, "val/deq_recurrence_share/k2": 0.4,
        "val/deq_iterations/k0": 8.0, "test/sm_loss": -32.5, "val/sm_loss": -31.0})
    explicit = next(j for j in study.jobs("decision") if j["family"] == "dkef" and j["arm"] == "explicit")
    study.run_dir(work / "decision_short", explicit).mkdir(parents=True)  # unfinished: left out
    study.main(["report", "--work", str(work), "--out", str(out)])
    res = json.loads((out / "deq_recurrence.json").read_text())
    (row,) = res["decision_short"]["rows"]
    assert row["arm"] == "deq_record" and abs(row["val/deq_recurrence_share"] - 0.3) < 1e-12
    assert row["val/deq_recurrence_share_blocks"] == [0.2, 0.3, 0.4] and row["test/sm_loss"] == -32.5
    assert "candidates" not in res  # no finished candidate job
    assert res["decision_short"]["command"] == (
        "python -m benchmarks.studies.deq_recurrence report --work <dir> --out <out dir>")
    text = (out / "deq_recurrence.json").read_text() + (out / "deq_recurrence.md").read_text()
    assert str(tmp_path) not in text
    md = (out / "deq_recurrence.md").read_text()
    assert "| dkef | deq_record | 0 | 0.3 | – | – | – | 8 | – | -31 | -32.5 |" in md
    (out / "deq_recurrence.md").unlink()
    study.main(["--render", "--out", str(out)])
    assert (out / "deq_recurrence.md").read_text() == md


def test_decision_summary_means_and_verdicts_on_known_numbers():
    """Mean ± sd per arm and the verdict of each claim over seeds: the record arm lower than the explicit one by far
    more than 2 s.e. agrees; a difference inside 2 s.e. is undecided."""
    losses = {"deq_record": [-10.0, -11.0, -12.0], "one_pass": [-10.5, -11.0, -11.5], "explicit": [-1.0, -2.0, -3.0],
              "deq_paper": [-9.0, -10.0, -11.0]}
    rows = [{"family": "dkef", "arm": arm, "seed": s, "test/sm_loss": v, "val/deq_recurrence_share": 0.25}
            for arm, vals in losses.items() for s, v in enumerate(vals)]
    text = "\n".join(study.decision_summary(rows))
    assert "| deq_record | 3 | -11.00 ± 1.00 | 0.250 ± 0.000 |" in text
    assert "| the DEQ of record beats the explicit network | agree (difference 9.00, 2 s.e. = 1.63) |" in text
    assert "beats its one-pass control | undecided (difference 0.00" not in text  # equal means are said as such
    assert "beats its one-pass control | undecided (equal means) |" in text
    assert "beats the paper's DEQ | undecided (difference 1.00 ≤ 2 s.e. = 1.63) |" in text
