"""The project's own errors reach the user as one line, without a traceback, and exit non-zero; HYDRA_FULL_ERROR=1
keeps the traceback (src/runs/errors.py, at the entry points src.train, src.evaluate, src.sample)."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

from src.runs.errors import is_project_error, one_line
from tests.conftest import FAST, FAST_MODEL, REPO_ROOT


def _run(module: str, args: list[str], full_error: bool = False) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k != "HYDRA_FULL_ERROR"}
    env.update(OMP_NUM_THREADS="1", WANDB_MODE="offline", **({"HYDRA_FULL_ERROR": "1"} if full_error else {}))
    return subprocess.run([sys.executable, "-m", module, *args], check=False, cwd=REPO_ROOT, env=env,
                          capture_output=True, text=True, timeout=300)


@pytest.mark.parametrize("overrides, line", [
    (["deq.max_iter=0"], "ValueError: deq.max_iter must be >= 1, got 0"),
    # slow: deq.max_iter=0 covers the same one_line_errors() path; test_train.py checks the message in-process
    pytest.param(["deq.norm_lambda=0.5"],
                 ("ValueError: deq.norm_lambda=0.5 is invalid: it must be > 1 so that the DEQ map is a "
                  "contraction (paper §3.2: W <- W / (lambda ||W||_F))"), marks=pytest.mark.slow),
    # slow: deq.max_iter=0 covers the same one_line_errors() path; test_train.py checks the message in-process
    pytest.param(["data=redwine", "data.root={root}", "data.download=false"],
                 ("FileNotFoundError: data file 'winequality-red.csv' not found (searched: "
                  "{root}/wine-quality/winequality-red.csv, {root}/winequality-red.csv); download=False, so it was "
                  "not downloaded."), marks=pytest.mark.slow),
])
def test_train_prints_the_projects_line_and_exits_1(tmp_path, overrides, line):
    root = tmp_path / "nowhere"
    done = _run("src.train", [*FAST_MODEL, *(o.format(root=root) for o in overrides), f"hydra.run.dir={tmp_path}"])
    assert done.returncode == 1
    lines = done.stderr.splitlines()
    assert len([ln for ln in lines if ln.startswith(line.format(root=root))]) == 1  # once, on one line
    assert "Traceback" not in done.stderr and '  File "' not in done.stderr, done.stderr[-3000:]
    assert not (tmp_path / "metrics.json").exists()


def test_train_keeps_the_traceback_with_hydra_full_error(tmp_path):
    done = _run("src.train", [*FAST, "deq.max_iter=0", f"hydra.run.dir={tmp_path}"], full_error=True)
    assert done.returncode == 1
    assert "Traceback (most recent call last)" in done.stderr
    assert "src/deq/config.py" in done.stderr  # the frame that raised the original error
    assert "ValueError: deq.max_iter must be >= 1, got 0" in done.stderr


# slow: src.sample covers src.evaluate's case, the two entry points run the same report_errors() wrapper
@pytest.mark.parametrize("module", [pytest.param("src.evaluate", marks=pytest.mark.slow), "src.sample"])
def test_evaluate_and_sample_print_one_line(tmp_path, module):
    missing = tmp_path / "nowhere" / "last.ckpt"
    done = _run(module, [f"ckpt_path={missing}"])
    assert done.returncode == 1
    assert done.stderr.strip().splitlines() == [f"FileNotFoundError: checkpoint not found: {missing}"]
    done = _run(module, [f"ckpt_path={missing}"], full_error=True)
    assert done.returncode == 1 and "Traceback (most recent call last)" in done.stderr
    assert "src/runtime/checkpoints.py" in done.stderr


def test_only_errors_raised_by_the_project_are_shortened():
    from src.deq.config import deq_setting

    with pytest.raises(ValueError) as ours:
        deq_setting({"enabled": True, "max_iter": 0}, "dkef")
    assert is_project_error(ours.value)
    assert one_line(ours.value).startswith("ValueError: deq.max_iter must be >= 1")
    with pytest.raises(ValueError) as theirs:  # raised inside torch: keeps its traceback
        torch.optim.Adam([], lr=1e-3)
    assert not is_project_error(theirs.value)
    assert not is_project_error(RuntimeError("not a validation error"))
