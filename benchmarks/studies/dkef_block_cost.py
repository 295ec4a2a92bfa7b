"""What DKEF's DEQ blocks cost per training step against the 3-layer explicit net, at two revisions side by side.

Issue 60 asks DKEF's block of record for the paper's memory: at most 1.1x the 3-layer net's bytes saved for
backward and 1.2x its step time, on the main job (``python -m src.train model=dkef loss=sm deq=true``: the 10-d
Gaussian, batch 32 = α on 16 + exact SM on 16, M = 200 inducing points) and on RedWine at ``experiment=dkef_uci``
(D = 11, batch 128). Each worker process builds the arms (``DKEFLitModule`` as those runs build it, one thread)
and runs their own ``training_step`` in turn, round by round (``benchmarks.lib.step``), so a load spike on this
shared machine hits every arm alike; the bytes autograd saves per step (``SavedTensorsMeter``, the runs'
``profile/saved_bytes_mean``) are deterministic. Workers of the revisions (``--revs``, each one's ``src`` as
committed, ``benchmarks.lib.step_cases.snapshot``) alternate, ``--repeats`` times; a figure is the minimum over
all its steps (and the median, for the noise), and each ratio is to the 3-layer net of the same worker. The
step's CPU time (``time.thread_time``, one thread) is recorded beside its wall time: other jobs' load stretches
the wall time of whatever step they preempt, the CPU time much less.

Arms (spectral; Picard, relative 1e-4, as ``conf/shared/deq_solver.yaml``; every DEQ at the setting's latent
width: main 30 (``conf/model/dkef.yaml``), uci 64 (``conf/experiment/dkef_uci.yaml``)):

- ``record``: the setting's block of record — main: λ = 1.8, K = 5 phantom steps (``conf/deq/family/dkef.yaml``);
  uci: λ = 2, K = 2 (``conf/experiment/dkef_uci.yaml``);
- ``implicit``: the same block with ``deq.backward=implicit`` (exact derivatives; the jets' implicit route);
- ``paper``: the paper's block, Frobenius λ = 2, K = 2;
- ``3-layer``: ``deq=false depth=3``;
- main only, ``former record (width 64, λ 2)``: the main job's record before its width and bound changed (K = 5).

(The arms are this study's; each revision's ``src`` builds and runs them, so two revisions measure the same blocks
before and after a change of the code.)

    python -m benchmarks.studies.dkef_block_cost --revs 67b52d7,HEAD
    python -m benchmarks.studies.dkef_block_cost --revs HEAD --settings main --ks 4,3 --name dkef_block_cost_k
    python -m benchmarks.studies.dkef_block_cost --render
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from benchmarks.lib.results import (
    load_results,
    machine_facts,
    rendered,
    result_options,
    script_command,
    write_results,
)
from benchmarks.lib.step_cases import ROOT, commit_of, rev_env, rev_trees

MODULE = "benchmarks.studies.dkef_block_cost"
SETTINGS = {"main": {"dim": 10, "batch": 32, "record_k": 5, "record_width": 30, "record_lambda": 1.8},
            "uci": {"dim": 11, "batch": 128, "record_k": 2, "record_width": 64, "record_lambda": 2.0}}
ARMS = ("record", "implicit", "paper", "3-layer")
# the main job's record before its latent width and bound changed (conf/deq/family/dkef.yaml), measured beside it
FORMER = {"main": ("former record (width 64, λ 2)", {"width": 64, "norm_lambda": 2.0})}
SOLVER = {"solver": "picard", "tol": 1e-4, "stop_mode": "rel", "max_iter": 30, "warm_start": True,
          "norm": "spectral", "norm_lambda": 2.0, "backward": "phantom", "injection": None}
BOUNDS = {"bytes": 1.1, "time": 1.2}
OPTIMIZER = {"_target_": "torch.optim.Adam", "_partial_": True, "lr": 1e-3, "weight_decay": 1e-12}  # conf/model/dkef.yaml


def _arm(setting: str, arm: str) -> tuple[dict | None, int | None]:
    """An arm's ``deq`` setting (None: the 3-layer net) and the DEQ's latent width, in the setting."""
    s = SETTINGS[setting]
    record = {"enabled": True, **SOLVER, "norm_lambda": s["record_lambda"], "phantom_steps": s["record_k"]}
    width = s["record_width"]
    if arm.startswith("record K="):  # --ks: the record with another number of phantom steps
        return dict(record, phantom_steps=int(arm.split("=")[1])), width
    if setting in FORMER and arm == FORMER[setting][0]:
        former = FORMER[setting][1]
        return dict(record, norm_lambda=former["norm_lambda"]), former["width"]
    return {"record": record, "implicit": dict(record, backward="implicit"),
            "paper": {"enabled": True, **SOLVER, "norm": "frobenius", "phantom_steps": 2},
            "3-layer": None}[arm], width


def _data(setting: str, data_root: str | None):
    import torch

    from benchmarks.lib.step_cases import redwine_rows

    s = SETTINGS[setting]
    g = torch.Generator().manual_seed(0)
    if setting == "uci":
        rows, source = redwine_rows(data_root, 8 * s["batch"] + 200, g)
    else:
        rows, source = torch.randn(8 * s["batch"] + 200, s["dim"], generator=g), "N(0, I_10)"
    return rows, source


def worker(setting: str, rounds: int, warmup: int, data_root: str | None, ks: tuple[int, ...] = ()) -> dict:
    """One process: every arm built, warmed up, its saved bytes metered, then ``rounds`` rounds of one step each."""
    import torch

    from benchmarks.lib.step import trainer_free, training_step
    from src.callbacks.profiling import SavedTensorsMeter
    from src.lit.dkef import DKEFLitModule
    from src.models.dkef import DKEF

    torch.set_num_threads(1)
    torch.set_flush_denormal(True)
    s = SETTINGS[setting]
    rows, source = _data(setting, data_root)
    batches = [rows[s["batch"] * k: s["batch"] * (k + 1)] for k in range(8)]
    arms = {}
    former = (FORMER[setting][0],) if setting in FORMER else ()
    for arm in (*ARMS, *former, *(f"record K={k}" for k in ks)):
        torch.manual_seed(0)
        deq, width = _arm(setting, arm)
        module = DKEFLitModule(s["dim"], loss={"name": "sm"}, deq=deq or {"enabled": False},
                               depth=None if deq else 3, optimizer=OPTIMIZER,
                               net=functools.partial(DKEF, deq_width=width))
        with torch.no_grad():
            module.net.inducing.copy_(rows[-200:])
        arms[arm] = (module, trainer_free(module))
    for i in range(warmup):
        for module, opts in arms.values():
            training_step(module, batches[i % 8], opts, i)
    saved = {}
    for arm, (module, opts) in arms.items():
        with SavedTensorsMeter() as meter:
            training_step(module, batches[0], opts, 0)
        saved[arm] = meter.bytes
    times = {arm: [] for arm in arms}
    cpu = {arm: [] for arm in arms}
    for r in range(rounds):
        for arm, (module, opts) in arms.items():
            t, c = time.perf_counter(), time.thread_time()
            training_step(module, batches[r % 8], opts, r)
            cpu[arm].append(time.thread_time() - c)
            times[arm].append(time.perf_counter() - t)
    return {"source": source, "saved_bytes": saved, "step_s": times, "cpu_s": cpu}


def _summary(parts: list[dict]) -> dict:
    arms = parts[0]["saved_bytes"]
    out = {}
    for arm in arms:
        steps = [t for p in parts for t in p["step_s"][arm]]
        out[arm] = {"saved_mb": parts[0]["saved_bytes"][arm] / 1e6, "min_ms": min(steps) * 1e3,
                    "median_ms": statistics.median(steps) * 1e3, "steps": len(steps),
                    # per worker: the arm's minimum over the 3-layer's minimum (the pairing the bound reads)
                    "time_ratios": [min(p["step_s"][arm]) / min(p["step_s"]["3-layer"]) for p in parts],
                    "median_ratios": [statistics.median(p["step_s"][arm]) / statistics.median(p["step_s"]["3-layer"])
                                      for p in parts]}
        if all("cpu_s" in p for p in parts):  # the step's CPU time (its one thread's): what other jobs' load adds less to
            cpu = [t for p in parts for t in p["cpu_s"][arm]]
            out[arm].update({"cpu_min_ms": min(cpu) * 1e3, "cpu_median_ms": statistics.median(cpu) * 1e3,
                             "cpu_ratios": [min(p["cpu_s"][arm]) / min(p["cpu_s"]["3-layer"]) for p in parts],
                             "cpu_median_ratios": [statistics.median(p["cpu_s"][arm])
                                                   / statistics.median(p["cpu_s"]["3-layer"]) for p in parts]})
    for v in out.values():
        v["bytes_ratio"] = v["saved_mb"] / out["3-layer"]["saved_mb"]
        v["time_ratio"] = v["min_ms"] / out["3-layer"]["min_ms"]
    return out


def _ratios(ratios: list[float]) -> str:
    """A table cell: the median of the workers' ratios, then each worker's."""
    return f"{statistics.median(ratios):.2f} ({', '.join(f'{x:.2f}' for x in ratios)})"


def _arm_table(by_rev: dict, head: str, rule: str, cells) -> list[str]:
    """One table of a setting: a row per revision and arm, ``cells(arm's figures)`` after the two names."""
    rows = [f"| {rev} | {arm} | {cells(v)} |" for rev, entry in by_rev.items() for arm, v in entry["arms"].items()]
    return [head, rule, *rows, ""]


def render(res: dict) -> str:
    meta = res["meta"]
    lines = ["# DKEF's DEQ block against the 3-layer net: bytes saved and step time", "",
             f"Command: `{meta['command']}`", "",
             (f"Machine: {meta['machine']}; load average at the start {meta['load_average']} (a shared, loaded "
             f"machine: figures are minimums over {meta['rounds']} interleaved steps per worker × {meta['repeats']} "
             "workers per revision, the revisions' workers alternating; a ratio pairs an arm with the 3-layer net of "
             "its own worker; medians show the noise). Bounds "
             f"(issue 60): bytes ≤ {BOUNDS['bytes']}×, time ≤ {BOUNDS['time']}× the 3-layer net's."), ""]
    for setting, by_rev in res["settings"].items():
        s = SETTINGS[setting]
        lines += [(f"## {setting}: D = {s['dim']}, batch {s['batch']}, record K = {s['record_k']} "
                  f"({next(iter(by_rev.values()))['source']})"), ""]
        lines += _arm_table(by_rev, ("| revision | arm | saved MB | × 3-layer | min ms | × 3-layer: median over workers "
                                     "of the min ratio (per worker) | median ms | × 3-layer: of the median ratio (per "
                                     "worker) |"), "|---|---|---:|---:|---:|---|---:|---|",
                            lambda v: (f"{v['saved_mb']:.3f} | {v['bytes_ratio']:.3f} | {v['min_ms']:.1f} | "
                                       f"{_ratios(v['time_ratios'])} | {v['median_ms']:.1f} | "
                                       f"{_ratios(v['median_ratios'])}"))
        if all("cpu_min_ms" in v for entry in by_rev.values() for v in entry["arms"].values()):
            lines += ["CPU time of the step (`time.thread_time`, its one thread's; the same pairing):", ""]
            lines += _arm_table(by_rev, ("| revision | arm | min CPU ms | × 3-layer: median over workers of the min "
                                         "ratio (per worker) | median CPU ms | × 3-layer: of the median ratio (per "
                                         "worker) |"), "|---|---|---:|---|---:|---|",
                                lambda v: (f"{v['cpu_min_ms']:.1f} | {_ratios(v['cpu_ratios'])} | "
                                           f"{v['cpu_median_ms']:.1f} | {_ratios(v['cpu_median_ratios'])}"))
    if meta.get("note"):
        lines += [meta["note"].rstrip(), ""]
    return "\n".join(lines)


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--revs", default="HEAD", help="comma-separated commits, each measured as committed")
    ap.add_argument("--settings", default="main,uci", help=f"comma-separated, of {', '.join(SETTINGS)}")
    ap.add_argument("--repeats", type=int, default=3, help="workers per revision and setting (alternating)")
    ap.add_argument("--rounds", type=int, default=40, help="timed steps per arm and worker")
    ap.add_argument("--warmup", type=int, default=10)
    ap.add_argument("--root", default=str(ROOT / "data"), help="data root (RedWine for the uci setting)")
    ap.add_argument("--note", default=None, help="a markdown file printed below the tables")
    ap.add_argument("--ks", default="", help="comma-separated K: also the record with K phantom steps (arm 'record "
                                             "K=<k>'; revisions whose study has this option)")
    ap.add_argument("--worker", default=None, help=argparse.SUPPRESS)  # "<setting>": run one worker, print JSON
    result_options(ap, "dkef_block_cost")
    args = ap.parse_args(argv)
    if args.worker:
        ks = tuple(int(k) for k in args.ks.split(",") if k.strip())
        print(json.dumps(worker(args.worker, args.rounds, args.warmup, args.root, ks)))
        return {}
    if rendered(args, args.name, render):
        return {}
    data_root = str(Path(args.root).resolve())  # the workers run in the snapshots' folders: a relative root would miss
    revs = [r.strip() for r in args.revs.split(",") if r.strip()]
    settings = [s.strip() for s in args.settings.split(",") if s.strip()]
    with tempfile.TemporaryDirectory(prefix="deqsm_dkef_cost_") as tmp:
        trees = rev_trees(revs, Path(tmp))
        parts = {(s, rev): [] for s in settings for rev in revs}
        load = " ".join(f"{x:.2f}" for x in os.getloadavg())
        for _ in range(args.repeats):
            for s in settings:
                for rev in revs:
                    env = rev_env(trees[rev], dict(os.environ, OMP_NUM_THREADS="1"))
                    out = subprocess.run([sys.executable, "-m", MODULE, "--worker", s, "--rounds", str(args.rounds),
                                          "--warmup", str(args.warmup), "--root", data_root,
                                          *(["--ks", args.ks] if args.ks else [])],
                                         env=env, check=True, capture_output=True, text=True, cwd=trees[rev])
                    parts[(s, rev)].append(json.loads(out.stdout.strip().splitlines()[-1]))
                    print(s, rev, "done", flush=True)
    res = load_results(args.out, args.name) or {}
    res["meta"] = {"command": script_command(MODULE, argv, data_root=args.root), "machine": machine_facts(),
                   "load_average": load, "rounds": args.rounds, "repeats": args.repeats,
                   "note": Path(args.note).read_text() if args.note else res.get("meta", {}).get("note")}
    res.setdefault("settings", {})
    for s in settings:
        res["settings"][s] = {f"{rev} ({commit_of(rev)})": {"source": parts[(s, rev)][0]["source"],
                                                            "arms": _summary(parts[(s, rev)])} for rev in revs}
    write_results(args.out, args.name, res, render)
    print(f"-> {args.out / args.name}.md")
    return res


if __name__ == "__main__":
    main()
