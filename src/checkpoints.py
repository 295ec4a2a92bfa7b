"""Checkpoint checks: a truncated or foreign file gets an error that names it, before Lightning sees it."""

from __future__ import annotations

import os
import tempfile
import zipfile
from pathlib import Path

import torch
from lightning.pytorch.plugins.io import TorchCheckpointIO


class CheckpointError(RuntimeError):
    pass


def check_checkpoint(path: str | Path) -> dict:
    """Load and sanity-check a Lightning checkpoint; return it. Raises CheckpointError naming the file."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"checkpoint not found: {path}")
    if path.stat().st_size == 0 or not zipfile.is_zipfile(path):
        raise CheckpointError(
            f"checkpoint {path} is truncated or not a PyTorch checkpoint (not a complete zip archive); "
            "use another checkpoint of the run (e.g. checkpoints/last.ckpt or the best epoch_*.ckpt)"
        )
    try:
        ckpt = torch.load(path, map_location="cpu", weights_only=False)
    except Exception as exc:  # corrupt archive members, unpickling errors
        raise CheckpointError(f"checkpoint {path} could not be read ({type(exc).__name__}: {exc})") from exc
    if not isinstance(ckpt, dict) or "state_dict" not in ckpt or "pytorch-lightning_version" not in ckpt:
        raise CheckpointError(
            f"checkpoint {path} is not a deqsm/Lightning training checkpoint (no state_dict / Lightning version); "
            "src.train and src.evaluate need a file written by src.train"
        )
    return ckpt


class AtomicCheckpointIO(TorchCheckpointIO):
    """Lightning CheckpointIO that writes to a temporary file and renames it into place.

    Lightning's default writes the target file directly, so a run killed mid-write leaves a truncated
    ``last.ckpt`` where a good one stood. Here a finished checkpoint is only ever replaced by another
    finished one (``os.replace`` is atomic on POSIX).
    """

    def save_checkpoint(self, checkpoint, path, storage_options=None):
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
        try:
            with os.fdopen(fd, "wb") as fh:
                torch.save(checkpoint, fh)
                fh.flush()
                os.fsync(fh.fileno())
            os.chmod(tmp, 0o644)
            os.replace(tmp, path)
        except BaseException:
            Path(tmp).unlink(missing_ok=True)
            raise
