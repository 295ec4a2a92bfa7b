"""Sweeps as the paper's tables read: every job's ``metrics.json`` grouped by the overrides that vary between the
jobs (read from each job's ``.hydra/overrides.yaml``), seeds excluded, mean ± std over seeds per group; the
markdown table, the JSON and two plots (memory against depth, test SM loss against training wall time). The
command line is :mod:`src.report`.
"""

from __future__ import annotations

from collections import defaultdict
from pathlib import Path
from statistics import mean

from src.config.family_data import family_of
from src.deq.config import run_depth
from src.reports.tables import (
    figure,
    format_summary,
    group_rows,
    load_run,
    markdown_table,
    parse_overrides,
    summarise,
    summarise_metrics,
)

__all__ = ["COLUMNS", "block_share", "build_report", "group_jobs", "load_jobs", "plot", "summarise", "summarise_jobs", "to_markdown"]

# (metrics.json key, column title, decimals shown)
COLUMNS = [
    ("test/sm_loss", "test SM loss", 2),
    ("test/log_likelihood", "test LL", 2),
    ("test/fisher_divergence", "Fisher div.", 2),
    ("n_params", "params", 0),
    ("profile/saved_bytes_mean", "saved MB/step", 2),
    ("profile/peak_cuda_bytes_max", "peak CUDA MB", 2),
    ("profile/time_per_step_s", "s/step", 4),
    ("profile/deq_iterations_mean", "DEQ iters", 2),
    # beside the iterations, how much the recurrence does: ‖z* − φ(0)‖/‖z*‖ at the test (src.deq.diagnostics;
    # below 0.10 the block is near-inert, in effect an explicit network); the mean over blocks (block_share)
    ("test/deq_recurrence_share", "DEQ recurrence share", 3),
]
SHARE = "test/deq_recurrence_share"
SEED_KEYS = {"seed"}
IGNORED_KEYS = {"hydra.job.num", "paths.output_dir"}


def load_jobs(dirs: list[Path]) -> list[dict]:
    """Every run under ``dirs``: ``{"dir", "metrics", "overrides" ({key: value})}``."""
    jobs = []
    for d in dirs:
        if not d.exists():
            raise FileNotFoundError(f"sweep directory not found: {d}")
        for path in sorted(d.rglob("metrics.json")):
            run = load_run(path.parent)
            jobs.append({**run, "overrides": parse_overrides(run["overrides"])})
    if not jobs:
        raise FileNotFoundError(f"no metrics.json under {', '.join(map(str, dirs))}: nothing to report")
    return jobs


def group_jobs(jobs: list[dict]) -> tuple[list[str], dict[tuple, list[dict]]]:
    """(the override keys that vary, seeds excluded; ``{their values: jobs}`` sorted by value)."""
    keys = sorted({k for j in jobs for k in j["overrides"]} - SEED_KEYS - IGNORED_KEYS)
    groups = group_rows(jobs, lambda j: tuple(j["overrides"].get(k, "") for k in keys))
    # drop keys that never vary (and are set everywhere): they add nothing to a row
    varying = [i for i, k in enumerate(keys) if len({g[i] for g in groups}) > 1]
    keys = [keys[i] for i in varying]
    regrouped: dict[tuple, list[dict]] = defaultdict(list)
    for g, members in groups.items():
        regrouped[tuple(g[i] for i in varying)].extend(members)
    return keys, dict(sorted(regrouped.items()))


def block_share(metrics: dict) -> dict:
    """``metrics`` with ``test/deq_recurrence_share`` for the table: a model with one DEQ block logs it as is; one
    with several (DKEF's three feature networks, NICE's couplings) logs it per block (``…/<block>``), and the
    table shows their mean."""
    if SHARE in metrics:
        return metrics
    per_block = [v for k, v in metrics.items() if k.startswith(SHARE + "/") and isinstance(v, (int, float))]
    return {**metrics, SHARE: mean(per_block)} if per_block else metrics


def summarise_jobs(jobs: list[dict], dirs: list[Path] | None = None) -> dict:
    """The report (what ``report.json`` holds) of already loaded jobs: a pure function."""
    keys, groups = group_jobs(jobs)
    rows = [{"group": dict(zip(keys, values)), "n_seeds": len(members),
             "metrics": summarise_metrics([block_share(j["metrics"]) for j in members], [k for k, _, _ in COLUMNS])}
            for values, members in groups.items()]
    return {"keys": keys, "rows": rows, "n_jobs": len(jobs), "dirs": [str(d) for d in dirs or []]}


def build_report(dirs: list[Path]) -> dict:
    return summarise_jobs(load_jobs(dirs), dirs)


def to_markdown(report: dict) -> str:
    """``report.md`` from the report dict (``report.json``): columns no row has are left out."""
    cols = [c for c in COLUMNS if any(r["metrics"][c[0]]["n"] for r in report["rows"])]
    head = [*report["keys"], "seeds", *(t for _, t, _ in cols)]
    body = []
    for r in report["rows"]:
        cells = [r["group"][k] for k in report["keys"]] + [str(r["n_seeds"])]
        cells += [format_summary(k, r["metrics"][k]["mean"], r["metrics"][k]["std"], r["metrics"][k]["n"], d)
                  for k, _, d in cols]
        body.append(cells)
    return "\n".join(markdown_table(head, body)) + "\n"


def plot(jobs: list[dict], out: Path) -> list[Path]:
    """``memory_vs_depth.png`` and ``test_loss_vs_wall_time.png`` of loaded jobs, into ``out``."""
    # memory vs depth: explicit runs as a line over depth, DEQ runs as horizontal markers
    explicit, implicit = defaultdict(list), defaultdict(list)
    for j in jobs:
        m, cfg = j["metrics"], j["metrics"].get("config", {})
        saved = m.get("profile/saved_bytes_mean")
        if saved is None:
            continue
        depth, ran_deq = run_depth(cfg, family_of(cfg) or "dkef")  # the run's own default
        (implicit if ran_deq else explicit)[depth].append(saved / 1e6)
    memory = out / "memory_vs_depth.png"
    with figure(memory) as (_, axes):
        ax = axes[0][0]
        if explicit:
            ds = sorted(explicit)
            ax.plot(ds, [mean(explicit[d]) for d in ds], "o-", label="explicit (depth = layers)")
        for d, vals in sorted(implicit.items()):
            ax.axhline(mean(vals), ls="--", color="C1", label=f"DEQ (layers in f = {d})")
        ax.set_xlabel("depth")
        ax.set_ylabel("saved for backward per step (MB)")
        ax.legend(fontsize=8)
    # test loss vs wall time
    loss_time = out / "test_loss_vs_wall_time.png"
    with figure(loss_time) as (_, axes):
        ax = axes[0][0]
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
    return [memory, loss_time]
