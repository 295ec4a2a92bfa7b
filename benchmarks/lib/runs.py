"""Finished ``python -m src.train`` run directories, as the grids read and record them.

- :func:`tested_checkpoint`: the checkpoint a finished run tested;
- :func:`portable`: a grid's record of a run with no path of this machine in it;
- :func:`slug`: a variant's name as a file or directory name;
- :func:`run_dir_name`, :func:`merge_curves`: a training-curves variant's run directory, and parts of one
  ``benchmarks.tools.training_curves`` protocol joined into one result.
"""

from __future__ import annotations

import json
import re
import shutil
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

def run_dir_name(variant: str, seed: int) -> str:
    """A variant's run directory under ``--runs/<grid>``: its slug, with ``_seed<s>`` for a seed other than 0 (so
    the seeds of one variant never share, and never reuse, one run)."""
    return slug(variant) + (f"_seed{seed}" if seed else "")


def merge_curves(paths: list[Path], out: Path, name: str) -> dict:
    """One result from partial ones of the same grid and evaluation protocol (one process per variant, run side
    by side); each part's command is kept, and each variant's sample grid is copied under the new name."""
    parts = [(p, json.loads(p.read_text())) for p in paths]
    first_path, first = parts[0]
    res = {"meta": {k: v for k, v in first["meta"].items() if k != "command"}, "runs": {}}
    res["meta"]["commands"] = []
    for path, part in parts:
        for key in ("grid", "experiment", "seed", "eval_overrides", "real_fid_n", "machine"):
            if part["meta"].get(key) != first["meta"].get(key):
                raise SystemExit(f"{path}: {key} {part['meta'].get(key)!r} differs from {first_path}'s "
                                 f"{first['meta'].get(key)!r}; only results of one protocol can be merged")
        res["meta"]["commands"].append(part["meta"]["command"])
        for variant, run in part["runs"].items():
            if variant in res["runs"]:
                raise SystemExit(f"{path}: variant {variant!r} is in more than one part; merge each once")
            run = dict(run)
            if run.get("samples"):
                target = f"{name}_{slug(variant)}_samples.png"
                out.mkdir(parents=True, exist_ok=True)
                shutil.copyfile(path.parent / run["samples"], out / target)
                run["samples"] = target
            res["runs"][variant] = run
    return res
