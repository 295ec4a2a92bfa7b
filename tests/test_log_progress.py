"""Progress in any log (issue 40): with stdout not a terminal a run logs plain lines — step, loss, s/step,
ETA — at a cadence, and the evaluation phases (src.runtime.progress) log theirs; silent on request."""

from __future__ import annotations

import logging
import os
import re
import subprocess
import sys
from types import SimpleNamespace

import pytest
import torch

from src.callbacks.log_progress import LogProgress, format_duration
from tests.conftest import FAST, REPO_ROOT


def fake_trainer(**kw):
    base = {"is_global_zero": True, "global_step": 0, "max_steps": 10, "current_epoch": 0,
            "sanity_checking": False, "callback_metrics": {"val/sm_loss": torch.tensor(0.5)},
            "estimated_stepping_batches": 10}
    return SimpleNamespace(**{**base, **kw})


def run_steps(cb: LogProgress, trainer, n: int) -> None:
    cb.on_train_start(trainer, None)
    for i in range(n):
        trainer.global_step += 1
        cb.on_train_batch_end(trainer, None, {"loss": torch.tensor(1.5 - 0.1 * i)}, None, i)
    cb.on_train_end(trainer, None)


def test_lines_every_n_steps_with_loss_and_eta(caplog):
    caplog.set_level(logging.INFO, logger="src.callbacks.log_progress")
    run_steps(LogProgress(every_n_steps=4, every_s=None, when="always"), fake_trainer(), 10)
    lines = [r.getMessage() for r in caplog.records]
    steps = [m for m in lines if m.startswith("epoch 0 step")]
    assert [m.split(":")[0] for m in steps] == ["epoch 0 step 1/10 (10 %)", "epoch 0 step 4/10 (40 %)",
                                               "epoch 0 step 8/10 (80 %)"]
    assert re.fullmatch(r"epoch 0 step 4/10 \(40 %\): loss 1\.2, [0-9.e-]+ s/step, ETA [0-9.]+ s", steps[1])
    assert lines[0] == "training: from step 0 to 10" and lines[-1].startswith("training done: 10 steps in ")


def test_silent_on_request_on_other_ranks_and_in_a_terminal(caplog, monkeypatch):
    caplog.set_level(logging.INFO, logger="src.callbacks.log_progress")
    run_steps(LogProgress(every_n_steps=1, when="never"), fake_trainer(), 3)
    run_steps(LogProgress(every_n_steps=1, when="always"), fake_trainer(is_global_zero=False), 3)
    monkeypatch.setattr(sys.stdout, "isatty", lambda: True)
    run_steps(LogProgress(every_n_steps=1, when="auto"), fake_trainer(), 3)
    assert caplog.records == []
    monkeypatch.setattr(sys.stdout, "isatty", lambda: False)
    run_steps(LogProgress(every_n_steps=1, when="auto"), fake_trainer(), 3)
    assert len(caplog.records) == 5


def test_a_long_validation_logs_its_batches(caplog, monkeypatch):
    """A validation says when it starts (its batch count) and, when it lasts longer than every_s, how far it
    is every every_s seconds; nothing during the sanity check."""
    caplog.set_level(logging.INFO, logger="src.callbacks.log_progress")
    clock = iter(range(0, 1000, 20))  # each call to the clock: 20 s later
    monkeypatch.setattr("src.callbacks.log_progress.time.monotonic", lambda: float(next(clock)))
    cb = LogProgress(every_s=30.0, when="always")
    trainer = fake_trainer(global_step=200, num_val_batches=[4])
    cb.on_validation_start(trainer, None)
    for i in range(4):
        cb.on_validation_batch_end(trainer, None, None, None, i)
    cb.on_validation_end(trainer, None)
    lines = [r.getMessage() for r in caplog.records]
    assert lines == ["validation at step 200: 4 batches", "validation at step 200: batch 2/4, 40.0 s",
                     "validation at step 200: batch 4/4, 1 min 20 s",
                     "validation at epoch 0 step 200: val/sm_loss 0.5"]
    caplog.clear()
    sanity = fake_trainer(sanity_checking=True, num_val_batches=[2])
    cb.on_validation_start(sanity, None)
    cb.on_validation_batch_end(sanity, None, None, None, 0)
    assert caplog.records == []


def test_bad_settings_are_one_line():
    with pytest.raises(ValueError, match="callbacks.log_progress.when='sometimes' is invalid"):
        LogProgress(when="sometimes")
    with pytest.raises(ValueError, match=r"callbacks.log_progress.every_s=0 must be > 0"):
        LogProgress(every_s=0)


def test_format_duration():
    assert [format_duration(s) for s in (3.21, 75.3, 4000, float("inf"))] == ["3.2 s", "1 min 15 s",
                                                                            "1 h 06 min", "?"]


def test_a_run_logged_to_a_file_shows_its_progress(tmp_path):
    """The user's view: ``python -m src.train ... > run.log 2>&1`` holds the training and test-phase lines."""
    log_file = tmp_path / "run.log"
    cmd = [sys.executable, "-m", "src.train", *FAST, "trainer.max_steps=6", "trainer.val_check_interval=3",
           "callbacks.log_progress.every_n_steps=2", "callbacks.memory_estimate=null",
           "model.metrics.log_likelihood.samples=200", f"hydra.run.dir={tmp_path / 'run'}"]
    with open(log_file, "w") as fh:
        done = subprocess.run(cmd, check=False, cwd=REPO_ROOT, stdout=fh, stderr=subprocess.STDOUT, timeout=300,
                              env={**os.environ, "OMP_NUM_THREADS": "1"})
    text = log_file.read_text()
    assert done.returncode == 0, text[-3000:]
    for step in (2, 4, 6):
        assert re.search(rf"epoch \d+ step {step}/6 \(\d+ %\): loss [-0-9.e]+, [0-9.e-]+ s/step, ETA ", text), step
    assert re.search(r"validation at epoch \d+ step 3: .*val/sm_loss [-0-9.e]+", text)
    assert "training done: 6 steps in " in text
    # the test phase's exact-SM points (src.runtime.progress): start and end lines in the log
    assert re.search(r"exact SM loss \(test points, D=\d+\): started \(\d+ in all\)", text)
    assert re.search(r"exact SM loss \(test points, D=\d+\): done \(\d+\) in ", text)
