"""benchmarks/studies/deq_recurrence.py: its run-directory layout, the rows it reads from finished jobs, and
``report`` (tables from finished jobs, nothing run) followed by ``--render`` (the same markdown from the JSON)."""

from __future__ import annotations

import json

from benchmarks.studies import deq_recurrence as study


def _finish(work, grid, job, metrics):
    rd = study.run_dir(work / grid, job)
    rd.mkdir(parents=True)
    (rd / "metrics.json").write_text(json.dumps(metrics))


def test_decision_grid_has_its_arms_per_seed_in_its_run_directories(tmp_path):
    jobs = study.jobs("decision")
    four = {(f, a) for f in ("dkef", "nice", "ncsn") for a in ("deq_record", "deq_paper", "one_pass", "explicit")}
    three = {("vae", a) for a in ("deq_record", "one_pass", "explicit")}
    spectral = {("ncsn", "deq_spectral"), ("ncsn", "one_pass_spectral")}
    assert {(j["family"], j["arm"]) for j in jobs} == four | three | spectral
    assert len(jobs) == (len(four) + len(three) + len(spectral)) * len(study.SEEDS)
    ncsn = next(j for j in jobs if j["family"] == "ncsn" and j["arm"] == "one_pass_spectral")
    assert "deq.norm=spectral" in ncsn["overrides"] and "deq.one_pass=true" in ncsn["overrides"]
    vae = next(j for j in jobs if j["family"] == "vae" and j["arm"] == "explicit")
    assert "deq=false" in vae["overrides"] and "log_likelihood.test_points=100" in vae["overrides"]
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
    assert "| deq_record | 1 | -32.50 | 0.300 | 8.0 |" in md
    (out / "deq_recurrence.md").unlink()
    study.main(["--render", "--out", str(out)])
    assert (out / "deq_recurrence.md").read_text() == md


def test_decision_summary_means_and_verdicts_on_known_numbers():
    """Mean ± sd per arm and the verdict of each claim over seeds: the record arm lower than the explicit one by far
    more than 2 s.e. agrees by both rules; a difference inside 2 s.e. is undecided by both."""
    losses = {"deq_record": [-10.0, -11.0, -12.0], "one_pass": [-10.5, -11.0, -11.5], "explicit": [-1.0, -2.0, -3.0],
              "deq_paper": [-9.0, -10.0, -11.0]}
    rows = [{"family": "dkef", "arm": arm, "seed": s, "test/sm_loss": v, "val/deq_recurrence_share": 0.25}
            for arm, vals in losses.items() for s, v in enumerate(vals)]
    text = "\n".join(study.decision_summary(rows))
    assert "| deq_record | 3 | -11.00 ± 1.00 | 0.250 ± 0.000 | — |" in text
    sm = "test SM loss (lower is better)"
    assert (f"| the DEQ of record beats the explicit network | {sm} | agree at 2 s.e. (difference 9.00 > 2 s.e. = "
            "1.63); agree by Welch's t-test (p < 0.001, df = 4.0: needs > 2.78 s.e. = 2.27) |") in text
    assert "beats its one-pass control | undecided at 2 s.e. (difference 0.00" not in text  # equal means said so
    assert f"beats its one-pass control | {sm} | undecided (equal means) at 2 s.e. and by Welch's t-test |" in text
    assert (f"beats the paper's DEQ | {sm} | undecided at 2 s.e. (difference 1.00 ≤ 2 s.e. = 1.63); undecided by "
            "Welch's t-test (p = 0.288, df = 4.0: needs > 2.78 s.e. = 2.27) |") in text


def test_decision_summary_higher_is_better_for_log_likelihoods():
    """The SSM-VAE is decided on its AIS log p(x): a higher mean agrees, and a missing arm's claims are skipped."""
    lls = {"deq_record": [-100.0, -101.0, -102.0], "one_pass": [-110.0, -111.0, -112.0],
           "explicit": [-90.0, -91.0, -92.0]}
    rows = [{"family": "vae", "arm": arm, "seed": s, "test/log_likelihood": v}
            for arm, vals in lls.items() for s, v in enumerate(vals)]
    text = "\n".join(study.decision_summary(rows))
    ll = "AIS log p(x) (nats, 100 images) (higher is better)"
    welch = "by Welch's t-test (p < 0.001, df = 4.0: needs > 2.78 s.e. = 2.27) |"
    assert f"one-pass control | {ll} | agree at 2 s.e. (difference 10.00 > 2 s.e. = 1.63); agree {welch}" in text
    assert (f"beats the explicit network | {ll} | disagree at 2 s.e. (difference 10.00 > 2 s.e. = 1.63); disagree "
            f"{welch}") in text
    assert "paper's DEQ" not in text


def test_protocol_grid_keeps_each_experiments_own_length():
    """The protocol grid runs each family's experiment with deq=true (its block of record) as committed: no
    step count, validation schedule or block override in its command."""
    jobs = study.jobs("protocol")
    assert [j["family"] for j in jobs] == ["dkef", "nice", "vae", "ncsn"]
    for j in jobs:
        cmd = " ".join(study.command(j, "<data dir>", "<run dir>"))
        assert "deq=true" in cmd and "max_steps" not in cmd and "val_check_interval" not in cmd
        assert "deq.norm" not in cmd and "test=false" in cmd


def test_every_ncsn_decision_arm_composes_the_block_its_name_says(tmp_path):
    """ncsn_mnist defaults to the normalised block: an arm that names another block must switch it off (seed 2 of
    the paper's arm and two spectral seeds once ran the normalised block under their labels)."""
    from src.deq.config import deq_setting
    from tests.conftest import compose_train

    base, _ = study.FAMILIES["ncsn"]
    want = {"deq_record": ("normalized_residual", None, None, "implicit", False),
            "one_pass": ("normalized_residual", None, None, "implicit", True),
            "deq_paper": (None, "frobenius", 2.0, "phantom", False),
            "deq_spectral": (None, "spectral", 1.5, "implicit", False),
            "one_pass_spectral": (None, "spectral", 1.5, "implicit", True)}
    arms = study.decision_arms("ncsn")
    assert set(want) <= set(arms)
    for arm, expected in want.items():
        cfg = compose_train([*base.split(), *arms[arm].split()], tmp_path / arm)
        deq = deq_setting(cfg.deq, "ncsn")
        assert (deq.block, deq.norm, deq.norm_lambda, deq.backward, deq.one_pass) == expected, arm
