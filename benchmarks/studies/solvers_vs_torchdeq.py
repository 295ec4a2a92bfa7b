"""Our forward solvers (src/deq/solvers.py) beside TorchDEQ 0.1.0's on the same maps, one thread (issue: "Anderson
at least as fast as TorchDEQ's best").

TorchDEQ is installed in a separate environment (a benchmark, never a dependency of the package or its tests):

    python -m venv <venv> && <venv>/bin/pip install torch==2.13.0 torchdeq==0.1.0
    python -m benchmarks.studies.solvers_vs_torchdeq --torchdeq-python <venv>/bin/python [--repeats 5]
    python -m benchmarks.studies.solvers_vs_torchdeq --render

Each side runs in its own process (``--worker``; TorchDEQ's under the other environment's interpreter, which imports
only this file and :mod:`src.deq`'s torch-only modules) and builds the same maps from the same seeds: the NCSN
block of record's map (:class:`src.deq.maps.NormalizedResidualMap`, 16 channels, state [64, 16, 28, 28],
initialisation weights, not a trained checkpoint) and a DKEF-sized dense map (:func:`src.deq.maps.dense_map`, width
64, 11 inputs, 500 samples, spectral λ = 1.2). Two comparisons per solver:

- **same work**: ``evals`` evaluations of f with the stop rule off (tol 0), the per-evaluation cost of each
  implementation's own bookkeeping; ``evals`` = the evaluations our Anderson needs at relative 1e-4 per sample;
- **to tolerance**: each solver's own relative rule at 1e-4 (ours per sample, TorchDEQ's on the whole batch's norm,
  its only rule), time and evaluations.

Times are the minimum (and median) over ``--repeats`` solves after one warm-up, on a shared machine: read
differences under ~10 % as noise.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

MODULE = "benchmarks.studies.solvers_vs_torchdeq"
STEM = "solvers_vs_torchdeq"
TOL = 1e-4
OURS = {"picard": {"method": "picard"}, "anderson": {"method": "anderson", "anderson_m": 5},
        "broyden": {"method": "broyden"}}
THEIRS = {"fixed_point_iter": {}, "anderson (m=5, lam=1e-4, default)": {"m": 5},
          "anderson (m=5, lam=1e-8)": {"m": 5, "lam": 1e-8}, "broyden": {}}
THEIR_SOLVER = {"fixed_point_iter": "fixed_point_iter", "broyden": "broyden"}


def _core_importable() -> None:
    """Make :mod:`src.deq` importable in an environment without this package's dependencies (TorchDEQ's): ``src``
    as a bare namespace (its ``__init__`` installs a Hydra patch; :mod:`src.deq` itself needs torch only)."""
    try:
        import src  # noqa: F401
    except ImportError:
        import types

        pkg = types.ModuleType("src")
        pkg.__path__ = [str(Path(__file__).resolve().parents[2] / "src")]
        sys.modules["src"] = pkg


def build_map(name: str):
    """(f, z0) of map ``name``, detached, from fixed seeds (the same in either environment)."""
    import torch

    _core_importable()

    from src.deq import DenseDEQBlock, DEQConfig, NormalizedResidualDEQBlock

    torch.manual_seed(0)
    if name == "ncsn_normalized_residual":
        block = NormalizedResidualDEQBlock(16, config=DEQConfig(block="normalized_residual"))
        x = torch.randn(64, 16, 28, 28)
    elif name == "dkef_dense":
        block = DenseDEQBlock(11, 64, config=DEQConfig(norm="spectral", norm_lambda=1.2))
        x = torch.randn(500, 11)
    else:
        raise ValueError(f"unknown map {name!r}")
    block.eval()
    with torch.no_grad():
        f = block.fixed_point_map(x)
        z0 = torch.zeros(block.state_shape(x))
    return f, z0


def _timed(run, repeats: int) -> tuple[list[float], object]:
    run()  # warm-up
    times, out = [], None
    for _ in range(repeats):
        t0 = time.perf_counter()
        out = run()
        times.append(time.perf_counter() - t0)
    return times, out


def worker(spec: dict) -> dict:
    """One side (``ours`` | ``torchdeq``) on one map: {solver: {same_work_ms, to_tol_ms, to_tol_evals}}."""
    import torch

    torch.set_num_threads(1)
    f, z0 = build_map(spec["map"])
    counted = {"n": 0}

    def fc(z):
        counted["n"] += 1
        return f(z)

    out = {}
    with torch.no_grad():
        if spec["side"] == "ours":
            from src.deq.solvers import solve

            for name, kw in OURS.items():
                same, _ = _timed(lambda kw=kw: solve(f, z0, tol=0.0, max_iter=spec["evals"], **kw), spec["repeats"])
                tol, res = _timed(lambda kw=kw: solve(f, z0, tol=TOL, stop_mode="rel", max_iter=100, **kw),
                                  spec["repeats"])
                counted["n"] = 0
                solve(fc, z0, tol=TOL, stop_mode="rel", max_iter=100, **kw)
                out[name] = {"same_work_ms": [t * 1e3 for t in same], "to_tol_ms": [t * 1e3 for t in tol],
                             "to_tol_evals": counted["n"], "converged": bool(res.converged)}
        else:
            from torchdeq.solver import get_solver

            for name, kw in THEIRS.items():
                solver = get_solver(THEIR_SOLVER.get(name, "anderson"))
                same, _ = _timed(lambda s=solver, kw=kw: s(f, z0, max_iter=spec["evals"], tol=0.0, stop_mode="abs",
                                                          **kw), spec["repeats"])
                tol, _ = _timed(lambda s=solver, kw=kw: s(f, z0, max_iter=100, tol=TOL, stop_mode="rel", **kw),
                                spec["repeats"])
                counted["n"] = 0
                solver(fc, z0, max_iter=100, tol=TOL, stop_mode="rel", **kw)
                out[name] = {"same_work_ms": [t * 1e3 for t in same], "to_tol_ms": [t * 1e3 for t in tol],
                             "to_tol_evals": counted["n"]}
    return out


def _run_worker(python: str, spec: dict) -> dict:
    root = Path(__file__).resolve().parents[2]
    env = dict(os.environ, OMP_NUM_THREADS="1", MKL_NUM_THREADS="1")
    ran = subprocess.run([python, "-m", MODULE, "--worker", json.dumps(spec)], cwd=root, env=env,
                         capture_output=True, text=True, check=False)
    if ran.returncode != 0:
        raise SystemExit(f"worker {spec} failed:\n{ran.stderr[-3000:]}")
    return json.loads(ran.stdout.strip().splitlines()[-1])


def _evals_of_our_anderson(map_name: str) -> int:
    import torch

    from src.deq.solvers import solve

    torch.set_num_threads(1)
    f, z0 = build_map(map_name)
    with torch.no_grad():
        return int(solve(f, z0, tol=TOL, stop_mode="rel", max_iter=100, **OURS["anderson"]).iterations)


def render(res: dict) -> str:
    meta = res["meta"]
    lines = ["# Forward solvers beside TorchDEQ 0.1.0", "", f"`{meta['command']}`", "",
             (f"Machine: {meta['machine']}; TorchDEQ side: {meta.get('torchdeq') or 'not run'}. "
             "Times in ms, min (median) over the repeats; a shared machine: differences under ~10 % are noise."), ""]
    for map_name, sides in res["maps"].items():
        lines += [f"## {map_name} (same work: {sides['evals']} evaluations of f)", "",
                  "| side | solver | same work ms | to rel 1e-4: ms | evaluations |", "|---|---|---|---|---|"]
        for side in ("ours", "torchdeq"):
            for name, r in sides.get(side, {}).items():
                cell = (lambda v: f"{min(v):.1f} ({statistics.median(v):.1f})")
                lines.append(f"| {side} | {name} | {cell(r['same_work_ms'])} | {cell(r['to_tol_ms'])} | "
                             f"{r['to_tol_evals']} |")
        lines.append("")
    return "\n".join(lines)


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--worker", help=argparse.SUPPRESS)
    ap.add_argument("--torchdeq-python", help="the interpreter of an environment with torchdeq==0.1.0")
    ap.add_argument("--maps", default="ncsn_normalized_residual,dkef_dense")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--render", action="store_true", help="run nothing: rebuild the markdown from the JSON")
    ap.add_argument("--out", type=Path, default=Path(__file__).resolve().parents[1] / "results")
    args = ap.parse_args(argv)
    if args.worker:
        print(json.dumps(worker(json.loads(args.worker))))
        return
    from benchmarks.lib.results import machine_facts, rerender, script_command, write_results

    if args.render:
        rerender(args.out, STEM, render)
        return
    res = {"meta": {"command": script_command(MODULE, argv, placeholders={args.torchdeq_python: "<venv>/bin/python"}
                                              if args.torchdeq_python else None),
                    "machine": machine_facts().replace(f"{__import__('torch').get_num_threads()} thread(s)",
                                                       "1 thread(s)"),
                    "torchdeq": "torchdeq 0.1.0, torch 2.13.0 (a separate environment)" if args.torchdeq_python
                    else None},
           "maps": {}}
    for map_name in args.maps.split(","):
        evals = _evals_of_our_anderson(map_name)
        spec = {"map": map_name, "evals": evals, "repeats": args.repeats}
        entry = {"evals": evals, "ours": _run_worker(sys.executable, {**spec, "side": "ours"})}
        if args.torchdeq_python:
            entry["torchdeq"] = _run_worker(args.torchdeq_python, {**spec, "side": "torchdeq"})
        res["maps"][map_name] = entry
        print(map_name, json.dumps({s: {k: min(v["to_tol_ms"]) for k, v in entry[s].items()}
                                    for s in ("ours", "torchdeq") if s in entry}), flush=True)
    write_results(args.out, STEM, res, render)


if __name__ == "__main__":
    main()
