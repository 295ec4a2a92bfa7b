"""The one job runner of the benchmarks: ``python -m src.<entry> …`` processes run in the repository, one at a
time (:func:`run_module`, :func:`train_job`) or N at a time (:func:`run_parallel`).

- :func:`thread_env`: this environment with the torch/BLAS threads set;
- :func:`run_process`: one command, optionally stopped (with every process it started) after a time limit;
- :func:`run_module`: ``python -m <entry> <args>``; its exit code and output tail;
- :func:`train_job`: one ``python -m src.train`` job in its run directory (reused when that already holds
  ``metrics.json``), or in a temporary one that is removed afterwards;
- :func:`run_parallel`: commands ``parallel`` at a time, each with its output in its own log file.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path

from benchmarks.lib.results import ROOT

__all__ = ["run_module", "run_parallel", "run_process", "thread_env", "train_job"]


def thread_env(threads: int | None = 1) -> dict[str, str]:
    """This process's environment with ``OMP_NUM_THREADS``/``MKL_NUM_THREADS`` set to ``threads`` (None: as is)."""
    env = dict(os.environ)
    if threads:
        env.update(OMP_NUM_THREADS=str(threads), MKL_NUM_THREADS=str(threads))
    return env


def run_process(cmd: Sequence[str], env: dict | None = None, capture: bool = True,
                timeout_s: float | None = None, cwd: Path | None = None) -> dict:
    """Run ``cmd`` in the repository (or ``cwd``: a revision's tree, :func:`benchmarks.lib.step_cases.rev_env`; its
    own process group). Returns ``{"code", "wall_s", "stdout" (its whole
    output; "" unless ``capture``), "tail" (the last 2000 characters of its stderr, of its stdout when stderr is
    empty), "stopped"}``; after ``timeout_s`` the process and all it started are killed (``stopped`` True,
    ``code`` None)."""
    pipe = subprocess.PIPE if capture else None
    t0 = time.perf_counter()
    proc = subprocess.Popen(list(cmd), cwd=cwd or ROOT, env=env, stdout=pipe, stderr=pipe, text=True,
                            start_new_session=True)
    try:
        stdout, stderr = proc.communicate(timeout=None if timeout_s is None else max(1.0, timeout_s))
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.communicate()
        return {"code": None, "wall_s": time.perf_counter() - t0, "stdout": "", "tail": "", "stopped": True}
    return {"code": proc.returncode, "wall_s": time.perf_counter() - t0, "stdout": stdout or "",
            "tail": ((stderr or stdout) or "")[-2000:], "stopped": False}


def run_module(entry: str, args: Sequence[str], env: dict | None = None, capture: bool = True
               ) -> tuple[int, str]:
    """Run ``python -m <entry> <args>`` in the repository; return its exit code and, when ``capture``, the
    last 2000 characters of its stderr (of its stdout when stderr is empty). ``capture=False`` lets its
    output through (a long training run a user watches)."""
    ran = run_process([sys.executable, "-m", entry, *args], env, capture)
    return ran["code"], ran["tail"]


def resume_overrides(run_dir: Path) -> list[str]:
    """``["ckpt_path=<run_dir>/checkpoints/last.ckpt"]`` when an unfinished run (no ``metrics.json``) left its
    newest state there — a job killed mid-run continues exactly where it stopped (src.train refuses to start a
    new run in a directory that holds a checkpoint) —, else ``[]``."""
    last = Path(run_dir) / "checkpoints" / "last.ckpt"
    if (Path(run_dir) / "metrics.json").exists() or not last.is_file():
        return []
    return [f"ckpt_path={last}"]


def train_job(overrides: Sequence[str], run_dir: Path | None, env: dict | None = None, rerun: bool = False,
              capture: bool = True, timeout_s: float | None = None) -> dict:
    """One ``python -m src.train <overrides> hydra.run.dir=<run_dir>`` job.

    A run directory that already holds ``metrics.json`` is reused (nothing runs) unless ``rerun``, which
    moves the old run directory aside (``<name>.replaced-<time>``) and trains afresh; one whose run was killed resumes from its ``last.ckpt`` (:func:`resume_overrides`); ``run_dir=None`` runs in a temporary directory, removed afterwards. A job still
    running after ``timeout_s`` is stopped. Returns ``{"ok", "reused", "wall_s" (None when reused), "metrics"
    (its metrics.json, when ``ok``), "error" (the output's tail, only on failure), "stopped" (only when
    stopped)}``; ``ok`` means the job left a ``metrics.json``.
    """
    if run_dir is None:
        with tempfile.TemporaryDirectory(prefix="deqsm_job_") as tmp:
            return train_job(overrides, Path(tmp), env, rerun, capture, timeout_s)
    run_dir = Path(run_dir)
    done = run_dir / "metrics.json"
    if rerun and run_dir.exists():  # a fresh run: the old one is kept beside it, never deleted
        run_dir.rename(run_dir.with_name(f"{run_dir.name}.replaced-{time.strftime('%Y%m%d-%H%M%S')}"))
    if done.exists():
        return {"ok": True, "reused": True, "wall_s": None, "metrics": json.loads(done.read_text())}
    ran = run_process([sys.executable, "-m", "src.train", *overrides, *resume_overrides(run_dir),
                       f"hydra.run.dir={run_dir}"], env, capture, timeout_s)
    out = {"ok": ran["code"] == 0 and done.exists(), "reused": False, "wall_s": ran["wall_s"]}
    if ran["stopped"]:
        out.update(stopped=True, error=f"stopped after {timeout_s:.0f} s (the time left in the budget)")
    elif out["ok"]:
        out["metrics"] = json.loads(done.read_text())
    else:
        out["error"] = ran["tail"] or f"exit code {ran['code']}, no metrics.json in {run_dir}"
    return out


def run_parallel(jobs: Sequence[tuple[object, Sequence[str], Path]], parallel: int, heartbeat_s: float = 60.0,
                 env: dict | None = None) -> dict[object, dict]:
    """Run ``(key, command, log file)`` jobs ``parallel`` at a time in the repository (environment ``env``, this
    process's when None; e.g. :func:`thread_env`), each with its output in its log file. Prints a line as each
    starts and ends and, every ``heartbeat_s``, which are still running. Returns ``{key: {"code", "wall_s",
    "log"}}``."""
    pending, running, done = list(jobs), {}, {}
    t_start = last_beat = time.time()
    while pending or running:
        while pending and len(running) < parallel:
            key, cmd, log = pending.pop(0)
            Path(log).parent.mkdir(parents=True, exist_ok=True)
            fh = Path(log).open("w")  # noqa: SIM115 (closed when its job ends, below)
            proc = subprocess.Popen(list(cmd), cwd=ROOT, env=env, stdout=fh, stderr=subprocess.STDOUT)
            running[key] = (proc, fh, time.time(), log)
            print(f"[{len(done) + len(running)}/{len(jobs)}] started {key}", flush=True)
        for key, (proc, fh, t0, log) in list(running.items()):
            code = proc.poll()
            if code is None:
                continue
            fh.close()
            del running[key]
            done[key] = {"code": code, "wall_s": time.time() - t0, "log": str(log)}
            status = "done" if code == 0 else f"FAILED (exit {code}; see {log})"
            print(f"[{len(done)}/{len(jobs)} finished] {key}: {status} in {time.time() - t0:.0f} s", flush=True)
        if running and time.time() - last_beat >= heartbeat_s:
            last_beat = time.time()
            print(f"... {time.time() - t_start:.0f} s: running {', '.join(map(str, running))}; {len(pending)} "
                  "waiting", flush=True)
        time.sleep(0.5)
    return done
