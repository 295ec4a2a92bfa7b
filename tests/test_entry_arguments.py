"""The ``key=value`` arguments of ``python -m src.evaluate`` and ``python -m src.sample``
(src/runs/load.py ``split_arguments``): the entry point's own keys apart from the run-config overrides."""

from __future__ import annotations

import subprocess
import sys

import pytest

from src.runs.load import split_arguments
from tests.conftest import REPO_ROOT


def test_own_keys_apart_from_overrides():
    own, overrides = split_arguments(["ckpt_path=a/b=c.ckpt", "data.root=/d", "n=8", "trust_checkpoint=true", "n"],
                                     ("ckpt_path", "n", "trust_checkpoint"))
    assert own == {"ckpt_path": "a/b=c.ckpt", "n": "8", "trust_checkpoint": "true"}  # split at the first '='
    assert overrides == ["data.root=/d"]  # a bare own key is neither


# slow: test_one_line_errors.py's src.sample case runs the same command (ckpt_path taken, the missing file named)
@pytest.mark.slow
def test_entry_points_take_their_keys_on_the_command_line(tmp_path):
    """The commands themselves: src.evaluate without ckpt_path prints its usage line; src.sample passes its
    ckpt_path on (a missing file is named) and keeps n/out apart from the run-config overrides."""
    res = subprocess.run([sys.executable, "-m", "src.evaluate", "n=3"], check=False, cwd=REPO_ROOT, capture_output=True,
                         text=True, timeout=120)
    assert res.returncode != 0
    assert res.stderr.strip().splitlines()[-1].startswith("usage: python -m src.evaluate ckpt_path=")
    missing = tmp_path / "missing.ckpt"
    res = subprocess.run([sys.executable, "-m", "src.sample", f"ckpt_path={missing}", "n=4", "out=s.png",
                          "model.sampling.n_steps_each=2"], check=False, cwd=REPO_ROOT, capture_output=True, text=True, timeout=120)
    assert res.returncode != 0
    assert str(missing) in res.stderr
