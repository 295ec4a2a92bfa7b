"""What the image-DEQ techniques cost per training step at ``experiment=ncsn_mnist_long``, each design beside TwoRes.

Each design (``ARMS``) trains ``--steps`` steps by the user's own command (``python -m src.train
experiment=ncsn_mnist_long <overrides> trainer.max_steps=<steps> test=false``, validation off), in its own process
with one torch thread, *at the same time as* a TwoRes run of the same length (``deq=false depth=1``): the machine is
shared (2 cores, other jobs), so absolute seconds drift with its load and the figure to read is the design's
seconds per step over its own TwoRes partner's. Per run, from its ``metrics.json`` (the profiling callback,
``src.callbacks.profiling``; the first step excluded from the time): seconds per step, bytes autograd saved per
step, the forward solves' mean iterations and cap hits (``deq.max_iter`` reached unconverged) and the adjoint
solves' mean iterations — the convergence check of a few training steps.

    python -m benchmarks.studies.ncsn_mdeq_cost --root <data dir> [--arms mdeq_res,mdeq_gn] [--steps 20]
    python -m benchmarks.studies.ncsn_mdeq_cost --render

Writes ``benchmarks/results/ncsn_mdeq_cost.{json,md}`` (arms measured again replace their rows).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from benchmarks.lib.jobs import run_process, thread_env
from benchmarks.lib.results import (
    DATA_ROOT,
    RESULTS,
    load_results,
    machine_facts,
    rerender,
    script_command,
    write_results,
)

MODULE = "benchmarks.studies.ncsn_mdeq_cost"
STEM = "ncsn_mdeq_cost"
BASE = ["experiment=ncsn_mnist_long", "test=false", "logger=csv", "trainer.enable_progress_bar=false",
        "trainer.limit_val_batches=0", "trainer.val_check_interval=100000"]
TWORES = "deq=false depth=1"
MDEQ_RES = "model.arch=mdeq deq=true deq.block=null deq.norm=spectral deq.norm_lambda=2"
MDEQ_GN = "model.arch=mdeq model.cell=mdeq_gn deq=true deq.block=null deq.solver=anderson deq.max_iter=30"
DEQ_GN = "model.cell=mdeq_gn deq=true deq.block=null deq.solver=anderson deq.max_iter=30"
MDEQ_RES_15 = "model.arch=mdeq deq=true deq.block=null deq.norm=spectral deq.norm_lambda=1.5"
# the group-norm cell with the phantom backward (K = 3) and a 12-iteration Anderson solve: its cheap form
MDEQ_GN_PH = ("model.arch=mdeq model.cell=mdeq_gn deq=true deq.block=null deq.solver=anderson deq.max_iter=12 "
              "deq.backward=phantom deq.phantom_steps=3 deq.backward_tol=null")
DEQ_GN_PH = ("model.cell=mdeq_gn deq=true deq.block=null deq.solver=anderson deq.max_iter=12 "
             "deq.backward=phantom deq.phantom_steps=3 deq.backward_tol=null")
FPC = "deq.correction_states=2 deq.correction_gamma=0.8"
# arm: (overrides after experiment=ncsn_mnist_long, what it is)
ARMS = {
    "refinenet": ("model.arch=refinenet", "RefineNet (no DEQ)"),
    "record": ("deq=true", "the DEQ of record (normalised ResBlock, implicit backward, adjoint tol 1e-2)"),
    "mdeq_res": (MDEQ_RES, "multi-resolution equilibrium (28x28x16 + 14x14x32), resblock cells, spectral lambda 2"),
    "mdeq_res_one_pass": (f"{MDEQ_RES} deq.one_pass=true", "its one-pass control"),
    "mdeq_gn": (MDEQ_GN, "multi-resolution equilibrium, MDEQ group-norm cells, Anderson, cap 30"),
    "mdeq_gn_jr": (f"{MDEQ_GN} deq.jacobian_penalty=1", "mdeq_gn + Jacobian penalty gamma 1 (8 rows)"),
    "mdeq_gn_one_pass": (f"{MDEQ_GN} deq.one_pass=true", "its one-pass control"),
    "deq_gn": (DEQ_GN, "single-resolution DEQ (arch=deq) with the MDEQ group-norm cell, Anderson, cap 30"),
    "mdeq_res_l15": (MDEQ_RES_15, "mdeq_res at spectral lambda 1.5 (bound 1.48: convergence no longer guaranteed)"),
    "mdeq_res3_l15": (f"{MDEQ_RES_15} model.scales=3", "mdeq_res_l15 over three resolutions (28, 14, 7)"),
    "mdeq_res_l15_jr": (f"{MDEQ_RES_15} deq.jacobian_penalty=1", "mdeq_res_l15 + Jacobian penalty gamma 1"),
    "mdeq_gn_phantom_jr": (f"{MDEQ_GN_PH} deq.jacobian_penalty=1",
                           "mdeq_gn, phantom K = 3, Anderson cap 12, Jacobian penalty gamma 1"),
    "deq_gn_phantom_jr": (f"{DEQ_GN_PH} deq.jacobian_penalty=1",
                          "deq_gn, phantom K = 3, Anderson cap 12, Jacobian penalty gamma 1"),
    "mdeq_gn_k1_jr": (f"{MDEQ_GN_PH.replace('phantom_steps=3', 'phantom_steps=1')} deq.jacobian_penalty=1",
                      "mdeq_gn, phantom K = 1, Anderson cap 12, Jacobian penalty gamma 1"),
    "deq_gn_k1_jr": (f"{DEQ_GN_PH.replace('phantom_steps=3', 'phantom_steps=1')} deq.jacobian_penalty=1",
                     "deq_gn, phantom K = 1, Anderson cap 12, Jacobian penalty gamma 1"),
    # fixed-point correction (Bai et al. 2022; TorchDEQ's n_states = 2, gamma = 0.8): the search plan's C1 and C2
    "mdeq_res_fpc": (f"{MDEQ_RES_15} {FPC}", "mdeq_res_l15 + fixed-point correction, 2 states, gamma 0.8"),
    # C1 with the solve's budget as the cap: at max_iter 128 both states sit past a 7-iteration solve (its fixed point)
    "mdeq_res_fpc_cap10": (f"{MDEQ_RES_15} deq.max_iter=10 {FPC}",
                           "mdeq_res_fpc with deq.max_iter=10 (states after 5 and 10 evaluations)"),
    "mdeq_gn_fpc_jr": (f"{MDEQ_GN_PH.replace('phantom_steps=3', 'phantom_steps=1')} deq.jacobian_penalty=1 {FPC}",
                       "mdeq_gn_k1_jr + fixed-point correction, 2 states, gamma 0.8"),
}
MB = 2**20


def train_command(overrides: str, steps: int) -> list[str]:
    return [*BASE, *overrides.split(), f"trainer.max_steps={steps}"]


def read_run(run_dir: Path) -> dict:
    m = json.loads((run_dir / "metrics.json").read_text())
    return {"s_per_step": m["profile/time_per_step_s"], "saved_MB": m["profile/saved_bytes_mean"] / MB,
            "params": m.get("n_params"), "iterations": m.get("profile/deq_iterations_mean"),
            "iterations_max": m.get("profile/deq_iterations_max"), "cap_hits": m.get("profile/deq_hit_cap_count"),
            "adjoint_iterations": m.get("profile/deq_adjoint_iterations_mean"),
            "adjoint_cap_hits": m.get("profile/deq_adjoint_hit_cap_mean"),
            "cpu_over_wall": m["time/fit_cpu_s"] / m["time/fit_s"] if m.get("time/fit_s") else None}


def train(overrides: str, steps: int, root: str, run_dir: Path) -> dict:
    cmd = [sys.executable, "-m", "src.train", *train_command(overrides, steps), f"data.root={root}",
           f"hydra.run.dir={run_dir}"]
    out = run_process(cmd, env=thread_env(1))
    if out["code"] != 0:
        raise RuntimeError(f"{' '.join(cmd)} failed:\n{out['tail']}")
    return read_run(run_dir)


def run(args) -> dict:
    res = load_results(args.out, STEM) or {"arms": {}}
    arms = args.arms.split(",") if args.arms else list(ARMS)
    unknown = [a for a in arms if a not in ARMS]
    if unknown:
        raise SystemExit(f"--arms: unknown {unknown}; known: {', '.join(ARMS)}")
    with tempfile.TemporaryDirectory() as work:
        for arm in arms:
            overrides, what = ARMS[arm]
            with ThreadPoolExecutor(2) as pool:  # the design and its TwoRes partner at the same time
                mine = pool.submit(train, overrides, args.steps, args.root, Path(work) / arm)
                partner = pool.submit(train, TWORES, args.steps, args.root, Path(work) / f"{arm}_twores")
                row, ref = mine.result(), partner.result()
            res["arms"][arm] = {"what": what, "study_command": args.command, "command": "python -m src.train " + " ".join(
                [*train_command(overrides, args.steps), "data.root=<data dir>"]), **row, "twores": ref,
                "time_ratio": row["s_per_step"] / ref["s_per_step"], "bytes_ratio": row["saved_MB"] / ref["saved_MB"]}
            res["meta"] = {"command": args.command, "machine": machine_facts().rsplit("; cpu", 1)[0],
                           "steps": args.steps, "twores_command": "python -m src.train " + " ".join(
                               [*train_command(TWORES, args.steps), "data.root=<data dir>"])}
            write_results(args.out, STEM, res, render)
            print(f"{arm}: {row['s_per_step']:.2f} s/step ({res['arms'][arm]['time_ratio']:.2f}x TwoRes), "
                  f"{row['saved_MB']:.1f} MB ({res['arms'][arm]['bytes_ratio']:.2f}x)", flush=True)
    return res


def _f(v, digits=2):
    return "–" if v is None else f"{v:.{digits}f}"


def _cpu_range(res: dict) -> str:
    shares = [r["cpu_over_wall"] for r in res.get("arms", {}).values() if r.get("cpu_over_wall") is not None]
    return f"{min(shares):.2f}-{max(shares):.2f}" if shares else "not recorded"


def render(res: dict) -> str:
    meta = res.get("meta", {})
    studies = list(dict.fromkeys(r.get("study_command", meta.get("command", "")) for r in res.get("arms", {}).values()))
    lines = ["# Image-DEQ designs: cost per training step beside TwoRes (`experiment=ncsn_mnist_long`)", "",
             "Made by, in turn:", "", "```bash", *studies, "```", "",
             (f"{meta.get('machine', '')}. {meta.get('steps')} training steps per run "
             "(batch 32, SSM-VR), each design in its own process with one torch thread, at the same time as a TwoRes "
             f"run (`{meta.get('twores_command', '')}`). **The machine is shared** (2 cores, other engineers' jobs and "
             "a background training run): absolute seconds are several times those of a quiet machine (the campaign "
             "measured TwoRes at 0.40-0.45 s and RefineNet at 0.71 s per step); read the ratio to the TwoRes run "
             "beside it. Saved bytes do not depend on the load. Iterations: forward solves, mean over the steps "
             "(max); cap hits: forward solves that reached `deq.max_iter` unconverged; adjoint: the implicit "
             f"backward's adjoint solves, mean iterations. Each run's CPU over wall time was {_cpu_range(res)}: its "
             "process held a fraction of a core."), "",
             ("| design | s / step | TwoRes beside it | time × TwoRes | saved MB | × TwoRes | params | iterations "
              "(max) | cap hits | adjoint iterations |"), "|---|---|---|---|---|---|---|---|---|---|"]
    for arm, r in res.get("arms", {}).items():
        lines.append(f"| {arm} | {_f(r['s_per_step'])} | {_f(r['twores']['s_per_step'])} | {_f(r['time_ratio'])} | "
                     f"{_f(r['saved_MB'], 1)} | {_f(r['bytes_ratio'])} | {r['params'] or '–'} | "
                     f"{_f(r['iterations'], 1)} ({_f(r['iterations_max'], 0)}) | {_f(r['cap_hits'], 0)} | "
                     f"{_f(r['adjoint_iterations'], 1)} |")
    ratios = [r["time_ratio"] for r in res.get("arms", {}).values()]
    if ratios:
        lines += ["", f"Median time ratio over the designs: {statistics.median(ratios):.2f}."]
    lines += ["", "Designs:", ""]
    lines += [f"- **{arm}**: {r['what']}. `{r['command']}`" for arm, r in res.get("arms", {}).items()]
    return "\n".join(lines) + "\n"


def main(argv=None):
    argv = sys.argv[1:] if argv is None else list(argv)
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--root", default=str(DATA_ROOT), help="data root (MNIST)")
    ap.add_argument("--arms", default="", help=f"comma-separated, default all: {', '.join(ARMS)}")
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--out", type=Path, default=RESULTS)
    ap.add_argument("--render", action="store_true", help="run nothing: the markdown again from the JSON")
    args = ap.parse_args(argv)
    if args.render:
        return rerender(args.out, STEM, render)
    args.command = script_command(MODULE, argv, data_root=args.root)
    return run(args)


if __name__ == "__main__":
    main()
