"""The main job's DKEF block of record against its alternatives, trained: quality, recurrence and cost per seed.

The main job is ``python -m src.train model=dkef loss=sm deq=true`` (the 10-d Gaussian N(0, I), batch 32 = α on 16
+ exact SM on 16, M = 200 inducing points, 1520 steps; its DEQ block ``conf/deq/family/dkef.yaml`` at the latent
width ``conf/model/dkef.yaml`` sets). Each arm is that command with its overrides, at each ``--seeds`` seed, one
``src.train`` process at a time with one thread (a run directory that already holds ``metrics.json`` is reused). Per
arm and seed: test log-likelihood (importance sampling) against the truth's, Fisher divergence, test exact SM loss,
each block's recurrence share ‖z* − φ(0)‖/‖z*‖ on the test set (paper eq. 5), forward iterations, time per step and
bytes saved per step as the run's profiling callback measured them (the machine's load stretches the times: the
study of the step's cost side by side is ``benchmarks/studies/dkef_block_cost.py``).

Issue 60 asks the record for a recurrence share of at least 15 % and a test log-likelihood no worse than the former
record's (the ``former record`` arm, its block until issue 60: latent width 64, spectral λ = 2). The ``one-pass
control`` is the record's network evaluated once from z = 0 (``deq.one_pass=true``): what the recurrence adds.

    python -m benchmarks.studies.dkef_main_block [--seeds 0,1,2] [--arms record,3-layer] [--runs DIR]
    python -m benchmarks.studies.dkef_main_block --render

Writes ``benchmarks/results/dkef_main_block.{json,md}`` (the arms a call does not run keep their saved runs).
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path

from benchmarks.lib.jobs import thread_env, train_job
from benchmarks.lib.results import (
    ROOT,
    commands_so_far,
    load_results,
    machine_facts,
    rendered,
    result_options,
    script_command,
    write_results,
)
from benchmarks.lib.runs import slug

MODULE = "benchmarks.studies.dkef_main_block"
MAIN_JOB = ["model=dkef", "loss=sm"]
ARMS = {
    "record": ["deq=true"],
    "former record (width 64 λ 2)": ["deq=true", "model.net.deq_width=64", "deq.norm_lambda=2"],
    "width 30 λ 2": ["deq=true", "deq.norm_lambda=2"],
    "paper's block (Frobenius λ 2 K 2)": ["deq=true", "deq.norm=frobenius", "deq.norm_lambda=2",
                                              "deq.phantom_steps=2"],
    "one-pass control": ["deq=true", "deq.one_pass=true"],
    "3-layer": ["deq=false"],
}
SHARE = "test/deq_recurrence_share/net.features."


def summary(metrics: dict) -> dict:
    """One run's figures (shares: one per feature block, in block order)."""
    shares = [metrics[k] for k in sorted(k for k in metrics if k.startswith(SHARE))]
    return {"test_ll": metrics["test/log_likelihood"], "true_ll": metrics["test/true_log_likelihood"],
            "fisher": metrics["test/fisher_divergence"], "test_sm": metrics["test/sm_loss"], "shares": shares,
            "iterations": metrics.get("profile/deq_iterations_mean"), "s_per_step": metrics["profile/time_per_step_s"],
            "saved_mb": metrics["profile/saved_bytes_mean"] / 1e6, "steps": metrics["global_step"]}


def _span(values, fmt="{:.3f}") -> str:
    values = [v for v in values if v is not None]
    if not values:
        return "—"
    lo, hi = min(values), max(values)
    return fmt.format(lo) if lo == hi else f"{fmt.format(lo)} – {fmt.format(hi)}"


def render(res: dict) -> str:
    meta = res["meta"]
    lines = ["# The main job's DKEF block of record, trained (issue 60)", "",
             *(["Commands, in the order they built this result:", "", *(f"- `{c}`" for c in meta["commands"])]
               if len(meta.get("commands", [])) > 1 else [f"Command: `{meta['command']}`"]), "",
             (f"Machine: {meta['machine']}; one `src.train` at a time, one "
             "thread (other jobs on the machine stretch the times: read them as a guide, the cost side by side is "
             "`dkef_block_cost_main.md`)."), "",
             ("Each arm: `python -m src.train model=dkef loss=sm <arm's overrides> seed=<s>` (1520 steps). Test LL − "
             "truth: the test log-likelihood (importance sampling) minus the true one (higher is better, 0 is the "
             "truth); shares: each feature block's recurrence share on the test set (min – max over blocks and "
             "seeds); per seed the three blocks' shares in the JSON."), "",
             ("| arm | overrides | seeds | test LL per seed | test LL − truth, mean | Fisher divergence | test SM | "
             "recurrence share (blocks × seeds) | forward iterations | s / step | MB saved / step |"),
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    for arm, entry in res["arms"].items():
        runs = entry["runs"]
        if not runs:
            continue
        seeds = sorted(runs, key=int)
        ll = [runs[s]["test_ll"] for s in seeds]
        gap = statistics.mean(runs[s]["test_ll"] - runs[s]["true_ll"] for s in seeds)
        shares = [x for s in seeds for x in runs[s]["shares"]]
        lines.append(
            f"| {arm} | `{' '.join(entry['overrides'])}` | {', '.join(seeds)} | "
            f"{' / '.join(f'{v:.3f}' for v in ll)} | {gap:+.3f} | {_span([runs[s]['fisher'] for s in seeds])} | "
            f"{_span([runs[s]['test_sm'] for s in seeds], '{:.2f}')} | "
            f"{_span([100 * x for x in shares], '{:.1f} %') if shares else '—'} | "
            f"{_span([runs[s]['iterations'] for s in seeds], '{:.2f}')} | "
            f"{_span([runs[s]['s_per_step'] for s in seeds], '{:.4f}')} | "
            f"{_span([runs[s]['saved_mb'] for s in seeds], '{:.2f}')} |")
    lines.append("")
    if meta.get("note"):
        lines += [meta["note"].rstrip(), ""]
    return "\n".join(lines)


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--seeds", default="0,1,2")
    ap.add_argument("--arms", default=",".join(ARMS), help=f"comma-separated, of: {'; '.join(ARMS)}")
    ap.add_argument("--runs", type=Path, default=ROOT / "outputs" / "dkef_main_block")
    ap.add_argument("--note", type=Path, default=None, help="a markdown file printed below the table")
    result_options(ap, "dkef_main_block")
    args = ap.parse_args(argv)
    if rendered(args, args.name, render):
        return {}
    arms = [a.strip() for a in args.arms.split(",") if a.strip()]
    unknown = sorted(set(arms) - set(ARMS))
    if unknown:
        ap.error(f"unknown arm(s) {unknown}; the arms are: {'; '.join(ARMS)}")
    seeds = [int(s) for s in args.seeds.split(",")]
    saved = load_results(args.out, args.name)  # the arms this call does not run keep their runs and commands
    command = script_command(MODULE, argv)
    old_meta = saved.get("meta", {})
    res = {"meta": {"command": command, "machine": machine_facts(), "commands": commands_so_far(old_meta, command),
                    "note": args.note.read_text() if args.note else old_meta.get("note")},
           "arms": {a: {"overrides": [*MAIN_JOB, *ARMS[a]],
                        "runs": {} if a in arms else saved.get("arms", {}).get(a, {}).get("runs", {})} for a in ARMS}}
    for arm in arms:
        for seed in seeds:
            run_dir = args.runs / f"{slug(arm)}_seed{seed}"
            ran = train_job([*MAIN_JOB, *ARMS[arm], f"seed={seed}", "logger=csv",
                             "trainer.enable_progress_bar=false"], run_dir, thread_env(1))
            if not ran["ok"]:
                raise SystemExit(f"{arm} seed {seed} failed:\n{ran.get('error', '')}")
            res["arms"][arm]["runs"][str(seed)] = summary(ran["metrics"])
            print(f"{arm} seed {seed}: test LL {ran['metrics']['test/log_likelihood']:.3f}", flush=True)
            write_results(args.out, args.name, res, render)
    print(json.dumps({a: len(e["runs"]) for a, e in res["arms"].items()}))
    return res


if __name__ == "__main__":
    main()
