"""DKEF at the paper's protocol (§4.2, Tables 2 and 3): one table over seeds with the paper's figures beside
ours, validation learning curves with seed bands, a verdict per claim, and the controlled per-point analysis
of the test SM loss.

The runs come from the resumable grid runner (each job the ``python -m src.train experiment=dkef_uci …`` a user
types, at the experiment's 300 epochs, batch 128, M = 200, 10⁶ importance samples), which also re-evaluates
every tested checkpoint with the reference's final stage (``--eval-final-refit``: α on every training point,
λ refitted on validation, ``model.final_refit``)::

    python -m benchmarks.tools.run_grid dkef --datasets redwine --methods 'DEQ-SM,DEQ-SSM-VR,SM 3-layer,SM 16-layer' \\
        --seeds 0,1,2 --jobs 2 --threads 1 --root <data dir> --runs outputs/paper_protocol/dkef \\
        --out outputs/paper_protocol --name dkef_grid --eval-final-refit
    python -m benchmarks.tools.dkef_paper_protocol --grid outputs/paper_protocol/dkef_grid.json --root <data dir>

``--grid LABEL=PATH`` adds a controlled grid (e.g. another data split) whose methods are shown as
``METHOD (LABEL)``. ``--add`` keeps the jobs of the saved result in ``--out`` and adds those of ``--grid`` (a
job of the same data set, method and seed replaces the saved one): grids run in another session, whose run
directories are gone, join the table without re-running the others. Each run's validation curve is read from its CSV log and the per-point test SM losses from
its tested checkpoint (mean, median, and the mean without the largest 2 %: the loss is heavy-tailed, so a few
test points move the mean by several nats), all stored in the JSON, so ``--render`` rebuilds the markdown and
the figure without the run directories. Writes ``dkef_paper_protocol.{json,md}`` and
``dkef_paper_protocol_curves.png`` in ``--out`` (default ``benchmarks/results``).
"""

from __future__ import annotations

import argparse
import csv
import json
import math
import statistics
from pathlib import Path

from benchmarks.lib.paper import DKEF_NICE, DKEF_PM
from benchmarks.lib.results import (
    DATA_ROOT,
    ROOT,
    added_to_saved,
    fmt,
    machine_facts,
    note_lines,
    rendered,
    result_options,
    script_command,
    seed_verdict,
    write_results,
)
from benchmarks.lib.runs import portable, tested_checkpoint
from src.reports.tables import figure, group_rows, markdown_table, summarise

STEM = "dkef_paper_protocol"
METHOD_ORDER = ["DEQ-SM", "DEQ-SSM-VR", "SM 3-layer", "SM 8-layer", "SM 16-layer"]
TRIM_SHARE = 0.02  # the trimmed mean drops this share of the largest per-point losses
# ----------------------------------------------------------------------------------------- collecting
def validation_curve(run_dir: Path) -> list[tuple[int, float]]:
    """(global step, validation SM loss) of every validation epoch, from the run's CSV log."""
    logs = sorted(run_dir.glob("csv/version_*/metrics.csv"))
    if not logs:
        return []
    points = {}
    with logs[-1].open() as fh:
        for row in csv.DictReader(fh):
            value = row.get("val/sm_loss")
            if value:
                points[int(row["step"])] = float(value)
    return sorted(points.items())


def per_point_test_sm(run_dir: Path, root: str, final_refit: bool) -> list[float]:
    """Exact SM loss (eq. 1) of every test point at the tested checkpoint, with α as the run's test fitted it
    (``final_refit``: after the reference's final stage). Its mean is the run's test/sm_loss."""
    import torch

    from src.runs.load import load_module

    overrides = [f"data.root={root}"]
    if final_refit:
        overrides += ["model.final_refit.lambda_steps=1000", "model.final_refit.lr=1e-3"]
    module = load_module(tested_checkpoint(run_dir), overrides)[0]
    if final_refit:
        module.final_refit_alpha_lambda()
    else:
        module.refit_alpha()
    net = module.net
    test = module.split_tensor("test")
    out = []
    with torch.no_grad():
        alpha = net.alpha.double()
    for i in range(test.shape[0]):
        g, b = (t.double() for t in net.alpha_system_on(test[i : i + 1], "exact"))
        out.append(float(net.exact_sm_of_alpha(alpha, g, b, test[i : i + 1].double())))
    return out


def tail_summary(values: list[float]) -> dict:
    ordered = sorted(values)
    keep = ordered[: len(ordered) - max(1, round(TRIM_SHARE * len(ordered)))]
    return {"n": len(values), "mean": sum(values) / len(values), "median": statistics.median(values),
            "trimmed_mean": sum(keep) / len(keep), "max": ordered[-1]}


def collect(grids: list[tuple[str, Path]], root: str, tails: bool) -> list[dict]:
    jobs = []
    for label, path in grids:
        data = json.loads(path.read_text())
        for job in data["jobs"]:
            if not job.get("ok"):
                continue
            job = portable(dict(job, method=job["method"] + (f" ({label})" if label else "")))
            run_dir = Path(job["run_dir"])
            run_dir = run_dir if run_dir.is_absolute() else ROOT / run_dir
            job["val_curve"] = validation_curve(run_dir)
            if tails and (run_dir / "metrics.json").exists():
                job["test_sm_per_point"] = {
                    "as_trained": tail_summary(per_point_test_sm(run_dir, root, final_refit=False))}
                if "final_refit/test/sm_loss" in job["metrics"]:
                    job["test_sm_per_point"]["final_refit"] = tail_summary(
                        per_point_test_sm(run_dir, root, final_refit=True))
                print(f"{job['group']} {job['method']} seed {job['seed']}: per-point test SM done", flush=True)
            job["grid_command"] = data["meta"]["command"]
            jobs.append(job)
    return jobs


# -------------------------------------------------------------------------------------------- table
def base_method(method: str) -> str:
    return method.split(" (")[0]


def ordered(methods) -> list[str]:
    rank = {m: i for i, m in enumerate(METHOD_ORDER)}
    return sorted(methods, key=lambda m: (rank.get(base_method(m), len(rank)), m))


def values(rows, key) -> list[float]:
    return [r["metrics"].get(key) for r in rows]


def cell(rows, key: str, digits: int = 2) -> str:
    """The ``mean ± sd`` over seeds of one metric (:func:`run_grid.fmt`: bytes in MB, ``—`` for none)."""
    return fmt(values(rows, key), digits, key)


def tail_cell(rows, which: str, stat: str) -> str:
    return fmt([r.get("test_sm_per_point", {}).get(which, {}).get(stat) for r in rows], 2, stat)


# §4.2's claims on Tables 2 and 3: (the DEQ method, the method it beats, whether its step costs are compared: the
# paper's memory and time claims are against the explicit depths)
CLAIMS = [("DEQ-SM", "SM 16-layer", True), ("DEQ-SM", "SM 3-layer", True), ("DEQ-SM", "SM 8-layer", True),
          ("DEQ-SM", "DSM", False), ("DEQ-SM", "CP", False), ("DEQ-SM", "SSM", False), ("DEQ-SM", "SSM-VR", False),
          ("DEQ-SSM-VR", "SSM-VR", False)]


def verdict_lines(jobs) -> list[str]:
    """One line per claim of :data:`CLAIMS` and figure (test SM loss and LL, as trained and after the final λ
    refit; saved bytes and time per step against the depths), both rules of :func:`seed_verdict` named; a claim
    whose rows have not run at this protocol says so (undecided)."""
    lines = []
    for group, rows in group_rows(jobs, lambda r: r["group"]).items():
        by = group_rows(rows, lambda r: r["method"])
        if "DEQ-SM" not in by and "DEQ-SSM-VR" not in by:
            continue
        for mine, other, costs in CLAIMS:
            if mine not in by or other not in by:
                missing = " and ".join(m for m in (mine, other) if m not in by)
                lines.append(f"- {group}, {mine} vs {other}: undecided — {missing} not run at this protocol")
                continue
            deq = by[mine]
            for prefix, what in (("", "as trained"), ("final_refit/", "after the final λ refit")):
                sm = seed_verdict(values(deq, f"{prefix}test/sm_loss"), values(by[other], f"{prefix}test/sm_loss"),
                                  lower_is_better=True)
                ll = seed_verdict(values(deq, f"{prefix}test/log_likelihood"),
                                  values(by[other], f"{prefix}test/log_likelihood"), lower_is_better=False)
                if math.isnan(sm[1]) or math.isnan(sm[2]):
                    continue
                lines.append(f"- {group}, \"{mine} beats {other} on test SM loss\" ({what}): {sm[0]}; "
                             f"{sm[1]:.2f} vs {sm[2]:.2f}")
                lines.append(f"- {group}, \"{mine} beats {other} on test LL\" ({what}): {ll[0]}; "
                             f"{ll[1]:.2f} vs {ll[2]:.2f}")
            for key, what in (("profile/saved_bytes_mean", "saved bytes per step"),
                              ("profile/time_per_step_s", "time per step")) if costs else ():
                v = seed_verdict(values(deq, key), values(by[other], key), lower_is_better=True, detail=False)
                if math.isnan(v[1]) or math.isnan(v[2]):
                    continue
                scale = 1e6 if "bytes" in key else 1.0
                unit = " MB" if "bytes" in key else " s"
                lines.append(f"- {group}, \"{mine} needs less {what} than {other}\": {v[0]}; "
                             f"{v[1] / scale:.3g}{unit} vs {v[2] / scale:.3g}{unit} (ratio {v[1] / v[2]:.2f})")
    return lines


def paper_gap_lines(jobs) -> list[str]:
    """Rows further than 2 seed sds from the paper's test SM / LL (the issue's threshold for a controlled run)."""
    lines = []
    for (group, method), rows in group_rows(jobs, lambda r: (r["group"], r["method"])).items():
        paper = DKEF_NICE.get((group, method))
        if paper is None:
            continue
        pm = DKEF_PM.get((group, method), (None, None))
        for key, target, tpm, what in (
                ("test/sm_loss", paper[0], pm[0], "SM"), ("test/log_likelihood", paper[1], pm[1], "LL"),
                ("final_refit/test/sm_loss", paper[0], pm[0], "SM after the final refit"),
                ("final_refit/test/log_likelihood", paper[1], pm[1], "LL after the final refit")):
            m, s, n = summarise(values(rows, key))
            if n < 2:
                continue
            far = abs(m - target) > 2 * s
            ptxt = f"{target:g}" + (f" ± {tpm:g}" if tpm is not None else "")
            lines.append(f"- {group} {method} {what}: {m:.2f} ± {s:.2f} vs paper {ptxt} — "
                         + (f"{abs(m - target) / s:.1f} seed sds away" if s > 0 else "sd 0")
                         + (" (far: more than 2 sds)" if far else " (within 2 sds)")
                         + (f"; {abs(m - target) / tpm:.1f} of the paper's ±" if tpm else ""))
    return lines


def render(res: dict) -> str:
    meta, jobs = res["meta"], res["jobs"]
    if meta.get("commands"):  # several sessions' grids added to one result (--add)
        lines = ["Commands, in the order they built this result (`--add` keeps the saved jobs):", "",
                 *(f"- `{c}`" for c in meta["commands"]), ""]
    else:
        lines = [f"Command: `{meta['command']}`", ""]
    lines += [f"Machine: {meta['machine']}", ""]
    lines += ["Grids (each job's own `src.train` command and its `src.evaluate` re-evaluation are in the JSON):", ""]
    lines += [f"- `{c}`" for c in meta["grid_commands"]] + [""]
    lines += note_lines(meta)
    lines += [
        ("Test SM loss: the exact SM loss (eq. 1) per test point, averaged (lower is better); test LL: log p̃ − log Ẑ "
        "with 10⁶ importance samples. *As trained*: α refitted on 1000 training points at the trained λ (what "
        "`src.train` reports); *final refit*: the reference code's final stage before its test (`model.final_refit`: "
        "α on every training point, then log10 λ alone trained 1000 Adam steps at 1e-3 on the validation SM loss). "
        "mean ± sd over seeds; saved MB/step and s/step are the training step's (CPU, shared cores)."), ""]
    has_fisher = any(r["metrics"].get("test/fisher_divergence") is not None for r in jobs)
    head = ["data set", "method", "seeds", "steps", "test SM (mean ± sd)", "test LL (mean ± sd)",
            "test SM, final refit", "test LL, final refit"]
    head += ["Fisher div."] if has_fisher else []
    head += ["saved MB/step", "s/step", "paper SM / LL" + (" / Fisher" if has_fisher else "")]
    body = []
    groups = group_rows(jobs, lambda r: r["group"])
    for group, rows in groups.items():
        by = group_rows(rows, lambda r: r["method"])
        for method in ordered(by):
            rs = by[method]
            paper = DKEF_NICE.get((group, base_method(method)))
            ptxt = " / ".join(f"{v:g}" for v in (paper[:3] if has_fisher else paper[:2]) if v is not None) \
                if paper else "—"
            row = [group, method, str(len(rs)), cell(rs, "global_step", 0), cell(rs, "test/sm_loss"),
                   cell(rs, "test/log_likelihood"), cell(rs, "final_refit/test/sm_loss"),
                   cell(rs, "final_refit/test/log_likelihood")]
            row += [cell(rs, "test/fisher_divergence")] if has_fisher else []
            row += [cell(rs, "profile/saved_bytes_mean", 1), cell(rs, "profile/time_per_step_s", 3), ptxt]
            body.append(row)
    lines += ["## Results", "", *markdown_table(head, body), ""]
    tail_rows = []
    for group, rows in groups.items():
        by = group_rows(rows, lambda r: r["method"])
        for method in ordered(by):
            rs = by[method]
            if not any("test_sm_per_point" in r for r in rs):
                continue
            for which, what in (("as_trained", "as trained"), ("final_refit", "final refit")):
                tail_rows.append([group, method, what, tail_cell(rs, which, "mean"), tail_cell(rs, which, "median"),
                                  tail_cell(rs, which, "trimmed_mean"), tail_cell(rs, which, "max")])
    if tail_rows:
        lines += ["## The test SM loss per test point", "",
                  (f"Per-point exact SM losses of each seed's tested checkpoint (mean ± sd over seeds of each "
                  f"statistic); *trimmed*: the mean without the largest {TRIM_SHARE:.0%} of the points."), "",
                  *markdown_table(["data set", "method", "α", "mean", "median", "trimmed mean", "largest point"],
                                  tail_rows), ""]
    lines += ["## Verdicts on the paper's claims (§4.2)", "",
              ("Each verdict names its rule. At 2 s.e.: agree / disagree when the two means differ by more than "
               "twice the standard error of their difference over seeds (sample sds, no t-correction: lenient at "
               "3 seeds); by Welch's t-test: when its two-sided p < 0.05, i.e. the difference exceeds t₀.₉₇₅(df) "
               "s.e. at the Welch–Satterthwaite df (2.8-4.3 s.e. at 3 seeds a side); undecided otherwise."), "",
              *verdict_lines(jobs), ""]
    gaps = paper_gap_lines(jobs)
    if gaps:
        lines += ["## Distance to the paper's figures", "", *gaps, ""]
    lines += [f"Learning curves: `{STEM}_curves.png` (validation SM loss vs steps, mean over seeds, band min–max).",
              ""]
    return "\n".join(lines)


def plot(jobs, out: Path) -> Path:
    groups = group_rows([j for j in jobs if j.get("val_curve")], lambda r: r["group"])
    path = out / f"{STEM}_curves.png"
    with figure(path, 1, max(1, len(groups)), figsize=(5.5 * max(1, len(groups)), 3.8)) as (_, axes):
        for i, (group, rows) in enumerate(groups.items()):
            ax = axes[0][i]
            by = group_rows(rows, lambda r: r["method"])
            for k, method in enumerate(ordered(by)):
                curves = [dict(r["val_curve"]) for r in by[method]]
                steps = sorted(set.intersection(*(set(c) for c in curves)))
                if not steps:
                    continue
                mean = [sum(c[s] for c in curves) / len(curves) for s in steps]
                ax.plot(steps, mean, color=f"C{k}", label=f"{method} ({len(curves)} seeds)", lw=1.2)
                ax.fill_between(steps, [min(c[s] for c in curves) for s in steps],
                                [max(c[s] for c in curves) for s in steps], color=f"C{k}", alpha=0.2)
            lo = min(min(v for _, v in r["val_curve"]) for r in rows)
            ax.set_ylim(lo - 5, max(10.0, lo + 60))
            ax.set_xlabel("training step")
            ax.set_ylabel("validation SM loss (exact)")
            ax.set_title(f"{group}: validation SM loss (the reference split's validation set is other rows)",
                         fontsize=8)
            ax.legend(fontsize=7)
    return path


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--grid", action="append", default=[],
                    help="a run_grid.py dkef result JSON (repeatable); LABEL=PATH marks a controlled grid's methods")
    ap.add_argument("--root", default=str(DATA_ROOT), help="data.root for the per-point analysis")
    ap.add_argument("--no-tails", action="store_true", help="skip the per-point analysis of the test SM loss")
    ap.add_argument("--note", type=Path, default=None, help="a markdown finding printed above the table")
    ap.add_argument("--add", action="store_true",
                    help="keep the saved result's jobs (in --out) and add or replace those of --grid")
    result_options(ap)
    args = ap.parse_args(argv)
    if rendered(args, STEM, render):
        res = json.loads((args.out / f"{STEM}.json").read_text())
        print("wrote", args.out / f"{STEM}.md", plot(res["jobs"], args.out))
        return
    if not args.grid:
        ap.error("--grid PATH is needed (a run_grid.py dkef result); --render rebuilds from the saved JSON")
    grids = []
    for spec in args.grid:
        label, _, path = spec.rpartition("=") if "=" in spec else ("", "", spec)
        grids.append((label, Path(path)))
    for _, path in grids:
        if not path.exists():
            raise SystemExit(f"no grid result at {path}: run benchmarks/tools/run_grid.py dkef … --name <stem> first")
    jobs = collect(grids, args.root, tails=not args.no_tails)
    def portable_text(text: str) -> str:  # no path of this machine in a committed result
        return text.replace(args.root, "<data dir>").replace(f"{ROOT}/", "")

    meta = {"command": portable_text(script_command("benchmarks.tools.dkef_paper_protocol", argv, data_root=args.root)), "machine": machine_facts(),
            "grid_commands": list(dict.fromkeys(portable_text(j.pop("grid_command")) for j in jobs))}
    for j in jobs:
        for key in ["command", *(k for k in j if k.endswith("_eval_command"))]:
            j[key] = portable_text(j[key] or "")
    if args.add:
        jobs, meta = added_to_saved(json.loads((args.out / f"{STEM}.json").read_text()), jobs, meta)
    if args.note:
        meta["note"] = args.note.read_text()
    write_results(args.out, STEM, {"meta": meta, "jobs": jobs}, render, indent=1)
    print((args.out / f"{STEM}.md").read_text())
    print("wrote", args.out / f"{STEM}.json", args.out / f"{STEM}.md", plot(jobs, args.out))


if __name__ == "__main__":
    main()
