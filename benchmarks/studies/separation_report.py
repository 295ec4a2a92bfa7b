"""DEQ vs feed-forward: the studies of *Separation and Bias of Deep Equilibrium Models on Expressivity and
Learning Dynamics* (NeurIPS 2024) in one report.

    python -m benchmarks.studies.separation_report [--only regions,implicit_bias,gotu,steep,signal] [--seeds 0,1,2] [--rerun]
    python -m benchmarks.studies.separation_report --render     # rebuild the markdown from the JSON

Part 1 computes the exact checks (pure functions of ``src/separation``: no training; Theorem 3's on one random
problem per seed). Part 2 runs every training study as the ``python -m src.train experiment=<name> …`` command a
user types, once per seed (seed 0: the command as documented; seed s ≥ 1 appends ``seed=s data.seed=s``), one
process per job, one torch thread each, run directories under ``--runs``. It resumes: a job whose directory
already holds ``metrics.json`` is reused (with the wall time it took, kept beside it) unless ``--rerun``, so an
interrupted report is finished by running the same command again. Tables give mean ± sd over the seeds
(:func:`merge_seeds`). ``--seeds 0`` is the quick one-seed report (≈ 37 jobs, ≈ 17 min on one idle core).
Writes ``separation.json`` (every figure measured, the commands), ``separation.md`` (each
claim of the paper beside what was measured: agree / disagree / not testable here) and ``separation_*.png``
into ``--out`` (default ``benchmarks/results``). The report's words (each study's protocol, each claim) are in
``benchmarks/studies/separation_report.md``, a template this script fills in with the numbers and verdicts.
"""

from __future__ import annotations

import argparse
import functools
import itertools
import json
import math
import operator
import os
import platform
import re
import shlex
import shutil
import time
from pathlib import Path
from string import Template

import numpy as np

from benchmarks.lib.jobs import thread_env, train_job
from benchmarks.lib.results import RESULTS, ROOT, made_by, script_command, seed_rules, write_results
from src.reports.tables import group_rows, summarise
from src.separation import implicit_bias as ib
from src.separation import regions as rg
from src.separation import tasks

STUDIES = ("regions", "implicit_bias", "gotu", "steep", "signal")


def _plt():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


# ------------------------------------------------------------------------------------ part 1: exact
def exact_theorem1(ms=range(2, 17)) -> list[dict]:
    rows = []
    for m in ms:
        t0 = time.perf_counter()
        exact = m <= 8
        W, u, c = rg.theorem1_weights(m, exact=exact)
        z = rg.relu_deq_unrolled(W, u, c, m, exact=exact)
        bps = rg.breakpoints(z, np.ones(m))
        dyadic = all(float(b) * 2 ** m == k + 1 for k, b in enumerate(bps))
        odd = 2 * np.random.default_rng(m).integers(0, 2 ** m, 4096) + 1
        x = np.concatenate([[0.0, 1.0], odd / 2 ** (m + 1)])
        its0, z_star = rg.picard_iterations_to_fixed_point(x, m, max_iter=m + 1)
        its1, _ = rg.picard_iterations_to_fixed_point(x, m, z0=z_star, max_iter=1)
        rows.append({"m": m, "regions": len(bps) + 1, "two_to_m": 2 ** m, "breakpoints_dyadic": dyadic,
                     "arithmetic": "exact rationals" if exact else "float64 (dyadic: exact)",
                     "picard_from_zero_max": int(its0.max()), "rebuttal_init_one_step_unchanged":
                     bool(np.array_equal(rg.theorem1_map(z_star, x, m), z_star)),
                     "rebuttal_init_iterations": int(its1.max()), "seconds": time.perf_counter() - t0})
    return rows


def exact_theorem3(seed: int = 0) -> dict:
    X, y, _ = ib.regression_problem(10, 40, 3, seed=seed)
    d = X.shape[1]
    b0 = np.ones(d)
    beta_q, _, feas = ib.q_minimiser(X, y, b0)
    kkt = ib.q_kkt_residual(beta_q, X, y, b0)
    beta_gf, v_gf = ib.gradient_flow_diag_deq(X, y, b0, 200.0)
    gd = {}
    for lr in (1e-2, 5e-3, 2.5e-3):
        out = ib.gd_diag_deq(X, y, b0, lr, round(80 / lr), record_every=round(1 / lr))
        mirror = max(np.abs(b ** -3 - (3 * X.T @ v + b0 ** -3)).max() for _, b, v in out["trajectory"])
        gd[lr] = {"beta": out["beta"], "gap_to_q": float(np.abs(out["beta"] - beta_q).max()),
                  "closed_form_mirror_gap_max": float(mirror), "loss": out["loss"]}
    rich = 2 * gd[2.5e-3]["beta"] - gd[5e-3]["beta"]  # Richardson: the O(lr) term cancels
    dln = {}
    for alpha in (1.0, 0.1, 0.01):
        bh, _, _ = ib.hyperbolic_entropy_minimiser(X, y, alpha)
        lr = 2e-2 if alpha < 1 else 5e-3
        steps = int(400 / lr) if alpha >= 0.1 else int(2000 / lr)
        g = ib.gd_diag_net(X, y, alpha, lr, steps)
        dln[alpha] = {"gap_gd_to_hyperbolic": float(np.abs(g["beta"] - bh).max()), "loss": g["loss"],
                      "participation": ib.density(bh)["participation"],
                      "gap_to_min_l1": float(np.abs(bh - ib.min_l1(X, y)).max())}
    # the minus-sign form of Q is unbounded below on {Xβ = y, β > 0} iff some n ≥ 0 in null(X) has β(0)^-3 · n > 0
    from scipy.optimize import linprog

    lp = linprog(-(b0 ** -3), A_eq=X, b_eq=np.zeros(X.shape[0]), bounds=[(0, 1)] * d, method="highs")
    ray = lp.x if lp.success else None
    return {
        "problem": "N = 10, d = 40, X ~ N(0, 1/d), y = X beta*, beta* = 1 + 2 on 3 coordinates; beta(0) = 1",
        "q_minimiser_feasibility": feas, "q_minimiser_kkt_stationarity": kkt["stationarity"],
        "gradient_flow_gap_to_q_minimiser": float(np.abs(beta_gf - beta_q).max()),
        "gradient_flow_closed_form_gap": float(np.abs(ib.closed_form_beta(X, v_gf, b0) - beta_gf).max()),
        "gradient_flow_kkt_q_plus": ib.q_kkt_residual(beta_gf, X, y, b0, 1.0)["stationarity"],
        "gradient_flow_kkt_q_minus": ib.q_kkt_residual(beta_gf, X, y, b0, -1.0)["stationarity"],
        "q_minus_unbounded_on_feasible_set": bool(ray is not None and -lp.fun > 1e-9),
        "q_minus_along_ray": ([ib.q_objective(beta_gf + s * ray, b0, -1.0) for s in (0.0, 10.0, 100.0, 1000.0)]
                              if ray is not None else None),
        "gd": {f"{lr:g}": {k: v for k, v in r.items() if k != "beta"} for lr, r in gd.items()},
        "gd_richardson_gap_to_q": float(np.abs(rich - beta_q).max()),
        "diag_net": {f"{a:g}": r for a, r in dln.items()},
        "participation": {"q_minimiser (diag. DEQ)": ib.density(beta_q)["participation"],
                          "min l1": ib.density(ib.min_l1(X, y))["participation"],
                          "min l2": ib.density(ib.min_l2(X, y))["participation"]},
    }


def exact_steep(dims=(5, 10, 15, 20), eps: float = 1e-6) -> list[dict]:
    out = []
    for d in dims:
        r = tasks.picard_vs_bisection(1.0, 2.0 ** -d, eps)
        out.append({"d": d, "delta": 2.0 ** -d, "eps": eps, **r, "log2_inv_eps": math.log2(1 / eps)})
    return out


# ------------------------------------------------------------------------------- part 2: training runs
SEEDS = (0, 1, 2)


def seeded(overrides: list[str], seed: int) -> list[str]:
    """A job's overrides for seed ``seed``: seed 0 is the experiment's default command; seed s ≥ 1 appends
    ``seed=s data.seed=s`` (initialisation and batch order, and the task's random draws: training inputs, the
    tones' phases, the regression's X)."""
    return list(overrides) if seed == 0 else [*overrides, f"seed={seed}", f"data.seed={seed}"]


def grid(only, seeds=SEEDS) -> list[dict]:
    """Every training job: one per (study, model, seed). A deterministic job (no random draw at all: the hand-built
    DEQ, GOTU's diagonal models from their fixed start on the whole cube by full-batch GD) runs for the first seed
    only: its other seeds are the same run (measured: bit-identical metrics)."""
    jobs = []

    def add(study, name, overrides, deterministic=False):
        if study in only:
            for s in (seeds[:1] if deterministic else seeds):
                jobs.append({"study": study, "name": name, "seed": int(s), "overrides": seeded(overrides, s)})

    add("regions", "DEQ (hand-built, m = 6)", ["experiment=linear_regions", "deq=true"], deterministic=True)
    # the same 6 neurons as a DEQ, trained: random start, Frobenius-normalised W (a contraction), as the FFNs
    add("regions", "DEQ width 6 (trained)",
        ["experiment=linear_regions", "deq=true", "model.construction=none", "deq.norm=frobenius"])
    for depth in (2, 3, 4, 7):
        add("regions", f"FFN depth {depth}", ["experiment=linear_regions", "deq=false", f"depth={depth}"])
    add("regions", "FFN depth 3, 64 neurons (reference)",
        ["experiment=linear_regions", "deq=false", "depth=3", "model.width=64"])
    add("regions", "DEQ width 64 (trained, reference)",
        ["experiment=linear_regions", "deq=true", "model.construction=none", "deq.norm=frobenius", "model.width=64"])
    add("implicit_bias", "diagonal linear DEQ", ["experiment=implicit_bias", "model.arch=diag_deq"])
    add("implicit_bias", "diagonal linear network", ["experiment=implicit_bias", "model.arch=diag_net"])
    adam = ["model.optimizer._target_=torch.optim.Adam", "model.optimizer.lr=1e-3"]
    for tag, extra in (("dense", []), ("sparse", ["data.task_kwargs.support=3"])):
        add("gotu", f"diagonal linear DEQ ({tag})", ["experiment=gotu", "model.arch=diag_deq", *extra], True)
        add("gotu", f"diagonal linear network ({tag})", ["experiment=gotu", "model.arch=diag_net", *extra], True)
        add("gotu", f"FFN depth 4 ({tag})", ["experiment=gotu", "model.arch=mlp", "depth=4", "model.match=none",
                                              "model.hidden=64", *adam, *extra])
        add("gotu", f"vanilla DEQ ({tag})", ["experiment=gotu", "model.arch=deq", "model.width=64", *adam, *extra])
    add("gotu", "FFN depth 33 (dense)", ["experiment=gotu", "model.arch=mlp", "depth=33", "model.match=none",
                                         "model.hidden=64", *adam])
    for d in (5, 10, 15, 20):
        for deq in ("true", "false"):
            add("steep", f"{'DEQ' if deq == 'true' else 'FFN'} d={d}", ["experiment=steep", f"deq={deq}", f"data.dim={d}"])
    for d in (5, 10, 15, 20):  # a near-critical DEQ: W / (1.1 ||W||_2), the map can amplify ~11x
        add("steep", f"DEQ-spectral d={d}", ["experiment=steep", "deq=true", f"data.dim={d}", "deq.norm=spectral",
                                              "deq.norm_lambda=1.1"])
    for deq in ("true", "false"):  # δ decoupled from d (δ = 2^-10 at d = 10 is the default run above)
        add("steep", f"{'DEQ' if deq == 'true' else 'FFN'} d=10 delta=2^-20",
            ["experiment=steep", f"deq={deq}", "data.dim=10", f"data.task_kwargs.delta={2.0 ** -20!r}"])
    add("signal", "DEQ width 32", ["experiment=high_frequency", "deq=true"])
    add("signal", "DEQ width 32, spectral λ = 1.1",
        ["experiment=high_frequency", "deq=true", "deq.norm=spectral", "deq.norm_lambda=1.1"])
    add("signal", "FFN equal params (depth 3)", ["experiment=high_frequency", "deq=false"])
    add("signal", "FFN equal FLOPs (width 32, depth 13)",
        ["experiment=high_frequency", "deq=false", "model.match=none", "model.hidden=32", "depth=13"])
    return jobs


def slug(job) -> str:
    """The job's run directory name: study and model (and ``_seed<s>`` for s ≥ 1)."""
    name = "".join(ch if ch.isascii() and ch.isalnum() else "_" for ch in f"{job['study']}_{job['name']}").strip("_")
    return name + (f"_seed{job['seed']}" if job.get("seed", 0) else "")


def run_job(job, runs: Path, rerun: bool, collect: bool = False) -> dict:
    """One study job (one torch thread); its record with the metrics, or the error of a failed run. With
    ``collect`` nothing runs: a job without ``metrics.json`` is recorded as ``not_run``."""
    run_dir = runs / slug(job)
    job = {**job, "command": "python -m src.train " + " ".join(shlex.quote(o) for o in job["overrides"]),
           "run_dir": str(run_dir.relative_to(ROOT)) if run_dir.is_relative_to(ROOT) else str(run_dir)}
    if collect and not (run_dir / "metrics.json").exists():
        return {**job, "not_run": True, "wall_s": float("nan")}
    ran = train_job([*job["overrides"], "trainer.enable_progress_bar=false"], run_dir, thread_env(1), rerun)
    timing = run_dir / "job_wall_s.json"  # the wall time of the run that made the directory, for a reuse
    if ran["wall_s"] is not None and ran["ok"]:
        timing.write_text(json.dumps(ran["wall_s"]))
    reused = json.loads(timing.read_text()) if ran["reused"] and timing.exists() else float("nan")
    job["wall_s"] = reused if ran["wall_s"] is None else ran["wall_s"]  # nan: reused, time not known
    if not ran["ok"]:
        job["error"] = ran["error"]
        print(f"FAILED {job['name']}: {job['error'][-400:]}", flush=True)
        return job
    metrics = json.loads((run_dir / "metrics.json").read_text())
    job["metrics"] = {k: v for k, v in metrics.items() if isinstance(v, (int, float)) and not isinstance(v, bool)}
    print(f"done {job['name']} ({job['wall_s']:.0f} s)", flush=True)
    return job


# ------------------------------------------------------------------------------------------ report
def merge_seeds(jobs) -> list[dict]:
    """One record per (study, model), in first-seen order, from the jobs of its seeds: ``metrics`` (the mean of
    every metric over the seeds that ran), ``sd`` (their sample standard deviation; 0 for one seed), ``by_seed``
    (``{seed: that seed's metrics}``), ``seeds`` (those that ran), ``failed_seeds``, ``command`` and ``run_dir``
    (the first seed's: seed 0 is the default command), ``wall_s`` (one per job), ``missing_seeds`` (not run yet:
    a report gathered with ``--collect``). A record none of whose seeds
    ran has no ``metrics``. Jobs without a ``seed`` (a JSON written before seeds) count as seed 0."""
    out = []
    for (study, name), js in group_rows(jobs, lambda j: (j["study"], j["name"])).items():
        ok = [j for j in js if "metrics" in j]
        rec = {"study": study, "name": name, "command": js[0]["command"], "seeds": [j.get("seed", 0) for j in ok],
               "failed_seeds": [j.get("seed", 0) for j in js if "metrics" not in j and not j.get("not_run")],
               "missing_seeds": [j.get("seed", 0) for j in js if j.get("not_run")],
               "run_dir": (ok or js)[0]["run_dir"], "wall_s": [j.get("wall_s", float("nan")) for j in js]}
        if ok:
            keys = list(dict.fromkeys(k for j in ok for k in j["metrics"]))
            stats = {k: summarise(j["metrics"].get(k) for j in ok) for k in keys}
            rec.update(metrics={k: s[0] for k, s in stats.items()}, sd={k: s[1] for k, s in stats.items()},
                       by_seed={j.get("seed", 0): j["metrics"] for j in ok})
        out.append(rec)
    return out


def _m(recs, name, key, default=float("nan")):
    for j in recs:
        if j["name"] == name and "metrics" in j:
            return j["metrics"].get(key, default)
    return default


def _fmt(v, digits=3):
    if v is None or (isinstance(v, float) and math.isnan(v)):
        return "—"
    if isinstance(v, float) and (abs(v) >= 1e4 or (0 < abs(v) < 1e-3)):
        return f"{v:.2e}"
    return f"{v:.{digits}g}" if isinstance(v, float) else str(v)


def _pm(rec, key) -> str:
    """``"mean ± sd"`` of a metric over a record's seeds (the value alone for one seed, ``—`` for none)."""
    if rec is None or "metrics" not in rec or key not in rec["metrics"]:
        return "—"
    n = sum(1 for m in rec["by_seed"].values() if m.get(key) is not None and math.isfinite(m[key]))
    mean_ = rec["metrics"][key]
    return _fmt(mean_) if n <= 1 else f"{_fmt(mean_)} ± {_fmt(rec['sd'][key], 2)}"


def _each(values) -> str:
    """Per-seed values joined with `` / `` (the exact checks, one problem per seed)."""
    return " / ".join(_fmt(v) for v in values)


def _per_seed(a, b, key_a, key_b=None, better=lambda x, y: x < y) -> tuple[int, int]:
    """``(k, n)``: in k of the n seeds both records ran, ``better(a's key_a, b's key_b)``; keys may be callables
    of a seed's metrics."""
    get = lambda m, k: k(m) if callable(k) else m[k]
    common = sorted(set(a.get("by_seed", {})) & set(b.get("by_seed", {})))
    k = sum(better(get(a["by_seed"][s], key_a), get(b["by_seed"][s], key_b or key_a)) for s in common)
    return k, len(common)


def _errorbar(ax, xs, recs, key, fmt="o-", **kw):
    ax.errorbar(xs, [r["metrics"][key] for r in recs], yerr=[r["sd"][key] for r in recs], fmt=fmt, capsize=3, **kw)


def figures(jobs, exact, out: Path) -> list[str]:
    """The report's figures from the merged records (means, error bars = sd over seeds; heatmaps and copied
    per-run figures: seed 0's run)."""
    plt = _plt()
    made = []
    by = {j["name"]: j for j in merge_seeds(jobs) if "metrics" in j}
    # Theorem 1: regions vs width (construction) and trained models' regions/L∞ vs depth
    fig, (a1, a2) = plt.subplots(1, 2, figsize=(10, 3.2))
    ms = [r["m"] for r in exact["theorem1"]]
    a1.semilogy(ms, [r["regions"] for r in exact["theorem1"]], "o", label="ReLU DEQ construction (counted)")
    a1.semilogy(ms, [2 ** m for m in ms], "k-", lw=0.8, label="2^m")
    a1.semilogy(ms, [m + 1 for m in ms], "--", label="1-hidden-layer FFN bound m + 1")
    a1.set_xlabel("width m (neurons)"), a1.set_ylabel("linear regions on [0, 1]"), a1.legend(fontsize=7)
    depths = [d for d in (2, 3, 4, 7) if f"FFN depth {d}" in by]
    if depths:
        recs = [by[f"FFN depth {d}"] for d in depths]
        _errorbar(a2, depths, recs, "test/regions", label="FFN regions")
        deq = by.get("DEQ width 6 (trained)")
        if deq and "test/regions" in deq["metrics"]:
            a2.errorbar([1], [deq["metrics"]["test/regions"]], yerr=[deq["sd"]["test/regions"]], fmt="D", capsize=3,
                        color="C2", label="trained DEQ, width 6 (at x = 1)")
        a2.axhline(64, color="k", lw=0.8, label="target: 2^6 = 64")
        a2b = a2.twinx()
        _errorbar(a2b, depths, recs, "test/linf", fmt="s--", color="C3", label="FFN L∞ error")
        a2b.set_ylabel("L∞ error", color="C3")
        a2.set_xlabel("FFN depth (6 neurons in all)"), a2.set_ylabel("regions (mean ± sd over seeds)")
        a2.legend(fontsize=7, loc="center left")
    fig.tight_layout()
    fig.savefig(out / "separation_regions.png", dpi=110)
    plt.close(fig)
    made.append("separation_regions.png")
    # Theorem 2: L∞ and ‖θ‖∞ vs d
    ds = [d for d in (5, 10, 15, 20) if f"DEQ d={d}" in by and f"FFN d={d}" in by]
    if ds:
        fig, (a1, a2) = plt.subplots(1, 2, figsize=(10, 3.2))
        for kind in ("DEQ", "FFN", "DEQ-spectral"):
            if not all(f"{kind} d={d}" in by for d in ds):
                continue
            recs = [by[f"{kind} d={d}"] for d in ds]
            _errorbar(a1, ds, recs, "test/linf", label=kind)
            _errorbar(a2, ds, recs, "test/weight_inf_norm", label=kind)
        a1.set_xlabel("d (δ = 2^-d)"), a1.set_ylabel("test L∞ error"), a1.legend()
        a2.set_xlabel("d (δ = 2^-d)"), a2.set_ylabel("‖θ‖∞ (DEQ: normalised W)"), a2.legend()
        fig.tight_layout()
        fig.savefig(out / "separation_steep.png", dpi=110)
        plt.close(fig)
        made.append("separation_steep.png")
    # Theorem 3: the DEQ run's figure (seed 0)
    j = by.get("diagonal linear DEQ")
    if j:
        shutil.copy(ROOT / j["run_dir"] / "implicit_bias.png", out / "separation_implicit_bias.png")
        made.append("separation_implicit_bias.png")
    # GOTU heatmaps (seed 0)
    names = [n for n in ("FFN depth 33 (dense)", "FFN depth 4 (dense)", "diagonal linear DEQ (dense)",
                         "vanilla DEQ (dense)", "diagonal linear network (dense)") if n in by]
    if names:
        fig, axes = plt.subplots(1, len(names), figsize=(3.3 * len(names), 3))
        for ax, n in zip(np.atleast_1d(axes), names):
            F = np.abs(np.load(ROOT / by[n]["run_dir"] / "features.npz")["features"])
            ax.imshow((F / max(F.max(), 1e-300)).T, aspect="auto", cmap="viridis", vmin=0, vmax=1)
            ax.set_title(f"{n.replace(' (dense)', '')}\nparticipation "
                         f"{by[n]['by_seed'][by[n]['seeds'][0]]['test/feature_participation']:.2f}", fontsize=8)
            ax.set_xlabel("sample"), ax.set_ylabel("unit")
        fig.tight_layout()
        fig.savefig(out / "separation_gotu_features.png", dpi=110)
        plt.close(fig)
        made.append("separation_gotu_features.png")
    # high frequency: per-tone error
    sig = [j for j in by.values() if j["study"] == "signal"]
    if sig:
        keys = _tone_keys(sig[0])
        fig, ax = plt.subplots(figsize=(7, 3))
        w = 0.8 / len(sig)
        for i, j in enumerate(sig):
            ax.bar(np.arange(len(keys)) + i * w, [j["metrics"][k] for k in keys], w, label=j["name"],
                   yerr=[j["sd"][k] for k in keys], capsize=2)
        ax.set_xticks(np.arange(len(keys)) + 0.4 - w / 2, [k.rsplit("_", 1)[1] + " cycles" for k in keys])
        ax.set_ylabel("relative error of the tone\n(mean ± sd over seeds)"), ax.legend(fontsize=7)
        fig.tight_layout()
        fig.savefig(out / "separation_signal.png", dpi=110)
        plt.close(fig)
        made.append("separation_signal.png")
    for name, target in (("DEQ (hand-built, m = 6)", "separation_regions_deq_fit.png"),
                         ("DEQ width 6 (trained)", "separation_regions_trained_deq_fit.png")):
        if name in by:  # the per-run figures, for the record
            shutil.copy(ROOT / by[name]["run_dir"] / "regions.png", out / target)
            made.append(target)
    return made


def _tone_keys(rec) -> list[str]:
    return sorted((k for k in rec["metrics"] if k.startswith("test/band_err_") and k[-1].isdigit()),
                  key=lambda k: float(k.rsplit("_", 1)[1]))


TEMPLATE = Path(__file__).with_suffix(".md")  # the report's words: sections and table rows with $fields
_MARKER = re.compile(r"^<!-- (section|row) (\w+) -->\n", re.MULTILINE)
AGREE, DISAGREE = "**agree**", "**disagree**"


def template(path: Path = TEMPLATE) -> tuple[dict[str, Template], dict[str, Template]]:
    """``(sections, rows)`` of the report's template: a section is the text up to the next marker, a row one
    line (a table row, or a phrase repeated per item)."""
    parts = _MARKER.split(path.read_text())
    sections, rows = {}, {}
    for kind, name, body in zip(parts[1::3], parts[2::3], parts[3::3]):
        if kind == "section":
            sections[name] = Template(body)
        else:
            rows[name] = Template(body.rstrip("\n"))
    return sections, rows


def _verdict(ok: bool) -> str:
    return AGREE if ok else DISAGREE


def _seeds_text(recs) -> str:
    seeds = sorted({s for r in recs for s in r.get("seeds", [])})
    return f"{len(seeds)} seed{'s' if len(seeds) != 1 else ''} ({', '.join(map(str, seeds))})" if seeds else "no runs"


def markdown(jobs, exact, made, meta) -> str:
    """The report: :data:`TEMPLATE` filled in with what was measured (a pure function of the saved JSON).
    Training tables show mean ± sd over the seeds (:func:`merge_seeds`); verdicts compare the means and say in
    how many seeds the comparison holds."""
    section, row = template()
    recs = merge_seeds(jobs)

    def rows(name, items) -> str:
        return "\n".join(row[name].substitute(item) for item in items)

    def ran(study) -> list[dict]:
        return [j for j in recs if j["study"] == study and "metrics" in j]

    by = {j["name"]: j for j in recs if "metrics" in j}
    t3 = exact["theorem3"] if isinstance(exact["theorem3"], list) else [exact["theorem3"]]
    problem_seeds = meta.get("problem_seeds", list(range(len(t3))))
    command = made_by(meta.get("command"), "python benchmarks/separation_report.py", meta.get("command"))
    out = [section["head"].substitute(command=command, machine=meta["machine"], date=meta["date"], seeds=_seeds_text(recs),
                                      problem_count=len(t3), problem_seeds=", ".join(map(str, problem_seeds)))]
    failed = [f"{j['name']} (seed {s})" for j in recs for s in j["failed_seeds"]]
    if failed:
        out.append(section["failed"].substitute(failed=", ".join(failed)))
    missing = [f"{j['name']} (seed {s})" for j in recs for s in j.get("missing_seeds", [])]
    if missing:
        out.append(section["missing"].substitute(command=command, n=len(missing), missing=", ".join(missing)))

    # ---------------------------------------------------------------- Theorem 1
    t1 = exact["theorem1"]
    ffn = [by[n] for n in by if n.startswith("FFN depth") and "reference" not in n]
    reference = "FFN depth 3, 64 neurons (reference)"
    best = max(ffn, key=lambda r: r["metrics"].get("test/regions", 0), default=None)
    best_linf = min(ffn, key=lambda r: r["metrics"]["test/linf"], default=None)
    out.append(section["regions"].substitute(
        theorem1_rows=rows("theorem1", [{**r, "seconds": f"{r['seconds']:.2f}"} for r in t1]),
        regions_rows=rows("regions", [
            {"name": j["name"], "seeds": len(j["seeds"]), "regions": _pm(j, "test/regions"),
             "linf": _pm(j, "test/linf"), "mse": _pm(j, "test/mse"), "params": int(j["metrics"]["n_params"]),
             "command": j["command"]} for j in ran("regions")]),
        regions_verdict=_verdict(all(r["regions"] == r["two_to_m"] and r["breakpoints_dyadic"] for r in t1)),
        picard_max=max(r["picard_from_zero_max"] for r in t1),
        convergence_verdict=_verdict(all(r["picard_from_zero_max"] <= r["m"] and r["rebuttal_init_one_step_unchanged"]
                                         for r in t1)),
        best_ffn=best["name"] if best else "—", best_ffn_regions=_pm(best, "test/regions"),
        best_ffn_linf=_pm(best_linf, "test/linf"),
        reference_regions=_pm(by.get(reference), "test/regions"), reference_linf=_pm(by.get(reference), "test/linf")))
    deq6, deq64 = by.get("DEQ width 6 (trained)"), by.get("DEQ width 64 (trained, reference)")
    if deq6 and best_linf:
        k, n = _per_seed(deq6, best_linf, "test/linf")
        out.append(section["regions_trained"].substitute(
            deq_regions=_pm(deq6, "test/regions"), deq_linf=_pm(deq6, "test/linf"), deq_mse=_pm(deq6, "test/mse"),
            ffn=best_linf["name"], ffn_regions=_pm(best_linf, "test/regions"), ffn_linf=_pm(best_linf, "test/linf"),
            deq64=(row["deq64"].substitute(regions=_pm(deq64, "test/regions"), linf=_pm(deq64, "test/linf"))
                   if deq64 else ""),
            k=k, n=n, verdict=("**the trained DEQ fits better**" if deq6["metrics"]["test/linf"]
                               < best_linf["metrics"]["test/linf"] else "**the trained DEQ does not fit better**")))
    out.append(section["regions_end"].template)

    # ---------------------------------------------------------------- Theorem 3
    ib_rows = []
    for j in ran("implicit_bias"):
        gap = "test/gap_to_q_minimiser" if "test/gap_to_q_minimiser" in j["metrics"] else "test/gap_to_hyperbolic_minimiser"
        ib_rows.append({
            "name": j["name"], "seeds": len(j["seeds"]), "train_loss": _pm(j, "test/train_loss"), "gap": _pm(j, gap),
            "closed_form": (f"{_pm(j, 'test/closed_form_gap_beta')}; {_pm(j, 'test/closed_form_gap_mirror')}"
                            if "test/closed_form_gap_beta" in j["metrics"] else _fmt(None)),
            "participation": _pm(j, "test/beta_participation"), "mse": _pm(j, "test/mse"), "command": j["command"]})
    each = lambda *path: _each([functools.reduce(operator.getitem, path, t) for t in t3])  # one value per problem
    lrs, alphas, names = list(t3[0]["gd"]), list(t3[0]["diag_net"]), list(t3[0]["participation"])
    out.append(section["implicit_bias"].substitute(
        problem=t3[0]["problem"], problem_seeds=" / ".join(map(str, problem_seeds)),
        flow_closed_form_gap=each("gradient_flow_closed_form_gap"),
        flow_gap_to_q=each("gradient_flow_gap_to_q_minimiser"),
        q_kkt=each("q_minimiser_kkt_stationarity"),
        flow_kkt_plus=each("gradient_flow_kkt_q_plus"),
        flow_kkt_minus=each("gradient_flow_kkt_q_minus"),
        gd_rows=rows("gd", [{"lr": lr, "gap": each("gd", lr, "gap_to_q"),
                             "mirror": each("gd", lr, "closed_form_mirror_gap_max")} for lr in lrs]),
        richardson_gap=each("gd_richardson_gap_to_q"),
        diag_net_rows=rows("diag_net", [
            {"alpha": a, "gap": each("diag_net", a, "gap_gd_to_hyperbolic"),
             "gap_l1": each("diag_net", a, "gap_to_min_l1"),
             "participation": each("diag_net", a, "participation")} for a in alphas]),
        participation_rows=rows("participation", [{"name": n, "value": each("participation", n)}
                                                  for n in names]),
        implicit_bias_rows=rows("implicit_bias", ib_rows),
        flow_verdict=_verdict(all(t["gradient_flow_gap_to_q_minimiser"] <= 1e-6
                                  and t["gradient_flow_closed_form_gap"] <= 1e-6 for t in t3)),
        flow_gap_to_q_max=_fmt(max(t["gradient_flow_gap_to_q_minimiser"] for t in t3)),
        flow_kkt_plus_max=_fmt(max(t["gradient_flow_kkt_q_plus"] for t in t3)),
        flow_kkt_minus_min=_fmt(min(t["gradient_flow_kkt_q_minus"] for t in t3)),
        q_minus_unbounded=f"{sum(bool(t['q_minus_unbounded_on_feasible_set']) for t in t3)} of {len(t3)}",
        q_minus_ray=", ".join(_fmt(v) for v in (t3[0]["q_minus_along_ray"] or [])),
        participation_deq=each("participation", "q_minimiser (diag. DEQ)"),
        participation_network=each("diag_net", "0.01", "participation"),
        participation_min_l1=each("participation", "min l1"),
        dense_verdict=_verdict(all(t["participation"]["q_minimiser (diag. DEQ)"] > t["diag_net"]["0.01"]["participation"]
                                   for t in t3))))

    # ---------------------------------------------------------------- GOTU
    out.append(section["gotu"].substitute(gotu_rows=rows("gotu", [
        {"name": j["name"], "seeds": len(j["seeds"]), "gotu": _pm(j, "test/gotu_error"), "unseen": _pm(j, "test/gotu_error_unseen"),
         "seen": _pm(j, "test/seen_error"), "beta_frozen": _pm(j, "test/beta_frozen"), "bias": _pm(j, "test/bias"),
         "participation": _pm(j, "test/feature_participation"), "command": j["command"]}
        for j in ran("gotu")])))
    g = {n: by[n] for n in by if by[n]["study"] == "gotu"}
    deq_d, dln_d = g.get("diagonal linear DEQ (dense)"), g.get("diagonal linear network (dense)")
    if deq_d and dln_d:
        dense = {n.replace(" (dense)", ""): r for n, r in g.items() if n.endswith("(dense)")}
        ffns = [n for n in ("FFN depth 4", "FFN depth 33") if n in dense]
        key = "test/feature_participation"

        def density(n, f):
            k, m = _per_seed(dense[n], dense[f], key, better=lambda a, b: a > b)
            return row["density"].substitute(deq=n, ffn=f, verdict=_verdict(dense[n]["metrics"][key] > dense[f]["metrics"][key]),
                                             k=k, n=m)

        k, n = _per_seed(deq_d, dln_d, "test/gotu_error")
        out.append(section["gotu_claims"].substitute(
            deq_dense=_pm(deq_d, "test/gotu_error"), network_dense=_pm(dln_d, "test/gotu_error"),
            ffn4_dense=_pm(g.get("FFN depth 4 (dense)"), "test/gotu_error"),
            ffn33_dense=_pm(g.get("FFN depth 33 (dense)"), "test/gotu_error"),
            vanilla_dense=_pm(g.get("vanilla DEQ (dense)"), "test/gotu_error"),
            deq_sparse=_pm(g.get("diagonal linear DEQ (sparse)"), "test/gotu_error"),
            network_sparse=_pm(g.get("diagonal linear network (sparse)"), "test/gotu_error"),
            gotu_verdict=_verdict(deq_d["metrics"]["test/gotu_error"] < dln_d["metrics"]["test/gotu_error"]), k=k, n=n,
            participations=", ".join(f"{n} {_pm(r, key)}" for n, r in dense.items()),
            density_verdicts="; ".join(density(n, f) for n in ("diagonal linear DEQ", "vanilla DEQ") if n in dense
                                       for f in ffns)))

    # ---------------------------------------------------------------- Theorem 2
    steep_rows = []
    for j in ran("steep"):
        m = j["metrics"]
        steep_rows.append({
            "kind": j["name"].split()[0], "seeds": len(j["seeds"]), "dim": int(m["test/dim"]), "log2_inv_delta": f"{m['test/log2_inv_delta']:.0f}",
            "linf": _pm(j, "test/linf"), "err_at_peak": _pm(j, "test/err_at_peak"), "mse": _pm(j, "test/mse"),
            "weight_norm": _pm(j, "test/weight_inf_norm"), "params": int(m["n_params"]),
            "deq_iterations": _pm(j, "test/deq_iterations"), "command": j["command"]})
    out.append(section["steep"].substitute(
        solver_rows=rows("solver", [{**r, "log2_inv_eps": f"{r['log2_inv_eps']:.1f}"} for r in exact["steep"]]),
        steep_rows=rows("steep", steep_rows)))
    ds = [d for d in (5, 10, 15, 20) if f"DEQ d={d}" in by and f"FFN d={d}" in by]
    if ds:
        def norms(kind, key="test/weight_inf_norm"):
            return [by[f"{kind} d={d}"]["metrics"][key] for d in ds if f"{kind} d={d}" in by]

        def shown(kind, key="test/weight_inf_norm"):
            return ", ".join(_pm(by[f"{kind} d={d}"], key) for d in ds if f"{kind} d={d}" in by)

        fw, fl, dl = norms("FFN"), norms("FFN", "test/linf"), norms("DEQ", "test/linf")
        sw = norms("DEQ-spectral")
        sw = sw if len(sw) == len(ds) else []
        fitted = max(max(dl), max(fl)) < 0.1  # both models approximate f_δ: only then do their norms mean anything

        def lower_at_every_d(kind) -> str:
            """Is ``kind``'s weight ∞-norm below the FFN's at every d, over seeds — at 2 s.e. and by Welch's t-test
            (:func:`benchmarks.lib.results.seed_rules`), each verdict naming its rule?"""
            rules = {}
            for d in ds:
                a, b = (by[f"{k} d={d}"].get("by_seed") or {} for k in (kind, "FFN"))
                rules[d] = seed_rules([m["test/weight_inf_norm"] for m in a.values()],
                                      [m["test/weight_inf_norm"] for m in b.values()], lower_is_better=True)

            def by_rule(rule: str, name: str, within: str) -> str:
                per_d = {d: r[rule] for d, r in rules.items()}
                if all(v == "agree" for v in per_d.values()):
                    return f"{AGREE} {name}"
                if any(v == "disagree" for v in per_d.values()):
                    return f"{DISAGREE} {name} (higher at d = " + ", ".join(
                        str(d) for d, v in per_d.items() if v == "disagree") + ")"
                return f"**undecided** {name} ({within} at d = " + ", ".join(
                    str(d) for d, v in per_d.items() if v != "agree") + ")"

            return (by_rule("by_2se", "at 2 s.e.", "within 2 s.e. of the seeds") + ", "
                    + by_rule("by_welch", "by Welch's t-test", "p ≥ 0.05"))

        out.append(section["steep_claims"].substitute(
            dims=ds, ffn_norms=shown("FFN"), deq_norms=shown("DEQ"), deq_linf=shown("DEQ", "test/linf"),
            ffn_linf=shown("FFN", "test/linf"),
            grows_verdict=AGREE if all(a <= b for a, b in itertools.pairwise(fw)) else row["not_monotone"].template,
            caveat="" if fitted else row["caveat"].template,
            lower_verdict=lower_at_every_d("DEQ"),
            spectral_norms=row["spectral_norms"].substitute(norms=shown("DEQ-spectral")) if sw else "",
            spectral_verdict=(row["spectral_verdict"].substitute(verdict=lower_at_every_d("DEQ-spectral"))
                              if sw else "")))

    # ---------------------------------------------------------------- signal
    sig = ran("signal")
    if sig:
        keys = _tone_keys(sig[0])
        hi = keys[-2:]
        top = lambda m: sum(m[k] for k in hi)  # (the two highest tones' errors, one seed)
        deqs = [j for j in sig if j["name"].startswith("DEQ")]
        best_deq = min(deqs, key=lambda j: top(j["metrics"]))

        def signal_verdict(j):
            k, n = _per_seed(best_deq, j, top)
            supported = top(best_deq["metrics"]) < top(j["metrics"])
            return row["signal_verdict"].substitute(
                ffn=j["name"], k=k, n=n,
                verdict="**supported on this proxy**" if supported else "**not supported on this proxy**")

        out.append(section["signal"].substitute(
            tone_heads=" | ".join(row["tone_head"].substitute(frequency=k.rsplit("_", 1)[1]) for k in keys),
            tone_rule="|---|" + "---|" * (len(keys) + 7),
            signal_rows=rows("signal", [
                {"name": j["name"], "seeds": len(j["seeds"]), "tones": " | ".join(_pm(j, k) for k in keys),
                 "other": _pm(j, "test/band_err_other"), "mse": _pm(j, "test/mse"),
                 "params": int(j["metrics"]["n_params"]), "flops": _pm(j, "test/flops_per_forward"),
                 "deq_iterations": _pm(j, "test/deq_iterations"), "command": j["command"]} for j in sig]),
            highest_tones="; ".join(row["highest_tones"].substitute(
                name=j["name"], errors=", ".join(_pm(j, k) for k in hi)) for j in sig),
            best_deq=best_deq["name"],
            signal_verdicts="; ".join(signal_verdict(j) for j in sig if not j["name"].startswith("DEQ"))))

    walls = [w for j in recs for w in j["wall_s"] if w is not None and not math.isnan(w)]
    out.append(section["run_times"].substitute(
        run_time_rows=rows("run_time", [
            {"study": j["study"], "name": j["name"], "n": len(j["seeds"]),
             "wall_s": _fmt(summarise(j["wall_s"])[0])} for j in recs]),
        total_wall_s=f"{sum(walls):.0f}"))
    out.append(section["figures"].substitute(figure_list=rows("figure", [{"file": f} for f in made])))
    return "".join(out)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--only", default=",".join(STUDIES), help=f"comma-separated subset of {','.join(STUDIES)}")
    p.add_argument("--runs", default=str(ROOT / "outputs" / "benchmarks" / "separation"))
    p.add_argument("--out", default=str(RESULTS))
    p.add_argument("--seeds", default=",".join(map(str, SEEDS)),
                   help="comma-separated seeds of every trained job (seed 0 = the default command)")
    p.add_argument("--rerun", action="store_true")
    p.add_argument("--collect", action="store_true",
                   help="run no training: report the jobs whose run directories hold metrics.json, list the rest "
                        "as not run (the same command without --collect runs them)")
    p.add_argument("--render", action="store_true",
                   help="run nothing: rebuild separation.md from the saved separation.json")
    args = p.parse_args(argv)
    only = set(args.only.split(","))
    out, runs = Path(args.out), Path(args.runs)
    out.mkdir(parents=True, exist_ok=True)
    if args.render:
        payload = json.loads((out / "separation.json").read_text())
        made = payload.get("figures")
        if made is None:  # a JSON written before the figure list was kept in it: the list in the markdown
            lines = (out / "separation.md").read_text().split("## Figures", 1)[-1].splitlines()
            made = [ln[3:-1] for ln in lines if ln.startswith("- `")]
        # the figures themselves need the run directories (some copy a run's own plot): not redrawn here
        (out / "separation.md").write_text(markdown(payload["jobs"], payload["exact"], made, payload["meta"]))
        print(f"wrote {out / 'separation.md'} from {out / 'separation.json'}")
        return
    meta = {"command": script_command("benchmarks.studies.separation_report", argv), "machine": f"{platform.machine()} {platform.processor() or ''} {os.cpu_count()} CPUs".strip(),
            "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "python": platform.python_version()}
    t0 = time.perf_counter()
    seeds = [int(v) for v in args.seeds.split(",")]
    meta["seeds"] = meta["problem_seeds"] = seeds
    exact = {"theorem1": exact_theorem1(), "theorem3": [exact_theorem3(s) for s in seeds], "steep": exact_steep()}
    print(f"exact checks: {time.perf_counter() - t0:.1f} s", flush=True)
    previous = {}
    if (out / "separation.json").exists():
        previous = {j.get("run_dir"): j.get("wall_s") for j in json.loads((out / "separation.json").read_text())["jobs"]}
    jobs = []
    for j in grid(only, seeds):
        job = run_job(j, runs, args.rerun, args.collect)
        if math.isnan(job.get("wall_s", float("nan"))) and previous.get(job.get("run_dir")) is not None:
            job["wall_s"] = previous[job["run_dir"]]
        jobs.append(job)
    made = figures(jobs, exact, out)
    payload = {"meta": meta, "exact": exact, "jobs": jobs, "figures": made}
    write_results(out, "separation", payload, lambda p: markdown(p["jobs"], p["exact"], p["figures"], p["meta"]),
                  default=float)
    print(f"wrote {out / 'separation.md'} ({time.perf_counter() - t0:.0f} s)")


if __name__ == "__main__":
    main()
