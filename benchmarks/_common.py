"""What every benchmark script shares. A script's first project import is ``import _common`` (or ``from _common
import …``): that puts the repository on ``sys.path``, so ``python benchmarks/<script>.py`` runs from a checkout
with or without ``pip install -e .``, and the commands the result tables record keep working.

- paths: :data:`ROOT` (the repository), :data:`RESULTS` (``benchmarks/results``), :data:`DATA_ROOT` (the
  default ``data.root``, the config's ``paths.data_dir``);
- jobs: :func:`run_module` (one ``python -m src.<entry> …`` process, run in the repository) and
  :func:`train_job` (one ``python -m src.train …`` job in its own run directory, reused when that already holds
  ``metrics.json``): the one subprocess runner of ``run_grid.py``, ``training_curves.py`` and
  ``separation_report.py``;
- one training step: :func:`trainer_free` and :func:`training_step` run a LightningModule's *own*
  ``training_step`` with its *own* configured optimisers outside a ``Trainer`` (Lightning Fabric), so a
  memory benchmark measures the step a training run takes, not a copy of it;
- measuring: :func:`measured` (wall time, bytes autograd saves for backward, CUDA peak of one call),
  :func:`device_name`.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))
RESULTS = ROOT / "benchmarks" / "results"
DATA_ROOT = ROOT / "data"

__all__ = ["DATA_ROOT", "RESULTS", "ROOT", "device_name", "measured", "run_module", "thread_env",
           "train_job", "trainer_free", "training_step"]


# ---------------------------------------------------------------------------------------------- jobs
def thread_env(threads: int | None = 1) -> dict[str, str]:
    """This process's environment with ``OMP_NUM_THREADS``/``MKL_NUM_THREADS`` set to ``threads`` (None: as is)."""
    env = dict(os.environ)
    if threads:
        env.update(OMP_NUM_THREADS=str(threads), MKL_NUM_THREADS=str(threads))
    return env


def run_module(entry: str, args: Sequence[str], env: dict | None = None, capture: bool = True
               ) -> tuple[int, str]:
    """Run ``python -m <entry> <args>`` in the repository; return its exit code and, when ``capture``, the
    last 2000 characters of its stderr (of its stdout when stderr is empty). ``capture=False`` lets its
    output through (a long training run a user watches)."""
    cmd = [sys.executable, "-m", entry, *args]
    proc = subprocess.run(cmd, check=False, cwd=ROOT, capture_output=capture, text=True, env=env)
    tail = ((proc.stderr or proc.stdout) or "")[-2000:] if capture else ""
    return proc.returncode, tail


def train_job(overrides: Sequence[str], run_dir: Path, env: dict | None = None, rerun: bool = False,
              capture: bool = True) -> dict:
    """One ``python -m src.train <overrides> hydra.run.dir=<run_dir>`` job.

    A run directory that already holds ``metrics.json`` is reused (nothing runs) unless ``rerun``, which
    deletes that file first. Returns ``{"ok", "reused", "wall_s" (None when reused), "error" (the output's
    tail, only on failure)}``; ``ok`` means the job left a ``metrics.json``.
    """
    run_dir = Path(run_dir)
    done = run_dir / "metrics.json"
    if rerun:
        done.unlink(missing_ok=True)
    if done.exists():
        return {"ok": True, "reused": True, "wall_s": None}
    t0 = time.perf_counter()
    code, tail = run_module("src.train", [*overrides, f"hydra.run.dir={run_dir}"], env, capture)
    out = {"ok": code == 0 and done.exists(), "reused": False, "wall_s": time.perf_counter() - t0}
    if not out["ok"]:
        out["error"] = tail or f"exit code {code}, no metrics.json in {run_dir}"
    return out


# ------------------------------------------------------------------------------------ one training step
def trainer_free(module, device: str = "cpu"):
    """``module`` (a LightningModule) set up to run its own ``training_step`` without a ``Trainer``: moved to
    ``device``, its ``configure_optimizers()`` set up with Lightning Fabric (so ``self.optimizers()``,
    ``manual_backward`` and ``self.log`` work as in training; nothing is logged). Returns the optimisers."""
    from lightning.fabric import Fabric

    accelerator = "cuda" if str(device).startswith("cuda") else "cpu"
    fabric = Fabric(accelerator=accelerator, devices=1, loggers=[])
    optimizers = module.configure_optimizers()
    optimizers = optimizers if isinstance(optimizers, (list, tuple)) else [optimizers]
    _, *optimizers = fabric.setup(module, *optimizers)
    return optimizers


def training_step(module, batch, optimizers, batch_idx: int = 0):
    """One training step of a module prepared by :func:`trainer_free`, as the Trainer takes it: with manual
    optimisation the module's ``training_step`` updates itself; with automatic optimisation its returned loss
    is backpropagated and every optimiser steps (Lightning's loop: zero_grad, training_step, backward, step)."""
    if not module.automatic_optimization:
        return module.training_step(batch, batch_idx)
    for opt in optimizers:
        opt.zero_grad(set_to_none=True)
    loss = module.training_step(batch, batch_idx)
    module.manual_backward(loss)
    for opt in optimizers:
        opt.step()
    return loss


# ------------------------------------------------------------------------------------------- measuring
def _sync(device: str) -> None:
    import torch

    if str(device).startswith("cuda"):
        torch.cuda.synchronize()


def measured(fn: Callable[[], object], device: str = "cpu") -> dict:
    """Call ``fn()`` once; return ``{"result", "seconds" (CUDA-synchronised wall time), "saved_bytes" (bytes
    of the distinct storages autograd saves for backward during the call), "peak_cuda_bytes" (on a GPU:
    ``torch.cuda.max_memory_allocated`` with the peak reset before the call; else None)}``."""
    import torch

    from src.callbacks.profiling import SavedTensorsMeter

    cuda = str(device).startswith("cuda")
    _sync(device)
    if cuda:
        torch.cuda.reset_peak_memory_stats(device)
    t0 = time.perf_counter()
    with SavedTensorsMeter() as meter:
        result = fn()
    _sync(device)
    seconds = time.perf_counter() - t0
    return {"result": result, "seconds": seconds, "saved_bytes": meter.bytes,
            "peak_cuda_bytes": torch.cuda.max_memory_allocated(device) if cuda else None}


def device_name(device: str) -> str:
    """The GPU's name for a CUDA device, else the CPU's (``platform.processor()``, or ``"cpu"``)."""
    import platform

    import torch

    if str(device).startswith("cuda"):
        return torch.cuda.get_device_name()
    return platform.processor() or "cpu"
