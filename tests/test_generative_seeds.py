"""The multi-seed NCSN / SSM-VAE comparison (benchmarks/tools/generative_seeds.py) on per-seed results with known numbers:
seeds read from the commands, protocol checks, the equal-steps and equal-wall-time reads, the verdicts."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from benchmarks.tools import generative_seeds as gs

DEQ, REFINE, TWORES = "DEQ-SSM-VR NCSN", "SSM-VR NCSN (RefineNet)", "TwoRes-SSM-VR NCSN"


def _run(seed: int, fids: list[float], walls: list[float], dsm: float, saved: float, per_step: float) -> dict:
    """A training_curves run: checkpoints at steps 100, 200, … with the given FIDs and wall times."""
    pts = {f"step_{100 * (i + 1):07d}.ckpt": {
        "step": 100 * (i + 1), "train_time_s": w,
        "metrics": {"test/fid": f, "test/fid_bootstrap_sd": 2.0, "test/dsm_loss": dsm + (len(fids) - 1 - i)}}
        for i, (f, w) in enumerate(zip(fids, walls))}
    return {"command": f"python -m src.train experiment=ncsn_mnist seed={seed} test=false", "points": pts,
            "train": {"profile/saved_bytes_mean": saved, "profile/time_per_step_s": per_step}}


def _part(tmp_path: Path, seed: int, runs: dict, **meta) -> Path:
    m = {"grid": "ncsn", "experiment": "experiment=ncsn_mnist", "eval_overrides": ["model.metrics.fid.n_samples=1000"],
         "real_fid_n": 1000, "real_fid": 20.0, "machine": "test machine", "command": f"python x --seed {seed}"} | meta
    path = tmp_path / f"part{seed}_{len(list(tmp_path.iterdir()))}.json"
    path.write_text(json.dumps({"meta": m, "runs": runs}))
    return path


def _three_seeds(tmp_path: Path) -> list[Path]:
    # DEQ: FID 100/101/102 at 200 steps, fast (1 s/step); RefineNet: FID 150/152/148, 2 s/step;
    # TwoRes: FID 99/104/101 (a tie with the DEQ)
    parts = []
    for s, (d, r, t) in enumerate([(100, 150, 99), (101, 152, 104), (102, 148, 101)]):
        parts.append(_part(tmp_path, s, {
            DEQ: _run(s, [300, d], [100, 200], 10.0, 3e8, 1.0),
            REFINE: _run(s, [170 + s, r], [200, 400], 12.0, 6e8, 2.0),
            TWORES: _run(s, [280, t], [100, 200], 10.5, 3e8, 1.0)}))
    return parts


def test_seed_of_reads_the_last_seed_override():
    assert gs.seed_of("python -m src.train seed=2 data.seed=5") == 2
    assert gs.seed_of("python -m src.train experiment=x") == 0
    assert gs.seed_of("python -m src.train seed=1 seed=3") == 3


def test_collect_groups_seeds_and_refuses_mixed_protocols(tmp_path):
    parts = _three_seeds(tmp_path)
    res = gs.collect([(p, json.loads(p.read_text())) for p in parts])
    assert sorted(res["runs"][DEQ]) == ["0", "1", "2"] and len(res["meta"]["parts"]) == 3
    other = _part(tmp_path, 3, {DEQ: _run(3, [1], [1], 1, 1, 1)}, eval_overrides=["model.metrics.fid.n_samples=250"])
    with pytest.raises(SystemExit, match="eval_overrides"):
        gs.collect([(p, json.loads(p.read_text())) for p in [*parts, other]])
    with pytest.raises(SystemExit, match="seed 0 is in more than one part"):
        gs.collect([(p, json.loads(p.read_text())) for p in [parts[0], parts[0]]])


def test_equal_steps_equal_wall_time_and_verdicts(tmp_path):
    res = gs.collect([(p, json.loads(p.read_text())) for p in _three_seeds(tmp_path)])
    res["meta"] |= {"command": "python -m benchmarks.tools.generative_seeds ncsn", "name": "ncsn_mnist_seeds"}
    budget = gs.wall_budget(res["runs"])
    assert budget == 200  # the DEQ's and TwoRes' 200 s; the RefineNet needs 400 s for its 200 steps
    slow = json.loads(json.dumps(res["runs"]))
    slow[DEQ]["2"]["points"]["step_0000200.ckpt"]["train_time_s"] = 230  # one slower seed: all its seeds finish
    slow[TWORES]["0"]["points"]["step_0000200.ckpt"]["train_time_s"] = 260
    assert gs.wall_budget(slow) == 230
    # within 200 s the RefineNet reached step 100 only: FID 170/171/172
    assert gs.at_wall_time(res["runs"][REFINE]["1"], budget) | {} == {
        "test/fid": 171, "test/fid_bootstrap_sd": 2.0, "test/dsm_loss": 13.0, "step": 100}
    lines = gs.verdicts(res, budget)
    text = "\n".join(lines)
    # DEQ 101 ± 1 vs RefineNet 150 ± 2: better by 49, 2 s.e. = 2 sqrt(1/3 + 4/3) = 2.58; Welch df = 50/17
    assert (f'"{DEQ} ≥ {REFINE}", FID at equal steps: agree at 2 s.e. (difference 49.00 > 2 s.e. = 2.58); agree by '
            "Welch's t-test (p < 0.001, df = 2.9: needs > 3.22 s.e. = 4.16); 101.00 vs 150.00") in text
    assert f'"{DEQ} ≥ {REFINE}", FID at equal wall time (200 s): agree' in text
    # DEQ 101 ± 1 vs TwoRes 101.33 ± 2.52: a tie
    assert f'"{DEQ} ≥ {TWORES}", FID at equal steps: undecided' in text
    # saved bytes do not vary over seeds: any difference decides, none is a tie
    assert (f'"{DEQ} needs less saved MB / step than {REFINE}": agree (no spread on either side: any difference '
            "decides) at 2 s.e. and by Welch's t-test; ratio 0.50") in text
    assert (f'"{DEQ} needs less saved MB / step than {TWORES}": undecided (equal means) at 2 s.e. and by Welch\'s '
            "t-test; ratio 1.00") in text
    md = gs.render(res)
    assert "| DEQ-SSM-VR NCSN | 0,1,2 | 200 | 101.00 ± 1.00 | 2.00 | 10.00 ± 0.00 | — | 300.0 ± 0.0 | 1.000 ± 0.000 | 200 ± 0 |" in md
    assert "## At the same training wall time (200 s, the fastest variant's)" in md
    assert "| SSM-VR NCSN (RefineNet) | 0,1,2 | 100 ± 0 | 171.00 ± 1.00 | 13.00 ± 0.00 |" in md
    # a seed tested only at its last step, past the budget, is not read at equal time, and the row says so
    last_only = json.loads(json.dumps(res))
    del last_only["runs"][REFINE]["2"]["points"]["step_0000100.ckpt"]
    assert "| SSM-VR NCSN (RefineNet) | 0,1 | 100 ± 0 | 170.50 ± 0.71 |" in gs.render(last_only)


def test_equal_time_table_warns_when_runs_shared_the_machine(tmp_path):
    """Parts trained side by side (seeds_campaign.py --parallel) record it, and the equal-wall-time table says that
    their wall times include the others' load; parts trained alone (or recorded before the field) get no warning."""
    alone = gs.collect([(p, json.loads(p.read_text())) for p in _three_seeds(tmp_path)])
    alone["meta"] |= {"command": "c", "name": "n"}
    assert [p["concurrent"] for p in alone["meta"]["parts"]] == [1, 1, 1]
    assert "Caution" not in gs.render(alone)
    shared = json.loads(json.dumps(alone))
    shared["meta"]["parts"][1]["concurrent"] = 12
    md = gs.render(shared)
    caution = md.index("Caution: these runs trained up to 12 processes at once")
    assert md.index("## At the same training wall time") < caution < md.index("## Verdicts")


def test_main_writes_json_markdown_and_figure_and_renders_again(tmp_path):
    parts = _three_seeds(tmp_path)
    out = tmp_path / "out"
    gs.main(["ncsn", *(a for p in parts for a in ("--part", str(p))), "--out", str(out)])
    for suffix in ("json", "md", "png"):
        assert (out / f"ncsn_mnist_seeds.{suffix}").stat().st_size > 0
    md = (out / "ncsn_mnist_seeds.md").read_text()
    (out / "ncsn_mnist_seeds.md").unlink()
    gs.main(["ncsn", "--render", "--out", str(out)])
    assert (out / "ncsn_mnist_seeds.md").read_text() == md
    with pytest.raises(SystemExit, match="not 'vae'"):
        gs.main(["vae", "--part", str(parts[0]), "--out", str(out)])


def test_vae_last_metrics_take_the_larger_final_ais_test():
    run = {"points": {"a": {"step": 100, "train_time_s": 5, "metrics": {"test/log_likelihood": -120.0}}},
           "final": {"step": 100, "ais_points": 500,
                     "metrics": {"test/log_likelihood": -110.0, "test/log_likelihood_stderr": 1.5}}}
    last = gs.last_metrics(run)
    assert last["test/log_likelihood"] == -110.0 and last["ais_points"] == 500
    run["final"]["step"] = 50  # a final test of another checkpoint is not this one's
    assert gs.last_metrics(run)["test/log_likelihood"] == -120.0


def test_vae_arms_are_compared_paired_by_image():
    """The per-image AIS differences of two arms on the same images: per seed and pooled, with the verdict at
    2 s.e. of the mean paired difference — a shift hidden by the images' spread in the unpaired errors shows."""
    import math

    rec, ssm = "DEQ-SSM VAE (record)", "SSM VAE"
    base = [-80.0 - 10 * i for i in range(20)]  # the images' spread: sd ~59 nats
    shift = [0.5 + (0.1 if i % 2 else -0.1) for i in range(20)]  # the DEQ arm 0.5 ± 0.1 nats higher per image

    def run(values):
        return {"final": {"per_point": values}}

    res = {"runs": {rec: {"0": run([b + s for b, s in zip(base, shift)]), "1": run([b + 0.5 for b in base])},
                    ssm: {"0": run(base), "1": run(base)}}}
    (line,) = [x for x in gs.paired_lines(res) if x.startswith(f"- {rec} − {ssm}")]
    se = math.sqrt(sum((d - 0.5) ** 2 for d in shift) / 39) / math.sqrt(40)  # the pooled differences' s.e.
    assert (f"+0.500 ± {se:.3f} nats over 40 (seed, image) pairs → agree at 2 s.e., agree by the paired t-test "
            "(p < 0.001, df = 39)") in line
    assert "seed 0: +0.500 ± 0.023 (20 images)" in line and "seed 1: +0.500 ± 0.000 (20 images)" in line
    res["runs"][rec]["1"] = run([b - 2.0 for b in base])  # seed 1 worse by 2 nats: the pooled mean turns negative
    (line,) = [x for x in gs.paired_lines(res) if x.startswith(f"- {rec} − {ssm}")]
    assert line.split(" nats")[0].endswith("-0.750 ± 0.200") and "disagree at 2 s.e., disagree by the paired" in line
    # a shift of 2.6 s.e.: decided at 2 s.e., not by the t-test at 3 pairs (t₀.₉₇₅(2) = 4.30)
    res = {"runs": {rec: {"0": run([1.0, 3.0, 5.0])}, ssm: {"0": run([0.0, 0.0, 0.0])}}}
    (line,) = [x for x in gs.paired_lines(res) if x.startswith(f"- {rec} − {ssm}")]
    assert "+3.000 ± 1.155 nats over 3 (seed, image) pairs → agree at 2 s.e., undecided by the paired t-test" in line


def test_the_decision_joins_committed_reference_seeds_of_the_same_protocol(tmp_path):
    """The image-DEQ decision (``ncsn_search``): a design and its one-pass control trained now, TwoRes and RefineNet
    joined from a committed result of another grid with the same experiment, evaluation and real-data FID; the
    verdicts read the design against all three. A reference of another protocol, or a variant it lacks, is
    refused."""
    design, control = "S1 mdeq_res", "S1 mdeq_res (one-pass)"
    parts = [_part(tmp_path, s, {design: _run(s, [300, 90 + s], [100, 200], 10.0, 3e8, 1.0),
                                 control: _run(s, [300, 120 + s], [100, 200], 10.0, 2e8, 0.8)}, grid="ncsn_search")
             for s in range(3)]
    campaign = gs.collect([(p, json.loads(p.read_text())) for p in _three_seeds(tmp_path)])
    campaign["meta"] |= {"command": "python -m benchmarks.tools.generative_seeds ncsn --part …", "name": "campaign"}
    committed = tmp_path / "campaign.json"
    committed.write_text(json.dumps(campaign))
    out = tmp_path / "out"
    gs.main(["ncsn_search", *(a for p in parts for a in ("--part", str(p))), "--out", str(out),
             "--name", "decision", "--reference", f"{committed}:{TWORES},{REFINE}"])
    res = json.loads((out / "decision.json").read_text())
    assert sorted(res["runs"]) == sorted([design, control, TWORES, REFINE])
    assert res["runs"][TWORES] == campaign["runs"][TWORES]
    assert res["meta"]["references"][0]["variants"] == [TWORES, REFINE]
    md = (out / "decision.md").read_text()
    assert "Joined as committed from `campaign.json` (grid `ncsn`" in md
    # design 91 ± 1 against TwoRes 101.33 ± 2.52, its control 121 ± 1 and RefineNet 150 ± 2: better than all three
    for other in (TWORES, control, REFINE):
        assert f'"{design} ≥ {other}", FID at equal steps: agree at 2 s.e.' in md
    with pytest.raises(SystemExit, match="no variant 'TwoRes'"):
        gs.main(["ncsn_search", "--part", str(parts[0]), "--out", str(out), "--reference", f"{committed}:TwoRes"])
    other = json.loads(committed.read_text())
    other["meta"]["real_fid_n"] = 500
    committed.write_text(json.dumps(other))
    with pytest.raises(SystemExit, match="real_fid_n"):
        gs.main(["ncsn_search", "--part", str(parts[0]), "--out", str(out), "--reference", f"{committed}:{TWORES}"])
