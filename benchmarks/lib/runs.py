"""Finished ``python -m src.train`` run directories, as the grids read and record them.

- :func:`tested_checkpoint`: the checkpoint a finished run tested;
- :func:`portable`: a grid's record of a run with no path of this machine in it;
- :func:`slug`: a variant's name as a file or directory name.
"""

from __future__ import annotations

import json
import re
from pathlib import Path


def tested_checkpoint(run_dir: Path) -> Path:
    """The checkpoint a finished run tested (its ``metrics.json``), found in the run directory's ``checkpoints/``
    when the recorded path is of another machine or working directory (a run trained elsewhere and copied)."""
    recorded = json.loads((run_dir / "metrics.json").read_text()).get("tested_checkpoint")
    if not recorded:
        return run_dir / "checkpoints" / "last.ckpt"
    path = Path(recorded)
    return path if path.exists() else run_dir / "checkpoints" / path.name


def portable(record: dict) -> dict:
    """The record with its run directory and checkpoint paths relative to the repository (from ``outputs/``
    on), so the committed JSON names no path of the machine that ran it."""
    def rel(path):
        text = str(path)
        return text[text.index("outputs/"):] if "outputs/" in text else text

    out = dict(record, run_dir=rel(record.get("run_dir", "")))
    if "tested_checkpoint" in record.get("metrics", {}):
        out["metrics"] = dict(record["metrics"], tested_checkpoint=rel(record["metrics"]["tested_checkpoint"]))
    return out


def slug(name: str) -> str:
    return re.sub(r"[^A-Za-z0-9]+", "_", name).strip("_").lower()
