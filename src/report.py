"""Turn sweeps into a table and figures, the way the paper's tables read.

    python -m src.report outputs/train/multiruns/<time> [more sweep dirs ...] [--out DIR]

Every ``metrics.json`` under the given directories is one job. Jobs are grouped by the overrides that vary
between them (read from each job's ``.hydra/overrides.yaml``), seeds excluded; each group gets mean ± std
over its seeds. Writes ``report.md`` (markdown table), ``report.json`` and two PNG plots — memory (bytes
saved for backward per step) against depth, and test SM loss against training wall time — into ``--out``
(default: the first directory).
"""

from __future__ import annotations

import argparse
import json
import math
from collections import defaultdict
from pathlib import Path
from statistics import mean, stdev

import yaml

COLUMNS = [
    ("test/sm_loss", "test SM loss"),
    ("test/log_likelihood", "test LL"),
    ("test/fisher_divergence", "Fisher div."),
    ("n_params", "params"),
    ("profile/saved_bytes_mean", "saved MB/step"),
    ("profile/peak_cuda_bytes_max", "peak CUDA MB"),
    ("profile/time_per_step_s", "s/step"),
    ("profile/deq_iterations_mean", "DEQ iters"),
]
SEED_KEYS = {"seed"}
IGNORED_KEYS = {"hydra.job.num", "paths.output_dir"}


def load_jobs(dirs: list[Path]) -> list[dict]:
    jobs = []
    for d in dirs:
        if not d.exists():
            raise FileNotFoundError(f"sweep directory not found: {d}")
        for path in sorted(d.rglob("metrics.json")):
            try:
                metrics = json.loads(path.read_text())
            except json.JSONDecodeError as exc:
                raise ValueError(f"{path} is not valid JSON ({exc}); re-run that job or delete the file") from exc
            ov_file = path.parent / ".hydra" / "overrides.yaml"
            overrides = yaml.safe_load(ov_file.read_text()) if ov_file.exists() else []
            parsed = {}
            for item in overrides or []:
                key, _, value = str(item).partition("=")
                parsed[key.lstrip("+~")] = value
            jobs.append({"dir": str(path.parent), "metrics": metrics, "overrides": parsed})
    if not jobs:
        raise FileNotFoundError(f"no metrics.json under {', '.join(map(str, dirs))}: nothing to report")
    return jobs


def group_jobs(jobs: list[dict]) -> tuple[list[str], dict[tuple, list[dict]]]:
    keys = sorted({k for j in jobs for k in j["overrides"]} - SEED_KEYS - IGNORED_KEYS)
    groups: dict[tuple, list[dict]] = defaultdict(list)
    for j in jobs:
        groups[tuple(j["overrides"].get(k, "") for k in keys)].append(j)
    # drop keys that never vary (and are set everywhere): they add nothing to a row
    varying = [i for i, k in enumerate(keys) if len({g[i] for g in groups}) > 1]
    keys = [keys[i] for i in varying]
    regrouped: dict[tuple, list[dict]] = defaultdict(list)
    for g, members in groups.items():
        regrouped[tuple(g[i] for i in varying)].extend(members)
    return keys, dict(sorted(regrouped.items()))


def summarise(values: list[float]) -> tuple[float, float, int]:
    vals = [v for v in values if v is not None and math.isfinite(v)]
    if not vals:
        return float("nan"), float("nan"), 0
    return mean(vals), (stdev(vals) if len(vals) > 1 else 0.0), len(vals)


def _fmt(key: str, m: float, s: float, n: int) -> str:
    if n == 0:
        return "—"
    scale = 1e6 if "bytes" in key else 1.0
    m, s = m / scale, s / scale
    digits = 0 if key == "n_params" else (4 if key.endswith("time_per_step_s") else 2)
    text = f"{m:.{digits}f}"
    return text + (f" ± {s:.{digits}f}" if n > 1 else "")


def build_report(dirs: list[Path]) -> dict:
    jobs = load_jobs(dirs)
    keys, groups = group_jobs(jobs)
    rows = []
    for values, members in groups.items():
        row = {"group": dict(zip(keys, values)), "n_seeds": len(members), "metrics": {}}
        for key, _ in COLUMNS:
            m, s, n = summarise([j["metrics"].get(key) for j in members])
            row["metrics"][key] = {"mean": m, "std": s, "n": n}
        rows.append(row)
    return {"keys": keys, "rows": rows, "n_jobs": len(jobs), "dirs": [str(d) for d in dirs]}


def to_markdown(report: dict) -> str:
    cols = [(k, t) for k, t in COLUMNS if any(r["metrics"][k]["n"] for r in report["rows"])]
    head = [*report["keys"], "seeds", *(t for _, t in cols)]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in report["rows"]:
        cells = [r["group"][k] for k in report["keys"]] + [str(r["n_seeds"])]
        cells += [_fmt(k, m=r["metrics"][k]["mean"], s=r["metrics"][k]["std"], n=r["metrics"][k]["n"])
                  for k, _ in cols]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def plot(report: dict, jobs_dirs: list[Path], out: Path) -> list[Path]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    jobs = load_jobs(jobs_dirs)
    written = []
    # memory vs depth: explicit runs as a line over depth, DEQ runs as horizontal markers
    fig, ax = plt.subplots(figsize=(5, 3.5))
    explicit, implicit = defaultdict(list), defaultdict(list)
    for j in jobs:
        m, cfg = j["metrics"], j["metrics"].get("config", {})
        saved = m.get("profile/saved_bytes_mean")
        if saved is None:
            continue
        enabled = bool(cfg.get("deq", {}).get("enabled", False))
        depth = cfg.get("depth") or (1 if enabled else 3)
        (implicit if enabled else explicit)[depth].append(saved / 1e6)
    if explicit:
        ds = sorted(explicit)
        ax.plot(ds, [mean(explicit[d]) for d in ds], "o-", label="explicit (depth = layers)")
    for d, vals in sorted(implicit.items()):
        ax.axhline(mean(vals), ls="--", color="C1", label=f"DEQ (layers in f = {d})")
    ax.set_xlabel("depth")
    ax.set_ylabel("saved for backward per step (MB)")
    ax.legend(fontsize=8)
    fig.tight_layout()
    p = out / "memory_vs_depth.png"
    fig.savefig(p, dpi=120)
    plt.close(fig)
    written.append(p)
    # test loss vs wall time
    fig, ax = plt.subplots(figsize=(5, 3.5))
    for j in jobs:
        m = j["metrics"]
        t, steps, loss = m.get("profile/time_per_step_s"), m.get("profile/steps"), m.get("test/sm_loss")
        if None in (t, steps, loss):
            continue
        label = ", ".join(f"{k}={v}" for k, v in j["overrides"].items() if k not in SEED_KEYS) or "run"
        ax.scatter([t * steps], [loss], label=label, s=18)
    ax.set_xlabel("training wall time (s)")
    ax.set_ylabel("test exact SM loss")
    handles, labels = ax.get_legend_handles_labels()
    uniq = dict(zip(labels, handles))
    if uniq:
        ax.legend(uniq.values(), uniq.keys(), fontsize=6)
    fig.tight_layout()
    p = out / "test_loss_vs_wall_time.png"
    fig.savefig(p, dpi=120)
    plt.close(fig)
    written.append(p)
    return written


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("dirs", nargs="+", type=Path, help="sweep (multirun) directories")
    parser.add_argument("--out", type=Path, default=None, help="where to write report.md/json and plots")
    args = parser.parse_args(argv)
    out = args.out or args.dirs[0]
    out.mkdir(parents=True, exist_ok=True)
    report = build_report(args.dirs)
    md = to_markdown(report)
    (out / "report.md").write_text(md)
    (out / "report.json").write_text(json.dumps(report, indent=2))
    plots = plot(report, args.dirs, out)
    print(md)
    print(f"wrote {out / 'report.md'}, {out / 'report.json'}, " + ", ".join(str(p) for p in plots))
    return report


if __name__ == "__main__":
    main()
