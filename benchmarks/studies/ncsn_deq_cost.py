"""Where the NCSN DEQ's training step spends its time and bytes, and what the routes to a cheaper recurring block
cost and give (issue: "recurrence at the cost of one residual block").

**Step cost** (``cost``): the ``experiment=ncsn_mnist`` training step (batch 64, ngf 16, SSM-VR, real MNIST
batches from ``--root``), the module's own ``training_step`` outside a Trainer (:mod:`benchmarks.lib.step`), one
arm per process, ``--rounds`` rounds with the arm order reversed every other round, ``--warmup`` + ``--steps``
steps each. Per arm: median seconds per step, bytes autograd saves for backward over the step (distinct storages,
the meter of ``src.callbacks.profiling``), forward solver iterations, and *by phase*: the implicit backward's
nested levels (level 0 the forward solve; level 1 the adjoint solve run inside the objective's create_graph
derivative ∇ₓ(vᵀs); level 2 the adjoint of that adjoint, run by the loss's backward to the parameters), timed and
with the bytes saved while each runs (the rest of the network is "outside the DEQ's solves"). The phases are read
from a ``torch.profiler`` trace of each timed step — the DEQ core's own ``record_function`` spans (``deq.solve``,
``deq.implicit_backward.level<k>``, ``deq.implicit_backward.solve.level<k>``) and a marker span per saved tensor
(:func:`phases_of_trace`) — so nothing of the core is replaced; the timed steps' seconds include the profiler's
overhead (one CPU event per operator).

**Frontier** (``frontier``): 300-step runs at batch 32 of each route (the candidates protocol of
``benchmarks/results/deq_recurrence.md``: ``experiment=ncsn_mnist data.batch_size=32``, validation at step 300), read
from their run directories: recurrence share, contraction, solver iterations, cap hits, validation DSM, and the
training loss curve (a route that diverges shows it there).

**Acceptance** (``acceptance``): 40-step ``experiment=ncsn_mnist`` runs of the DEQ arms and TwoRes, run alternately
by the user's own command (``python -m src.train``), read from their run directories: the profiling callback's
seconds and saved bytes per step, each arm against the TwoRes run of its round. ``acceptance_after``: the same
for runs of a later tree (the DEQ core's rewrite, issue 60), kept beside the first.

    python -m benchmarks.studies.ncsn_deq_cost cost --root <data dir> [--arms record,twores] [--rounds 2]
    python -m benchmarks.studies.ncsn_deq_cost families --root <data dir> --revs <before>,HEAD --clock cpu --untraced
    python -m benchmarks.studies.ncsn_deq_cost frontier --runs <dir with one run dir per arm>
    python -m benchmarks.studies.ncsn_deq_cost acceptance --runs <dir of 40-step runs named <tag>_r<round>_<arm>>
    python -m benchmarks.studies.ncsn_deq_cost acceptance_after --runs <dir> --note <markdown file>
    python -m benchmarks.studies.ncsn_deq_cost --render

**Before and after** (``--revs A,B`` with a cost section): every arm at each revision as committed (its ``src`` and
``conf`` unpacked, :func:`benchmarks.lib.step_cases.rev_trees`), the revisions' processes alternating within each
arm; ``--untraced`` times the steps without the profiler (its per-operator overhead would weigh on the revision
with more small operators), the bytes then in total only. Stored as ``<section>_revs``.

Writes ``benchmarks/results/ncsn_deq_cost.{json,md}`` (each call replaces its own section).
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import csv
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

from benchmarks.lib.jobs import run_process, thread_env
from benchmarks.lib.results import (
    DATA_ROOT,
    machine_facts,
    note_lines,
    rendered,
    result_options,
    script_command,
)
from benchmarks.lib.step_cases import commit_of, rev_env, rev_trees

MODULE = "benchmarks.studies.ncsn_deq_cost"
STEM = "ncsn_deq_cost"
BASE = ["experiment=ncsn_mnist", "logger=none"]
# experiment=ncsn_mnist's DEQ of record (conf/experiment/ncsn_mnist.yaml). Since deq.backward_tol=1e-2 joined it,
# the committed cost tables' "deq=true" rows (adjoint solves at 1e-4) repeat with deq.backward_tol=null added.
RECORD = "deq=true"
# arm: (overrides, what it is). "plain_norms" switches the record map's recomputing norms off (the step before it).
ARMS = {
    "twores": ("deq=false depth=1", "TwoRes: one plain ResBlock where the DEQ block is"),
    "refinenet": ("model.arch=refinenet", "RefineNet (no DEQ)"),
    "paper": ("deq=true deq.block=null deq.norm=frobenius deq.norm_lambda=2 deq.backward=phantom",
              "the paper's DEQ-ResBlock, phantom K = 2 (near-inert: share 0.08 %)"),
    "one_pass": ("deq=true deq.one_pass=true", "the record's one-pass control φ(0)"),
    "record_plain_norms": (RECORD, "the record (normalised ResBlock, exact implicit backward) with plain-op norms"),
    "record": (RECORD, "the record: normalised ResBlock, exact implicit backward, recomputing norms"),
    "record_autograd_products": (RECORD, ("the record with autograd's Jacobian products in its adjoint solves "
                                          "(a VJP on a graph built once, torch.func.jvp), not the map's own")),
    "record_anderson": (f"{RECORD} deq.solver=anderson", "the record with Anderson for every solve"),
    "record_adjoint_tol_1e-4": (f"{RECORD} deq.backward_tol=null",
                                "the record with its adjoint solves at deq.tol (1e-4), as before it took 1e-2"),
    "exact_orders_1": (f"{RECORD} deq.exact_orders=1 deq.phantom_steps=1",
                       "the record, order-2 adjoint truncated to one Neumann term (no level-2 solve)"),
    "phantom_k1": (f"{RECORD} deq.backward=phantom deq.phantom_steps=1", "the record block, phantom K = 1"),
    "phantom_k1_jr": (f"{RECORD} deq.backward=phantom deq.phantom_steps=1 deq.jacobian_penalty=100",
                      "phantom K = 1 + Jacobian penalty γ = 100 on 8 rows"),
}
MB = 2**20
# the clock of every timed figure: wall (perf_counter), or with --clock cpu this process's CPU time (one torch
# thread: the step's compute, not the waits while other processes hold the cores; for a busy machine)
CLOCKS = {"wall": time.perf_counter, "cpu": time.process_time}
# The same accounting for every family (section ``families``): each family's experiment, its DEQ of record (the
# experiment's deq=true), the paper's block, the record's one-pass control and the explicit network.
FAMILY_BASE = {"dkef": "experiment=dkef_uci data=redwine loss=sm", "nice": "experiment=nice_mnist loss=ssm",
               "vae": "experiment=vae_mnist", "ncsn": "experiment=ncsn_mnist"}
FAMILY_ARMS = {
    "record": ("deq=true", "the DEQ of record (the experiment's deq=true)"),
    "paper": ("deq=true deq.norm=frobenius deq.norm_lambda=2", "the paper's block (Frobenius, λ = 2)"),
    "one_pass": ("deq=true deq.one_pass=true", "the record's one-pass control φ(0)"),
    "explicit": ("deq=false", "the explicit network"),
}
FAMILY_EXTRA = {("ncsn", "paper"): "deq.block=null deq.backward=phantom", ("ncsn", "explicit"): "depth=1"}
# The paper authors' code's CIFAR-10 SSM-VR settings (benchmarks/lib/step_cost/ncsn.py, ncsn_memory.md's first table):
# 3×32×32, ngf 128, batch 4, 232 levels 50 → 0.01, Gaussian projections, cond_norm; uniform images, seeded.
RECORD_AUTHORS = {"block": "normalized_residual", "backward": "implicit", "norm": None, "norm_lambda": None,
                  "tol": 1e-4, "stop_mode": "rel"}
AUTHORS_ARMS = {  # arm: (arch, deq, depth, deq overrides of benchmarks.lib.step_cases.deq_settings, what it is)
    "twores": ("deq", False, 1, {}, ARMS["twores"][1]),
    "record_plain_norms": ("deq", True, None, RECORD_AUTHORS, ARMS["record_plain_norms"][1]),
    "record": ("deq", True, None, RECORD_AUTHORS, ARMS["record"][1]),
    "paper": ("deq", True, None, {"tol": 1e-4, "stop_mode": "rel"}, ARMS["paper"][1]),
    "record_adjoint_tol_1e-2": ("deq", True, None, {**RECORD_AUTHORS, "backward_tol": 1e-2},
                                "the record with its adjoint solves at relative 1e-2"),
}


# ------------------------------------------------------------------------------------------ one arm (worker)
OUTSIDE = "outside the DEQ's solves"
SAVED = "ncsn_deq_cost.saved:"  # this study's own marker span: one per tensor autograd saves, named with its bytes


def phase_of_label(name: str) -> str | None:
    """The phase of a ``record_function`` label of the DEQ core (:mod:`src.deq.implicit`), None for others:
    ``deq.solve`` the forward solve, ``deq.implicit_backward.solve.level<k>`` the k-th adjoint solve,
    ``deq.implicit_backward.level<k>`` the backward of level k (its VJP in p and the nested solves)."""
    from src.deq.implicit import PHASE_IMPLICIT_BACKWARD, PHASE_SOLVE

    if name == PHASE_SOLVE:
        return "forward solve (level 0)"
    if name.startswith(f"{PHASE_IMPLICIT_BACKWARD}.solve.level"):
        return f"adjoint solve, level {name.rsplit('level', 1)[1]}"
    if name.startswith(f"{PHASE_IMPLICIT_BACKWARD}.level"):
        return f"backward of level {name.rsplit('level', 1)[1]} (VJP in p, nested solves)"
    return None


def phases_of_trace(events) -> tuple[dict[str, float], dict[str, int]]:
    """(seconds, saved bytes) by phase of one profiled step, from its ``torch.profiler`` events: a phase's
    seconds are its spans' inclusive CPU time (nested phases included, as the levels nest); a saved tensor's bytes
    go to the innermost phase span around its marker (:data:`SAVED`), else to :data:`OUTSIDE`."""
    seconds: dict[str, float] = collections.defaultdict(float)
    saved: dict[str, int] = collections.Counter()
    for ev in events:
        phase = phase_of_label(ev.name)
        if phase is not None:
            seconds[phase] += ev.cpu_time_total / 1e6
        elif ev.name.startswith(SAVED):
            node, where = ev.cpu_parent, OUTSIDE
            while node is not None:
                if (label := phase_of_label(node.name)) is not None:
                    where = label
                    break
                node = node.cpu_parent
            saved[where] += int(ev.name[len(SAVED):])
    return dict(seconds), dict(saved)


def worker(spec: dict) -> dict:
    """One arm, in this process: warm-up and timed steps on MNIST batches; returns its record."""
    import torch
    from torch.profiler import ProfilerActivity, profile, record_function

    from benchmarks.lib.config import train_config
    from benchmarks.lib.step import trainer_free, training_step
    from src.runs.build import build

    torch.set_num_threads(int(spec["threads"]))
    clock = CLOCKS[spec.get("clock") or "wall"]
    torch.manual_seed(0)
    if spec.get("setting") == "authors":
        from benchmarks.lib.step_cost.ncsn import AUTHORS_SETTINGS
        from benchmarks.lib.step_cost.ncsn import build as build_ncsn

        arch, deq, depth, overrides, _ = AUTHORS_ARMS[spec["arm"]]
        module = build_ncsn(arch, deq, depth, 128, "cpu", overrides, **AUTHORS_SETTINGS)
        g = torch.Generator().manual_seed(0)
        batches = iter([torch.rand(4, 3, 32, 32, generator=g) for _ in range(64)])
    else:
        base = FAMILY_BASE[spec["family"]].split() + ["logger=none"] if spec.get("family") else BASE
        cfg = train_config([*base, f"data.root={spec['root']}", *spec["overrides"].split()], spec.get("conf"))
        module = build(cfg.model)
        dm = build(cfg.data)
        dm.setup("fit")
        batches = iter(dm.train_dataloader())
    if spec["arm"] == "record_autograd_products":  # the adjoint solves take autograd's products: the block's map
        from src.deq.maps import NormalizedResidualMap  # built again with hand_products=False

        for m in module.modules():
            if isinstance(getattr(m, "phi", None), NormalizedResidualMap):
                m.phi = NormalizedResidualMap(m.phi.padding, recompute=m.phi.recompute, hand_products=False)
    if spec["arm"] == "record_plain_norms":  # the block's map built again with plain-op norms
        from src.deq.maps import NormalizedResidualMap

        for m in module.modules():
            if isinstance(getattr(m, "phi", None), NormalizedResidualMap):
                m.phi = NormalizedResidualMap(m.phi.padding, recompute=False)
    optimizers = trainer_free(module)
    from src.deq.lookup import blocks_of

    blocks = [b for _, b in blocks_of(module)]
    steps = []
    traced = spec.get("trace", True)
    for k in range(int(spec["warmup"]) + int(spec["steps"])):
        batch = next(batches)
        seen: set = set()
        total = {OUTSIDE: 0}

        def pack(t, seen=seen, total=total):  # a marker span per distinct storage saved: its phase is the span around it
            storage = t.untyped_storage()
            if storage.data_ptr() not in seen:
                seen.add(storage.data_ptr())
                total[OUTSIDE] += storage.nbytes()
                if traced:
                    with record_function(f"{SAVED}{storage.nbytes()}"):
                        pass
            return t

        timed = k >= int(spec["warmup"])
        with (profile(activities=[ProfilerActivity.CPU]) if timed and traced else contextlib.nullcontext()) as prof:
            t0 = clock()
            with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
                training_step(module, batch, optimizers)
            seconds = clock() - t0
        if timed:  # untraced: the bytes' total only (no phases)
            by_seconds, by_phase = phases_of_trace(prof.events()) if traced else ({}, total)
            its = [b.last_stats["iterations"] for b in blocks if b.last_stats]
            adjoint = [b.last_backward_stats["iterations"] for b in blocks if b.last_backward_stats]
            steps.append({"s": seconds, "saved_MB": sum(by_phase.values()) / MB,
                          "saved_MB_by_phase": {p: b / MB for p, b in by_phase.items()},
                          "seconds_by_phase": by_seconds,
                          "iterations": statistics.mean(its) if its else None,
                          "adjoint_iterations": max(adjoint) if adjoint else None})
    return {"arm": spec["arm"], "steps": steps, "params": sum(p.numel() for p in module.parameters())}


# ------------------------------------------------------------------------------------------ sections
def family_arms(families: list[str]) -> dict[str, tuple[str, str]]:
    """``family/arm`` → (overrides, what it is) of the ``families`` section."""
    return {f"{family}/{arm}": (" ".join(filter(None, [ov, FAMILY_EXTRA.get((family, arm), "")])), what)
            for family in families for arm, (ov, what) in FAMILY_ARMS.items()}


def authors_arms() -> dict[str, tuple[str, str]]:
    """arm → (its deq settings as overrides, what it is) of the ``authors`` section (:data:`AUTHORS_ARMS`)."""
    return {arm: ("deq=false depth=1" if not deq else
                  " ".join(f"deq.{k}={'null' if v is None else v}" for k, v in overrides.items()), what)
            for arm, (_, deq, _, overrides, what) in AUTHORS_ARMS.items()}


def run_cost(args) -> dict:
    """A step-cost section: every arm in its own process, round by round. With ``--revs`` every arm runs at each
    revision as committed (its ``src`` and ``conf``, :func:`benchmarks.lib.step_cases.rev_trees`), the revisions
    alternating within each arm and their order reversed every other round; the section then holds one row set per
    revision (``{"meta", "revs": {rev: rows}}``)."""
    catalogue = {"families": family_arms(list(FAMILY_BASE)), "authors": authors_arms()}.get(args.section, ARMS)
    arms = args.arms.split(",") if args.arms else list(catalogue)
    unknown = [a for a in arms if a not in catalogue]
    if unknown:
        raise SystemExit(f"unknown arm(s) {', '.join(unknown)}; valid: {', '.join(catalogue)}")
    revs = [r.strip() for r in args.revs.split(",") if r.strip()] if args.revs else [None]
    labels = {rev: f"{rev} ({commit_of(rev)})" for rev in revs if rev}  # the commits measured, named at the start
    records: dict[tuple, list] = collections.defaultdict(list)
    with tempfile.TemporaryDirectory(prefix="deqsm_ncsn_cost_") as tmp:
        trees = rev_trees(revs, Path(tmp)) if args.revs else {None: None}
        root = str(Path(args.root).resolve()) if args.revs else args.root  # a worker runs in its revision's tree
        for r in range(args.rounds):
            for arm in (arms if r % 2 == 0 else arms[::-1]):
                for rev in (revs if r % 2 == 0 else revs[::-1]):
                    spec = {"arm": arm, "overrides": catalogue[arm][0], "root": root,
                            "threads": args.threads, "warmup": args.warmup, "steps": args.steps,
                            "setting": args.section, "family": arm.split("/")[0] if args.section == "families" else None,
                            "clock": args.clock, "trace": not args.untraced,
                            "conf": str(trees[rev] / "conf") if rev else None}
                    print(f"round {r + 1}/{args.rounds}: {arm}{f' at {rev}' if rev else ''} …", flush=True)
                    env = thread_env(args.threads)
                    ran = run_process([sys.executable, "-m", MODULE, "--worker", json.dumps(spec)],
                                      rev_env(trees[rev], env) if rev else env, cwd=trees[rev])
                    if ran["code"] != 0:
                        raise SystemExit(f"{arm} failed:\n{ran['tail']}")
                    rec = json.loads(ran["stdout"].strip().splitlines()[-1])
                    records[(rev, arm)].extend(rec["steps"])
                    print(f"  {statistics.median(s['s'] for s in rec['steps']):.3f} s/step, "
                          f"{max(s['saved_MB'] for s in rec['steps']):.1f} MB saved", flush=True)
    by_rev = {rev: _rows({arm: steps for (r, arm), steps in records.items() if r == rev}, catalogue) for rev in revs}
    base = {"authors": "the authors' CIFAR-10 SSM-VR settings: 3×32×32, ngf 128, batch 4, 232 levels 50 → 0.01, "
                       "Gaussian projections, uniform images",
            "families": "; ".join(f"{f}: `{b}`" for f, b in FAMILY_BASE.items())}.get(args.section, " ".join(BASE))
    meta = {"command": args.command, "machine": machine_facts(), "threads": args.threads,
            "rounds": args.rounds, "warmup": args.warmup, "steps": args.steps,
            **({"clock": "cpu"} if args.clock == "cpu" else {}), **({"untraced": True} if args.untraced else {}),
            "load_average": " ".join(f"{x:.2f}" for x in os.getloadavg()), "base": base, "note": _note(args)}
    if args.revs:
        return {"meta": meta, "revs": {labels[rev]: rows for rev, rows in by_rev.items()}}
    return {"meta": meta, "rows": by_rev[None]}


def _rows(records: dict[str, list], catalogue: dict) -> dict:
    """The table rows of one revision's steps ``{arm: [step records]}``."""
    rows = {}
    for arm, steps in records.items():
        last = steps[-1]
        phases = sorted({p for s in steps for p in s["seconds_by_phase"]})
        shown, what = catalogue[arm]
        rows[arm] = {"overrides": shown, "what": what, "steps": len(steps),
                     "s_per_step": statistics.median(s["s"] for s in steps),
                     "s_min": min(s["s"] for s in steps), "s_max": max(s["s"] for s in steps),
                     "saved_MB": statistics.median(s["saved_MB"] for s in steps),
                     "iterations": statistics.mean(s["iterations"] for s in steps) if last["iterations"] else None,
                     "adjoint_iterations": statistics.mean(s["adjoint_iterations"] for s in steps)
                     if last["adjoint_iterations"] else None,
                     "seconds_by_phase": {p: statistics.median(s["seconds_by_phase"].get(p, 0.0) for s in steps)
                                          for p in phases},
                     "saved_MB_by_phase": last["saved_MB_by_phase"]}
    return rows


def read_run(run_dir: Path) -> dict:
    """A 300-step frontier run's figures: the last validation's DEQ keys and DSM, cap hits, the loss curve."""
    rows = []
    for log in sorted(run_dir.glob("csv/version_*/metrics.csv"))[-1:]:
        with log.open() as fh:
            rows = list(csv.DictReader(fh))
    val = [r for r in rows if r.get("val/dsm_loss")]
    last = val[-1] if val else {}
    loss = [(int(r["step"]), float(r["train/loss_step"])) for r in rows if r.get("train/loss_step")]
    caps = sum(float(r["profile/deq_hit_cap"]) for r in rows if r.get("profile/deq_hit_cap"))
    its = [float(r["profile/deq_iterations"]) for r in rows if r.get("profile/deq_iterations")]

    def num(key):
        return float(last[key]) if last.get(key) else None

    return {"command": _train_command(_run_overrides(run_dir)),
            "last_step": loss[-1][0] + 1 if loss else 0, "val_dsm": num("val/dsm_loss"),
            "share": num("val/deq_recurrence_share"), "contraction": num("val/deq_contraction_rate"),
            "logged_cap_hits": caps, "max_iterations": max(its) if its else None,
            "loss_curve": loss}


def run_frontier(args) -> dict:
    runs = {}
    for run_dir in sorted(Path(args.runs).iterdir()):
        if run_dir.is_dir() and (run_dir / "csv").exists():
            runs[run_dir.name] = read_run(run_dir)
    return {"meta": {"command": args.command, "note": _note(args)}, "runs": runs}


def _run_overrides(run_dir: Path) -> list[str]:
    """A run's command-line overrides (``.hydra/overrides.yaml``) without the machine's data root and run folder."""
    from omegaconf import OmegaConf

    overrides = run_dir / ".hydra" / "overrides.yaml"
    return [c for c in (OmegaConf.load(overrides) if overrides.exists() else [])
            if not c.startswith(("data.root=", "hydra.run.dir="))]


def _train_command(overrides: list[str]) -> str:
    return "python -m src.train " + " ".join([*overrides, "data.root=<data dir>"])


def read_acceptance_run(run_dir: Path) -> dict:
    """A 40-step acceptance run (``<tag>_r<round>_<arm>``): its command, the profiling callback's seconds and saved
    bytes per step, forward solver iterations, and CPU over wall time (≈ 1: its core was not shared)."""
    from omegaconf import OmegaConf

    m = json.loads((run_dir / "metrics.json").read_text())
    config = run_dir / ".hydra" / "config.yaml"
    deq = OmegaConf.load(config).get("deq", {}) if config.exists() else {}
    cmd = _run_overrides(run_dir)
    tag, _, rest = run_dir.name.partition("_r")
    return {"command": _train_command(cmd), "arm": " ".join(c for c in cmd if c.startswith(("deq", "depth"))),
            "tag": tag, "round": int(rest.split("_")[0]) if rest else 1,
            "s_per_step": m["profile/time_per_step_s"], "saved_MB": m["profile/saved_bytes_mean"] / MB,
            "iterations": m.get("profile/deq_iterations_mean"), "cpu_over_wall": m["time/fit_cpu_s"] / m["time/fit_s"],
            # the adjoint solves' stop rule the run had (deq.backward_tol, else deq.tol; none without a DEQ)
            "adjoint_tol": (deq.get("backward_tol") or deq.get("tol")) if deq.get("enabled") else None,
            "adjoint_iterations": m.get("profile/deq_adjoint_iterations_mean")}


def run_acceptance(args) -> dict:
    runs = {d.name: read_acceptance_run(d) for d in sorted(Path(args.runs).iterdir()) if (d / "metrics.json").is_file()}
    return {"meta": {"command": args.command, "machine": machine_facts().rsplit("; cpu", 1)[0], "note": _note(args)},
            "runs": runs}


def _note(args) -> str | None:
    return Path(args.note).read_text() if args.note else None


# ------------------------------------------------------------------------------------------ render
def _f(v, digits=2):
    return "–" if v is None else f"{v:.{digits}f}"


def _cost_lines(cost: dict, title: str) -> list[str]:
    """The table and phase lines of one step-cost section (``cost``: ncsn_mnist; ``authors``: the authors' CIFAR-10
    settings)."""
    from src.reports.tables import markdown_table

    meta, rows = cost["meta"], cost["rows"]
    lines = [title.format(base=meta["base"]), "",
             (f"`{meta['command']}` — {meta['machine']}. Each arm in its own process, {meta['rounds']} "
              f"round(s) (order reversed every other round), {meta['warmup']} warm-up + {meta['steps']} timed "
              "steps a round; medians over the timed steps. *saved* = bytes autograd saves for backward over the "
              "whole step (distinct storages). The machine is shared (2 cores, other jobs): read ratios of arms "
              "measured in the same call, not absolute seconds."
              + (" Seconds are this process's CPU time (`--clock cpu`, one torch thread), not wall time: the "
                 "machine ran other jobs, whose share of the cores a wall clock would count." if meta.get("clock")
                 == "cpu" else "")), ""]
    lines += note_lines(meta)
    families = all("/" in arm for arm in rows)
    ref_name = "explicit" if families else "TwoRes"

    def ref(arm, kind="explicit"):  # the row an arm is compared with: TwoRes, or its family's explicit / one-pass
        return rows.get(f"{arm.split('/')[0]}/{kind}") if families else rows.get("twores")

    head = ["arm", "overrides", "s/step", f"× {ref_name}", "saved MB", f"× {ref_name}", "fwd iters", "adjoint iters"]
    if families:
        head[4:4] = ["× one-pass"]
    body = []
    for arm, r in rows.items():
        base = ref(arm)
        cells = [arm, f"`{r['overrides']}`", _f(r["s_per_step"], 3),
                 _f(r["s_per_step"] / base["s_per_step"]) if base else "–", _f(r["saved_MB"], 1),
                 _f(r["saved_MB"] / base["saved_MB"]) if base else "–", _f(r["iterations"], 1),
                 _f(r["adjoint_iterations"], 1)]
        if families:
            one = ref(arm, "one_pass")
            cells[4:4] = [_f(r["s_per_step"] / one["s_per_step"]) if one else "–"]
        body.append(cells)
    lines += markdown_table(head, body) + [""]
    lines += [("By phase (the median seconds inside each, nested phases included; MB saved while it ran, of one "
              "step):"), ""]
    for arm, r in rows.items():
        if not r["seconds_by_phase"]:
            continue
        parts = [f"{p}: {_f(r['seconds_by_phase'].get(p), 3)} s, {_f(r['saved_MB_by_phase'].get(p, 0.0), 1)} MB"
                 for p in sorted(set(r["seconds_by_phase"]) | set(r["saved_MB_by_phase"]))]
        lines.append(f"- **{arm}** — " + "; ".join(parts))
    lines.append("")
    return lines


def _revs_lines(section: dict, title: str) -> list[str]:
    """A step-cost section run at several revisions (``--revs``): per arm, each revision's s/step and saved MB, the
    last revision over the first, and each revision's ratio to its own reference row (TwoRes, or the family's
    explicit network)."""
    from src.reports.tables import markdown_table

    meta, by_rev = section["meta"], section["revs"]
    revs = list(by_rev)
    first = revs[0]
    lines = [title.format(base=meta["base"]) + f": {' against '.join(revs[::-1])}", "",
             (f"`{meta['command']}` — {meta['machine']}; load average at the start {meta.get('load_average', '?')}. "
              f"Every arm in its own process at each revision as committed (its `src` and `conf`), the revisions "
              f"alternating within each arm, {meta['rounds']} round(s) (arm and revision order reversed every other "
              f"round), {meta['warmup']} warm-up + {meta['steps']} timed steps a process; s/step: the median of the "
              "timed steps (in brackets the least and the largest), saved MB: bytes autograd saves for backward over "
              "the whole step (distinct storages; deterministic)."
              + (" Seconds are this process's CPU time (`--clock cpu`, one torch thread), not wall time."
                 if meta.get("clock") == "cpu" else "")
              + (" Steps timed without the profiler." if meta.get("untraced") else "")), ""]
    lines += note_lines(meta)
    arms = list(by_rev[first])
    families = all("/" in arm for arm in arms)

    def ref(rows, arm):
        return rows.get(f"{arm.split('/')[0]}/explicit") if families else rows.get("twores")

    head = ["arm", "overrides", *[f"s/step {r.split()[0]}" for r in revs], "time after / before",
            *[f"saved MB {r.split()[0]}" for r in revs], "bytes after / before",
            *[f"× {'explicit' if families else 'TwoRes'} {r.split()[0]} (time, bytes)" for r in revs], "fwd iters"]
    body = []
    for arm in arms:
        rows = [by_rev[r].get(arm) for r in revs]
        if any(x is None for x in rows):
            continue
        a, b = rows[0], rows[-1]

        def span(x):
            return f"{x['s_per_step']:.3f} ({x['s_min']:.3f}–{x['s_max']:.3f})" if "s_min" in x else _f(x["s_per_step"], 3)

        refs = []
        for r, x in zip(revs, rows):
            base = ref(by_rev[r], arm)
            refs.append(f"{x['s_per_step'] / base['s_per_step']:.2f}, {x['saved_MB'] / base['saved_MB']:.2f}"
                        if base else "–")
        body.append([arm, f"`{a['overrides']}`", *[span(x) for x in rows], _f(b["s_per_step"] / a["s_per_step"]),
                     *[_f(x["saved_MB"], 1) for x in rows], _f(b["saved_MB"] / a["saved_MB"], 3), *refs,
                     " / ".join(_f(x["iterations"], 1) for x in rows)])
    lines += markdown_table(head, body) + [""]
    return lines


ACCEPTANCE_TITLES = {
    "acceptance": "## The acceptance: 40-step `experiment=ncsn_mnist` runs side by side (batch 64, SSM-VR)",
    "acceptance_after": ("## The acceptance after the DEQ core's rewrite (issue 60): 40-step `experiment=ncsn_mnist` "
                         "runs side by side (batch 64, SSM-VR)"),
}


def _acceptance_lines(accept: dict, title: str = ACCEPTANCE_TITLES["acceptance"]) -> list[str]:
    """The issue's acceptance measurement: 40-step runs, each arm against the TwoRes run of its round."""
    from src.reports.tables import markdown_table

    meta, runs = accept["meta"], accept["runs"]
    lines = [title, "",
             (f"`{meta['command']}` reads the runs below — {meta['machine']}. s/step and saved MB are the profiling "
              "callback's (`profile/time_per_step_s`, `profile/saved_bytes_mean` in each run's metrics.json: wall "
              "time per step after the first); each arm is compared with the TwoRes run (`deq=false depth=1`) of its "
              "round; CPU / wall ≈ 1 says the run had its core to itself."), ""]
    lines += note_lines(meta)
    twores = {(r["tag"], r["round"]): r for r in runs.values() if r["arm"] == "deq=false depth=1"}
    head = ["run", "overrides", "adjoint tol", "round", "s/step", "× TwoRes", "saved MB", "× TwoRes", "fwd iters",
            "adjoint iters", "CPU / wall"]
    body = []
    for name, r in runs.items():
        base = twores.get((r["tag"], r["round"]))
        tol = r.get("adjoint_tol")
        body.append([name, f"`{r['arm']}`", "–" if tol is None else f"{tol:g}", str(r["round"]),
                     _f(r["s_per_step"], 3), _f(r["s_per_step"] / base["s_per_step"]) if base else "–",
                     _f(r["saved_MB"], 1), _f(r["saved_MB"] / base["saved_MB"]) if base else "–",
                     _f(r["iterations"], 1), _f(r.get("adjoint_iterations"), 1), _f(r["cpu_over_wall"])])
    lines += markdown_table(head, body) + [""]
    lines += ["Commands:", ""] + [f"- {name}: `{r['command']}`" for name, r in runs.items()] + [""]
    return lines


def render(res: dict) -> str:
    lines = ["# The NCSN DEQ's step: where time and bytes go, and the routes to a cheaper recurring block", ""]
    for section, title in (("cost", "## Step cost at `{base}` (batch 64, ngf 16, SSM-VR, MNIST batches)"),
                           ("authors", "## Step cost at {base}"),
                           ("families", "## A cost line for every family ({base}; each experiment's batches)")):
        if section in res:
            lines += _cost_lines(res[section], title)
        if f"{section}_revs" in res:
            lines += _revs_lines(res[f"{section}_revs"], title)
    for section, title in ACCEPTANCE_TITLES.items():
        if res.get(section):
            lines += _acceptance_lines(res[section], title)
    frontier = res.get("frontier")
    if frontier:
        meta = frontier["meta"]
        lines += ["## The routes over 300 steps (batch 32, validation at step 300)", "",
                  f"`{meta['command']}` reads the runs below (each its `src.train` command).", ""]
        lines += note_lines(meta)
        head = ["run", "steps run", "val DSM", "share", "contraction", "max iters (logged)", "logged steps at the cap",
                "training loss (every 50 steps, and the last)"]
        body = []
        for name, r in frontier["runs"].items():
            curve = ", ".join(f"{v:.0f}" for s, v in r["loss_curve"] if (s + 1) % 50 == 0 or s + 1 == r["last_step"])
            body.append([name, str(r["last_step"]), _f(r["val_dsm"]), _f(r["share"], 4), _f(r["contraction"], 3),
                         _f(r["max_iterations"], 0), _f(r["logged_cap_hits"], 0), curve])
        from src.reports.tables import markdown_table

        lines += markdown_table(head, body) + [""]
        lines += ["Commands:", ""] + [f"- {name}: `{r['command']}`" for name, r in frontier["runs"].items()] + [""]
    return "\n".join(lines)


def main(argv=None):
    argv = sys.argv[1:] if argv is None else list(argv)
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("section", nargs="?",
                    choices=("cost", "authors", "families", "frontier", "acceptance", "acceptance_after"))
    ap.add_argument("--root", default=str(DATA_ROOT), help="data.root (MNIST)")
    ap.add_argument("--arms", default="", help=f"cost: comma-separated arms (default all: {', '.join(ARMS)})")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--clock", choices=tuple(CLOCKS), default="wall",
                    help="wall time, or the process's CPU time (one thread: robust to other processes' load)")
    ap.add_argument("--runs", type=Path, default=None,
                    help="frontier / acceptance: a folder of 300-step / 40-step run directories")
    ap.add_argument("--note", default=None, help="a markdown file: a finding, written below the section's table")
    ap.add_argument("--revs", default=None,
                    help="cost sections: comma-separated commits, each measured as committed, side by side (the "
                         "section is stored as <section>_revs)")
    ap.add_argument("--untraced", action="store_true",
                    help="cost sections: time the steps without the profiler (no phases; bytes in total)")
    ap.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    result_options(ap)
    args = ap.parse_args(argv)
    if args.worker:
        print(json.dumps(worker(json.loads(args.worker))), flush=True)
        return
    if rendered(args, STEM, render):
        return
    if args.section is None:
        ap.error("give a section (cost | authors | families | frontier | acceptance | acceptance_after) or --render")
    placeholders = {str(args.runs): "<runs dir>"} if args.runs else None
    args.command = script_command(MODULE, argv, data_root=args.root, placeholders=placeholders)
    from benchmarks.lib.results import load_results, write_results

    res = load_results(args.out, STEM)
    runner = {"frontier": run_frontier, "acceptance": run_acceptance,
              "acceptance_after": run_acceptance}.get(args.section, run_cost)
    res[f"{args.section}_revs" if args.revs and runner is run_cost else args.section] = runner(args)
    write_results(args.out, STEM, res, render)
    print(render(res))


if __name__ == "__main__":
    main()
