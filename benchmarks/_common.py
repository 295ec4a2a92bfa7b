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
  :func:`device_name`;
- what a result records: :func:`machine_facts`, :func:`script_command`;
- result files: :func:`result_options` (``--out``, ``--render``), :func:`rendered` (``--render``: the markdown
  rebuilt from the saved JSON, nothing run), :func:`note_lines`;
- studies of trained checkpoints (``--ckpt LABEL=PATH …``): :func:`checkpoint_options` and
  :func:`checkpoint_study`.
"""

from __future__ import annotations

import argparse
import os
import platform
import shlex
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

__all__ = ["DATA_ROOT", "RESULTS", "ROOT", "checkpoint_options", "checkpoint_study", "device_name", "machine_facts",
           "measured", "note_lines", "rendered", "result_options", "run_module", "script_command", "thread_env",
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
    import torch

    if str(device).startswith("cuda"):
        return torch.cuda.get_device_name()
    return platform.processor() or "cpu"


# ------------------------------------------------------------------------------ what a result records
def machine_facts() -> str:
    """``"x86_64, 2 cores; python 3.11.7; torch 2.13.0; cpu, 1 thread(s)"``: the machine line of a result."""
    import torch

    return (f"{platform.machine()}, {os.cpu_count()} cores; python {platform.python_version()}; "
            f"torch {torch.__version__}; cpu, {torch.get_num_threads()} thread(s)")


def script_command(script: str, argv: Sequence[str] | None = None) -> str:
    """``python benchmarks/<script> <argv>`` (this process's arguments by default), each argument quoted as a
    shell needs it: the command a result records."""
    return " ".join(["python", f"benchmarks/{script}", *(shlex.quote(a) for a in
                                                         (sys.argv[1:] if argv is None else argv))])


# ------------------------------------------------------------------------------------ result files
def result_options(ap: argparse.ArgumentParser, name: str | None = None) -> None:
    """``--out`` (the results folder, default ``benchmarks/results``), ``--name`` (the result's file stem,
    when ``name`` is given as its default) and ``--render`` (rebuild the markdown from the saved JSON)."""
    ap.add_argument("--out", type=Path, default=RESULTS, help="results folder")
    if name is not None:
        ap.add_argument("--name", default=name, help="result file stem")
    ap.add_argument("--render", action="store_true", help="run nothing: rebuild the markdown from the JSON")


def rendered(args, stem: str, render: Callable[[dict], str]) -> bool:
    """With ``--render``: ``<out>/<stem>.md`` rebuilt from ``<out>/<stem>.json`` (True: nothing else to do). With
    ``--note FILE`` too: a finding written after the run, stored in the JSON's ``meta.note`` first."""
    if not args.render:
        return False
    from src.reporting import load_results, rerender, write_results

    if getattr(args, "note", None):
        res = load_results(args.out, stem)
        res["meta"]["note"] = Path(args.note).read_text()
        write_results(args.out, stem, res, render)
    else:
        rerender(args.out, stem, render)
    return True


def note_lines(meta: dict) -> list[str]:
    """A result's ``--note`` (a finding, written below its table) as markdown lines, or none."""
    return [meta["note"].strip(), ""] if meta.get("note") else []


# -------------------------------------------------------------------------- studies of checkpoints
def checkpoint_options(ap: argparse.ArgumentParser, name: str, what: str) -> None:
    """The options every study of trained checkpoints has: ``--ckpt LABEL=PATH`` (repeatable), ``--root``,
    ``--n``, ``--seed``, ``--note``, ``--out``, ``--name`` (default ``name``), ``--render``."""
    from src.reporting import labelled_checkpoint

    ap.add_argument("--ckpt", action="append", default=[], type=labelled_checkpoint,
                    help=f"LABEL=PATH of {what} (repeatable; split at the last =)")
    ap.add_argument("--root", default=None, help="data.root")
    ap.add_argument("--n", type=int, default=64)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--note", default=None, help="a markdown file appended to the table (the finding)")
    result_options(ap, name)


def checkpoint_study(ap: argparse.ArgumentParser, args, script: str, render: Callable[[dict], str],
                     measure: Callable[[object], dict], **meta) -> None:
    """Run a study parsed with :func:`checkpoint_options`: ``measure(module)`` for each ``--ckpt`` (loaded by
    ``src.sample.load_module``, torch threads from ``OMP_NUM_THREADS``), ``<out>/<name>.json`` and ``.md``
    rewritten after each; ``meta`` (the study's settings) is recorded beside the machine and the command.
    With ``--render`` only the markdown is rebuilt from the saved JSON."""
    from src.reporting import write_results

    if rendered(args, args.name, render):
        return
    if not args.ckpt:
        ap.error("give at least one --ckpt LABEL=PATH")
    import torch

    from src.sample import load_module

    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    overrides = [f"data.root={args.root}"] if args.root else []
    res = {"meta": {"machine": machine_facts(), "command": script_command(script), "n": args.n, **meta,
                    "seed": args.seed, "note": Path(args.note).read_text() if args.note else None},
           "checkpoints": {}}
    for label, path in args.ckpt:
        module = load_module(path, overrides)[0]
        res["checkpoints"][label] = {"checkpoint": path, **measure(module)}
        write_results(args.out, args.name, res, render)
        print(f"{label}: done", flush=True)
    print(f"-> {Path(args.out) / args.name}.md")
