"""What the entry points (``src.train``, ``src.evaluate``, ``src.sample``) and the callbacks share: files written
atomically, the run's float environment, and the printed metrics table.

Atomic files: every file a run or a download leaves behind (checkpoints, metrics.json, sample grids, weights,
data archives) is written to a temporary name in its destination's folder and ``os.replace``d into place, so
a reader — or a run killed mid-write — never sees a half-written file where a good one stood. The temporary
file is in the same folder (not the system temp folder) because a rename across file systems is a copy.
"""

from __future__ import annotations

import json
import logging
import os
import tempfile
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from pathlib import Path
from typing import IO, Any

import torch

log = logging.getLogger(__name__)


@contextmanager
def atomic_file(path: str | os.PathLike, mode: str = "wb", *, suffix: str = ".tmp",
                fsync: bool = False) -> Iterator[IO]:
    """Open a temporary file beside ``path`` for writing; on a clean exit it replaces ``path`` (mode 0644),
    on an exception it is removed and ``path`` is left as it was. ``fsync``: flush to disk before the rename
    (checkpoints, downloads)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=suffix)
    try:
        with os.fdopen(fd, mode) as fh:
            yield fh
            fh.flush()
            if fsync:
                os.fsync(fh.fileno())
        os.chmod(tmp, 0o644)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def write_json_atomic(path: str | os.PathLike, payload: Mapping[str, Any]) -> None:
    """``payload`` as indented, key-sorted JSON, written atomically (:func:`atomic_file`)."""
    with atomic_file(path, "w") as fh:
        json.dump(payload, fh, indent=2, sort_keys=True)


def set_float_environment(cfg: Mapping) -> None:
    """Process-wide float settings of a run: ``flush_denormal`` (conf/train.yaml says why). Called first thing
    in a run: the CPU flag is per thread, and the intra-op thread pool inherits it only if it is created after
    (measured: set after a 2-thread op had built the pool, half the results stayed subnormal)."""
    flush = bool(cfg.get("flush_denormal", True))
    if not torch.set_flush_denormal(flush) and flush:
        log.warning("flush_denormal=true is not supported by this CPU (needs SSE3); subnormal floats stay slow")


def print_metrics(metrics: Mapping[str, Any], where: str | os.PathLike) -> None:
    """The numeric entries of ``metrics`` as a table (Rich), titled with the file they were written to."""
    rows = [(k, v) for k, v in metrics.items() if isinstance(v, (int, float)) and not isinstance(v, bool)]
    try:
        from rich.console import Console
        from rich.table import Table
    except ImportError:  # pragma: no cover
        for k, v in sorted(rows):
            print(f"{k}: {v}")
        return
    table = Table(title=f"metrics ({where})")
    table.add_column("metric")
    table.add_column("value", justify="right")
    for k, v in sorted(rows):
        table.add_row(k, f"{v:.6g}" if isinstance(v, float) else str(v))
    Console().print(table)
