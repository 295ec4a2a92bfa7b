"""The fault suite (issue 40): what a run survives, each case with what it checks, as one table.

    make faults      # = FAULTS_OUT=benchmarks/results python -m pytest -q -s -m slow tests/test_faults.py

Every case runs the real entry points (``python -m src.train``, the checkpoint IO, the data readers) under a
fault — SIGKILL mid-epoch (one process and DDP) and mid-save, a NaN, a truncated or foreign checkpoint, corrupt data files, a full
disk, runs started together — and asserts what must hold afterwards. Where an existing test already covers a
case (tests/test_resume_kill.py, tests/test_checkpoint_safety.py, tests/test_infra.py, the data tests) the case
calls it, so the suite and the default tests check the same thing. At the end of the module the table — case,
what is checked, result — is printed and, with ``FAULTS_OUT=<dir>``, written to ``<dir>/faults.md`` and
``faults.json`` with the command and machine facts.
"""

from __future__ import annotations

import contextlib
import datetime
import errno
import os
import platform
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from benchmarks.tools.fault_table import table as fault_rows_table
from benchmarks.tools.fault_table import write as write_fault_table
from tests.conftest import FAST, REPO_ROOT, compose_train

pytestmark = pytest.mark.slow

COMMAND = "python -m pytest -q -s -m slow tests/test_faults.py"  # with FAULTS_OUT=benchmarks/results: make faults
ROWS: list[dict] = []


@contextlib.contextmanager
def case(name: str, checked: str):
    """Run the block as the fault case ``name``; its row says PASS, or FAIL with the first line of the error."""
    t0 = time.monotonic()
    row = {"case": name, "checked": checked}
    try:
        yield
    except BaseException as exc:
        first = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
        row.update(result="FAIL", detail=f"{type(exc).__name__}: {first[:200]}")
        raise
    else:
        row.update(result="PASS", detail="")
    finally:
        row["seconds"] = round(time.monotonic() - t0, 1)
        ROWS.append(row)


@pytest.fixture(scope="module", autouse=True)
def fault_table():
    ROWS.clear()
    yield
    text = fault_rows_table(ROWS)
    print("\n\nfault suite\n" + text)
    out = os.environ.get("FAULTS_OUT")
    if not out:
        return
    facts = {"command": COMMAND, "date_utc": datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M"),
             "python": platform.python_version(), "torch": torch.__version__, "machine": platform.machine(),
             "cpus": os.cpu_count(), "passed": sum(r["result"] == "PASS" for r in ROWS), "cases": len(ROWS)}
    write_fault_table(Path(out), {"meta": facts, "rows": ROWS})


# --------------------------------------------------------------------------------------------- kill and resume
def test_sigkill_mid_epoch_then_resume(tmp_path):
    from tests.test_resume_kill import test_sigkill_mid_epoch_then_resume_is_bit_equal as kill_resume

    with case("SIGKILL mid-epoch, resume (1 process)",
              "DKEF killed by SIGKILL mid-epoch 2 (after a mid-epoch validation), resumed from last.ckpt: "
              "parameters, optimiser, RNG and warm-start states and test metrics bit-equal to the uninterrupted "
              "run in float64; a killed save's temporary file removed"):
        kill_resume(tmp_path, "dkef_midval")


def test_sigkill_from_outside_then_resume(tmp_path):
    from tests.test_infra import test_kill_and_resume_matches_uninterrupted_run as outside_kill

    with case("SIGKILL from outside, resume",
              "a run killed by `kill -9` from another process once epoch 2's checkpoint exists resumes to the "
              "uninterrupted run's parameters and test metrics; training time continues"):
        outside_kill(tmp_path)


def test_ddp_sigkill_mid_epoch_then_resume(tmp_path):
    from tests.test_ddp_resume import test_ddp_sigkill_mid_epoch_then_resume_is_bit_equal as ddp_kill_resume

    with case("SIGKILL mid-epoch, resume (DDP, 2 processes)",
              "DKEF under trainer=ddp_cpu with rank-dependent RNG streams, both ranks killed by SIGKILL mid-epoch, "
              "resumed: parameters, optimiser, every rank's RNG streams and warm starts, test metrics bit-equal to "
              "the uninterrupted run in float64"):
        ddp_kill_resume(tmp_path, "dkef")


KILL_MID_SAVE = """
import os, signal, sys, torch
from src.runtime.checkpoints import AtomicCheckpointIO
io, path = AtomicCheckpointIO(), sys.argv[1]
io.save_checkpoint({"state_dict": {"w": torch.ones(1000)}, "global_step": 1, "pytorch-lightning_version": "2.6"},
                   path)
def dying_save(obj, fh, *args, **kwargs):  # half an archive on disk, then SIGKILL: no clean-up runs
    fh.write(b"PK\\x03\\x04" + bytes(4096)); fh.flush(); os.fsync(fh.fileno())
    os.kill(os.getpid(), signal.SIGKILL)
torch.save = dying_save
io.save_checkpoint({"state_dict": {"w": torch.zeros(1000)}, "global_step": 2, "pytorch-lightning_version": "2.6"},
                   path)
"""


def test_kill_during_a_checkpoint_write(tmp_path):
    from src.runtime.checkpoints import check_checkpoint_file, load_checked, remove_stale_temporaries

    with case("SIGKILL during a checkpoint write",
              "a process killed while writing last.ckpt leaves the previous last.ckpt whole and loadable (step 1), "
              "and only a .last.ckpt.*.tmp, which the next start removes"):
        last = tmp_path / "checkpoints" / "last.ckpt"
        done = subprocess.run([sys.executable, "-c", KILL_MID_SAVE, str(last)], cwd=REPO_ROOT, check=False,
                              capture_output=True, text=True, timeout=120)
        assert done.returncode == -signal.SIGKILL, done.stderr[-2000:]
        check_checkpoint_file(last)
        ckpt = load_checked(last)
        assert ckpt["global_step"] == 1 and torch.equal(ckpt["state_dict"]["w"], torch.ones(1000))
        stale = list(last.parent.glob(".last.ckpt.*.tmp"))
        assert len(stale) == 1 and stale[0].stat().st_size > 4096
        assert remove_stale_temporaries(last.parent) == stale and not stale[0].exists()


# ----------------------------------------------------------------------------------------------- bad values
def test_nan_mid_run(tmp_path):
    from tests.test_checkpoint_safety import test_diverging_run_writes_no_nonfinite_checkpoint as diverging

    with case("NaN mid-run",
              "DEQ-DKEF at lr 5 turns its weights NaN at step 6: no checkpoint of that state is written, the run "
              "stops naming the newest finite checkpoint (step 5), every file on disk is finite"):
        diverging(tmp_path)


def test_corrupt_or_truncated_checkpoint(tmp_path):
    from tests.test_infra import test_corrupt_and_foreign_checkpoints_are_named as corrupt

    with case("truncated or foreign checkpoint",
              "a half-written .ckpt and a non-Lightning one are refused naming the file (`is truncated`, `is not "
              "a deqsm/Lightning checkpoint`), also by `src.train ckpt_path=`"):
        corrupt(tmp_path)


def test_corrupt_data_files(tmp_path):
    from tests.test_data_mnist import test_corrupt_files_are_named_in_the_error as corrupt_mnist
    from tests.test_data_uci import test_wine_parser_rejects_non_wine_files as corrupt_uci

    with case("corrupt data files",
              "MNIST: a truncated gzip, a short IDX payload and an HTML error page saved as .gz are each refused "
              "naming the file; UCI: a CSV without the quality column and an HTML page are refused"):
        (tmp_path / "mnist").mkdir()
        (tmp_path / "uci").mkdir()
        corrupt_mnist(tmp_path / "mnist")
        corrupt_uci(tmp_path / "uci")


# ------------------------------------------------------------------------------------------------- full disk
def test_full_disk_during_a_checkpoint_write(tmp_path, monkeypatch):
    from src.runs.training import train
    from src.runtime import checkpoints
    from src.runtime.checkpoints import load_checked

    with case("full disk (simulated ENOSPC)",
              "the atomic writer fails with ENOSPC at the 3rd checkpoint: the run stops with that OSError, "
              "last.ckpt stays the step-2 state and loads, no temporary file is left behind"):
        saves = {"n": 0}
        real_save = torch.save

        def save_until_full(obj, fh, *args, **kwargs):
            saves["n"] += 1
            if saves["n"] >= 3:
                fh.write(bytes(1024))  # part of the file reached the disk, then it was full
                raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
            return real_save(obj, fh, *args, **kwargs)

        monkeypatch.setattr(checkpoints.torch, "save", save_until_full)
        cfg = compose_train([*FAST, "callbacks=default", "callbacks.progress_bar=null", "callbacks.memory_estimate=null",
                             "trainer.enable_progress_bar=false", "trainer.max_steps=5", "test=false",
                             "callbacks.last_checkpoint.every_n_train_steps=1"], tmp_path)
        with pytest.raises(OSError) as info:
            train(cfg)
        assert info.value.errno == errno.ENOSPC
        monkeypatch.setattr(checkpoints.torch, "save", real_save)
        ckpts = tmp_path / "checkpoints"
        assert load_checked(ckpts / "last.ckpt")["global_step"] == 2
        assert not list(ckpts.glob(".*.tmp")) and not (tmp_path / "metrics.json").exists()


# ---------------------------------------------------------------------------------------------- concurrency
def test_concurrent_runs(tmp_path):
    from tests.test_run_dir import check_concurrent_runs

    with case("4 runs started together",
              "4 `python -m src.train` processes started in the same second with the default run dir: 4 "
              "directories, each with its own last.ckpt, metrics.json (of its seed) and one CSV log"):
        check_concurrent_runs(tmp_path, [0, 1, 2, 3])


def test_an_occupied_run_dir_is_refused(tmp_path):
    from tests.test_run_dir import (
        test_an_explicit_finished_run_dir_is_refused_on_the_command_line as occupied,
    )

    with case("explicit run dir of a finished run",
              "`hydra.run.dir=` of a directory holding metrics.json is refused at start-up in one line naming "
              "it; the old metrics.json is untouched"):
        occupied(tmp_path)
