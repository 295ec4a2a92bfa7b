"""The pre-registered image-DEQ search (issue 59): every design's figures and the plan's rule applied to them.

The plan (``benchmarks/results/notes/ncsn_deq_search_plan.md``, committed before the first run) fixes the designs
(the ``ncsn_search`` grid of :mod:`benchmarks.lib.generative_grids`), the protocol (``experiment=ncsn_mnist_long``
for 1500 steps at seed 0, FID of 1000 samples) and the rule. Per design this joins:

- the FID at step 1500 ± its bootstrap sd, from the design's ``benchmarks.tools.training_curves`` part (``--parts``);
- solver iterations, cap hits and the training loss over its 1500 steps, from its run directory (``--runs``:
  ``metrics.json``'s ``profile/deq_*`` and the CSV log's ``train/loss_step``);
- the recurrence share over all 95 noise levels at step 1500, from ``benchmarks.studies.ncsn_share_by_level``
  (``--shares``, one JSON per design, labelled ``'<design> 1500'``);
- seconds per step and saved bytes against a TwoRes run beside it, from the committed
  ``benchmarks/results/ncsn_mdeq_cost.json`` (20-step runs, one thread each, ratios read side by side);
- sampling seconds per image against TwoRes (``--sample``: ``python -m src.sample … n=64 seed=0`` of the design's
  checkpoint and of a TwoRes checkpoint at the same time, one thread each, wall time including start-up; TwoRes
  has no solver, so its sampling time does not depend on how long it trained).

The rule (the plan's §"The rule that picks the winner"): (1) cost gate — time and bytes ratios to TwoRes at most
RefineNet's in the same study; (2) convergence gate — forward solves at the cap in at most 5 % of the training
steps, the training loss finite throughout and above −1000 at step 1500; (3) the lowest FID among the eligible
wins, every eligible design within 2 combined bootstrap sds of it is tied with it and the tie goes to the lowest
time ratio, then bytes ratio. Until every design of the plan has its FID the verdict is marked provisional.

    python -m benchmarks.studies.ncsn_deq_search --sample 'S1 mdeq_res' --ckpt <design ckpt> \\
        --twores-ckpt <TwoRes ckpt> --root <data dir> [--n 64]       # one design's sampling time, beside TwoRes
    python -m benchmarks.studies.ncsn_deq_search --parts <part>.json … --runs <runs dir> --shares <share>.json …
    python -m benchmarks.studies.ncsn_deq_search --render

Writes ``benchmarks/results/ncsn_deq_search.{json,md}`` (``--sample`` adds or replaces one design's sampling row).
"""

from __future__ import annotations

import argparse
import csv
import json
import math
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from benchmarks.lib.generative_grids import GRIDS
from benchmarks.lib.results import RESULTS, machine_facts, script_command, write_results
from benchmarks.lib.runs import merge_curves, run_dir_name
from src.reports.tables import markdown_table

NAME = "ncsn_deq_search"
MODULE = "benchmarks.studies.ncsn_deq_search"
STEP = 1500
CAP_SHARE = 0.05  # the convergence gate: forward solves at the cap in at most 5 % of the steps
RUNAWAY = -1000.0  # ... and the training loss above this at step 1500 (converged runs read ≈ −325 … −392)
REFERENCE_ARMS = ("SSM-VR NCSN (RefineNet)", "TwoRes-SSM-VR NCSN", "DEQ-SSM-VR NCSN (one-pass)",
                  "DEQ-SSM-VR NCSN (record)")


def designs() -> list[str]:
    """The plan's designs that train (the grid's S-designs, not their one-pass controls, which only the decision
    trains; C1/C2 were dropped by the cost gate before training)."""
    return [v for v in GRIDS["ncsn_search"]["variants"] if v.startswith("S") and not v.endswith("(one-pass)")]


def cost_arm(design: str) -> str:
    """``'S1 mdeq_res'`` -> ``'mdeq_res'``: the design's arm in ``ncsn_mdeq_cost.json``."""
    return design.split(" ", 1)[1]


def fid_at(point: dict) -> tuple[float, float]:
    m = point["metrics"]
    return float(m["test/fid"]), float(m["test/fid_bootstrap_sd"])


def point_at_step(run: dict, step: int = STEP) -> dict:
    for point in run["points"].values():
        if int(point["step"]) == step:
            return point
    raise SystemExit(f"no point at step {step} in the run of {run.get('command', '?')!r}")


def training_record(run_dir: Path) -> dict:
    """Solver counts over training (``metrics.json``'s profile) and the training loss (the CSV log)."""
    metrics = json.loads((run_dir / "metrics.json").read_text())
    losses, logged_caps = [], []
    for path in sorted(run_dir.glob("csv/version_*/metrics.csv")):
        with path.open() as fh:
            for row in csv.DictReader(fh):
                if row.get("train/loss_step") not in (None, ""):
                    losses.append((int(row["step"]), float(row["train/loss_step"])))
                if row.get("profile/deq_hit_cap") not in (None, ""):
                    logged_caps.append(float(row["profile/deq_hit_cap"]) > 0)
    losses.sort()
    steps = int(metrics.get("profile/steps") or 0)
    return {
        "steps": steps,
        "s_per_step_training": metrics.get("profile/time_per_step_s"),
        "saved_MB_training": (metrics.get("profile/saved_bytes_mean") or 0) / 1e6 or None,
        "iterations_mean": metrics.get("profile/deq_iterations_mean"),
        "iterations_max": metrics.get("profile/deq_iterations_max"),
        "cap_hits": metrics.get("profile/deq_hit_cap_count"),  # over `steps`: the steps since a resume, if any
        "logged_steps_at_cap": sum(logged_caps), "logged_steps": len(logged_caps),  # every logged step of the run
        "adjoint_iterations_mean": metrics.get("profile/deq_adjoint_iterations_mean"),
        "loss_logged": len(losses),
        "loss_all_finite": all(math.isfinite(v) for _, v in losses),
        "loss_min": min((v for _, v in losses), default=None),
        "loss_last": losses[-1][1] if losses else None,
        "loss_last_step": losses[-1][0] if losses else None,
        "val_share_16_levels": metrics.get("val/deq_recurrence_share"),
    }


def share_summary(path: Path, design: str) -> dict:
    data = json.loads(path.read_text())
    label = f"{design} {STEP}"
    if label not in data["checkpoints"]:
        raise SystemExit(f"{path}: no checkpoint labelled {label!r} (has {sorted(data['checkpoints'])})")
    entry = data["checkpoints"][label]
    s = entry["summary"]
    return {"share_all_levels": s["all_levels"],
            "share_by_third": [s["high_sigma_third"], s["mid_sigma_third"], s["low_sigma_third"]],
            "share_command": data["meta"]["command"]}


def gates(row: dict, refinenet: dict) -> dict:
    steps = row["training"]["steps"] or STEP
    cap_ok = row["training"]["cap_hits"] is not None and row["training"]["cap_hits"] <= CAP_SHARE * steps
    loss = row["training"]["loss_last"]
    converged = bool(cap_ok and row["training"]["loss_all_finite"] and loss is not None and loss > RUNAWAY)
    cost_ok = row["time_ratio"] <= refinenet["time_ratio"] and row["bytes_ratio"] <= refinenet["bytes_ratio"]
    aim = row["time_ratio"] <= 0.75 * refinenet["time_ratio"] and row["bytes_ratio"] <= 0.75 * refinenet["bytes_ratio"]
    return {"cost_gate": cost_ok, "aim_cost": aim, "convergence_gate": converged, "eligible": cost_ok and converged}


def pick(rows: dict[str, dict]) -> dict:
    """Rule 3 of the plan over the eligible designs: the lowest FID, ties (within 2 combined bootstrap sds)
    to the lowest time ratio, then bytes ratio."""
    eligible = {d: r for d, r in rows.items() if r["gates"]["eligible"] and r.get("fid") is not None}
    if not eligible:
        return {"winner": None, "tied": [], "why": "no design passed both gates"}
    best = min(eligible, key=lambda d: eligible[d]["fid"])
    fid, sd = eligible[best]["fid"], eligible[best]["fid_sd"]
    tied = [d for d, r in eligible.items() if abs(r["fid"] - fid) <= 2 * math.hypot(sd, r["fid_sd"])]
    winner = min(tied, key=lambda d: (eligible[d]["time_ratio"], eligible[d]["bytes_ratio"]))
    why = (f"lowest FID {fid:.1f} ± {sd:.1f}" if winner == best else
           f"tied with the lowest FID ({best}, {fid:.1f} ± {sd:.1f}) and the cheapest of the tied by time ratio")
    return {"winner": winner, "lowest_fid": best, "tied": sorted(tied), "why": why}


def reference_points() -> dict:
    data = json.loads((RESULTS / "ncsn_long_campaign_seed0.json").read_text())
    out = {}
    for arm in REFERENCE_ARMS:
        fid, sd = fid_at(point_at_step(data["runs"][arm]))
        out[arm] = {"fid": fid, "fid_sd": sd}
    return out


def collect(args) -> dict:
    merged = merge_curves(args.parts, Path(args.out), NAME)  # the parts' protocols checked equal; sample grids copied
    costs = json.loads((RESULTS / "ncsn_mdeq_cost.json").read_text())["arms"]
    shares = {}
    for path in args.shares:
        labels = json.loads(Path(path).read_text())["checkpoints"]
        for label in labels:
            shares[label.rsplit(" ", 1)[0]] = Path(path)
    old = load_existing(args.out)
    # the designs already in the saved result stay (a run directory of an earlier session may be gone): a new part
    # of the same design replaces its row
    rows = {d: r for d, r in old.get("designs", {}).items() if d not in merged["runs"]}
    curves_commands = {c.split("--variants ", 1)[1].split("'")[1]: c for c in merged["meta"].get("commands", [])
                       if "--variants '" in c}
    for design, run in merged["runs"].items():
        fid, sd = fid_at(point_at_step(run))
        cost = costs[cost_arm(design)]
        run_dir = Path(args.runs) / run_dir_name(design, 0)  # training_curves' run dir at seed 0
        row = {"overrides": GRIDS["ncsn_search"]["variants"][design], "command": run["command"],
               "samples": run.get("samples"),
               "fid": fid, "fid_sd": sd, "train_time_s": point_at_step(run).get("train_time_s"),
               "time_ratio": cost["time_ratio"], "bytes_ratio": cost["bytes_ratio"], "saved_MB_20": cost["saved_MB"],
               "cost_command": cost["study_command"], "training": training_record(run_dir),
               "curves_command": curves_commands.get(design)}
        if design in shares:
            row.update(share_summary(shares[design], design))
        if design in old.get("sampling", {}):
            row["sampling"] = old["sampling"][design]
        rows[design] = row
    refinenet = costs["refinenet"]
    for row in rows.values():
        row["gates"] = gates(row, refinenet)
    missing = [d for d in designs() if d not in rows]
    decision = pick(rows)
    decision["provisional"] = bool(missing)
    decision["missing"] = missing
    refs = reference_points()
    twores = refs["TwoRes-SSM-VR NCSN"]
    if decision["winner"]:
        w = rows[decision["winner"]]
        margin = 2 * math.hypot(w["fid_sd"], twores["fid_sd"])
        decision["beats_twores_1500"] = twores["fid"] - w["fid"] > margin
        decision["twores_gap"] = twores["fid"] - w["fid"]
        decision["twores_margin"] = margin
    return sanitized({"meta": {"machine": machine_facts(), "command": script_command(MODULE, data_root=None),
                     "parts_meta": merged["meta"], "refinenet_cost": {k: refinenet[k] for k in ("time_ratio",
                                                                                                 "bytes_ratio")},
                     "plan": "benchmarks/results/notes/ncsn_deq_search_plan.md"},
            "designs": dict(sorted(rows.items())), "references_1500": refs, "decision": decision, "sampling": old.get("sampling", {})},
        args.root)


def sanitized(value, root: str | None):
    """``value`` with the data directory of this machine written as ``<data dir>`` (results name no local path)."""
    if not root:
        return value
    if isinstance(value, str):
        return value.replace(str(root), "<data dir>")
    if isinstance(value, dict):
        return {k: sanitized(v, root) for k, v in value.items()}
    if isinstance(value, list):
        return [sanitized(v, root) for v in value]
    return value


def load_existing(out: Path) -> dict:
    path = Path(out) / f"{NAME}.json"
    return json.loads(path.read_text()) if path.exists() else {}


def sample_wall(ckpt: str, n: int, seed: int, root: str | None, out_png: Path) -> subprocess.Popen:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}
    cmd = [sys.executable, "-m", "src.sample", f"ckpt_path={ckpt}", f"n={n}", f"seed={seed}", f"out={out_png}"]
    if root:
        cmd.append(f"data.root={root}")
    return subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)


def measure_sampling(args) -> dict:
    """The design's and TwoRes' ``src.sample`` at the same time, one thread each: wall seconds / image."""
    with tempfile.TemporaryDirectory() as tmp:
        start = time.perf_counter()
        procs = {"design": sample_wall(args.ckpt, args.n, args.seed, args.root, Path(tmp) / "design.png"),
                 "twores": sample_wall(args.twores_ckpt, args.n, args.seed, args.root, Path(tmp) / "twores.png")}
        walls = {}
        pending = dict(procs)
        while pending:
            for key, proc in list(pending.items()):
                if proc.poll() is not None:
                    walls[key] = time.perf_counter() - start
                    if proc.returncode:
                        raise SystemExit(f"src.sample of the {key} checkpoint failed:\n{proc.stderr.read()[-2000:]}")
                    del pending[key]
            time.sleep(0.5)
    return {"n": args.n, "seed": args.seed, "s_per_image": walls["design"] / args.n,
            "twores_s_per_image": walls["twores"] / args.n, "ratio": walls["design"] / walls["twores"],
            "command": script_command(MODULE, data_root=args.root), "machine": machine_facts()}


def render(res: dict) -> str:
    refinenet = res["meta"]["refinenet_cost"]
    lines = ["### The image-DEQ search (issue 59): every design at 1500 steps, seed 0, and the plan's rule", "",
             ("The plan, committed before the first run: `benchmarks/results/notes/ncsn_deq_search_plan.md`. "
             "Protocol: `experiment=ncsn_mnist_long` for 1500 steps at seed 0, FID of 1000 samples ± its 100-draw "
             "bootstrap sd (real-vs-real floor 22.2). Cost ratios: 20-step runs beside a TwoRes run, one thread each "
             "(`ncsn_mdeq_cost.md`); RefineNet's there: "
             f"{refinenet['time_ratio']:.2f}× time, {refinenet['bytes_ratio']:.2f}× bytes (the cost gate). Sampling: "
             "`src.sample n=64 seed=0` of the design's 1500-step checkpoint and of a TwoRes checkpoint of the same "
             "experiment at the same time, one thread each, wall time with start-up (TwoRes has no solver, so its "
             "sampling time does not depend on how long it trained: a 5-step run, "
             "`python -m src.train experiment=ncsn_mnist_long deq=false depth=1 trainer.max_steps=5 seed=0`)."), ""]
    rows = []
    for design, r in res["designs"].items():
        t, g = r["training"], r["gates"]
        s = r.get("sampling")
        rows.append([
            design, f"{r['fid']:.1f} ± {r['fid_sd']:.1f}",
            f"{100 * r['share_all_levels']:.1f} % (thirds, high σ first: "
            + ", ".join(f"{100 * v:.1f}" for v in r["share_by_third"]) + ")" if r.get("share_all_levels") is not None else "not measured",
            f"{t['iterations_mean']:.1f} ({t['iterations_max']:.0f})" if t["iterations_mean"] is not None else "–",
            (f"{t['cap_hits']:.0f} / {t['steps']}" + (f" after its resume; {t['logged_steps_at_cap']} of all "
                                                        f"{t['logged_steps']} logged steps"
                                                        if t["steps"] < STEP else "")
             if t["cap_hits"] is not None else "–"),
            f"{t['loss_last']:.0f}" if t["loss_last"] is not None else "–",
            f"{r['time_ratio']:.2f}×", f"{r['bytes_ratio']:.2f}×",
            f"{s['ratio']:.2f}× ({s['s_per_image']:.1f} s vs {s['twores_s_per_image']:.1f} s)" if s else "not measured",
            ("yes" if g["cost_gate"] else "no") + (" (aim too)" if g["aim_cost"] else ""),
            "yes" if g["convergence_gate"] else "no"])
    lines += markdown_table(["design", "FID (1000) at 1500", "recurrence share, all 95 levels",
                             "forward iterations mean (max)", "cap hits / steps", "training loss at 1500",
                             "time × TwoRes", "bytes × TwoRes", "sampling s/image × TwoRes", "cost gate",
                             "convergence gate"], rows)
    lines += ["", "The campaign's arms at step 1500 (seed 0, `ncsn_long_campaign_seed0.json`): " + "; ".join(
        f"{arm} {p['fid']:.1f} ± {p['fid_sd']:.1f}" for arm, p in res["references_1500"].items()) + ".", ""]
    d = res["decision"]
    if d["winner"]:
        title = "Leading so far" if d["provisional"] else "Winner"
        verdict = f"**{title}: {d['winner']}** ({d['why']}; tied: {', '.join(d['tied'])})."
        verdict += (f" Against TwoRes' seed-0 FID at 1500: {d['twores_gap']:+.1f} (2 combined sds = "
                    f"{d['twores_margin']:.1f}): " + ("better by more than 2 sds." if d["beats_twores_1500"] else
                                                       "not better by more than 2 sds."))
        if not d["provisional"]:
            verdict += (f" It goes to the three-seed decision (the plan's rule 4 and amendment 2): `bash "
                        f"benchmarks/studies/ncsn_deq_decision.sh '{d['winner']}' <data dir>`.")
    else:
        verdict = f"**No winner:** {d['why']}."
    if d["provisional"]:
        verdict = f"*Provisional* ({len(d['missing'])} design(s) of the plan not yet in: {', '.join(d['missing'])}). " + verdict
    lines += [verdict, "", "Each design trained and tested by:", "", "```bash",
              *[r["curves_command"] for r in res["designs"].values() if r.get("curves_command")], "```", "",
              "Each design's training run (as `training_curves` ran it), its cost and its share:", ""]
    for design, r in res["designs"].items():
        lines += [f"- {design}: `{r['command']}`", f"  - cost: `{r['cost_command']}`"]
        if r.get("share_command"):
            lines += [f"  - share: `{r['share_command']}`"]
        if r.get("sampling"):
            lines += [f"  - sampling: `{r['sampling']['command']}`"]
        if r.get("samples"):
            lines += [f"  - samples of its 1500-step checkpoint: ![{design}]({r['samples']})"]
    lines += ["", f"Made by `{res['meta']['command']}`; machine: {res['meta']['machine']}."]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--parts", nargs="+", type=Path, default=[], help="training_curves JSON, one per design")
    ap.add_argument("--runs", type=Path, default=Path("outputs/ncsn_search/ncsn_search"), help="the designs' run dirs")
    ap.add_argument("--shares", nargs="*", type=Path, default=[], help="ncsn_share_by_level JSON per design")
    ap.add_argument("--sample", default=None, metavar="NAME", help="measure the design NAME's sampling time beside TwoRes")
    ap.add_argument("--ckpt", default=None, help="with --sample: the design's checkpoint")
    ap.add_argument("--twores-ckpt", default=None, help="with --sample: a TwoRes checkpoint of the same experiment")
    ap.add_argument("--n", type=int, default=64)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--root", default=None, help="data.root")
    ap.add_argument("--out", type=Path, default=RESULTS)
    ap.add_argument("--render", action="store_true")
    args = ap.parse_args(argv)
    if args.render:
        res = load_existing(args.out)
    elif args.sample:
        if args.sample not in designs() or not args.ckpt or not args.twores_ckpt:
            ap.error(f"--sample needs one of {designs()}, --ckpt and --twores-ckpt")
        if not load_existing(args.out):
            ap.error(f"{args.out / NAME}.json does not exist yet: collect the parts first")
        measured = sanitized(measure_sampling(args), args.root)
        res = load_existing(args.out)  # read after the measurement: a row joined meanwhile stays
        res.setdefault("sampling", {})[args.sample] = measured
        res["designs"].get(args.sample, {})["sampling"] = res["sampling"][args.sample]
    else:
        if not args.parts:
            ap.error("give --parts (or --render / --sample)")
        res = collect(args)
    write_results(args.out, NAME, res, render)
    print(f"-> {args.out / NAME}.md")


if __name__ == "__main__":
    main()
