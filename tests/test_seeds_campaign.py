"""benchmarks/tools/seeds_campaign.py: the multi-seed generative comparison as one command.

The process pool (parts run N at a time, a failing part reported while the others go on), the protocol each part
is given, and (slow) a whole dry run on MNIST: every part trained and tested, each seed merged, the seeds compared,
nothing in the results showing a path of this machine.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from benchmarks.lib.jobs import run_parallel
from benchmarks.tools import seeds_campaign

ROOT = Path(__file__).resolve().parents[1]


def _job(tmp_path: Path, name: str, code: int) -> list[str]:
    """A part that records when it ran and exits with ``code``."""
    script = (f"import time, sys; t0 = time.time(); time.sleep(0.6); "
              f"open({str(tmp_path / name)!r}, 'w').write(f'{{t0}} {{time.time()}}'); print('ran {name}'); "
              f"sys.exit({code})")
    return [sys.executable, "-c", script, "--name", name]


def test_parts_run_n_at_a_time_and_a_failure_does_not_stop_the_rest(tmp_path, capsys):
    jobs = [((s, v), _job(tmp_path, f"p{s}{v}", 3 if (s, v) == (0, "b") else 0), tmp_path / "logs" / f"p{s}{v}.log")
            for s in (0, 1) for v in "ab"]
    done = run_parallel(jobs, parallel=2, heartbeat_s=0.2)
    assert {k: r["code"] for k, r in done.items()} == {(0, "a"): 0, (0, "b"): 3, (1, "a"): 0, (1, "b"): 0}
    for (s, v), r in done.items():
        assert Path(r["log"]).read_text().strip() == f"ran p{s}{v}" and r["wall_s"] >= 0.6
    spans = [tuple(map(float, (tmp_path / f"p{s}{v}").read_text().split())) for s in (0, 1) for v in "ab"]
    # at every start, how many parts were running: never more than 2, and 2 at some point (really parallel)
    overlap = [sum(a <= t0 < b for a, b in spans) for t0, _ in spans]
    assert max(overlap) == 2
    out = capsys.readouterr().out
    assert "(0, 'b'): FAILED (exit 3" in out and "[4/4 finished]" in out and "running" in out


def test_each_part_gets_the_protocol_and_records_how_many_ran_at_once(tmp_path):
    ns = type("A", (), {})()
    proto = seeds_campaign.PROTOCOL["vae"]
    for key in ("steps", "every", "fid_samples", "ais_points", "final_ais_points", "extra", "eval_extra"):
        setattr(ns, key, proto[key])
    ns.grid, ns.root, ns.threads, ns.parallel, ns.name = "vae", "data", 1, 12, "vae_mnist_seeds"
    ns.runs, ns.work, ns.curve_seeds = ROOT / "outputs" / "r", ROOT / "outputs" / "w", {0, 1, 2}
    cmd = seeds_campaign.part_command(ns, 2, "DEQ-SSM VAE")
    line = seeds_campaign.shown(cmd)
    # the decisive comparison's VAE protocol (docs/experiments.md): 12 000 steps, a checkpoint every 3 000,
    # FID of 1 000 samples with its bootstrap, AIS on 16 images per checkpoint and on 500 at the last one
    for opt in ("--steps 12000", "--every 3000", "--fid-samples 1000", "--ais-points 16", "--final-ais-points 500",
                "--eval-extra model.metrics.fid.bootstrap=100", "--seed 2", "--variants 'DEQ-SSM VAE'",
                "--concurrent 12", "--runs outputs/r", "--out outputs/w/parts",
                "--name vae_mnist_seeds_seed2_deq_ssm_vae"):
        assert opt in line, opt
    assert str(ROOT) not in line and "--test-every" not in line  # a curve seed: every kept checkpoint tested
    assert seeds_campaign.PROTOCOL["ncsn"]["extra"] == "data.batch_size=32"
    ns.curve_seeds = {0}  # --curve-seeds 0: seed 2 tests only its last checkpoint
    assert "--test-every 12000" in seeds_campaign.shown(seeds_campaign.part_command(ns, 2, "DEQ-SSM VAE"))


def test_only_the_curve_steps_and_the_last_checkpoint_are_tested(tmp_path):
    from benchmarks.tools.training_curves import tested_checkpoints

    (tmp_path / "step_checkpoints").mkdir()
    for step in (1500, 3000, 4500, 6000, 7000):
        (tmp_path / "step_checkpoints" / f"step_{step:07d}.ckpt").write_bytes(b"")
    names = lambda every: [c.stem for c in tested_checkpoints(tmp_path, every)]
    assert names(None) == ["step_0001500", "step_0003000", "step_0004500", "step_0006000", "step_0007000"]
    assert names(3000) == ["step_0003000", "step_0006000", "step_0007000"]
    assert names(7000) == ["step_0007000"]


def test_unknown_variant_and_gpu_without_cuda_are_refused(monkeypatch):
    with pytest.raises(SystemExit, match="unknown variant.*'Aug\\(4\\)'"):
        seeds_campaign.main(["vae", "--variants", "Aug(4)", "--dry-run"])
    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(SystemExit, match="no CUDA device"):
        seeds_campaign.main(["vae", "--gpu"])


@pytest.mark.slow
@pytest.mark.parametrize("grid, deq, explicit", [("vae", "DEQ-SSM VAE", "SSM VAE"),
                                                 ("ncsn", "DEQ-SSM-VR NCSN", "TwoRes-SSM-VR NCSN")])
def test_dry_run_trains_tests_merges_and_compares_two_seeds(mnist_root, grid, deq, explicit):
    """The whole campaign at tiny sizes on the CPU (about a minute a grid on 2 cores)."""
    base = ROOT / "outputs" / "test_seeds_campaign" / grid  # inside the repository: recorded relative
    out, work = base / "out", base / "work"
    summary = seeds_campaign.main([grid, "--root", str(mnist_root), "--dry-run", "--seeds", "0,1", "--variants",
                                   f"{explicit},{deq}", "--parallel", "2", "--work", str(work), "--out", str(out)])
    assert summary["failed"] == [] and len(summary["per_seed"]) == 2
    res = json.loads((out / f"{grid}_mnist_seeds.json").read_text())
    assert set(res["runs"]) == {explicit, deq}
    assert all(set(seeds) == {"0", "1"} for seeds in res["runs"].values())
    md = (out / f"{grid}_mnist_seeds.md").read_text()
    assert f'"{deq} ≥ {explicit}", FID at equal steps:' in md
    assert "2 processes at once" in md and "Caution: these runs trained up to 2 processes" in md
    for text in ((out / f"{grid}_mnist_seeds.json").read_text(), md):
        assert str(ROOT) not in text


def test_a_user_override_replaces_the_protocols_value_of_its_key_once():
    """--eval-extra 'model.metrics.fid.bootstrap=100' on the VAE protocol (which sets the same) records it once; a
    different value replaces the protocol's in place; new keys follow."""
    merged = seeds_campaign.merged_overrides
    assert merged("model.metrics.fid.bootstrap=100", "model.metrics.fid.bootstrap=100") == \
        "model.metrics.fid.bootstrap=100"
    assert merged("a=1 b=2", "b=3 c=4") == "a=1 b=3 c=4"
    assert merged("a=1", None) == "a=1" and merged("", "x=1") == "x=1" and merged("", None) == ""


def test_a_part_another_process_still_tests_is_left_out_of_its_seeds_merge(tmp_path):
    """Two campaign processes share a --name: when one ends, a part the other is still testing has runs but no
    real-data FID reference yet; merging it would refuse the whole seed, so it waits, and an empty part is no part."""
    done, testing, empty = tmp_path / "a.json", tmp_path / "b.json", tmp_path / "c.json"
    done.write_text(json.dumps({"meta": {"real_fid_n": 1000}, "runs": {"TwoRes": {"points": {}}}}))
    testing.write_text(json.dumps({"meta": {"real_fid_n": None}, "runs": {"TwoRes-DSM": {"points": {}}}}))
    empty.write_text(json.dumps({"meta": {}, "runs": {}}))
    assert seeds_campaign.finished_parts([done, testing, empty]) == ([done], [testing])
