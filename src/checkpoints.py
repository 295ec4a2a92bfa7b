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


def check_checkpoint_file(path: str | Path) -> Path:
    """Cheap checks before any unpickling: the file exists and is a complete zip archive (torch.save's
    format). Raises FileNotFoundError / CheckpointError naming the file."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"checkpoint not found: {path}")
    if path.stat().st_size == 0 or not zipfile.is_zipfile(path):
        raise CheckpointError(
            f"checkpoint {path} is truncated or not a PyTorch checkpoint (not a complete zip archive); "
            "use another checkpoint of the run (e.g. checkpoints/last.ckpt or the best epoch_*.ckpt)"
        )
    return path


def load_checked(path: str | Path, map_location="cpu") -> dict:
    """Load a Lightning checkpoint once, checking it on the way; raises CheckpointError naming the file."""
    path = check_checkpoint_file(path)
    try:
        ckpt = torch.load(path, map_location=map_location, weights_only=False)
    except Exception as exc:  # corrupt archive members, unpickling errors
        raise CheckpointError(f"checkpoint {path} could not be read ({type(exc).__name__}: {exc})") from exc
    validate_checkpoint(ckpt, path)
    return ckpt


check_checkpoint = load_checked  # the name the tests and older scripts use


def validate_checkpoint(ckpt, path: str | Path) -> None:
    if not isinstance(ckpt, dict) or "state_dict" not in ckpt or "pytorch-lightning_version" not in ckpt:
        raise CheckpointError(
            f"checkpoint {path} is not a deqsm/Lightning training checkpoint (no state_dict / Lightning version); "
            "src.train and src.evaluate need a file written by src.train"
        )


class AtomicCheckpointIO(TorchCheckpointIO):
    """Lightning CheckpointIO that writes to a temporary file in the target's folder and renames it into
    place, and checks a checkpoint as it loads it (one load, errors that name the file).

    Why not Lightning's own ``_atomic_save``: its fsspec transaction writes to a temporary file in the
    system temp folder and ``shutil.move``s it on commit; when that folder is on another file system than
    the run directory (common on clusters: /tmp local, outputs on a network disk) the move is a copy, and a
    run killed during it leaves a truncated ``last.ckpt`` where a good one stood. Here the temporary file is
    in the same folder, fsynced, and ``os.replace``d (atomic on POSIX), so a finished checkpoint is only
    ever replaced by another finished one.
    """

    def __init__(self, validators=()):
        super().__init__()
        self.validators = list(validators)  # callables (checkpoint dict) -> None that raise on a bad resume

    def load_checkpoint(self, path, map_location=None, weights_only=None):
        # deqsm checkpoints hold RNG states (numpy arrays), which weights_only=True refuses
        ckpt = load_checked(path, map_location=map_location or "cpu")
        for check in self.validators:
            check(ckpt)
        return ckpt

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
