"""Our forward solvers (src/deq/solvers.py) beside TorchDEQ 0.1.0's on the same maps, one thread (issue: "Anderson
at least as fast as TorchDEQ's best").

TorchDEQ is installed in a separate environment (a benchmark, never a dependency of the package or its tests):

    python -m venv <venv> && <venv>/bin/pip install torch==2.13.0 torchdeq==0.1.0
    python -m benchmarks.studies.solvers_vs_torchdeq --torchdeq-python <venv>/bin/python [--rounds 7] \\
        [--maps ncsn_normalized_residual,dkef_dense] [--ckpt 'LABEL=<run dir>/checkpoints/last.ckpt' …]
    python -m benchmarks.studies.solvers_vs_torchdeq --render

**Maps.** Built-in, from fixed seeds with initialisation weights: the NCSN block of record's map
(:class:`src.deq.maps.NormalizedResidualMap`, 16 channels, state [64, 16, 28, 28]) and a DKEF-sized dense map
(:func:`src.deq.maps.dense_map`, width 64, 11 inputs, 500 samples, spectral λ = 1.2). Trained (``--ckpt``): every
DEQ block of a ``src.train`` checkpoint, loaded weights-only through the project's loader
(:func:`src.runs.load.load_module`), at the inputs it sees — an NCSN block at 64 test images, each perturbed at its
level of :func:`src.lit.ncsn.diagnostic_levels` (seeded noise), through the layers before the block
(``net.deq_input``); a DKEF feature network's block at its 200 inducing points and 300 test points. The map φ and
its parameters p = ``block.map_params(x)`` are written to a tensors-only file that both sides load weights-only, so
TorchDEQ's environment needs nothing of this package but :mod:`src.deq`'s torch-only modules.

**Rule.** Both sides stop when every sample's relative residual ‖f(z) − z‖ / ‖f(z)‖ is below 1e-4 (ours: ``rel``;
TorchDEQ 0.1.0's ``stop_mode="rel"`` is the same per-sample quotient, stopping on its maximum over the batch),
start from zeros, at most 100 evaluations of f. After each solve the quotient is computed again from the returned z,
outside the timing (``rel at return``).

**Two comparisons per solver.** *To tolerance*: time and evaluations of f to the rule. *Same work*: exactly
``evals`` evaluations of f with the stop rule off — ``evals`` = the evaluations our default Anderson needs to the
rule — so the times compare each implementation's own bookkeeping at equal work (the solvers' iteration limits are
set so that each evaluates f exactly ``evals`` times, counted).

**Timing.** Each side is one persistent worker process (one thread); the two alternate round by round (``--rounds``,
the side that goes first alternating too), after counted warm-up solves; in a round each configuration is timed
once, or for a small map as often as fits in 0.1 s (at most 20 times, the least kept); a figure is the minimum over
the rounds (the median shows the load of this shared machine). The clock is each worker's CPU time by default
(``--clock cpu``: one thread, so the solve's compute without the waits while other jobs hold the cores — on a
loaded machine a wall clock turns a 3 ms solve into 3-60 ms), or ``--clock wall``.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

MODULE = "benchmarks.studies.solvers_vs_torchdeq"
STEM = "solvers_vs_torchdeq"
TOL = 1e-4
MAX_ITER = 100
# name: solve() keywords. Anderson's regulariser is relative to the Gram matrix's scale (src/deq/solvers.py).
OURS = {"picard": {"method": "picard"},
        "anderson (m=5, lam=1e-8, default)": {"method": "anderson", "anderson_m": 5},
        "anderson (m=3, lam=1e-8)": {"method": "anderson", "anderson_m": 3},
        "anderson (m=6, lam=1e-8)": {"method": "anderson", "anderson_m": 6},
        "anderson (m=5, lam=1e-4)": {"method": "anderson", "anderson_m": 5, "anderson_lam": 1e-4},
        "broyden": {"method": "broyden"}}
DEFAULT_ANDERSON = "anderson (m=5, lam=1e-8, default)"
# name: (TorchDEQ solver, its keywords); its Anderson's regulariser is absolute
THEIRS = {"fixed_point_iter": ("fixed_point_iter", {}),
          "anderson (m=6, lam=1e-4, default)": ("anderson", {}),
          "anderson (m=5, lam=1e-4)": ("anderson", {"m": 5}),
          "anderson (m=5, lam=1e-8)": ("anderson", {"m": 5, "lam": 1e-8}),
          "anderson (m=3, lam=1e-8)": ("anderson", {"m": 3, "lam": 1e-8}),
          "anderson (m=6, lam=1e-8)": ("anderson", {"m": 6, "lam": 1e-8}),
          "broyden": ("broyden", {})}
BUILT_IN = ("ncsn_normalized_residual", "dkef_dense")
MAP_MODULES = ("src.deq.maps", "src.deq.multiscale")  # where a map φ named in a map file is looked up
NCSN_IMAGES, DKEF_TEST_POINTS = 64, 300


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


# ------------------------------------------------------------------------------------------ maps
def built_in_map(name: str):
    """(φ, p, state shape) of built-in map ``name``, detached, from fixed seeds (the same in either environment)."""
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
        raise ValueError(f"unknown map {name!r}; built in: {', '.join(BUILT_IN)}")
    block.eval()
    with torch.no_grad():
        params = tuple(p.detach() for p in block.map_params(x))
    return block.phi, params, tuple(block.state_shape(x))


def describe_map(phi) -> dict:
    """φ as plain data a weights-only load can read: its name in :data:`MAP_MODULES` and, for a map object, its
    attributes (numbers, strings, booleans, None, and tuples or lists of them)."""
    if callable(phi) and not isinstance(phi, type) and hasattr(phi, "__name__"):  # a module-level function
        return {"name": phi.__name__, "attrs": None}
    def plain(v):
        if isinstance(v, (list, tuple)):
            return all(plain(x) for x in v)
        return isinstance(v, (int, float, str, bool, type(None)))

    attrs = dict(vars(phi))
    bad = [k for k, v in attrs.items() if not plain(v)]
    if bad:
        raise ValueError(f"map {type(phi).__name__} holds {', '.join(bad)}: not plain data, cannot be exported")
    return {"name": type(phi).__name__, "attrs": attrs}


def rebuild_map(desc: dict):
    """The map φ that :func:`describe_map` described."""
    import importlib

    _core_importable()
    for mod in MAP_MODULES:
        obj = getattr(importlib.import_module(mod), desc["name"], None)
        if obj is None:
            continue
        if desc["attrs"] is None:
            return obj
        phi = obj.__new__(obj)
        phi.__dict__.update(desc["attrs"])
        return phi
    raise ValueError(f"map {desc['name']!r} is not in {', '.join(MAP_MODULES)}")


def block_inputs(module, name: str) -> tuple:
    """The inputs ``(x, *cond)`` block ``name`` of a loaded run's module is measured at (module docstring)."""
    import torch

    net = module.net
    if hasattr(net, "deq_input"):  # NCSN
        from src.lit.ncsn import diagnostic_levels

        x = module.split_tensor("test", NCSN_IMAGES)
        labels = diagnostic_levels(x.shape[0], net.sigmas.numel())
        g = torch.Generator().manual_seed(0)
        xt = x + net.sigmas.to(x.dtype)[labels].reshape(-1, *([1] * (x.dim() - 1))) * torch.randn(
            x.shape, generator=g, dtype=x.dtype)
        with torch.no_grad():
            return net.deq_input(xt, labels), labels
    if hasattr(net, "inducing"):  # DKEF: every feature network sees the inducing points and the data
        return (torch.cat([net.inducing.detach(), module.split_tensor("test", DKEF_TEST_POINTS)]),)
    raise ValueError(f"{type(module).__name__}: no rule for the inputs of its DEQ block {name}")


def export_checkpoint_maps(label: str, ckpt: str, folder: Path, overrides: list[str]) -> dict:
    """Every DEQ block of checkpoint ``ckpt`` as a map file in ``folder``: ``{map name: {"file", "block", "state",
    "run"}}`` (map name ``label`` for a single block, ``label/<block name>`` for several)."""
    import torch

    from src.deq.lookup import blocks_of
    from src.runs.load import load_module, run_of_checkpoint
    from src.runtime.checkpoints import load_checked

    module = load_module(ckpt, overrides)[0]
    blocks = blocks_of(module)
    if not blocks:
        raise SystemExit(f"{ckpt}: the checkpoint's network has no DEQ block")
    run_dir = run_of_checkpoint(ckpt, overrides)[2]
    ran = run_dir / ".hydra" / "overrides.yaml"
    from omegaconf import OmegaConf

    shown = [re.sub(r"^data\.root=.*", "data.root=<data dir>", o) for o in OmegaConf.load(ran)] if ran.is_file() else []
    command = ("python -m src.train " + " ".join(shown)) if shown else None  # no path of this machine
    step = load_checked(ckpt, mmap=True).get("global_step")
    out = {}
    for name, block in blocks:
        inputs = block_inputs(module, name)
        with torch.no_grad():
            params = tuple(p.detach().contiguous() for p in block.map_params(*inputs))
        key = label if len(blocks) == 1 else f"{label}/{name}"
        path = folder / (re.sub(r"[^A-Za-z0-9_.-]", "_", key) + ".pt")
        torch.save({"phi": describe_map(block.phi), "params": list(params),
                    "state": list(block.state_shape(inputs[0]))}, path)
        out[key] = {"file": str(path), "block": f"{name} ({type(block).__name__})",
                    "state": list(block.state_shape(inputs[0])), "checkpoint": ckpt, "global_step": step,
                    "train_command": command}
    return out


def load_map(spec: dict):
    """(f, z0) of a map request: built in by name, or a map file."""
    import torch

    if spec.get("file"):
        saved = torch.load(spec["file"], map_location="cpu", weights_only=True)
        phi, params, shape = rebuild_map(saved["phi"]), tuple(saved["params"]), tuple(saved["state"])
    else:
        phi, params, shape = built_in_map(spec["map"])
    return (lambda z: phi(z, *params)), torch.zeros(shape, dtype=params[0].dtype)


# ------------------------------------------------------------------------------------------ one side (worker)
def _rel_at_return(f, z) -> float:
    fz = f(z)
    return float(((fz - z).flatten(1).norm(dim=1) / fz.flatten(1).norm(dim=1).clamp_min(1e-30)).max())


CLOCKS = {"cpu": time.process_time, "wall": time.perf_counter}
CLOCK = {"now": time.process_time}  # the worker's clock (``--clock``)


def _min_time(run, budget_s: float = 0.1, most: int = 20) -> tuple[float, object]:
    """(the least seconds of ``run()`` over repeats, its result): repeated while they take less than ``budget_s``
    together (a solve of a small map takes ~1 ms: one call is all noise), at most ``most`` times."""
    best, spent, out = float("inf"), 0.0, None
    now = CLOCK["now"]
    for _ in range(most):
        t0 = now()
        out = run()
        dt = now() - t0
        best, spent = min(best, dt), spent + dt
        if spent >= budget_s:
            break
    return best, out


class Side:
    """One side's solvers on the maps it was asked about (maps and iteration limits kept between rounds)."""

    def __init__(self, side: str):
        self.side, self.maps, self.limits = side, {}, {}

    def _call(self, name: str, f, z0, max_iter: int, tol: float):
        if self.side == "ours":
            from src.deq.solvers import solve

            return solve(f, z0, tol=tol, stop_mode="rel", max_iter=max_iter, **OURS[name]).z
        from torchdeq.solver import get_solver

        solver, kw = THEIRS[name]
        return get_solver(solver)(f, z0, max_iter=max_iter, tol=tol, stop_mode="rel", **kw)[0]

    def _counted(self, name, f, z0, max_iter, tol) -> int:
        n = {"evals": 0}

        def fc(z):
            n["evals"] += 1
            return f(z)

        self._call(name, fc, z0, max_iter, tol)
        return n["evals"]

    def _same_work_limit(self, name, f, z0, evals: int) -> tuple[int, int]:
        """The iteration limit at which solver ``name`` evaluates f exactly ``evals`` times with the rule off
        (some evaluate once more than their limit), and the count there."""
        limit = evals
        for _ in range(4):
            got = self._counted(name, f, z0, limit, 0.0)
            if got == evals:
                break
            limit += evals - got
        return limit, got

    def round(self, spec: dict) -> dict:
        """One timed solve of each configuration, both comparisons (the first request of a map warms up)."""
        import torch

        key = spec["key"]
        if key not in self.maps:
            self.maps[key] = load_map(spec)
        f, z0 = self.maps[key]
        names = [n for n in (OURS if self.side == "ours" else THEIRS) if n not in spec.get("skip", ())]
        out = {}
        with torch.no_grad():
            for name in names:
                if (key, name) not in self.limits:  # warm-up: counted solves, the same-work limit
                    limit, same = self._same_work_limit(name, f, z0, spec["evals"])
                    self.limits[(key, name)] = (limit, same, self._counted(name, f, z0, MAX_ITER, TOL))
                limit, same_evals, tol_evals = self.limits[(key, name)]
                same_s = _min_time(lambda name=name, limit=limit: self._call(name, f, z0, limit, 0.0))[0]
                tol_s, z = _min_time(lambda name=name: self._call(name, f, z0, MAX_ITER, TOL))
                out[name] = {"same_work_ms": same_s * 1e3, "same_work_evals": same_evals, "to_tol_ms": tol_s * 1e3,
                             "to_tol_evals": tol_evals, "rel_at_return": _rel_at_return(f, z)}
        return out


def serve(side: str, clock: str) -> None:
    """A persistent worker: one JSON request a line on stdin, one JSON answer a line on stdout."""
    import torch

    CLOCK["now"] = CLOCKS[clock]
    torch.set_num_threads(1)
    torch.set_flush_denormal(True)
    worker = Side(side)
    for line in sys.stdin:
        if not line.strip():
            continue
        print(json.dumps(worker.round(json.loads(line))), flush=True)


class Worker:
    def __init__(self, python: str, side: str, clock: str):
        root = Path(__file__).resolve().parents[2]
        env = dict(os.environ, OMP_NUM_THREADS="1", MKL_NUM_THREADS="1")
        self.side = side
        self.proc = subprocess.Popen([python, "-m", MODULE, "--serve", side, "--clock", clock], cwd=root, env=env, text=True,
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE)

    def ask(self, spec: dict) -> dict:
        self.proc.stdin.write(json.dumps(spec) + "\n")
        self.proc.stdin.flush()
        line = self.proc.stdout.readline()
        if not line:
            raise SystemExit(f"the {self.side} worker stopped:\n{self.proc.stderr.read()[-3000:]}")
        return json.loads(line)

    def close(self) -> None:
        self.proc.stdin.close()
        self.proc.wait(timeout=60)


def _evals_of_our_anderson(spec: dict) -> tuple[int, list[int]]:
    """The evaluations of f our default Anderson needs to the rule on map ``spec``, and the map's state shape."""
    import torch

    from src.deq.solvers import solve

    torch.set_num_threads(1)
    f, z0 = load_map(spec)
    with torch.no_grad():
        res = solve(f, z0, tol=TOL, stop_mode="rel", max_iter=MAX_ITER, **OURS[DEFAULT_ANDERSON])
    return int(res.iterations), list(z0.shape)


# ------------------------------------------------------------------------------------------ results
def _summary(rounds: list[dict]) -> dict:
    out = {}
    for name in rounds[0]:
        rs = [r[name] for r in rounds]
        out[name] = {k: [r[k] for r in rs] for k in ("same_work_ms", "to_tol_ms")}
        out[name].update({k: rs[0][k] for k in ("same_work_evals", "to_tol_evals")})
        out[name]["rel_at_return"] = max(r["rel_at_return"] for r in rs)
    return out


def _best(entries: dict, column: str, anderson_only: bool = False) -> tuple[str, float]:
    cands = {n: min(v[column]) for n, v in entries.items() if not anderson_only or n.startswith("anderson")}
    name = min(cands, key=cands.get)
    return name, cands[name]


def _render_sequential(res: dict) -> str:
    """The table of a result made before the persistent, alternating workers (no ``meta.clock``): each side's
    solves in one process after the other, wall time, random-weight maps, "same work" not counted."""
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


def render(res: dict) -> str:
    meta = res["meta"]
    if "clock" not in meta:
        return _render_sequential(res)
    lines = ["# Forward solvers beside TorchDEQ 0.1.0", "", f"`{meta['command']}`", "",
             (f"Machine: {meta['machine']}; load average at the start {meta.get('load_average', '?')}; TorchDEQ "
              f"side: {meta.get('torchdeq') or 'not run'}. Times in ms "
              f"({'each worker process’s CPU time, one thread' if meta.get('clock') == 'cpu' else 'wall time'}), "
              f"min (median) over {meta.get('rounds', '?')} rounds, the two sides' persistent workers alternating "
              "round by round (a shared machine: read the minimums). Rule: every sample's ‖f(z) − z‖ / ‖f(z)‖ < 1e-4, from zeros, at most 100 evaluations; "
              "*rel at return* recomputes it from the returned z. *Same work*: each solver evaluates f exactly the "
              "number of times our default Anderson needs to the rule (the evaluations column of that comparison), "
              "the stop rule off. Our Anderson's λ is relative to its Gram matrix's scale, TorchDEQ's absolute."), ""]
    summary = [("| map | state | our default Anderson: to rule / same work | TorchDEQ's best Anderson: to rule / "
                "same work | our best Anderson (to rule) | our Picard / theirs (to rule) |"), "|---|---|---|---|---|---|"]
    sections = []
    for map_name, sides in res["maps"].items():
        src = sides.get("source", {})
        title = f"## {map_name} (same work: {sides['evals']} evaluations of f)"
        about = []
        if src.get("checkpoint"):
            about.append(f"Block {src['block']} of `{src['checkpoint']}` (step {src.get('global_step')}), state "
                         f"{src['state']}; trained by `{src.get('train_command')}`.")
        elif src.get("what"):
            about.append(src["what"])
        sections += [title, "", *about, *([""] if about else []),
                     "| side | solver | same work ms | evaluations | to rel 1e-4: ms | evaluations | rel at return |",
                     "|---|---|---|---|---|---|---|"]
        for side in ("ours", "torchdeq"):
            for name, r in sides.get(side, {}).items():
                def cell(v):
                    return f"{min(v):.1f} ({statistics.median(v):.1f})"
                sections.append(f"| {side} | {name} | {cell(r['same_work_ms'])} | {r['same_work_evals']} | "
                                f"{cell(r['to_tol_ms'])} | {r['to_tol_evals']} | {r['rel_at_return']:.1e} |")
        sections.append("")
        if "torchdeq" in sides:
            ours, theirs = sides["ours"], sides["torchdeq"]
            d = ours[DEFAULT_ANDERSON]
            tb_name, tb = _best(theirs, "to_tol_ms", anderson_only=True)
            tbs_name, tbs = _best(theirs, "same_work_ms", anderson_only=True)
            ob_name, ob = _best(ours, "to_tol_ms", anderson_only=True)
            summary.append(
                f"| {map_name} | {'×'.join(map(str, src.get('state', [])))} | {min(d['to_tol_ms']):.1f} / "
                f"{min(d['same_work_ms']):.1f} | {tb:.1f} {tb_name.removeprefix('anderson ')} / {tbs:.1f} "
                f"{tbs_name.removeprefix('anderson ')} | {ob:.1f} {ob_name.removeprefix('anderson ')} | "
                f"{min(ours['picard']['to_tol_ms']):.1f} / {min(theirs['fixed_point_iter']['to_tol_ms']):.1f} |")
    if len(summary) > 2:
        lines += ["## Summary: Anderson against TorchDEQ's best Anderson", "",
                  ("Minimum ms; TorchDEQ's best is the fastest of its Anderson configurations on that map and column "
                   "(named in brackets)."), "", *summary, ""]
    if meta.get("note"):
        lines += [meta["note"].rstrip(), ""]
    return "\n".join(lines + sections)


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--serve", choices=("ours", "torchdeq"), help=argparse.SUPPRESS)
    ap.add_argument("--torchdeq-python", help="the interpreter of an environment with torchdeq==0.1.0")
    ap.add_argument("--maps", default=",".join(BUILT_IN), help="built-in maps, comma-separated ('' for none)")
    ap.add_argument("--ckpt", action="append", default=[], metavar="LABEL=PATH",
                    help="a src.train checkpoint whose DEQ blocks are measured (repeatable)")
    ap.add_argument("--root", default=None, help="data.root of the checkpoints' runs (their test images)")
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--skip", action="append", default=[], metavar="NAME",
                    help="a solver configuration left out, as the tables name it (repeatable; e.g. broyden)")
    ap.add_argument("--clock", choices=tuple(CLOCKS), default="cpu",
                    help="cpu: each worker's CPU time (one thread; robust to other processes' load), or wall time")
    ap.add_argument("--note", default=None, help="a markdown file printed below the summary (with --render: stored)")
    ap.add_argument("--render", action="store_true", help="run nothing: rebuild the markdown from the JSON")
    ap.add_argument("--out", type=Path, default=Path(__file__).resolve().parents[1] / "results")
    ap.add_argument("--name", default=STEM)
    args = ap.parse_args(argv)
    if args.serve:
        serve(args.serve, args.clock)
        return
    from benchmarks.lib.results import load_results, machine_facts, rendered, script_command, write_results

    if rendered(args, args.name, render):  # --render [--note FILE]
        return
    import torch

    torch.set_num_threads(1)
    placeholders = {args.torchdeq_python: "<venv>/bin/python"} if args.torchdeq_python else {}
    res = {"meta": {"command": script_command(MODULE, argv, data_root=args.root, placeholders=placeholders),
                    "machine": machine_facts(), "rounds": args.rounds, "clock": args.clock,
                    "load_average": " ".join(f"{x:.2f}" for x in os.getloadavg()),
                    "torchdeq": "torchdeq 0.1.0, torch 2.13.0 (a separate environment)" if args.torchdeq_python
                    else None,
                    "note": Path(args.note).read_text() if args.note else load_results(args.out, args.name)
                    .get("meta", {}).get("note")},
           "maps": {}}
    with tempfile.TemporaryDirectory(prefix="deqsm_solver_maps_") as tmp:
        skip = [s.strip() for s in args.skip]  # names hold commas: one option per name
        specs = {m: {"key": m, "map": m, "skip": skip} for m in filter(None, args.maps.split(","))}
        sources = {m: {"what": "Initialisation weights (fixed seeds); see the study's docstring."} for m in specs}
        overrides = [f"data.root={args.root}"] if args.root else []
        for item in args.ckpt:
            label, path = item.rsplit("=", 1)
            for key, src in export_checkpoint_maps(label, path, Path(tmp), overrides).items():
                specs[key] = {"key": key, "file": src.pop("file"), "skip": skip}
                sources[key] = src
        for spec in specs.values():
            spec["evals"], sources[spec["key"]]["state"] = _evals_of_our_anderson(spec)
            print(spec["key"], "evals", spec["evals"], flush=True)
        workers = {"ours": Worker(sys.executable, "ours", args.clock)}
        if args.torchdeq_python:
            workers["torchdeq"] = Worker(args.torchdeq_python, "torchdeq", args.clock)
        rounds = {(k, s): [] for k in specs for s in workers}
        try:
            for r in range(args.rounds):
                order = list(workers) if r % 2 == 0 else list(workers)[::-1]
                for key, spec in specs.items():
                    for side in order:
                        rounds[(key, side)].append(workers[side].ask(spec))
                print(f"round {r + 1}/{args.rounds}", flush=True)
        finally:
            for w in workers.values():
                w.close()
    for key, spec in specs.items():
        res["maps"][key] = {"evals": spec["evals"], "source": sources[key],
                            **{side: _summary(rounds[(key, side)]) for side in workers}}
    write_results(args.out, args.name, res, render)
    print(f"-> {args.out / args.name}.md")


if __name__ == "__main__":
    main()
