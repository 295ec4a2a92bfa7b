"""Time one training step of each score-matching objective, and check that the exact-trace routes agree.

One step = objective forward (score, trace or its estimate) + ``loss.backward()`` to the parameters, on an
MLP energy log p̃(x) = wᵀ h_L(x) − ½‖x‖² with Softplus hidden layers:

* ``dkef``: hidden 30, 3 layers (the size of a DKEF feature network),
* ``nice``: hidden 1000, 5 layers (the size of one NICE coupling MLP),

at D = 11, 100, 200, 784. Methods: exact ``sm`` by each trace route (loop / replicate / func / batched),
``ssm_vr`` (1 projection), ``dsm`` and ``cp`` (1 noise sample). Cases whose time, extrapolated from the
same method at the previous D, exceeds ``--case-cap`` seconds are skipped and marked so. Agreement of the
routes is checked separately in float64 on a small batch (max |Δ loss per sample| and max relative Δ of
the parameter gradients, against the loop).

    python -m benchmarks.tools.objectives_bench                    # CPU, 1 thread (the defaults)
    python -m benchmarks.tools.objectives_bench --quick            # fewer repeats, smaller caps
    python -m benchmarks.tools.objectives_bench --device cuda      # GPU; results merged under "cuda"

Results: ``benchmarks/results/objectives.json`` (one section per device, merged across runs) and
``benchmarks/results/objectives.md`` (rendered from the json).
"""

from __future__ import annotations

import argparse
import functools
import json
import math
import platform
import statistics
import sys
import time
from pathlib import Path

import torch
from torch import nn

from benchmarks.lib.results import ROOT, made_by, result_options, script_command

try:
    import hydra  # noqa: F401  (``import src`` installs a Hydra hook)
except ImportError:  # a bare GPU box without Hydra: load src.objectives (pure torch) without that hook
    import types

    _pkg = types.ModuleType("src")
    _pkg.__path__ = [str(ROOT / "src")]
    sys.modules["src"] = _pkg

from src.objectives import cp, dsm, sm, ssm_vr
from src.reports.tables import load_results, write_results

SIZES = {"dkef": {"hidden": 30, "layers": 3}, "nice": {"hidden": 1000, "layers": 5}}
ROUTES = ("loop", "replicate", "func", "batched")


class MLPEnergy(nn.Module):
    def __init__(self, d: int, hidden: int, layers: int):
        super().__init__()
        mods, w = [], d
        for _ in range(layers):
            mods += [nn.Linear(w, hidden), nn.Softplus()]
            w = hidden
        self.net = nn.Sequential(*mods)
        self.out = nn.Linear(hidden, 1, bias=False)

    def log_density(self, x):
        x = x.reshape(x.shape[0], -1)
        return self.out(self.net(x)).squeeze(-1) - 0.5 * x.pow(2).sum(-1)


def copies_per_pass(d: int, batch: int, hidden: int, layers: int, itemsize: int, mem_budget: float) -> int:
    """Copies of x per replicate pass that keep the (rough) graph size under ``mem_budget`` bytes."""
    bytes_per_row = itemsize * (8 * d + 14 * hidden * layers)
    return max(1, min(d, int(mem_budget // (bytes_per_row * batch))))


def methods(d, batch, size, itemsize, mem_budget):
    k = copies_per_pass(d, batch, size["hidden"], size["layers"], itemsize, mem_budget)
    out = {
        "sm[loop]": functools.partial(sm, trace_route="loop"),
        "sm[replicate]": functools.partial(sm, trace_route="replicate", max_copies_per_pass=k),
        "sm[func]": functools.partial(sm, trace_route="func"),
        "sm[batched]": functools.partial(sm, trace_route="batched"),
        "ssm_vr": ssm_vr,
        "dsm": functools.partial(dsm, sigma=0.1),
        "cp": cp,
    }
    notes = {"sm[replicate]": f"{k} copies/pass" + ("" if k == d else f" ({math.ceil(d / k)} passes)")}
    return out, notes


def sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def time_step(fn, model, x, device, repeats, budget_s):
    params = list(model.parameters())

    def step():
        for p in params:
            p.grad = None
        out = fn(model, x)
        out.loss.backward()

    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    sync(device)
    t0 = time.perf_counter()
    step()  # warm-up (also the first estimate)
    sync(device)
    first = time.perf_counter() - t0
    n = max(1, min(repeats, int(budget_s / max(first, 1e-6))))
    ts = []
    for _ in range(n):
        t0 = time.perf_counter()
        step()
        sync(device)
        ts.append(time.perf_counter() - t0)
    peak = torch.cuda.max_memory_allocated(device) / 2**20 if device.type == "cuda" else None
    return statistics.median(ts), n, first, peak


def agreement(size, d, batch, device):
    torch.manual_seed(0)
    model = MLPEnergy(d, **size).to(device=device, dtype=torch.float64)
    x = torch.randn(batch, d, device=device, dtype=torch.float64)
    params = list(model.parameters())

    def run(route):
        out = sm(model, x, trace_route=route)
        grads = torch.autograd.grad(out.loss, params, allow_unused=True, materialize_grads=True)
        return out.per_sample.detach(), torch.cat([g.reshape(-1) for g in grads])

    ref_l, ref_g = run("loop")
    rows = []
    for route in ROUTES[1:]:
        try:
            l, g = run(route)
            rows.append(
                {
                    "size": size_name(size),
                    "D": d,
                    "route": route,
                    "max_abs_loss_diff": float((l - ref_l).abs().max()),
                    "max_rel_grad_diff": float((g - ref_g).abs().max() / ref_g.abs().max()),
                }
            )
        except RuntimeError as err:  # pragma: no cover - reported, not fatal
            rows.append({"size": size_name(size), "D": d, "route": route, "error": str(err)[:200]})
    return rows


def size_name(size):
    return next(k for k, v in SIZES.items() if v == size)


def run_benchmarks(args):
    device = torch.device(args.device)
    torch.set_num_threads(args.threads)
    dtype = getattr(torch, args.dtype)
    itemsize = torch.empty((), dtype=dtype).element_size()
    mem_budget = args.mem_budget_gb * 2**30
    section = {
        "device": torch.cuda.get_device_name(device)
        if device.type == "cuda"
        else platform.processor() or "cpu",
        "torch": torch.__version__,
        "threads": args.threads,
        "dtype": args.dtype,
        "case_cap_s": args.case_cap,
        "command": script_command("benchmarks.tools.objectives_bench", args.argv),
        "timings": [],
        "agreement": [],
    }
    started = time.perf_counter()
    for sname in args.sizes:
        size = SIZES[sname]
        batch = args.nice_batch if sname == "nice" else args.batch
        section["batch_" + sname] = batch
        prev: dict[str, tuple[int, float]] = {}
        for d in args.dims:
            torch.manual_seed(0)
            model = MLPEnergy(d, **size).to(device=device, dtype=dtype)
            x = torch.randn(batch, d, device=device, dtype=dtype)
            fns, notes = methods(d, batch, size, itemsize, mem_budget)
            for name, fn in fns.items():
                row = {"size": sname, "D": d, "method": name, "note": notes.get(name, "")}
                if name in prev:
                    d0, t0 = prev[name]
                    est = t0 * (d / d0) ** (1.3 if name.startswith("sm") else 0.5)
                    if est > args.case_cap:
                        row.update(
                            ms=None,
                            note=f"skipped: ~{est:.0f} s/step extrapolated > cap {args.case_cap:.0f} s",
                        )
                        section["timings"].append(row)
                        print(f"{sname:5s} D={d:4d} {name:14s} {row['note']}", flush=True)
                        continue
                try:
                    med, n, _first, peak = time_step(fn, model, x, device, args.repeats, args.case_budget)
                except (RuntimeError, MemoryError) as err:
                    row.update(ms=None, note=f"failed: {str(err).splitlines()[0][:120]}")
                    section["timings"].append(row)
                    print(f"{sname:5s} D={d:4d} {name:14s} {row['note']}", flush=True)
                    if device.type == "cuda":
                        torch.cuda.empty_cache()
                    continue
                prev[name] = (d, med)
                row.update(ms=1e3 * med, n=n, peak_mb=peak)
                section["timings"].append(row)
                mem = f" peak {peak:.0f} MiB" if peak is not None else ""
                print(
                    f"{sname:5s} D={d:4d} {name:14s} {1e3 * med:10.1f} ms (n={n}){mem} {row['note']}",
                    flush=True,
                )
            del model, x
            if device.type == "cuda":
                torch.cuda.empty_cache()
    for sname in args.sizes:
        for d in args.dims:
            if sname == "nice" and d > args.agree_max_d_nice:
                continue
            rows = agreement(SIZES[sname], d, args.agree_batch, device)
            section["agreement"] += rows
            for r in rows:
                print("agree", r, flush=True)
    section["total_s"] = time.perf_counter() - started
    return section


def render(results: dict) -> str:
    recorded = next(iter(results.values()), {}).get("command")
    lines = ["# Objectives: time of one training step", ""]
    lines.append(
        "One step = objective (score + trace or its estimate) + `loss.backward()` to the parameters, on an "
        "MLP energy with Softplus (`dkef`: hidden 30 × 3 layers; `nice`: hidden 1000 × 5 layers). Median "
        f"milliseconds per step. Generated by `{made_by(recorded, 'benchmarks/objectives_bench.py', recorded)}`."
    )
    for dev, sec in results.items():
        lines += [
            "",
            (
                f"## {dev}: {sec['device']}, torch {sec['torch']}, {sec['threads']} thread(s), {sec['dtype']} "
                f"(run took {sec.get('total_s', 0):.0f} s)"
            ),
        ]
        dims = sorted({r["D"] for r in sec["timings"]})
        for sname in dict.fromkeys(r["size"] for r in sec["timings"]):
            lines += [
                "",
                f"### {sname}, batch {sec.get('batch_' + sname)}",
                "",
                "| method | " + " | ".join(f"D={d}" for d in dims) + " |",
            ]
            lines.append("|---|" + "---:|" * len(dims))
            for m in dict.fromkeys(r["method"] for r in sec["timings"] if r["size"] == sname):
                cells = []
                for d in dims:
                    r = next(
                        (
                            r
                            for r in sec["timings"]
                            if r["size"] == sname and r["method"] == m and r["D"] == d
                        ),
                        None,
                    )
                    if r is None:
                        cells.append("")
                    elif r["ms"] is None:
                        cells.append(r["note"].split(":")[0])
                    else:
                        extra = f" ({r['note']})" if r["note"] else ""
                        peak = f", {r['peak_mb']:.0f} MiB" if r.get("peak_mb") else ""
                        cells.append(f"{r['ms']:.1f}{peak}{extra}")
                lines.append(f"| {m} | " + " | ".join(cells) + " |")
            notes = sorted({r["note"] for r in sec["timings"] if r["size"] == sname and r["ms"] is None})
            if notes:
                lines += [""] + [f"- {n}" for n in notes]
        if sec.get("agreement"):
            lines += [
                "",
                (
                    "Route agreement with the loop (float64, small batch): max |Δ per-sample loss|, "
                    "max relative Δ parameter gradient."
                ),
                "",
                "| size | D | route | Δ loss | Δ grad (rel) |",
                "|---|---:|---|---:|---:|",
            ]
            for r in sec["agreement"]:
                if "error" in r:
                    lines.append(f"| {r['size']} | {r['D']} | {r['route']} | error: {r['error'][:60]} | |")
                else:
                    lines.append(
                        f"| {r['size']} | {r['D']} | {r['route']} | {r['max_abs_loss_diff']:.1e} | "
                        f"{r['max_rel_grad_diff']:.1e} |"
                    )
    return "\n".join(lines) + "\n"


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", default="cpu")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--dtype", default="float32", choices=["float32", "float64"])
    p.add_argument("--batch", type=int, default=128, help="batch of the dkef-sized energy")
    p.add_argument(
        "--nice-batch", type=int, default=None, help="batch of the nice-sized one (default 16 CPU, 128 CUDA)"
    )
    p.add_argument("--dims", type=lambda s: [int(v) for v in s.split(",")], default=[11, 100, 200, 784])
    p.add_argument("--sizes", type=lambda s: s.split(","), default=list(SIZES))
    p.add_argument("--repeats", type=int, default=5, help="timed steps per case (after one warm-up)")
    p.add_argument("--case-budget", type=float, default=3.0, help="seconds of timed steps per case")
    p.add_argument("--case-cap", type=float, default=20.0, help="skip a case extrapolated above this s/step")
    p.add_argument(
        "--mem-budget-gb",
        type=float,
        default=None,
        help="bound on replicate's graph (default 3 CPU, 30 CUDA)",
    )
    p.add_argument("--agree-batch", type=int, default=4)
    p.add_argument("--agree-max-d-nice", type=int, default=784)
    p.add_argument(
        "--quick", action="store_true", help="fewer repeats and tighter caps (a few minutes on CPU)"
    )
    result_options(p)
    p.add_argument(
        "--merge", type=Path, action="append", default=[], help="json files whose sections to merge in"
    )
    args = p.parse_args(argv)
    args.argv = argv
    if args.nice_batch is None:
        args.nice_batch = 128 if args.device.startswith("cuda") else 16
    if args.mem_budget_gb is None:
        args.mem_budget_gb = 30.0 if args.device.startswith("cuda") else 3.0
    if args.quick:
        args.repeats, args.case_budget, args.case_cap = 3, 1.5, min(args.case_cap, 8.0)
        args.agree_batch, args.agree_max_d_nice = 2, 200
    results = load_results(args.out, "objectives")
    for m in args.merge:
        results.update(json.loads(m.read_text()))
    if not args.render:
        key = torch.device(args.device).type
        results[key] = run_benchmarks(args)
    write_results(args.out, "objectives", results, render)
    print(render(results))


if __name__ == "__main__":
    main()
