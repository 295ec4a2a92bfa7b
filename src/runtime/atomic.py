"""Files written atomically.

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


