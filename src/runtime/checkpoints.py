"""Checkpoint files: checked, safe loads; atomic writes; nothing non-finite or unloadable ever written.

Loading. Every load (resume, ``src.evaluate``, ``src.sample``, the benchmarks) goes through :func:`load_checked`,
which unpickles with ``torch.load(weights_only=True)``: tensors, numbers, strings and plain containers only, so
a checkpoint cannot run code as it is read. A file holding anything else (a pickled class, a function, a numpy
array as written by deqsm before this rule) is refused with :class:`UnsafeCheckpointError`, one line naming the
object; a checkpoint the user trusts (e.g. one they wrote themselves with an older deqsm) is loaded anyway with
``trust=True`` (``trust_checkpoint=true`` on the command line of ``src.train``, ``src.evaluate``, ``src.sample``).

Saving (:class:`AtomicCheckpointIO`). What deqsm writes is loadable that way: OmegaConf containers become plain
dicts/lists, paths strings; any other object is refused at save time with the key that holds it. The file is
written to a temporary file in its own folder, fsynced and renamed into place (atomic on POSIX). With
``last_path`` set (by :class:`src.callbacks.checkpoint.LastCheckpoint`), every checkpoint the run writes — a
step file, the best epoch, in any folder — is written *as* ``last.ckpt`` first and then hard-linked (copied
where links are not supported) under its own name, so a kill at any moment leaves ``last.ckpt`` at the newest
state saved (never behind a step or epoch file). Temporary files a killed
run left behind are removed by :func:`remove_stale_temporaries` when a run starts or resumes in that folder.

Non-finite state: :func:`nonfinite_entries` lists the parameters, optimiser, EMA and DEQ warm-start tensors of
a checkpoint that hold NaN/inf; :class:`src.lit.base.DeqsmModule` refuses to save such a checkpoint (on every
rank, so DDP stops together) and names :func:`newest_checkpoint` to resume from.
"""

from __future__ import annotations

import logging
import os
import pickle
import re
import shutil
import zipfile
from collections import OrderedDict
from collections.abc import Mapping
from pathlib import Path, PurePath
from typing import Any

import torch
from lightning.pytorch.plugins.io import TorchCheckpointIO

from src.runtime.atomic import atomic_file

log = logging.getLogger(__name__)

TRUST_HINT = "trust_checkpoint=true"  # the command-line opt-in for a trusted old checkpoint (docs/usage.md)


class CheckpointError(RuntimeError):
    pass


class UnsafeCheckpointError(CheckpointError):
    """A checkpoint holds a pickled object that a weights-only load refuses (it could run code as it loads)."""


class NonFiniteCheckpointError(FloatingPointError):
    """The state to be checkpointed holds NaN/inf: the checkpoint is not written."""


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


def _offending_object(exc: BaseException) -> str:
    """The pickled global torch's weights-only unpickler refused (``posix.system``, ``numpy.dtype``, …), from
    its message ("… GLOBAL <module.name> …"); the message's first line when it names none."""
    match = re.search(r"GLOBAL ([\w.]+)", str(exc))
    return match.group(1) if match else str(exc).splitlines()[0][:200]


def load_checked(path: str | Path, map_location="cpu", trust: bool = False, mmap: bool = False) -> dict:
    """Load a Lightning checkpoint once, checking it on the way: weights-only unpickling unless ``trust``
    (module docstring). ``mmap``: map the tensors' storage instead of reading it (a cheap look at a checkpoint's
    metadata, e.g. a resume's checks before the run starts). Raises UnsafeCheckpointError / CheckpointError naming
    the file."""
    path = check_checkpoint_file(path)
    try:
        ckpt = torch.load(path, map_location=map_location, weights_only=not trust, mmap=mmap)
    except pickle.UnpicklingError as exc:
        if trust:
            raise CheckpointError(f"checkpoint {path} could not be read ({type(exc).__name__}: {exc})") from exc
        raise UnsafeCheckpointError(
            f"checkpoint {path} holds a pickled {_offending_object(exc)}, which a safe load refuses (a checkpoint "
            f"can carry code that runs as it loads); load it only if you trust the file, with {TRUST_HINT}"
        ) from None
    except Exception as exc:  # corrupt archive members
        raise CheckpointError(f"checkpoint {path} could not be read ({type(exc).__name__}: {exc})") from exc
    validate_checkpoint(ckpt, path)
    return ckpt


def validate_checkpoint(ckpt, path: str | Path) -> None:
    if not isinstance(ckpt, dict) or "state_dict" not in ckpt or "pytorch-lightning_version" not in ckpt:
        raise CheckpointError(
            f"checkpoint {path} is not a deqsm/Lightning training checkpoint (no state_dict / Lightning version); "
            "src.train and src.evaluate need a file written by src.train"
        )


def check_matches_model(checkpoint: Mapping, model: torch.nn.Module, path: str | Path = "the checkpoint") -> None:
    """One line naming both families, or the first mismatching keys/shapes, when ``checkpoint``'s weights do not
    fit ``model`` (a checkpoint of another family or other sizes), instead of load_state_dict's key dump."""
    state = checkpoint.get("state_dict", {})
    mine = model.state_dict()
    here = type(model).__name__
    family = checkpoint.get("deqsm_family")
    if family and family != here:
        raise CheckpointError(f"checkpoint {path} is a {family} checkpoint, but this run builds a {here}: use the "
                              "model (and data) config the checkpoint was trained with")
    missing = [k for k in mine if k not in state]
    unexpected = [k for k in state if k not in mine]
    shapes = [f"{k} {list(state[k].shape)} in the checkpoint vs {list(v.shape)} here" for k, v in mine.items()
              if k in state and torch.is_tensor(v) and torch.is_tensor(state[k]) and state[k].shape != v.shape]
    if not (missing or unexpected or shapes):
        return

    def few(items):
        return ", ".join(items[:3]) + (f" (+{len(items) - 3} more)" if len(items) > 3 else "")

    parts = ([f"shapes differ: {few(shapes)}"] if shapes else []) + \
        ([f"missing in the checkpoint: {few(missing)}"] if missing else []) + \
        ([f"not in this {here}: {few(unexpected)}"] if unexpected else [])
    raise CheckpointError(f"checkpoint {path} ({family or 'another model'}) does not fit this {here}: "
                          f"{'; '.join(parts)}; use the model and data settings it was trained with")


# ------------------------------------------------------------------------------------------ what may be saved
_LEAVES = (str, bytes, bytearray, int, float, bool, complex, type(None), torch.Tensor, torch.Size, torch.dtype,
           torch.device)


def safe_contents(obj: Any, where: str = "checkpoint") -> Any:
    """``obj`` with OmegaConf containers as plain dicts/lists and paths as strings, everything else kept;
    raises TypeError naming ``where`` (the key path) for a value a weights-only load would refuse."""
    if isinstance(obj, _LEAVES):
        return obj
    try:
        from omegaconf import Container, OmegaConf

        if isinstance(obj, Container):
            return OmegaConf.to_container(obj, resolve=True)
    except ImportError:  # pragma: no cover
        pass
    if isinstance(obj, PurePath):
        return str(obj)
    if isinstance(obj, Mapping):
        items = {k: safe_contents(v, f"{where}/{k}") for k, v in obj.items()}
        return OrderedDict(items) if isinstance(obj, OrderedDict) else items
    if isinstance(obj, (list, tuple, set, frozenset)):
        values = [safe_contents(v, f"{where}[{i}]") for i, v in enumerate(obj)]
        return values if isinstance(obj, list) else (tuple(values) if isinstance(obj, tuple) else set(values))
    raise TypeError(
        f"{where} holds a {type(obj).__module__}.{type(obj).__qualname__}, which a safe checkpoint load "
        "(weights_only=True) refuses: store it as tensors or plain Python values (numbers, strings, lists, dicts)"
    )


# ------------------------------------------------------------------------------------------ non-finite state
FINITE_KEYS = ("state_dict", "optimizer_states", "current_model_state", "deqsm_warm_start")


def nonfinite_entries(checkpoint: Mapping, keys=FINITE_KEYS) -> list[str]:
    """Key paths of the floating tensors under ``keys`` (parameters and buffers, optimiser states, the EMA's
    trained weights, DEQ warm starts) that hold a NaN or an inf."""
    bad: list[str] = []

    def walk(obj, where):
        if torch.is_tensor(obj):
            if (obj.is_floating_point() or obj.is_complex()) and not bool(torch.isfinite(obj).all()):
                bad.append(where)
        elif isinstance(obj, Mapping):
            for k, v in obj.items():
                walk(v, f"{where}/{k}")
        elif isinstance(obj, (list, tuple)):
            for i, v in enumerate(obj):
                walk(v, f"{where}[{i}]")

    for key in keys:
        if key in checkpoint:
            walk(checkpoint[key], key)
    return bad


def newest_checkpoint(folders) -> Path | None:
    """The newest ``*.ckpt`` in ``folders`` (by modification time; ``last.ckpt`` first among equals)."""
    found = [p for folder in folders if folder and Path(folder).is_dir() for p in Path(folder).glob("*.ckpt")]
    if not found:
        return None
    return max(found, key=lambda p: (p.stat().st_mtime_ns, p.name == "last.ckpt"))


def remove_stale_temporaries(folder: str | Path | None) -> list[Path]:
    """Delete the ``.<name>.ckpt.*.tmp`` files a run killed while saving left in ``folder`` (SIGKILL runs no
    clean-up); returns them."""
    if folder is None or not Path(folder).is_dir():
        return []
    stale = sorted(Path(folder).glob(".*.ckpt.*.tmp"))
    for p in stale:
        p.unlink(missing_ok=True)
    if stale:
        log.info("removed %d unfinished checkpoint file(s) of a killed run in %s", len(stale), folder)
    return stale


# ------------------------------------------------------------------------------------------ the IO plugin
def _write_atomic(checkpoint: dict, path: Path) -> None:
    with atomic_file(path, fsync=True) as fh:
        torch.save(checkpoint, fh)


def _link_atomic(source: Path, path: Path) -> None:
    """``path`` becomes another name of ``source``'s content (a hard link; a copy where links fail), atomically."""
    tmp = path.parent / f".{path.name}.{os.getpid()}.link.tmp"
    tmp.unlink(missing_ok=True)
    try:
        try:
            os.link(source, tmp)
        except OSError:  # no hard links on this file system
            shutil.copyfile(source, tmp)
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


class AtomicCheckpointIO(TorchCheckpointIO):
    """Lightning CheckpointIO: safe, checked loads and atomic, safe writes (module docstring).

    Why not Lightning's own ``_atomic_save``: its fsspec transaction writes to a temporary file in the
    system temp folder and ``shutil.move``s it on commit; when that folder is on another file system than
    the run directory (common on clusters: /tmp local, outputs on a network disk) the move is a copy, and a
    run killed during it leaves a truncated ``last.ckpt`` where a good one stood. Here the temporary file is
    in the same folder, fsynced, and ``os.replace``d (atomic on POSIX), so a finished checkpoint is only
    ever replaced by another finished one.

    ``validators``: callables ``(checkpoint dict, path=…) -> None`` that raise on a bad resume. ``trust``: unpickle
    without the weights-only restriction (a trusted old checkpoint). ``last_path``: the run's ``last.ckpt``;
    every other checkpoint is written as it first (module docstring). ``stamp``: entries added to every checkpoint
    written (``src.train``: the run's identity, :mod:`src.runs.identity`, which a resume checks).
    """

    def __init__(self, validators=(), trust: bool = False, last_path: str | Path | None = None,
                 stamp: Mapping[str, Any] | None = None):
        super().__init__()
        self.validators = list(validators)
        self.stamp = dict(stamp or {})
        self.trust = bool(trust)
        self.last_path = None if last_path is None else Path(last_path)

    def load_checkpoint(self, path, map_location=None, weights_only=None):
        # weights-only unless the user trusts the file, whatever Lightning passes (module docstring)
        ckpt = load_checked(path, map_location=map_location or "cpu", trust=self.trust)
        for check in self.validators:
            check(ckpt, path=path)
        return ckpt

    def save_checkpoint(self, checkpoint, path, storage_options=None):
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        checkpoint = safe_contents({**checkpoint, **self.stamp})
        last = self.last_path
        if last is None or path.resolve() == last.resolve():
            _write_atomic(checkpoint, path)
            return
        _write_atomic(checkpoint, last)  # the newest state first: a kill now leaves last.ckpt current
        _link_atomic(last, path)
