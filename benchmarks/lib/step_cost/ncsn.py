"""Memory and time of NCSN score networks at the CIFAR-10 size: RefineNet vs TwoRes vs DEQ, in two settings.

``--settings authors`` (the default; issue 31): the paper authors' code's CIFAR-10 SSM-VR settings
(``ncsn/configs/cifar10_ssm.yml``: 232 geometric levels 50 → 0.01, Gaussian projections, ngf 128) at batch 4,
each network in both conditionings (``model.conditioning``: ``cond_norm``, NCSN-v1's CIN++ with a row per
level; ``sigma``, NCSNv2's unconditional network with output / σ) and, as the *before* row, ``cond_norm`` with
the plain autograd instance norm++ (the norms' ``recompute`` switched off: the step as it was before the
recomputing norm of ``src/layers/instance_norm.py``). Per row: parameters, bytes saved for backward over one whole
training step (``NCSNLitModule.training_step`` itself, run outside a Trainer by ``benchmarks.lib.step.training_step``: loss
with its create_graph gradient, backward, Adam), max RSS of the process, wall and CPU seconds per step, DEQ
solver iterations. Each row runs in its own process (``--worker``), so max RSS is that row's; ``--rounds 2``
runs the rows a second time in the opposite order and takes medians over both (the machine is shared). The
authors' figures (issue 31: their code on one pinned core, the same step) are shown beside ours.
``--profile`` adds, per row, the saved bytes by module (forward) and by backward node (the create_graph
backward) and the operators with the most self CPU time of one step (``torch.profiler``).

``--settings table5`` (paper Table 5): 10 levels 1 → 0.01, ``cond_norm``, one Rademacher projection, batch 2;
the score s(x̃, i) alone and the whole step — saved MB and ms (``build`` and ``measure``, also used by
``gpu_suite.py``).

Saved bytes come from ``torch.autograd.graph.saved_tensors_hooks`` (distinct storages; the same on any
device).

    python -m benchmarks.tools.step_cost ncsn --rounds 2            # authors' settings, CPU, 1 thread
    python -m benchmarks.tools.step_cost ncsn --settings table5     # Table 5's, batch 2
    python -m benchmarks.tools.step_cost ncsn --settings table5 --device cuda --batch 128

Results are merged by setting into ``benchmarks/results/ncsn_memory.json`` and rendered to
``benchmarks/results/ncsn_memory.md``.
"""

from __future__ import annotations

import argparse
import json
import platform
import resource
import statistics
import sys
import time
from collections import Counter

import torch

from benchmarks.lib import paper
from benchmarks.lib.jobs import run_process, thread_env
from benchmarks.lib.results import load_results, machine_facts, made_by, note_lines, write_results
from benchmarks.lib.step import measured, trainer_free, training_step
from benchmarks.lib.step_cases import ncsn_module
from src.lit.ncsn import NCSNLitModule
from src.reports.tables import markdown_table

STEM = "ncsn_memory"
# (row, arch, deq enabled, depth, deq overrides): the paper's three rows of Table 5, and the DEQ with the spectral
# bound on its convolutions (deq.norm=spectral) — with a relative stopping tolerance: its map contracts at ≈ 0.08,
# and an absolute 1e-5 per sample on a 128×32×32 state (‖z*‖ ≈ 10²) sits at float32's round-off floor, so
# Picard stalled at residual ≈ 1.1e-5 and ran to max_iter (measured)
VARIANTS = [("SSM-VR NCSN (RefineNet)", "refinenet", False, None, {}),
            ("TwoRes-SSM-VR NCSN (DEQ off)", "deq", False, 1, {}),
            ("DEQ-SSM-VR NCSN", "deq", True, None, {}),
            ("DEQ-SSM-VR NCSN (spectral norm)", "deq", True, None, {"norm": "spectral", "stop_mode": "rel"})]
MB = 2**20


def build(arch: str, deq: bool, depth: int | None, ngf: int, device: str, overrides: dict | None = None, *,
          levels: int = 10, sigma_begin: float = 1.0, conditioning: str = "cond_norm",
          projection: str = "rademacher") -> NCSNLitModule:
    """The ``model=ncsn`` module at 3×32×32 with the SSM-VR loss and the optimiser of ``conf/model/ncsn.yaml``;
    DEQ settings: ``conf/deq/true.yaml``'s defaults (Picard, K = 2 phantom) with ``overrides``. Defaults: Table
    5's setting (10 levels 1 → 0.01, cond_norm, Rademacher projections); :data:`AUTHORS_SETTINGS` the authors'."""
    return ncsn_module(arch, deq, depth, ngf, loss={"name": "ssm_vr", "projection": projection}, deq_overrides=overrides,
                       conditioning=conditioning,
                       noise={"sigma_begin": sigma_begin, "sigma_end": 0.01, "num_classes": levels}).to(device)


def measure(module: NCSNLitModule, batch: int, warmup: int, steps: int, device: str) -> dict:
    """Per step: the score s(x̃, i) alone (seeded x̃, i), then the module's own training step on x."""
    net = module.net
    optimizers = trainer_free(module, device)
    g = torch.Generator().manual_seed(0)
    cuda = device.startswith("cuda")
    score_t, score_b, step_t, step_b, iters, score_peak, step_peak = [], [], [], [], [], [], []
    for k in range(warmup + steps):
        x = torch.rand(batch, 3, 32, 32, generator=g).to(device)
        labels = torch.randint(0, net.sigmas.numel(), (batch,), generator=g).to(device)
        xt = (x + net.sigmas[labels].reshape(-1, 1, 1, 1) * torch.randn(x.shape, generator=g).to(device))
        xt.requires_grad_(True)
        base = torch.cuda.memory_allocated(device) if cuda else 0
        score = measured(lambda xt=xt, labels=labels: net.score(xt, labels), device)
        del score["result"]  # free the score's graph before the step
        step = measured(lambda x=x: training_step(module, x, optimizers), device)
        if cuda:  # the score: the allocator's peak above what was allocated before (graph, workspaces)
            score_peak.append(score["peak_cuda_bytes"] - base)
            step_peak.append(step["peak_cuda_bytes"])
        block = net.deq_block()
        if block is not None:
            iters.append(block.last_stats["iterations"])
        if k >= warmup:
            score_t.append(1e3 * score["seconds"])
            score_b.append(score["saved_bytes"])
            step_t.append(1e3 * step["seconds"])
            step_b.append(step["saved_bytes"])
    rec = {"score_ms": statistics.median(score_t), "score_saved_MB": max(score_b) / MB,
           "step_ms": statistics.median(step_t), "step_saved_MB": max(step_b) / MB}
    if score_peak:
        rec["score_peak_cuda_MB"], rec["step_peak_cuda_MB"] = max(score_peak) / MB, max(step_peak) / MB
    block = net.deq_block()
    if block is not None:
        rec["deq_iterations"] = statistics.mean(iters)
        x = torch.rand(batch, 3, 32, 32, generator=g).to(device)
        labels = torch.arange(batch, device=device) % net.sigmas.numel()
        with torch.no_grad():
            y = net.deq_input(x, labels)
        rec["contraction_rate"] = block.contraction_rate(y, labels)
    return rec


def _render_table5(results: dict) -> list[str]:
    """The ``--settings table5`` sections (score and step, beside Table 5)."""
    recorded = next(iter(results.values()), {}).get("meta", {}).get("command")
    command = made_by(recorded, "python benchmarks/ncsn_memory.py", "python -m benchmarks.tools.step_cost ncsn")
    lines = ["## Paper Table 5's setting", "",
             (f"`{command} --settings table5` — 3×32×32, ngf 128, 10 noise levels, the noise-conditional "
             "SSM-VR step (σ²-weighted, one Rademacher projection), Adam; DEQ: Picard, tol 1e-5, K = 2 phantom "
             "steps, warm start. *score* = s(x̃, i) with autograd (the graph SSM-VR differentiates); *step* = the "
             "whole training step. Saved MB = bytes autograd saves for backward (distinct storages). Untrained "
             "networks (initial weights)."), ""]
    for key, res in sorted(results.items()):
        meta = res["meta"]
        lines += [f"### {key}", "",
                  (f"{meta['device_name']}, torch {meta['torch']}, {meta['threads']} thread(s), batch {meta['batch']}, "
                  f"median of {meta['steps']} steps after {meta['warmup']} warm-up. {meta['note']}"), ""]
        cuda = all("score_peak_cuda_MB" in r for r in res["rows"])
        head = ["method", "params", "score saved MB", "score ms", "step saved MB", "step ms", "DEQ iters",
                "contraction", "paper: params / score-graph memory / total memory / ms per it (batch 128, GPU)"]
        if cuda:
            head[6:6] = ["score peak CUDA MB", "step peak CUDA MB"]
        body = []
        for row in res["rows"]:
            p = paper.NCSN[row["method"]]
            iters = f"{row['deq_iterations']:.1f}" if "deq_iterations" in row else "–"
            rate = f"{row['contraction_rate']:.1e}" if "contraction_rate" in row else "–"
            body.append([row["method"], f"{row['params'] / 1e6:.2f}M", f"{row['score_saved_MB']:.1f}",
                         f"{row['score_ms']:.0f}", f"{row['step_saved_MB']:.1f}", f"{row['step_ms']:.0f}", iters,
                         rate, f"{p[2]} / {p[3]} / {p[4]} / {p[1]}"])
            if cuda:
                body[-1][6:6] = [f"{row['score_peak_cuda_MB']:.0f}", f"{row['step_peak_cuda_MB']:.0f}"]
        lines += markdown_table(head, body)
        rows = {r["method"]: r for r in res["rows"]}
        ref, two, deq = (rows[v[0]] for v in VARIANTS[:3])
        lines += ["", "Ratios (ours; the paper's in brackets, from Table 5):", "",
                  f"- params DEQ / RefineNet: {deq['params'] / ref['params']:.2f} (9M / 28M = 0.32)",
                  (f"- score-graph memory DEQ / RefineNet: {deq['score_saved_MB'] / ref['score_saved_MB']:.2f} "
                  "(2104 / 7536 = 0.28); DEQ / TwoRes: "
                  f"{deq['score_saved_MB'] / two['score_saved_MB']:.2f} (2104 / 1701 = 1.24)"),
                  (f"- step memory DEQ / RefineNet: {deq['step_saved_MB'] / ref['step_saved_MB']:.2f} "
                  "(total memory 20.1 / 40.4 GB = 0.50); DEQ / TwoRes: "
                  f"{deq['step_saved_MB'] / two['step_saved_MB']:.2f} (20.1 / 18.5 = 1.09)"),
                  (f"- time per step DEQ / RefineNet: {deq['step_ms'] / ref['step_ms']:.2f} (481 / 871 = 0.55); "
                  f"DEQ / TwoRes: {deq['step_ms'] / two['step_ms']:.2f} (481 / 391 = 1.23)"), ""]
        if "contraction_rate" in deq:
            lines += [(f"At initialisation the DEQ map contracts at {deq['contraction_rate']:.1e} and the solver stops "
                       f"after {deq['deq_iterations']:.1f} iterations (paper, trained: 16.6): Frobenius-normalised "
                       "128-channel 3×3 kernels (÷ λ·3, the Lipschitz-safe factor) have an operator norm far below "
                       "1/λ, so the untrained block is close to one explicit residual branch and its memory is "
                       "TwoRes's. The rate after training is what `test/deq_contraction_rate` reports."), ""]
        spec = rows.get(VARIANTS[3][0])
        if spec is not None and "contraction_rate" in spec:
            lines += [(f"With `deq.norm=spectral deq.stop_mode=rel` (each kernel ÷ λ·‖conv‖₂, power iteration; the "
                       "solver stops at ‖f(z) − z‖ ≤ 1e-5·‖f(z)‖, since an absolute 1e-5 on this state is at float32's "
                       "round-off floor and stalled at 1.1e-5 for 128 iterations) the same untrained map "
                       f"contracts at {spec['contraction_rate']:.1e} in {spec['deq_iterations']:.1f} iterations: "
                       f"score {spec['score_saved_MB']:.1f} MB / {spec['score_ms']:.0f} ms, step "
                       f"{spec['step_saved_MB']:.1f} MB / {spec['step_ms']:.0f} ms."), ""]
    return lines


def run_table5(args) -> tuple[str, dict]:
    """Table 5's rows (score and step) in this process."""
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    rows = []
    for method, arch, deq, depth, overrides in VARIANTS:
        module = build(arch, deq, depth, args.ngf, args.device, overrides)
        rec = {"method": method, "params": sum(p.numel() for p in module.parameters()),
               **measure(module, args.batch, args.warmup, args.steps, args.device)}
        print(json.dumps(rec), flush=True)
        rows.append(rec)
    name = (torch.cuda.get_device_name() if args.device.startswith("cuda") else platform.processor() or "CPU")
    key = f"{args.device} batch {args.batch} ngf {args.ngf}"
    meta = {"device_name": name, "torch": torch.__version__, "threads": args.threads, "batch": args.batch,
            "steps": args.steps, "warmup": args.warmup, "command": args.command,
            "note": args.note or "No GPU was lent for this run: CPU figures only."}
    return key, {"meta": meta, "rows": rows}


AUTHORS_SETTINGS = {"levels": 232, "sigma_begin": 50.0, "projection": "gaussian"}
NETWORKS = {"DEQ": ("deq", True, None), "TwoRes": ("deq", False, 1), "RefineNet": ("refinenet", False, None)}
# (label, conditioning, recompute the norms): the step before the recomputing norm, then both conditionings
CONDITIONS = [("cond_norm, plain norms (before)", "cond_norm", False), ("cond_norm", "cond_norm", True),
              ("sigma", "sigma", True)]
# issue 31, the authors' code (ncsn/, configs/cifar10_ssm.yml) on one pinned core beside ours before the change:
# s/step, saved for backward MiB, max RSS MiB, params M
AUTHORS = {"DEQ": (9.71, 327, 1021, 5.50), "TwoRes": (12.22, 317, 1016, 7.39), "RefineNet": (16.29, 562, 1696, 29.69)}
ISSUE_OURS = {"DEQ": (9.11, 480, 1487, 12.48), "TwoRes": (8.27, 482, 1525, 12.46),
              "RefineNet": (17.31, 800, 2380, 38.57)}
TARGET_SPEEDUP = 1.2


def _attributed_step(module, x, optimizers) -> dict:
    """One training step with the saved bytes attributed: forward saves to the innermost module class running
    (norm+ELU counted as the norm), create_graph-backward saves to the autograd node saving them; and the
    operators with the most self CPU time (``torch.profiler``)."""
    names: list[str] = []
    by: Counter = Counter()
    seen: set = set()
    hooks = []

    def enter(mod, _inputs):
        names.append(type(mod).__name__)

    def leave(_mod, _inputs, _output):
        names.pop()  # returns None: the output stays

    for mod in module.net.modules():
        hooks += [mod.register_forward_pre_hook(enter), mod.register_forward_hook(leave)]

    def pack(t):
        key = t.untyped_storage().data_ptr()
        if key not in seen:
            seen.add(key)
            node = torch._C._current_autograd_node()
            where = f"forward: {names[-1]}" if names else f"backward: {node.name() if node else 'other'}"
            by[where] += t.untyped_storage().nbytes()
        return t.detach()

    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof, \
            torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        training_step(module, x, optimizers)
    for h in hooks:
        h.remove()
    events = sorted(prof.key_averages(), key=lambda e: e.self_cpu_time_total, reverse=True)
    total = sum(e.self_cpu_time_total for e in events)
    return {"saved_MB": {k: v / MB for k, v in by.most_common()},
            "ops": [{"op": e.key, "self_s": e.self_cpu_time_total / 1e6, "share": e.self_cpu_time_total / total,
                     "calls": e.count} for e in events[:12]]}


def worker(spec: dict) -> dict:
    """One row of the authors'-settings comparison, in this process: ``spec["warmup"]`` + ``spec["steps"]``
    training steps on seeded batches (the same in every row), saved bytes, times, DEQ iterations, max RSS."""
    torch.set_num_threads(int(spec["threads"]))
    torch.manual_seed(0)
    arch, deq, depth = NETWORKS[spec["network"]]
    module = build(arch, deq, depth, spec["ngf"], "cpu", levels=spec["levels"], sigma_begin=spec["sigma_begin"],
                   conditioning=spec["conditioning"], projection=spec["projection"])
    for m in module.net.modules():
        if hasattr(m, "recompute"):
            m.recompute = bool(spec["recompute"])
    optimizers = trainer_free(module, "cpu")
    g = torch.Generator().manual_seed(0)
    rec = {"params": sum(p.numel() for p in module.parameters()), "saved_MB": 0.0, "wall_s": [], "cpu_s": [],
           "deq_iterations": []}
    for k in range(spec["warmup"] + spec["steps"]):
        x = torch.rand(spec["batch"], 3, 32, 32, generator=g)
        c0 = time.process_time()
        step = measured(lambda x=x: training_step(module, x, optimizers))
        cpu = time.process_time() - c0
        block = module.net.deq_block()
        if k >= spec["warmup"]:
            rec["wall_s"].append(step["seconds"])
            rec["cpu_s"].append(cpu)
            rec["saved_MB"] = max(rec["saved_MB"], step["saved_bytes"] / MB)
            if block is not None:
                rec["deq_iterations"].append(block.last_stats["iterations"])
    rec["max_rss_MB"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    if spec.get("profile"):
        rec["profile"] = _attributed_step(module, torch.rand(spec["batch"], 3, 32, 32, generator=g), optimizers)
    return rec


def run_authors(args, on_row=None) -> dict:
    """Every network × condition in its own ``--worker`` process, ``--rounds`` times (odd rounds reversed)."""
    specs = [{"network": net, "label": label, "conditioning": cond, "recompute": rec, "batch": args.batch,
              "ngf": args.ngf, "threads": args.threads, "warmup": args.warmup, "steps": args.steps,
              "profile": args.profile, **AUTHORS_SETTINGS} for net in args.networks for label, cond, rec in CONDITIONS]
    rows: dict = {}
    meta = {"settings": "authors", "machine": machine_facts(), "command": args.command,
            "batch": args.batch, "ngf": args.ngf, "threads": args.threads, "rounds": args.rounds,
            "warmup": args.warmup, "steps": args.steps, "note": args.note, **AUTHORS_SETTINGS}
    for r in range(args.rounds):
        for spec in (specs if r % 2 == 0 else specs[::-1]):
            spec = {**spec, "profile": spec["profile"] and r == 0}  # one profiled step per row
            ran = run_process([sys.executable, "-m", "benchmarks.tools.step_cost", "ncsn", "--worker", json.dumps(spec)],
                              thread_env(args.threads))
            if ran["code"] != 0:
                raise SystemExit(f"step_cost ncsn: the worker of {spec['network']} / {spec['label']} failed:\n"
                                 f"{ran['tail']}")
            rec = json.loads(ran["stdout"].strip().splitlines()[-1])
            key = (spec["network"], spec["label"])
            if key not in rows:
                rows[key] = {"network": spec["network"], "conditioning": spec["label"], **rec}
            else:
                row = rows[key]
                for k in ("wall_s", "cpu_s", "deq_iterations"):
                    row[k] += rec[k]
                row["saved_MB"] = max(row["saved_MB"], rec["saved_MB"])
                row["max_rss_MB"] = max(row["max_rss_MB"], rec["max_rss_MB"])
            print(json.dumps({k: v for k, v in rows[key].items() if k != "profile"}), flush=True)
            if on_row is not None:  # what is measured so far, written after every row
                on_row({"meta": meta, "rows": list(rows.values())})
    return {"meta": meta, "rows": list(rows.values())}


def _median(xs):
    return statistics.median(xs) if xs else float("nan")


def _render_authors(key: str, res: dict) -> list[str]:
    m = res["meta"]
    lines = [f"## The authors' CIFAR-10 SSM-VR settings ({key})", "",
             (f"`{m['command']}` — {m['machine']}. 3×32×32, batch {m['batch']}, ngf {m['ngf']}, {m['levels']} "
              f"geometric levels {m['sigma_begin']:g} → 0.01, SSM-VR with {m['projection']} projections, Adam; "
              f"DEQ: Picard, tol 1e-5, K = 2 phantom steps, warm start. Untrained networks, seeded batches. Each "
              f"row in its own process, {m['rounds']} round(s) (a second one in the opposite order), "
              f"{m['steps']} steps each after {m['warmup']} warm-up: medians over all of them. *saved* = bytes "
              "autograd keeps for backward over one whole step (distinct storages); *max RSS* = the process's "
              "peak (Python, torch, the model, Adam's state, the step). *authors* = their code on one pinned "
              "core, from issue 31 (s/step, saved MiB, max RSS MiB, params M); *ours in issue 31* = our step "
              "before this change, measured there beside theirs."), ""]
    lines += note_lines(m)
    head = ["network", "conditioning", "params", "saved MiB", "max RSS MiB", "s/step wall", "s/step CPU",
            "DEQ iters", "authors", "ours in issue 31"]
    body = []
    for row in res["rows"]:
        a, o = AUTHORS[row["network"]], ISSUE_OURS[row["network"]]
        iters = f"{statistics.mean(row['deq_iterations']):.1f}" if row["deq_iterations"] else "–"
        body.append([row["network"], row["conditioning"], f"{row['params'] / 1e6:.2f}M", f"{row['saved_MB']:.0f}",
                     f"{row['max_rss_MB']:.0f}", f"{_median(row['wall_s']):.2f}", f"{_median(row['cpu_s']):.2f}",
                     iters, f"{a[0]} s, {a[1]} MiB, {a[2]} MiB, {a[3]}M", f"{o[0]} s, {o[1]} MiB, {o[2]} MiB"])
    lines += markdown_table(head, body)
    lines += ["", ("Against the authors' code. Time: this machine is shared, so our after/before CPU-time ratio, "
                   "measured here in one run, scales our issue-31 time (measured beside theirs) — *est. s/step* = "
                   "issue-31 s/step × (CPU s/step ÷ CPU s/step of the before row); the target is authors ÷ ours ≥ "
                   f"{TARGET_SPEEDUP}. Memory: saved bytes against theirs directly (the same count on any "
                   "machine)."), ""]
    head = ["network", "conditioning", "saved MiB / authors'", "est. s/step", "authors ÷ ours", "targets met"]
    body = []
    rows = {(r["network"], r["conditioning"]): r for r in res["rows"]}
    for row in res["rows"]:
        before = rows.get((row["network"], CONDITIONS[0][0]))
        if before is None or row is before:
            continue
        a, o = AUTHORS[row["network"]], ISSUE_OURS[row["network"]]
        est = o[0] * _median(row["cpu_s"]) / _median(before["cpu_s"])
        speed, mem = a[0] / est, row["saved_MB"] <= a[1]
        met = ", ".join([("memory" if mem else "memory not met"),
                         ("time" if speed >= TARGET_SPEEDUP else "time not met")])
        body.append([row["network"], row["conditioning"], f"{row['saved_MB']:.0f} / {a[1]}", f"{est:.2f}",
                     f"{speed:.2f}", met])
    lines += markdown_table(head, body) + [""]
    prof = [r for r in res["rows"] if "profile" in r]
    if prof:
        lines += ["### Profile of one step", "",
                  ("Saved MiB by where they are saved (forward: the innermost module running; backward: the "
                   "autograd node of the create_graph backward), and the operators with the most self CPU time "
                   "(share of the step; profiler on)."), ""]
        for row in prof:
            p = row["profile"]
            top = sorted(p["saved_MB"].items(), key=lambda kv: -kv[1])[:8]  # the JSON keeps keys sorted
            saved = "; ".join(f"{k} {v:.0f}" for k, v in top)
            ops = "; ".join(f"{o['op']} {100 * o['share']:.0f} % ({o['calls']})" for o in p["ops"][:8])
            lines += [f"- **{row['network']}, {row['conditioning']}** — saved: {saved}. Time: {ops}."]
        lines += [""]
    return lines


def render(results: dict) -> str:
    lines = ["# NCSN at the CIFAR-10 size: RefineNet vs TwoRes vs DEQ", ""]
    authors = {k: v for k, v in results.items() if v["meta"].get("settings") == "authors"}
    for key, res in sorted(authors.items()):
        lines += _render_authors(key, res)
    table5 = {k: v for k, v in results.items() if k not in authors}
    if table5:
        lines += _render_table5(table5)
    return "\n".join(lines)


def options(ap: argparse.ArgumentParser) -> None:
    ap.add_argument("--settings", choices=("authors", "table5"), default="authors")
    ap.add_argument("--batch", type=int, default=None, help="default: 4 (authors), 2 (table5)")
    ap.add_argument("--ngf", type=int, default=128)
    ap.add_argument("--warmup", type=int, default=1)
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--rounds", type=int, default=1, help="authors: rounds of every row (odd ones reversed)")
    ap.add_argument("--profile", action="store_true", help="authors: saved bytes by module and top operators")
    ap.add_argument("--networks", nargs="+", choices=list(NETWORKS), default=list(NETWORKS), help="authors: rows")
    ap.add_argument("--note", default=None)
    ap.add_argument("--worker", default=None, help=argparse.SUPPRESS)


def run(args) -> None:
    """``--device`` is Table 5's only (the authors' comparison runs on the CPU)."""
    if args.worker:
        print(json.dumps(worker(json.loads(args.worker))), flush=True)
        return
    results = load_results(args.out, STEM)
    if args.settings == "authors":
        args.batch = args.batch or 4
        key = f"cpu batch {args.batch} ngf {args.ngf} {AUTHORS_SETTINGS['levels']} levels"

        def partial(section):
            write_results(args.out, STEM, {**results, key: section}, render, indent=2, sort_keys=True)

        results[key] = run_authors(args, partial)
    else:
        args.batch = args.batch or 2
        key, results[key] = run_table5(args)
    write_results(args.out, STEM, results, render, indent=2, sort_keys=True)
    print(f"-> {args.out / STEM}.json and .md")
