"""One run, one directory (issue 40): a default run dir unique per process, and an explicit one that another
run used is refused in one line unless the run resumes from a checkpoint inside it."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from src.runtime.run_dir import LOCK_NAME, RunDirInUse, claim_run_dir, release, run_stamp
from tests.conftest import FAST, REPO_ROOT

TINY_RUN = [*FAST, "trainer.max_steps=3", "trainer.enable_progress_bar=false", "callbacks.memory_estimate=null",
            "model.metrics.log_likelihood.samples=200"]


def _env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in ("LOCAL_RANK", "NODE_RANK", "RANK")}
    return {**env, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}


def test_run_stamp_is_fixed_in_a_process_and_differs_between_processes():
    assert run_stamp() == run_stamp()
    code = "from src.runtime.run_dir import run_stamp; print(run_stamp())"
    procs = [subprocess.Popen([sys.executable, "-c", code], cwd=REPO_ROOT, stdout=subprocess.PIPE, text=True)
             for _ in range(3)]
    stamps = [p.communicate(timeout=120)[0].strip() for p in procs]
    assert len(set(stamps)) == 3, stamps
    assert all(len(s.split("_")) == 4 for s in stamps)  # date, time, microseconds, pid


def test_hydra_run_dir_uses_the_unique_stamp():
    from hydra import compose, initialize_config_dir
    from hydra.core.global_hydra import GlobalHydra

    GlobalHydra.instance().clear()
    with initialize_config_dir(config_dir=str(REPO_ROOT / "conf"), version_base="1.3"):
        cfg = compose(config_name="train", return_hydra_config=True)
    assert str(cfg.hydra.run.dir).endswith(f"/runs/{run_stamp()}")
    assert str(cfg.hydra.sweep.dir).endswith(f"/multiruns/{run_stamp()}")


def test_a_used_run_dir_is_refused_unless_resumed_from(tmp_path):
    assert claim_run_dir(tmp_path / "fresh") is not None  # a new directory: claimed
    finished = tmp_path / "finished"
    finished.mkdir()
    (finished / "metrics.json").write_text("{}")
    with pytest.raises(RunDirInUse) as info:
        claim_run_dir(finished)
    assert "\n" not in str(info.value)
    assert str(info.value).startswith(f"run directory {finished} already holds a finished run (metrics.json)")
    killed = tmp_path / "killed"
    (killed / "checkpoints").mkdir(parents=True)
    (killed / "checkpoints" / "last.ckpt").write_bytes(b"x")
    (killed / LOCK_NAME).write_text(f"{socket.gethostname()} 999999999\n")  # a dead process's lock
    with pytest.raises(RunDirInUse, match="checkpoints"):
        claim_run_dir(killed)
    with pytest.raises(RunDirInUse):  # a checkpoint elsewhere is no resume of this dir
        claim_run_dir(killed, ckpt_path=tmp_path / "other" / "last.ckpt")
    lock = claim_run_dir(killed, ckpt_path=killed / "checkpoints" / "last.ckpt")  # resuming on purpose
    assert lock.read_text().split()[1] == str(os.getpid())
    release(lock)
    assert not lock.exists()


def test_a_running_run_is_refused_even_when_resuming(tmp_path):
    sleeper = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        (tmp_path / "checkpoints").mkdir()
        (tmp_path / "checkpoints" / "last.ckpt").write_bytes(b"x")
        (tmp_path / LOCK_NAME).write_text(f"{socket.gethostname()} {sleeper.pid}\n")
        with pytest.raises(RunDirInUse, match=f"a running run \\(process {sleeper.pid}"):
            claim_run_dir(tmp_path, ckpt_path=tmp_path / "checkpoints" / "last.ckpt")
    finally:
        sleeper.kill()
        sleeper.wait()
    assert claim_run_dir(tmp_path, ckpt_path=tmp_path / "checkpoints" / "last.ckpt") is not None


def test_worker_ranks_neither_check_nor_claim(tmp_path, monkeypatch):
    (tmp_path / "metrics.json").write_text("{}")
    monkeypatch.setenv("LOCAL_RANK", "1")
    assert claim_run_dir(tmp_path) is None
    assert not (tmp_path / LOCK_NAME).exists()


def concurrent_runs(log_dir: Path, seeds: list[int]) -> list[subprocess.CompletedProcess]:
    """``python -m src.train`` once per seed, all started together, with the default run directory."""
    procs = [subprocess.Popen([sys.executable, "-m", "src.train", *TINY_RUN, f"seed={seed}", "logger=csv",
                               "callbacks=default", "callbacks.progress_bar=null",
                               f"paths.log_dir={log_dir}"], cwd=REPO_ROOT, env=_env(),
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for seed in seeds]
    outs = [p.communicate(timeout=600) for p in procs]
    return [subprocess.CompletedProcess(p.args, p.returncode, *out) for p, out in zip(procs, outs)]


def check_concurrent_runs(log_dir: Path, seeds: list[int]) -> list[Path]:
    """Each run has its own directory with its own checkpoint, metrics.json (of its seed) and CSV log."""
    for done in concurrent_runs(log_dir, seeds):
        assert done.returncode == 0, done.stderr[-3000:]
    run_dirs = sorted((log_dir / "train" / "runs").iterdir())
    assert len(run_dirs) == len(seeds), run_dirs
    got = sorted(json.loads((d / "metrics.json").read_text())["config"]["seed"] for d in run_dirs)
    assert got == sorted(seeds)
    for d in run_dirs:
        assert (d / "checkpoints" / "last.ckpt").is_file()
        assert len(list(d.rglob("metrics.csv"))) == 1  # one CSV version: no other run logged here
        assert not (d / LOCK_NAME).exists()  # released at the end
    return run_dirs


def test_concurrent_runs_keep_their_own_directories(tmp_path):
    check_concurrent_runs(tmp_path, [1, 2])  # four at once: tests/test_faults.py (make faults)


def test_an_explicit_finished_run_dir_is_refused_on_the_command_line(tmp_path):
    (tmp_path / "metrics.json").write_text("{}")
    cmd = [sys.executable, "-m", "src.train", *TINY_RUN, f"hydra.run.dir={tmp_path}"]
    done = subprocess.run(cmd, check=False, cwd=REPO_ROOT, env=_env(), capture_output=True, text=True,
                          timeout=300)
    assert done.returncode != 0
    assert f"already holds a finished run (metrics.json): resume it with ckpt_path={tmp_path}" in done.stderr
    assert (tmp_path / "metrics.json").read_text() == "{}"
