"""Several seeds of a generative model's training curves side by side: mean ± sd over seeds at the same step
count and at the same training wall time, error bands, and a verdict per claim of the DEQ against the explicit
models (the decisive multi-seed NCSN and SSM-VAE comparison).

One ``benchmarks/tools/training_curves.py`` result per seed (each seed's variants may be ``--merge``'d parts), then::

    python -m benchmarks.tools.training_curves vae --root <data dir> --steps 12000 --every 3000 --fid-samples 1000 \\
        --ais-points 16 --final-ais-points 500 --eval-extra model.metrics.fid.bootstrap=100 \\
        --seed S --runs outputs/benchmarks/seeds --out outputs/benchmarks/seeds --name vae_seed_S   # S = 0, 1, 2
    python -m benchmarks.tools.generative_seeds vae --part outputs/benchmarks/seeds/vae_seed_0.json \\
        --part outputs/benchmarks/seeds/vae_seed_1.json --part outputs/benchmarks/seeds/vae_seed_2.json

(``ncsn`` the same, with ``--fid-samples 1000 --eval-extra 'model.metrics.fid.bootstrap=100 …'``.) The parts must
share the grid, the experiment, the evaluation overrides and the real-data FID's sample size (refused
otherwise: a seed spread over two protocols is not a seed spread); a variant must not appear twice for one seed.
The seed of each run is read from its training command (``seed=S``).

What it reports, per variant (the last checkpoint of each seed; for ``vae`` its ``--final-ais-points`` test,
AIS on ≥ 500 test images):

- the metrics at the same step count, mean ± sd over seeds, with the metrics' own sampling error beside the seed
  spread (the FID's bootstrap sd, ``model.metrics.fid.bootstrap``; AIS's standard error over test images), the
  saved bytes and time per step;
- the metrics at the same training wall time: the budget is the time the fastest variant needed for all its
  seeds to reach the last step, and each seed of each variant is read at its last checkpoint trained within it;
- verdicts: each DEQ variant against each explicit one, on each quality metric, at equal steps and at equal
  wall time, by two rules, each named (:func:`benchmarks.lib.results.seed_verdict`): at 2 s.e., agree / disagree
  when the DEQ is better / worse by more than twice the standard error of the difference over seeds, and by
  Welch's t-test, when its two-sided p < 0.05; undecided otherwise (a tie within the seeds' noise: consistent
  with "DEQ ≥ explicit", not a proof of it); for ``vae``, AIS paired by test image, at 2 s.e. of the mean paired
  difference and by the paired t-test;
- curves of every metric against steps and against wall time, mean over seeds with a ± sd band.

Writes ``<name>.json`` (every seed's points, so ``--render`` rebuilds the rest), ``<name>.md`` and
``<name>.png`` in ``--out`` (default ``benchmarks/results``; ``--name`` default ``<grid>_mnist_seeds``).
"""

from __future__ import annotations

import argparse
import json
import math
import re
from pathlib import Path

from benchmarks.lib.generative_grids import GRIDS
from benchmarks.lib.results import (
    fmt,
    one_sample_t_test,
    p_text,
    result_options,
    script_command,
    seed_verdict,
    write_results,
)
from src.reports.tables import figure, markdown_table, summarise

PROTOCOL = ("grid", "experiment", "eval_overrides", "real_fid_n")
# The DEQ variants and the explicit ones they are compared with; each quality metric: (key, label, lower is
# better, the key of its own sampling error or None).
CLAIMS = {
    # the one-pass controls stand with the explicit arms: "DEQ (record) ≥ its one-pass control" is "the
    # recurrence helps"
    "ncsn": {"deq": ["DEQ-SSM-VR NCSN (record)", "DEQ-SSM-VR NCSN", "DEQ-SSM-VR NCSN (spectral norm)"],
             "explicit": ["SSM-VR NCSN (RefineNet)", "TwoRes-SSM-VR NCSN", "DEQ-SSM-VR NCSN (one-pass)"],
             "quality": [("test/fid", "FID", True, "test/fid_bootstrap_sd"),
                         ("test/dsm_loss", "test DSM loss", True, "test/dsm_loss_stderr")]},
    "vae": {"deq": ["DEQ-SSM VAE (record)", "DEQ-SSM VAE"],
            "explicit": ["Aug(16)-SSM VAE", "Aug(8)-SSM VAE", "SSM VAE", "DEQ-SSM VAE (one-pass)"],
            "quality": [("test/log_likelihood", "AIS log p(x)", False, "test/log_likelihood_stderr"),
                        ("test/fid", "FID", True, "test/fid_bootstrap_sd")]},
}
CLAIMS["ncsn_long"] = CLAIMS["ncsn"]
# the image-DEQ decision (issue 59): the search's winner against its own one-pass control, and against the committed
# TwoRes and RefineNet seeds of the campaign (--reference)
_SEARCH = [v for v in GRIDS["ncsn_search"]["variants"] if v.startswith("S") and not v.endswith("(one-pass)")]
CLAIMS["ncsn_search"] = {**CLAIMS["ncsn"], "deq": _SEARCH,
                         "explicit": ["SSM-VR NCSN (RefineNet)", "TwoRes-SSM-VR NCSN",
                                      *(f"{v} (one-pass)" for v in _SEARCH)]}
REFERENCE_PROTOCOL = ("experiment", "eval_overrides", "real_fid_n")  # a reference may come from another grid
COSTS = [("profile/saved_bytes_mean", "saved MB / step", 1), ("profile/time_per_step_s", "s / step", 3)]


# ------------------------------------------------------------------------------------------- collecting
def seed_of(command: str) -> int:
    """The ``seed=S`` override of a recorded training command (0 when the command sets none: the default)."""
    found = re.findall(r"(?:^|\s)seed=(\d+)(?=\s|$)", command or "")
    return int(found[-1]) if found else 0


def collect(parts: list[tuple[Path, dict]]) -> dict:
    """``{"meta", "runs": {variant: {seed: run}}}`` from training_curves results of one protocol."""
    first_path, first = parts[0]
    meta = {k: first["meta"].get(k) for k in (*PROTOCOL, "real_fid")}
    meta["parts"] = []
    runs: dict[str, dict[str, dict]] = {}
    for path, part in parts:
        for key in PROTOCOL:
            if part["meta"].get(key) != first["meta"].get(key):
                raise SystemExit(f"{path}: {key} {part['meta'].get(key)!r} differs from {first_path}'s "
                                 f"{first['meta'].get(key)!r}; the seeds of one comparison need one protocol")
        commands = part["meta"].get("commands") or [part["meta"].get("command")]
        meta["parts"].append({"machine": part["meta"].get("machine"), "commands": commands,
                              "concurrent": part["meta"].get("concurrent", 1)})
        for variant, run in part["runs"].items():
            seed = str(seed_of(run.get("command", "")))
            if seed in runs.setdefault(variant, {}):
                raise SystemExit(f"{path}: {variant!r} seed {seed} is in more than one part")
            runs[variant][seed] = {k: run.get(k) for k in ("command", "train", "points", "final")}
    return {"meta": meta, "runs": runs}


def add_references(res: dict, references: list[str]) -> None:
    """``FILE:VARIANT,VARIANT…``: those variants' seeds from a committed result of this tool (e.g. the campaign's
    TwoRes and RefineNet, ``benchmarks/results/ncsn_mnist_campaign.json``) joined to ``res`` as they are, when its
    protocol (experiment, evaluation overrides, real-data FID sample size) is this one's; listed in
    ``meta.references``."""
    for ref in references:
        path, _, names = ref.rpartition(":")
        if not path:
            raise SystemExit(f"--reference {ref!r}: give FILE:VARIANT[,VARIANT…]")
        other = json.loads(Path(path).read_text())
        for key in REFERENCE_PROTOCOL:
            if other["meta"].get(key) != res["meta"].get(key):
                raise SystemExit(f"--reference {path}: {key} {other['meta'].get(key)!r} differs from the parts' "
                                 f"{res['meta'].get(key)!r}; a reference must share the protocol")
        wanted = [n.strip() for n in names.split(",") if n.strip()]
        for n in wanted:
            if n not in other["runs"]:
                raise SystemExit(f"--reference {path}: no variant {n!r}; it has {', '.join(other['runs'])}")
            if n in res["runs"]:
                raise SystemExit(f"--reference {path}: {n!r} is in the parts already")
            res["runs"][n] = other["runs"][n]
        res["meta"].setdefault("references", []).append(
            {"file": Path(path).name, "grid": other["meta"].get("grid"), "variants": wanted,
             "command": other["meta"].get("command")})


def points(run: dict) -> list[dict]:
    return sorted((run.get("points") or {}).values(), key=lambda p: p["step"])


def last_metrics(run: dict) -> dict:
    """The metrics of a seed's last checkpoint: its curve point, overridden by its larger final test (``vae``:
    AIS on ``--final-ais-points`` images) when that tested the same step."""
    pts = points(run)
    if not pts:
        return {}
    metrics = dict(pts[-1]["metrics"])
    final = run.get("final") or {}
    if final.get("step") == pts[-1]["step"]:
        metrics.update(final.get("metrics") or {})
        metrics["ais_points"] = final.get("ais_points")
    return metrics | {"step": pts[-1]["step"], "train_time_s": pts[-1].get("train_time_s")}


def wall_budget(runs: dict) -> float | None:
    """The equal-time budget: the training time the fastest variant needed for every one of its seeds to reach
    its last checkpoint (the smallest, over variants, of the largest time over seeds)."""
    longest = []
    for seeds in runs.values():
        times = [t for t in (last_metrics(r).get("train_time_s") for r in seeds.values()) if t is not None]
        if times:
            longest.append(max(times))
    return min(longest) if longest else None


def at_wall_time(run: dict, budget: float) -> dict:
    """A seed's last checkpoint trained within ``budget`` seconds (its metrics and step), or {} if none is."""
    within = [p for p in points(run) if p.get("train_time_s") is not None and p["train_time_s"] <= budget * 1.0001]
    return within[-1]["metrics"] | {"step": within[-1]["step"]} if within else {}


# -------------------------------------------------------------------------------------------- summaries
def seeds_cell(seeds) -> str:
    """The seeds of a row, in order (``—`` for none)."""
    return ",".join(sorted(seeds, key=int)) or "—"


def mean_cell(values, digits: int = 2) -> str:
    """The mean alone (an error measure averaged over seeds), ``—`` for none."""
    m, _, n = summarise(values)
    return f"{m:.{digits}f}" if n else "—"


def summary_rows(res: dict) -> tuple[list[str], list[list[str]]]:
    grid = res["meta"]["grid"]
    head = ["variant", "seeds", "steps"]
    rows = []
    for _, label, _, err in CLAIMS[grid]["quality"]:
        head += [f"{label} (mean ± sd over seeds)", "its sampling error (mean over seeds)"]
    head += ["AIS test images"] if grid == "vae" else []
    head += [label for _, label, _ in COSTS] + ["wall s at the last step"]
    for variant, seeds in res["runs"].items():
        last = [last_metrics(r) for r in seeds.values()]
        steps = sorted({m.get("step") for m in last if m})
        row = [variant, seeds_cell(seeds), "–".join(map(str, steps)) or "—"]
        for key, _, _, err in CLAIMS[grid]["quality"]:
            row += [fmt([m.get(key) for m in last], 2, key), mean_cell([m.get(err) for m in last])]
        if grid == "vae":  # per seed: a seed tested on fewer images has the larger standard error
            row += [",".join(str(int(n)) if n else "—" for n in (m.get("ais_points") or m.get("test/ais_points")
                                                                  for m in last))]
        row += [fmt([(r.get("train") or {}).get(k) for r in seeds.values()], d, k) for k, _, d in COSTS]
        row += [fmt([m.get("train_time_s") for m in last], 0, "train_time_s")]
        rows.append(row)
    return head, rows


def wall_rows(res: dict, budget: float) -> tuple[list[str], list[list[str]]]:
    grid = res["meta"]["grid"]
    head = ["variant", "seeds read", "step reached (mean over seeds)",
            *(label for _, label, _, _ in CLAIMS[grid]["quality"])]
    rows = []
    for variant, seeds in res["runs"].items():
        at = [at_wall_time(r, budget) for r in seeds.values()]
        read = [s for s, a in zip(seeds, at) if a]  # a seed tested only at its last step may have no point within
        rows.append([variant, seeds_cell(read), fmt([a.get("step") for a in at], 0, "step"),
                     *(fmt([a.get(key) for a in at], 2, key) for key, _, _, _ in CLAIMS[grid]["quality"])])
    return head, rows


def verdicts(res: dict, budget: float | None) -> list[str]:
    """One line per (DEQ variant, explicit variant, metric, equal steps | equal wall time)."""
    grid, runs = res["meta"]["grid"], res["runs"]
    lines = []
    for deq in (v for v in CLAIMS[grid]["deq"] if v in runs):
        for other in CLAIMS[grid]["explicit"]:
            if other not in runs:
                lines.append(f"- \"{deq} ≥ {other}\": undecided — {other} not run")
                continue
            settings = [("at equal steps", last_metrics)]
            if budget is not None:
                settings.append((f"at equal wall time ({budget:.0f} s)", lambda r: at_wall_time(r, budget)))
            for where, read in settings:
                for key, label, lower, _ in CLAIMS[grid]["quality"]:
                    a = [read(r).get(key) for r in runs[deq].values()]
                    b = [read(r).get(key) for r in runs[other].values()]
                    verdict, ma, mb = seed_verdict(a, b, lower_is_better=lower)
                    if math.isnan(ma) or math.isnan(mb):  # not measured
                        continue
                    lines.append(f"- \"{deq} ≥ {other}\", {label} {where}: {verdict}; {ma:.2f} vs {mb:.2f}")
            for key, label, _ in COSTS:
                verdict, ma, mb = seed_verdict([(r.get("train") or {}).get(key) for r in runs[deq].values()],
                                               [(r.get("train") or {}).get(key) for r in runs[other].values()],
                                               lower_is_better=True, detail=False)
                if not (math.isnan(ma) or math.isnan(mb)) and mb:
                    lines.append(f"- \"{deq} needs less {label} than {other}\": {verdict}; "
                                 f"ratio {ma / mb:.2f}")
    return lines


def paired_lines(res: dict) -> list[str]:
    """``vae``: AIS log p(x) of each DEQ arm minus each other arm's, paired by test image (every run tests the
    same first n images, binarised once with a fixed seed): per seed the mean difference ± its standard error
    over images, and over all (seed, image) pairs. The images' own spread (sd ~33 nats over 100 images at 20 000
    steps) cancels in the differences: their standard error is 0.4-0.8 nats where the unpaired ones are 3.3."""
    runs = res["runs"]
    lines = []
    for deq in (v for v in CLAIMS["vae"]["deq"] if v in runs):
        for other in (v for v in CLAIMS["vae"]["explicit"] if v in runs):
            per_seed, pooled = [], []
            for seed in sorted(set(runs[deq]) & set(runs[other]), key=int):
                a = (runs[deq][seed].get("final") or {}).get("per_point")
                b = (runs[other][seed].get("final") or {}).get("per_point")
                if not a or not b or len(a) != len(b):
                    continue
                d = [u - w for u, w in zip(a, b)]
                m, sd, n = summarise(d)
                per_seed.append(f"seed {seed}: {m:+.3f} ± {sd / math.sqrt(n):.3f} ({n} images)")
                pooled += d
            if pooled:
                m, sd, n = summarise(pooled)
                se = sd / math.sqrt(n)
                verdict = "agree" if m > 2 * se else "disagree" if m < -2 * se else "undecided"
                _t, df, p, q = one_sample_t_test((m, sd, n))
                by_t = ("agree" if m > 0 else "disagree") if abs(m) > q * se else "undecided"
                lines.append(f"- {deq} − {other}: {m:+.3f} ± {se:.3f} nats over {n} (seed, image) pairs "
                             f"→ {verdict} at 2 s.e., {by_t} by the paired t-test ({p_text(p)}, df = {df:.0f}); "
                             + "; ".join(per_seed))
    return lines


# ---------------------------------------------------------------------------------------------- output
def shared_machine_caveat(meta: dict) -> list[str]:
    """A warning line when some seed's runs trained side by side with other processes (``seeds_campaign.py
    --parallel``): their wall times include a load that changed as parts finished, so equal wall time is
    approximate there."""
    most = max((p.get("concurrent") or 1 for p in meta["parts"]), default=1)
    if most <= 1:
        return []
    return [(f"Caution: these runs trained up to {most} processes at once on one machine, so a run's wall time "
             "includes the others' load (which fell as runs finished); the equal-steps table is the clean "
             "comparison, and `python -m benchmarks.tools.profile_step` times each step alone."), ""]


def render(res: dict) -> str:
    meta = res["meta"]
    lines = [f"# {meta['grid'].upper()} on MNIST over seeds ({meta['experiment']})", "",
             f"Command: `{meta['command']}`", "", "Per-seed training curves (each seed's commands):", ""]
    for part in meta["parts"]:
        lines += ["```bash", *part["commands"], "```", f"Machine: {part['machine']}", ""]
    for ref in meta.get("references", []):
        lines += [(f"Joined as committed from `{ref['file']}` (grid `{ref['grid']}`, the same experiment, evaluation and "
                   f"real-data FID): {', '.join(ref['variants'])} — made by `{ref['command']}`."), ""]
    lines += [(f"Each checkpoint tested with `python -m src.evaluate ckpt_path=<checkpoint> "
               f"{' '.join(meta['eval_overrides'] or [])}`; wall time = summed training step time."), ""]
    if meta.get("real_fid") is not None:
        lines += [(f"FID floor: {meta['real_fid_n']} real training images against the test images: "
                   f"{meta['real_fid']:.1f}."), ""]
    head, rows = summary_rows(res)
    lines += ["## At the same step count (each seed's last checkpoint)", "", *markdown_table(head, rows), ""]
    budget = wall_budget(res["runs"])
    if budget is not None:
        head, rows = wall_rows(res, budget)
        lines += [f"## At the same training wall time ({budget:.0f} s, the fastest variant's)", "",
                  ("Each seed read at its last checkpoint trained within the budget; a seed with none within it "
                   "(one tested only at its last step) is left out, so a row may stand on fewer seeds than the "
                   "table above."), "",
                  *shared_machine_caveat(meta),
                  *markdown_table(head, rows), ""]
    lines += ["## Verdicts", "",
              ("Each verdict names its rule. At 2 s.e.: agree when the DEQ is better by more than twice the "
               "standard error of the difference over seeds (sample sds, no t-correction: lenient at 3 seeds), "
               "disagree when worse by as much, undecided within it (a tie at this many seeds). By Welch's t-test: "
               "the same when its two-sided p < 0.05, i.e. the difference exceeds t₀.₉₇₅(df) s.e. at the "
               "Welch–Satterthwaite df (about 2.8-4.3 s.e. at 3 seeds a side)."), "",
              *verdicts(res, budget), ""]
    paired = paired_lines(res) if meta["grid"] == "vae" else []
    if paired:
        lines += ["## AIS log p(x) paired by test image (DEQ arm − other arm)", "",
                  ("Same images in every run; agree: the DEQ arm higher by more than 2 s.e. of the mean paired "
                   "difference (images of all seeds pooled; the per-seed means show the seeds' spread), or by the "
                   "paired t-test (two-sided p < 0.05 at n − 1 df)."), "",
                  *paired, ""]
    lines += [f"Curves (mean over seeds, band ± sd): `{meta['name']}.png`", ""]
    return "\n".join(lines)


def plot(res: dict, path: Path) -> None:
    grid = res["meta"]["grid"]
    metrics = [(k, label) for k, label, _ in GRIDS[grid]["metrics"]
               if any(p["metrics"].get(k) is not None for seeds in res["runs"].values() for r in seeds.values()
                      for p in points(r))]
    if not metrics:
        return
    with figure(path, len(metrics), 2, figsize=(10, 2.9 * len(metrics))) as (_fig, axes):
        for i, (key, label) in enumerate(metrics):
            for c, (variant, seeds) in enumerate(res["runs"].items()):
                by_step: dict[int, list[dict]] = {}
                for r in seeds.values():
                    for p in points(r):
                        if p["metrics"].get(key) is not None:
                            by_step.setdefault(p["step"], []).append(p)
                steps = sorted(s for s, ps in by_step.items() if len(ps) == len(seeds))  # every seed measured
                if not steps:
                    continue
                stats = [summarise(p["metrics"][key] for p in by_step[s]) for s in steps]
                walls = [summarise(p.get("train_time_s") for p in by_step[s])[0] for s in steps]
                mean = [m for m, _, _ in stats]
                lo = [m - s for m, s, _ in stats]
                hi = [m + s for m, s, _ in stats]
                for ax, xs in ((axes[i][0], steps), (axes[i][1], walls)):
                    ax.plot(xs, mean, "o-", color=f"C{c}", label=f"{variant} ({len(seeds)} seeds)", ms=3)
                    ax.fill_between(xs, lo, hi, color=f"C{c}", alpha=0.2)
            axes[i][0].set(xlabel="training steps", ylabel=label.replace("\\|", "|"))
            axes[i][1].set(xlabel="training wall time (s)", ylabel=label.replace("\\|", "|"))
        axes[0][0].legend(fontsize=7)


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("grid", choices=sorted(CLAIMS))
    ap.add_argument("--part", action="append", type=Path, default=[],
                    help="a training_curves.py result JSON of one seed (repeatable)")
    result_options(ap)
    ap.add_argument("--name", default=None, help="result file stem (default: <grid>_mnist_seeds)")
    ap.add_argument("--reference", action="append", default=[], metavar="FILE:VARIANTS",
                    help="join these variants' seeds from a committed result of this tool with the same protocol "
                         "(e.g. the campaign's TwoRes and RefineNet; repeatable)")
    args = ap.parse_args(argv)
    name = args.name or f"{args.grid}_mnist_seeds"
    if args.render:
        res = json.loads((args.out / f"{name}.json").read_text())
    else:
        if not args.part:
            ap.error("give --part JSON for each seed (training_curves.py results); --render rebuilds from the JSON")
        missing = [str(p) for p in args.part if not p.is_file()]
        if missing:
            raise SystemExit(f"no training_curves result at {', '.join(missing)}: run benchmarks/tools/training_curves.py "
                             f"{args.grid} --seed S --name <part> first")
        res = collect([(p, json.loads(p.read_text())) for p in args.part])
        if res["meta"]["grid"] != args.grid:
            raise SystemExit(f"the parts are {res['meta']['grid']!r} results, not {args.grid!r}")
        add_references(res, args.reference)
        res["meta"]["command"] = script_command("benchmarks.tools.generative_seeds", argv)
        res["meta"]["name"] = name
    write_results(args.out, name, res, render)
    plot(res, args.out / f"{name}.png")
    print("wrote", args.out / f"{name}.md")


if __name__ == "__main__":
    main()
