"""Where one DKEF exact-SM training step's time and FLOPs go, by phase and by D, and the jet route against the
replicated-autograd route side by side (issue #42).

The step is ``experiment=dkef_gaussian``'s: :meth:`src.lit.dkef.DKEFLitModule.training_objective` on a batch of 32
standard-normal points (α fitted in closed form on 16, exact SM on the other 16, M = 200 inducing points, 3 kernels of
30 features), then ``loss.backward()``, gradient-norm clipping at 100 and Adam (lr 1e-3, weight decay 1e-12), in
float32 on one thread. Methods: DEQ-SM (one dense DEQ block of width 200, phantom backward K = 2, Picard, tol 1e-5,
warm start: ``conf/deq/true.yaml``) and SM 16-layer (explicit features, 16 layers of width 30).

1. **Phases** (``--dims``, each route): one step under ``torch.profiler`` (``with_flops``) after ``--warmup`` steps;
   every operator's self CPU time and FLOPs go to the innermost phase label around it (``record_function`` ranges
   in the modules' code; this tool adds ``step.backward`` and ``step.optimizer``). FLOPs count the matrix products
   (``mm``, ``addmm``, ``bmm``, ``baddbmm``); the fraction of the core is that count per second over a plain matmul
   of comparable shape measured in the same run (``[16·D, W] @ [W, W]``, W the feature network's width, and the
   1600×200 · 200×200 product of the issue as the core's reference).
2. **Side by side** (``--side-dims``): two copies of the same model, one per route, stepped in turn on the same
   batches (``--repeats`` each, the first ``--warmup`` dropped); median step time per route and their ratio.
3. **Equality** (float64, the same dims): loss and parameter gradients of one step by each route from the same
   weights (largest gradient difference relative to the largest gradient entry).

    OMP_NUM_THREADS=1 python -m benchmarks.tools.dkef_step_profile
    OMP_NUM_THREADS=1 python -m benchmarks.tools.dkef_step_profile --dims 11,100 --side-dims 100 --repeats 5

Writes ``benchmarks/results/dkef_step_profile.json`` and ``.md``.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import time
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile, record_function

from benchmarks.lib.results import RESULTS, script_command
from src.lit.dkef import DKEFLitModule

BATCH, M, FEATURES = 32, 200, 30
DEQ = {"enabled": True, "solver": "picard", "tol": 1e-5, "stop_mode": "abs", "max_iter": 128, "phantom_steps": 2,
       "warm_start": True, "norm_lambda": 2.0, "norm": "frobenius", "backward": "phantom", "anderson_m": 5,
       "anderson_beta": 1.0, "injection": None}
METHODS = {  # name: (model keys, feature network width W)
    "DEQ-SM": ({"deq": DEQ, "depth": None, "deq_width": 200}, 200),
    "SM 16-layer": ({"deq": None, "depth": 16, "hidden": 30}, 30),
}
ROUTES = {"old": "autograd", "new": "jet"}  # model.exact_route of each side
PHASES = [  # (label, phase), innermost label wins
    ("deq.solve", "DEQ solve"),
    ("deq.phantom_steps", "phantom / implicit"),
    ("deq.implicit_backward", "phantom / implicit"),
    ("dkef.feature_jets.deq_steps", "phantom / implicit"),
    ("dkef.inducing_features", "features: inducing points"),
    ("dkef.features", "features: data"),
    ("dkef.feature_jets", "features: data"),
    ("dkef.kernel_derivatives", "kernel ∇k, Δk (jets)"),
    ("dkef.alpha_fit", "α fit"),
    ("objective.score", "score"),
    ("objective.trace", "Hessian trace"),
    ("step.backward", "backward to parameters"),
    ("step.optimizer", "optimiser"),
]
PHASE_ORDER = list(dict.fromkeys(p for _, p in PHASES)) + ["other"]
MATMULS = ("aten::mm", "aten::addmm", "aten::bmm", "aten::baddbmm")


def build(method: str, d: int, route: str, dtype=torch.float32, seed: int = 0) -> tuple[DKEFLitModule, torch.optim.Optimizer]:
    keys, _ = METHODS[method]
    torch.manual_seed(seed)
    module = DKEFLitModule(d, loss={"name": "sm", "trace_route": "auto"}, n_inducing=M, feature_dim=FEATURES,
                           exact_route=ROUTES[route], **keys).to(dtype)
    with torch.no_grad():
        module.net.inducing.copy_(torch.randn(M, d, dtype=dtype))
    return module, torch.optim.Adam(module.parameters(), lr=1e-3, weight_decay=1e-12)


def train_step(module: DKEFLitModule, opt: torch.optim.Optimizer, x: torch.Tensor) -> float:
    """experiment=dkef_gaussian's step: objective, backward, clip at 100, Adam (as Lightning runs it)."""
    out = module.training_objective(x)
    with record_function("step.backward"):
        out.loss.backward()
    with record_function("step.optimizer"):
        torch.nn.utils.clip_grad_norm_(module.parameters(), 100.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
    return float(out.loss.detach())


def matmul_gflops(n: int, k: int, w: int, repeats: int = 20) -> float:
    """GFLOP/s of a plain ``[n, k] @ [k, w]`` float32 product on this thread (median of ``repeats``)."""
    a, b = torch.randn(n, k), torch.randn(k, w)
    for _ in range(3):
        a @ b
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        a @ b
        times.append(time.perf_counter() - t0)
    return 2 * n * k * w / statistics.median(times) / 1e9


def _phase_of(event, labels: dict) -> str:
    node = event.cpu_parent
    while node is not None:
        if node.name in labels:
            return labels[node.name]
        node = node.cpu_parent
    return "other"


def profile_step(method: str, d: int, route: str, warmup: int) -> dict:
    module, opt = build(method, d, route)
    gen = torch.Generator().manual_seed(1)
    for _ in range(warmup):
        train_step(module, opt, torch.randn(BATCH, d, generator=gen))
    x = torch.randn(BATCH, d, generator=gen)
    with profile(activities=[ProfilerActivity.CPU], with_flops=True) as prof:
        t0 = time.perf_counter()
        train_step(module, opt, x)
        wall = time.perf_counter() - t0
    labels = dict(PHASES)
    time_us = dict.fromkeys(PHASE_ORDER, 0.0)
    flops = dict.fromkeys(PHASE_ORDER, 0)
    for ev in prof.events():
        if ev.name in labels:
            continue
        phase = labels[ev.name] if ev.name in labels else _phase_of(ev, labels)
        time_us[phase] += ev.self_cpu_time_total
        if ev.name in MATMULS:
            flops[phase] += int(ev.flops or 0)
    return {"profiled_wall_s": wall, "phase_s": {p: t / 1e6 for p, t in time_us.items()},
            "phase_matmul_gflop": {p: f / 1e9 for p, f in flops.items()}}


def side_by_side(method: str, d: int, repeats: int, warmup: int) -> dict:
    sides = {r: build(method, d, r) for r in ROUTES}
    gen = torch.Generator().manual_seed(2)
    times: dict[str, list[float]] = {r: [] for r in ROUTES}
    cpu: dict[str, list[float]] = {r: [] for r in ROUTES}
    losses: dict[str, list[float]] = {r: [] for r in ROUTES}
    for i in range(warmup + repeats):
        x = torch.randn(BATCH, d, generator=gen)
        for r, (module, opt) in sides.items():
            t0, c0 = time.perf_counter(), time.process_time()
            loss = train_step(module, opt, x)
            if i >= warmup:
                times[r].append(time.perf_counter() - t0)
                cpu[r].append(time.process_time() - c0)
                losses[r].append(loss)
    med = {r: statistics.median(t) for r, t in times.items()}
    med_cpu = {r: statistics.median(t) for r, t in cpu.items()}
    return {"median_s": med, "times_s": times, "speedup": med["old"] / med["new"], "median_cpu_s": med_cpu,
            "cpu_times_s": cpu, "speedup_cpu": med_cpu["old"] / med_cpu["new"],
            "max_abs_loss_difference_float32": max(abs(a - b) for a, b in zip(losses["old"], losses["new"]))}


def equality(method: str, d: int) -> dict:
    """One step's loss and gradients by each route from the same weights and batch, float64."""
    res = {}
    x = torch.randn(BATCH, d, generator=torch.Generator().manual_seed(3), dtype=torch.float64)
    for r in ROUTES:
        module, _ = build(method, d, r, dtype=torch.float64)
        loss = module.training_objective(x).loss
        loss.backward()
        res[r] = (float(loss.detach()), {n: p.grad.clone() for n, p in module.named_parameters() if p.grad is not None})
    (l_old, g_old), (l_new, g_new) = res["old"], res["new"]
    scale = max(float(g.abs().max()) for g in g_old.values())
    diff = max(float((g_new[n] - g_old[n]).abs().max()) for n in g_old)
    return {"loss_old": l_old, "loss_new": l_new, "loss_relative_difference": abs(l_new - l_old) / abs(l_old),
            "same_parameters_with_gradients": sorted(g_old) == sorted(g_new),
            "gradient_max_difference_over_max_entry": diff / scale}


def machine() -> dict:
    cpu = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return {"cpu": cpu, "python": platform.python_version(), "torch": torch.__version__,
            "threads": torch.get_num_threads()}


# ------------------------------------------------------------------------------------------------ markdown
def render(res: dict) -> str:
    mach = res["machine"]
    lines = [
        "# DKEF exact-SM step: profile by phase and the jet route side by side (issue #42)",
        "",
        f"`OMP_NUM_THREADS={res['machine']['threads']} {res['command']}`  ",
        (f"Machine: {mach['cpu']}; python {mach['python']}; torch {mach['torch']}; {mach['threads']} thread(s); "
        "float32 unless said. Step: `experiment=dkef_gaussian`'s (batch 32: α on 16, exact SM on 16; M = 200; "
        "3 kernels × 30 features; clip 100; Adam). **old** = `model.exact_route=autograd` (x replicated D times, "
        "reverse passes), **new** = `model.exact_route=jet` (what `auto` picks)."),
        "",
        (f"Core reference: a plain 1600×200 · 200×200 float32 matmul ran at **{res['matmul_reference_gflops']:.1f} "
        "GFLOP/s** in this run."),
        "",
        "## Side by side (interleaved, same batches, one thread)",
        "",
        ("| method | D | old step (s) | new step (s) | speed-up | old CPU (s) | new CPU (s) | CPU speed-up | "
        "max \\|Δ loss\\| float32 over the steps |"),
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for row in res["side_by_side"]:
        lines.append(f"| {row['method']} | {row['dim']} | {row['median_s']['old']:.3f} | {row['median_s']['new']:.3f} "
                     f"| **{row['speedup']:.1f}×** | {row['median_cpu_s']['old']:.3f} | "
                     f"{row['median_cpu_s']['new']:.3f} | **{row['speedup_cpu']:.1f}×** | "
                     f"{row['max_abs_loss_difference_float32']:.2g} |")
    lines += ["", (f"Medians over {res['repeats']} steps per route after {res['warmup']} warm-up steps; wall-clock "
              "time and the process's CPU time (the machine is shared: the CPU time is what one thread spent, the "
              "wall time adds waiting for a core)."), "",
              "## Equality (float64, one step from the same weights and batch)", "",
              "| method | D | loss old | loss new | relative loss difference | max gradient difference / max gradient |",
              "|---|---|---|---|---|---|"]
    for row in res["equality"]:
        lines.append(f"| {row['method']} | {row['dim']} | {row['loss_old']:.12g} | {row['loss_new']:.12g} | "
                     f"{row['loss_relative_difference']:.1e} | {row['gradient_max_difference_over_max_entry']:.1e} |")
    lines += ["", "## Phases (one profiled step; self CPU time and matmul FLOPs by innermost label)", "",
              ("Time under the profiler (its overhead included); GFLOP/s = the phase's matmul FLOPs over its time; "
              "% core = that over the reference matmul of shape [16·D, W] · [W, W] (W = 200 DEQ, 30 16-layer) "
              "measured in the same run."), ""]
    for row in res["phases"]:
        ref = row["matmul_like_gflops"]
        total_t = sum(row["phase_s"].values())
        total_f = sum(row["phase_matmul_gflop"].values())
        lines += [(f"### {row['method']}, D = {row['dim']}, {row['route']} route — profiled step "
                  f"{row['profiled_wall_s']:.3f} s, {total_f:.2f} GFLOP, {total_f / total_t:.1f} GFLOP/s "
                  f"({100 * total_f / total_t / ref:.0f} % of a [16·D, W]·[W, W] matmul at {ref:.1f} GFLOP/s)"), "",
                  "| phase | time (s) | share | matmul GFLOP | GFLOP/s | % core |", "|---|---|---|---|---|---|"]
        for p in PHASE_ORDER:
            t, f = row["phase_s"][p], row["phase_matmul_gflop"][p]
            if t < 5e-4 and f == 0:
                continue
            rate = f / t if t > 0 else 0.0
            lines.append(f"| {p} | {t:.3f} | {100 * t / total_t:.0f} % | {f:.3f} | {rate:.1f} | "
                         f"{100 * rate / ref:.0f} % |")
        lines.append("")
    lines += ["## Scaling with D (profiled step time by phase, s)", ""]
    for method in METHODS:
        for route in ROUTES:
            rows = [r for r in res["phases"] if r["method"] == method and r["route"] == route]
            if not rows:
                continue
            lines += [f"**{method}, {route} route**", "", "| phase | " + " | ".join(f"D={r['dim']}" for r in rows) + " |",
                      "|---|" + "---|" * len(rows)]
            for p in PHASE_ORDER:
                vals = [r["phase_s"][p] for r in rows]
                if max(vals) >= 5e-4:
                    lines.append(f"| {p} | " + " | ".join(f"{v:.3f}" for v in vals) + " |")
            lines.append("")
    return "\n".join(lines) + "\n"


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dims", default="11,50,100,200", help="D of the phase profiles")
    ap.add_argument("--side-dims", default="11,100,200", help="D of the side-by-side timing and the equality check")
    ap.add_argument("--methods", default=",".join(METHODS), help="comma-separated: " + ", ".join(METHODS))
    ap.add_argument("--repeats", type=int, default=7, help="timed steps per route (side by side)")
    ap.add_argument("--warmup", type=int, default=2, help="untimed steps first")
    ap.add_argument("--out", type=Path, default=RESULTS, help="results folder")
    ap.add_argument("--render", action="store_true", help="rebuild the markdown from the saved JSON only")
    args = ap.parse_args(argv)
    out_json, out_md = args.out / "dkef_step_profile.json", args.out / "dkef_step_profile.md"
    if args.render:
        out_md.write_text(render(json.loads(out_json.read_text())))
        return
    methods = [m.strip() for m in args.methods.split(",") if m.strip()]
    unknown = [m for m in methods if m not in METHODS]
    if unknown:
        raise SystemExit(f"unknown method(s) {unknown}; valid: {', '.join(METHODS)}")
    dims = [int(v) for v in args.dims.split(",") if v]
    side_dims = [int(v) for v in args.side_dims.split(",") if v]
    cmd = script_command("benchmarks.tools.dkef_step_profile", argv)
    res = {"command": cmd, "machine": machine(),
           "repeats": args.repeats, "warmup": args.warmup, "matmul_reference_gflops": matmul_gflops(1600, 200, 200),
           "side_by_side": [], "equality": [], "phases": []}
    for method in methods:
        for d in side_dims:
            row = {"method": method, "dim": d, **side_by_side(method, d, args.repeats, args.warmup)}
            print(f"{method} D={d}: old {row['median_s']['old']:.3f} s, new {row['median_s']['new']:.3f} s, "
                  f"{row['speedup']:.1f}x (CPU time {row['speedup_cpu']:.1f}x)", flush=True)
            res["side_by_side"].append(row)
            eq = {"method": method, "dim": d, **equality(method, d)}
            print(f"  float64: loss rel diff {eq['loss_relative_difference']:.1e}, "
                  f"grad diff {eq['gradient_max_difference_over_max_entry']:.1e}", flush=True)
            res["equality"].append(eq)
        for d in dims:
            w = METHODS[method][1]
            ref = matmul_gflops(16 * d, w, w)
            for route in ROUTES:
                row = {"method": method, "dim": d, "route": route, "matmul_like_gflops": ref,
                       **profile_step(method, d, route, args.warmup)}
                print(f"{method} D={d} {route}: profiled {row['profiled_wall_s']:.3f} s", flush=True)
                res["phases"].append(row)
    args.out.mkdir(parents=True, exist_ok=True)
    out_json.write_text(json.dumps(res, indent=1))
    out_md.write_text(render(res))


if __name__ == "__main__":
    main()
