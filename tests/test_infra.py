"""Training infrastructure: DDP, kill-and-resume, checkpoint errors, re-evaluation, sweep reports."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from src.runtime.checkpoints import CheckpointError, load_checked
from tests.conftest import FAST, REPO_ROOT

# A tiny DEQ-DKEF run: a few epochs of a few steps each, checkpoint every epoch.
RUN = [*FAST, "logger=csv", "callbacks=default", "callbacks.progress_bar=null", "trainer.max_epochs=4",
       "data.n_train=64", "data.batch_size=16", "trainer.enable_progress_bar=false"]


def run_train(overrides: list[str], run_dir: Path, timeout: int = 300, **popen) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "src.train", *overrides, f"hydra.run.dir={run_dir}"]
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "WANDB_MODE": "offline"}
    return subprocess.run(cmd, check=False, cwd=REPO_ROOT, env=env, capture_output=True, text=True, timeout=timeout, **popen)


def final_state(run_dir: Path) -> dict[str, torch.Tensor]:
    return torch.load(run_dir / "checkpoints" / "last.ckpt", map_location="cpu", weights_only=True)["state_dict"]


def checkpoint_train_time(path: Path) -> float:
    """The profiling callback's summed training-step time saved in a checkpoint."""
    states = torch.load(path, map_location="cpu", weights_only=True)["callbacks"]
    (value,) = [s["train_time_s"] for k, s in states.items() if "ProfilingCallback" in str(k)]
    return value


# slow: test_resume_kill.py's dkef_midval case SIGKILLs and resumes a DKEF run, bit-equal (train time: only here)
@pytest.mark.slow
def test_kill_and_resume_matches_uninterrupted_run(tmp_path):
    full = tmp_path / "full"
    res = run_train([*RUN, "seed=3"], full)
    assert res.returncode == 0, res.stderr[-3000:]

    # start the same run, SIGKILL it once the epoch-2 checkpoint exists, then resume from last.ckpt
    killed = tmp_path / "killed"
    cmd = [sys.executable, "-m", "src.train", *RUN, "seed=3", "trainer.max_epochs=4", f"hydra.run.dir={killed}"]
    proc = subprocess.Popen(cmd, cwd=REPO_ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                            env={**os.environ, "WANDB_MODE": "offline"})
    ckpt = killed / "checkpoints" / "last.ckpt"
    deadline = time.time() + 240
    while time.time() < deadline and proc.poll() is None:
        if ckpt.exists():
            try:
                if torch.load(ckpt, map_location="cpu", weights_only=True)["epoch"] >= 1:
                    break
            except Exception:  # noqa: BLE001, S110  being written right now: try again
                pass
        time.sleep(0.05)
    assert proc.poll() is None, "run finished before it could be killed: make it longer"
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    interrupted_epoch = torch.load(ckpt, map_location="cpu", weights_only=True)["epoch"]
    assert interrupted_epoch < 3
    interrupted_time = checkpoint_train_time(ckpt)
    assert interrupted_time > 0

    resumed = run_train([*RUN, "seed=3", f"ckpt_path={ckpt}"], killed)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    a, b = final_state(full), final_state(killed)
    assert a.keys() == b.keys()
    for k in a:
        torch.testing.assert_close(a[k], b[k], rtol=0, atol=1e-6, msg=f"parameter {k} differs after resume")
    ma = json.loads((full / "metrics.json").read_text())
    mb = json.loads((killed / "metrics.json").read_text())
    for key in ("test/sm_loss", "test/log_likelihood", "test/fisher_divergence"):
        assert ma[key] == pytest.approx(mb[key], rel=1e-5, abs=1e-6), key
    # the training time a checkpoint records is continued on resume, not restarted
    assert checkpoint_train_time(full / "checkpoints" / "last.ckpt") == pytest.approx(ma["profile/train_time_s"])
    assert checkpoint_train_time(ckpt) == pytest.approx(mb["profile/train_time_s"])
    assert mb["profile/train_time_s"] > interrupted_time

    # re-evaluating the finished run from its checkpoint reproduces its test metrics
    from src.runs.evaluation import evaluate

    tested = ma["tested_checkpoint"]
    ev = evaluate(tested)
    for key in ("test/sm_loss", "test/log_likelihood", "test/fisher_divergence"):
        assert ev[key] == pytest.approx(ma[key], rel=1e-6, abs=1e-6), key


def test_corrupt_and_foreign_checkpoints_are_named(tmp_path):
    truncated = tmp_path / "truncated.ckpt"
    torch.save({"state_dict": {"w": torch.zeros(1000)}, "pytorch-lightning_version": "2.6"}, truncated)
    data = truncated.read_bytes()
    truncated.write_bytes(data[: len(data) // 2])
    with pytest.raises(CheckpointError, match=r"truncated\.ckpt is truncated"):
        load_checked(truncated)
    foreign = tmp_path / "foreign.ckpt"
    torch.save({"weights": torch.zeros(3)}, foreign)
    with pytest.raises(CheckpointError, match=r"foreign\.ckpt is not a deqsm/Lightning"):
        load_checked(foreign)
    res = run_train([*FAST, f"ckpt_path={truncated}", "trainer.max_epochs=1"], tmp_path / "run")
    assert res.returncode != 0 and "truncated.ckpt is truncated" in res.stderr


# slow: test_ddp.py's VAE case runs trainer=ddp_cpu with identical ranks and a sharded test phase
@pytest.mark.slow
def test_ddp_two_cpu_processes_end_identical(tmp_path):
    run_dir = tmp_path / "ddp"
    res = run_train([*FAST, "callbacks=default", "callbacks.progress_bar=null", "trainer=ddp_cpu",
                     "trainer.max_epochs=2", "trainer.enable_progress_bar=false"], run_dir)
    assert res.returncode == 0, res.stderr[-4000:]
    metrics = json.loads((run_dir / "metrics.json").read_text())
    assert metrics["ddp/world_size"] == 2
    fps = metrics["ddp/param_fingerprints"]
    assert len(fps) == 2 and fps[0] == fps[1] and metrics["ddp/ranks_identical"] is True
    assert all(k in metrics for k in ("test/sm_loss", "test/log_likelihood"))
    # the test phase ran sharded over the 2 ranks (16 of the 32 test points each) and was reduced with
    # torchmetrics: it equals one process testing the same checkpoint on the whole split
    from src.runs.evaluation import evaluate

    single = evaluate(metrics["tested_checkpoint"])
    for key in ("test/sm_loss", "test/log_likelihood", "test/fisher_divergence"):
        assert metrics[key] == pytest.approx(single[key], rel=1e-5, abs=1e-6), key


def test_report_over_two_sweeps(tmp_path):
    cmd = [sys.executable, "-m", "src.train", "-m", *FAST, "trainer.max_epochs=1", "deq=false", "depth=1,2",
           "seed=0,1", f"hydra.sweep.dir={tmp_path / 'sweep_a'}"]
    res = subprocess.run(cmd, check=False, cwd=REPO_ROOT, capture_output=True, text=True, timeout=400)
    assert res.returncode == 0, res.stderr[-3000:]
    cmd = [sys.executable, "-m", "src.train", "-m", *FAST, "trainer.max_epochs=1", "deq=true", "seed=0,1",
           f"hydra.sweep.dir={tmp_path / 'sweep_b'}"]
    res = subprocess.run(cmd, check=False, cwd=REPO_ROOT, capture_output=True, text=True, timeout=400)
    assert res.returncode == 0, res.stderr[-3000:]
    assert len(list((tmp_path / "sweep_a").rglob("metrics.json"))) == 4
    res = subprocess.run([sys.executable, "-m", "src.report", str(tmp_path / "sweep_a"), str(tmp_path / "sweep_b"),
                          "--out", str(tmp_path / "rep")], check=False, cwd=REPO_ROOT, capture_output=True, text=True,
                         timeout=120)
    assert res.returncode == 0, res.stderr[-3000:]
    report = json.loads((tmp_path / "rep" / "report.json").read_text())
    assert report["n_jobs"] == 6
    # grouped by the swept keys, seeds averaged: depth=1, depth=2 (deq=false) and deq=true
    assert len(report["rows"]) == 3 and all(r["n_seeds"] == 2 for r in report["rows"])
    md = (tmp_path / "rep" / "report.md").read_text()
    assert "± " in md and "test SM loss" in md
    # each DEQ row's recurrence share beside its iterations (the mean of DKEF's three blocks); none for explicit rows
    assert md.splitlines()[0].endswith("| DEQ iters | DEQ recurrence share |")
    shares = {r["group"]["deq"]: r["metrics"]["test/deq_recurrence_share"] for r in report["rows"]}
    assert shares["True"]["n"] == 2 and 0.1 < shares["True"]["mean"] < 0.2 and shares["False"]["n"] == 0
    for png in ("memory_vs_depth.png", "test_loss_vs_wall_time.png"):
        assert (tmp_path / "rep" / png).stat().st_size > 1000
