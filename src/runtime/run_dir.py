"""One run, one directory.

Two things keep two runs from writing into the same ``outputs/.../runs/<stamp>/``:

- :func:`run_stamp`, the ``${run_stamp:}`` resolver of ``conf/hydra/default.yaml``: the start time to the
  microsecond plus the process id (``2026-11-27_00-21-29_123456_4242``), computed once per process. Two runs
  started in the same second — a shell loop over seeds with ``&`` — get two directories.
- :func:`claim_run_dir`, called as a run starts: a directory that holds a finished or running run
  (``metrics.json``, a checkpoint, or a :data:`LOCK_NAME` whose process is alive) is refused in one line,
  unless the run resumes from a checkpoint inside it on purpose (``ckpt_path=<dir>/checkpoints/last.ckpt``).
  Otherwise the directory is claimed with a lock file holding this process id (removed by :func:`release`).

Only the launching process claims: DDP worker ranks (started by Lightning with ``hydra.run.dir=`` the same
directory) and the ranks of a multi-node job skip both.
"""

from __future__ import annotations

import datetime
import functools
import os
import socket
from pathlib import Path

LOCK_NAME = ".run.lock"


@functools.lru_cache(maxsize=1)
def run_stamp() -> str:
    """This process's run stamp: local start time to the microsecond and the process id (cached: every
    resolution in one process — run dir, sweep dir — gives the same value)."""
    return f"{datetime.datetime.now():%Y-%m-%d_%H-%M-%S_%f}_{os.getpid()}"


class RunDirInUse(RuntimeError):
    """The run directory holds another run (finished or running)."""


def _is_worker_rank() -> bool:
    """A process that Lightning (or a cluster launcher) started as a rank other than 0."""
    return any(int(os.environ.get(k, "0") or 0) > 0 for k in ("LOCAL_RANK", "NODE_RANK", "RANK"))


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # a process of another user holds it: alive
        return True
    return True


def _live_lock(lock: Path) -> int | None:
    """The pid of the live process (on this host) that holds ``lock``, else None (no lock, a stale one)."""
    try:
        host, pid = lock.read_text().split()[:2]
        pid_int = int(pid)
    except (OSError, ValueError):
        return None
    if host != socket.gethostname():
        return pid_int  # another machine's run: cannot check it, treat it as running
    return pid_int if pid_int != os.getpid() and _pid_alive(pid_int) else None


def _is_inside(path: str | os.PathLike | None, directory: Path) -> bool:
    if not path:
        return False
    try:
        Path(path).resolve().relative_to(directory.resolve())
    except ValueError:
        return False
    return True


def occupant(run_dir: Path) -> str | None:
    """What in ``run_dir`` shows another run used it (a phrase), or None when it is free."""
    pid = _live_lock(run_dir / LOCK_NAME)
    if pid is not None:
        return f"a running run (process {pid}, {LOCK_NAME})"
    if (run_dir / "metrics.json").exists():
        return "a finished run (metrics.json)"
    ckpts = sorted((run_dir / "checkpoints").glob("*.ckpt")) if (run_dir / "checkpoints").is_dir() else []
    if ckpts:
        return f"a run's checkpoints ({ckpts[0].name})"
    return None


def claim_run_dir(run_dir: str | os.PathLike, ckpt_path: str | os.PathLike | None = None) -> Path | None:
    """Refuse ``run_dir`` when another run used it (see the module docstring), else write its lock file.
    Returns the lock's path (None on worker ranks, which neither check nor claim)."""
    if _is_worker_rank():
        return None
    run_dir = Path(run_dir)
    lock = run_dir / LOCK_NAME
    pid = _live_lock(lock)
    what = occupant(run_dir)
    resuming = _is_inside(ckpt_path, run_dir)
    if what is not None and (pid is not None or not resuming):
        hint = ("wait for it or choose another hydra.run.dir" if pid is not None else
                f"resume it with ckpt_path={run_dir}/checkpoints/last.ckpt, or leave hydra.run.dir at its "
                "default (a new directory per run)")
        raise RunDirInUse(f"run directory {run_dir} already holds {what}: {hint}")
    run_dir.mkdir(parents=True, exist_ok=True)
    lock.write_text(f"{socket.gethostname()} {os.getpid()}\n")
    return lock


def release(lock: Path | None) -> None:
    """Remove this process's lock file (the run ended; metrics.json or its checkpoints now mark the dir)."""
    if lock is None:
        return
    try:
        if lock.read_text().split()[1] == str(os.getpid()):
            lock.unlink()
    except (OSError, IndexError):
        pass
