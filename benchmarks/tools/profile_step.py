"""Where one training step's time goes, per family: torch.profiler tables grouped by phase.

Each case of ``benchmarks.lib.step_cases`` (DKEF exact SM on RedWine, NICE SSM, NCSN SSM-VR, SSM-VAE; the DEQ variant and
the explicit one it is compared with) runs its LightningModule's own ``training_step`` (outside a Trainer,
``benchmarks.lib.step.training_step``: its own optimisers, zero_grad / step / backward as Lightning's loop) for ``--warmup``
steps, then one step under ``torch.profiler`` (CPU). Every profiled operator's *self* CPU time is attributed to
the innermost phase label around it — the labels are ``torch.profiler.record_function`` ranges placed in the
modules' own code paths (a no-op when no profiler runs):

==============================  ===========================================================================
phase                           label (where)
==============================  ===========================================================================
DEQ solver forward              ``deq.solve`` (``src/deq/block.py``, ``src/deq/implicit.py``: the no-grad solve)
DEQ phantom steps (forward)     ``deq.phantom_steps`` (the K steps of Alg. 1 with autograd)
DEQ implicit backward           ``deq.implicit_backward`` (adjoint solves and the VJP in the map parameters)
score s(x)                      ``objective.score`` (``src/objectives/base.py``: s and its graph)
Hessian trace / projections     ``objective.trace`` (exact SM's D reverse passes, SSM's projected ones)
α fit                           ``dkef.alpha_fit`` (``src/models/dkef.py``: DKEF's closed-form α)
optimiser                       ``Optimizer.step#…`` / ``Optimizer.zero_grad#…`` (torch's own labels)
backward to the parameters      autograd-engine operators outside every label (``loss.backward()``)
other                           everything else (noise draws, the VAE's ELBO, logging, …)
==============================  ===========================================================================

Work the objective's derivative passes do *through* a DEQ (the backward of its phantom steps inside the trace)
counts as the trace: the labels say which code asked for the work, not which layer it ran in.

    python -m benchmarks.tools.profile_step                       # every case, 1 thread, HEAD as committed
    python -m benchmarks.tools.profile_step --cases dkef/deq,dkef/3-layer
    python -m benchmarks.tools.profile_step --render              # rebuild the markdown from the JSON

Writes ``benchmarks/results/profile_step.json`` and ``.md`` (cases given on the command line replace their
earlier entries; the others are kept).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from collections import defaultdict
from pathlib import Path

from benchmarks.lib.results import (
    DATA_ROOT,
    ROOT,
    load_results,
    machine_facts,
    made_by,
    note_lines,
    rendered,
    result_options,
    script_command,
    write_results,
)
from benchmarks.lib.step import trainer_free, training_step
from benchmarks.lib.step_cases import CASES, build_case, commit_of, deq_iterations, snapshot

MODULE = "benchmarks.tools.profile_step"
PHASES = [  # (label prefix, phase name), in table order
    ("deq.solve", "DEQ solver forward"),
    ("deq.phantom_steps", "DEQ phantom steps (forward)"),
    ("deq.implicit_backward", "DEQ implicit backward"),
    ("objective.score", "score s(x)"),
    ("objective.trace", "Hessian trace / projections"),
    ("dkef.alpha_fit", "α fit"),
    ("Optimizer.", "optimiser"),
]
BACKWARD, OTHER = "backward to the parameters", "other"
PHASE_NAMES = [name for _, name in PHASES] + [BACKWARD, OTHER]
ENGINE = "autograd::engine::evaluate_function"
LABELS = (*(prefix for prefix, _ in PHASES), ENGINE)  # ranges, not operators: left out of the operator list


def _phase_of(event) -> str:
    """The innermost phase label around ``event`` (itself included)."""
    node, in_engine = event, False
    while node is not None:
        for prefix, name in PHASES:
            if node.name.startswith(prefix):
                return name
        in_engine = in_engine or node.name.startswith(ENGINE)
        node = node.cpu_parent
    return BACKWARD if in_engine else OTHER


def profile_case(case: str, warmup: int, timed: int, data_root: str | None, top: int, root: Path = ROOT) -> dict:
    """One case profiled (see the module docstring); ``root``: the tree whose ``conf`` the case reads."""
    from torch.profiler import ProfilerActivity, profile

    module, batches, facts = build_case(case, root, data_root)
    optimizers = trainer_free(module)
    for k in range(warmup):
        training_step(module, batches[k % len(batches)], optimizers)
    times = []
    for k in range(timed):
        t0 = time.perf_counter()
        training_step(module, batches[(warmup + k) % len(batches)], optimizers)
        times.append(time.perf_counter() - t0)
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        t0 = time.perf_counter()
        training_step(module, batches[(warmup + timed) % len(batches)], optimizers)
        profiled_s = time.perf_counter() - t0
    phases: dict[str, float] = defaultdict(float)
    ops: dict[str, list] = defaultdict(lambda: [0.0, 0])
    for ev in prof.events():
        phases[_phase_of(ev)] += ev.self_cpu_time_total / 1e3  # ms
        if not ev.name.startswith(LABELS):
            ops[ev.name][0] += ev.self_cpu_time_total / 1e3
            ops[ev.name][1] += 1
    total = sum(phases.values())
    top_ops = sorted(ops.items(), key=lambda kv: -kv[1][0])[:top]
    return {"facts": facts, "step_s_median": statistics.median(times) if times else None, "timed_steps": timed,
            "profiled_step_s": profiled_s, "profiled_cpu_ms": total,
            "phases_ms": {name: phases.get(name, 0.0) for name in PHASE_NAMES},
            "top_ops": [{"name": n, "self_ms": v[0], "calls": v[1]} for n, v in top_ops],
            "n_events": len(prof.events()), "deq_iterations": deq_iterations(module)}


def render(res: dict) -> str:
    meta = res["meta"]
    lines = ["# One training step per family, profiled by phase", "",
             (f"Command: `{meta['command']}` (`<data dir>`: the data root). Machine: {meta['machine']}; load "
             f"average at the start {meta['load_average']}. Code: {meta['revision']}."), "",
             ("Each case is its LightningModule's own `training_step` (outside a Trainer; its own optimisers) after "
             f"{meta['warmup']} warm-up steps; *s/step* is the median of {meta['timed']} unprofiled steps, the phase "
             "columns are one profiled step's *self* CPU time (ms) attributed to the innermost `record_function` "
             f"label around each operator (see `{made_by(meta['command'], 'benchmarks/profile_step.py', MODULE)}`; the "
             "profiler's own overhead inflates "
             "the many-small-operator cases). The machine is shared (2 cores, other jobs running): absolute "
             "times are noisy, phase shares are what to read."), ""]
    cases = [c for c in CASES if c in res["cases"]]
    head = ["case", "s/step", "profiled CPU ms", *PHASE_NAMES]
    rows = []
    for c in cases:
        r = res["cases"][c]
        tot = r["profiled_cpu_ms"]
        cells = [c, f"{r['step_s_median']:.3f}" if r["step_s_median"] is not None else "–", f"{tot:.0f}"]
        cells += [f"{r['phases_ms'][p]:.0f} ({100 * r['phases_ms'][p] / tot:.0f} %)" if r["phases_ms"][p] >= 0.5
                  else "–" for p in PHASE_NAMES]
        rows.append(cells)
    lines += ["| " + " | ".join(head) + " |", "|---|" + "---:|" * (len(head) - 1)]
    lines += ["| " + " | ".join(r) + " |" for r in rows]
    lines.append("")
    for c in cases:
        r = res["cases"][c]
        facts = ", ".join(f"{k} {v}" for k, v in r["facts"].items())
        lines += [f"## {c}", "", f"{facts}.", "", "| operator | self ms | calls |", "|---|---:|---:|"]
        lines += [f"| `{o['name']}` | {o['self_ms']:.1f} | {o['calls']} |" for o in r["top_ops"]]
        lines.append("")
    lines += note_lines(meta)
    return "\n".join(lines)


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--cases", default=",".join(CASES), help=f"comma-separated, of {', '.join(CASES)}")
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--timed", type=int, default=3, help="unprofiled steps timed before the profiled one")
    ap.add_argument("--top", type=int, default=12, help="operators listed per case")
    ap.add_argument("--at", default="HEAD", help="the commit profiled (its src and conf as committed, unpacked "
                    "into a temporary folder), or 'worktree' for this checkout as it is")
    ap.add_argument("--root", default=str(DATA_ROOT), help="data root (RedWine for the DKEF cases)")
    ap.add_argument("--note", default=None, help="a markdown file appended below the tables (with --render: added to the saved results)")
    result_options(ap, "profile_step")
    args = ap.parse_args(argv)
    if rendered(args, args.name, render):
        return {}
    tree = ROOT
    if args.at != "worktree":  # the commit as committed: concurrent edits of the working tree cannot interfere
        if "src" in sys.modules:
            raise RuntimeError("profile_step: src was imported before the snapshot was put on sys.path")
        tmp = tempfile.TemporaryDirectory(prefix="deqsm_profile_")
        tree = snapshot(args.at, Path(tmp.name))
        sys.path.insert(0, str(tree))
    import torch

    
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    cases = [c.strip() for c in args.cases.split(",") if c.strip()]
    unknown = [c for c in cases if c not in CASES]
    if unknown:
        ap.error(f"unknown case(s) {', '.join(unknown)}; valid: {', '.join(CASES)}")
    res = load_results(args.out, args.name) or {}
    res.setdefault("cases", {})
    revision = "the working tree" if args.at == "worktree" else f"commit `{commit_of(args.at)}` as committed"
    res["meta"] = {"command": script_command(MODULE, argv, data_root=args.root), "machine": machine_facts(),
                   "revision": revision,
                   "load_average": " ".join(f"{x:.2f}" for x in os.getloadavg()), "warmup": args.warmup,
                   "timed": args.timed, "note": Path(args.note).read_text() if args.note else res.get("meta", {}).get("note")}
    for case in cases:
        res["cases"][case] = profile_case(case, args.warmup, args.timed, args.root, args.top, tree)
        print(case, json.dumps({k: res["cases"][case][k] for k in ("step_s_median", "profiled_cpu_ms")}),
              flush=True)
        write_results(args.out, args.name, res, render)
    print(f"-> {args.out / args.name}.md")
    return res


if __name__ == "__main__":
    main()
