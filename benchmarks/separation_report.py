"""DEQ vs feed-forward: the studies of *Separation and Bias of Deep Equilibrium Models on Expressivity and
Learning Dynamics* (NeurIPS 2024) in one report.

    python benchmarks/separation_report.py [--only regions,implicit_bias,gotu,steep,signal] [--rerun]
    python benchmarks/separation_report.py --render     # rebuild the markdown from the JSON

Part 1 computes the exact checks (pure functions of ``src/studies``: no training). Part 2 runs every training
study as the ``python -m src.train experiment=<name> …`` command a user types (one process per job, one torch
thread each, run directories under ``--runs``; a job whose directory already holds ``metrics.json`` is reused
unless ``--rerun``). Writes ``separation.json`` (every figure measured, the commands), ``separation.md`` (each
claim of the paper beside what was measured: agree / disagree / not testable here) and ``separation_*.png``
into ``--out`` (default ``benchmarks/results``). The report's words (each study's protocol, each claim) are in
``benchmarks/separation_report.md``, a template this script fills in with the numbers and verdicts.
"""

from __future__ import annotations

import argparse
import itertools
import json
import math
import os
import platform
import re
import shlex
import shutil
import time
from pathlib import Path
from string import Template

import numpy as np
from _common import RESULTS, ROOT, thread_env, train_job

from src.reporting import write_results
from src.studies import implicit_bias as ib
from src.studies import regions as rg
from src.studies import tasks

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
def grid(only) -> list[dict]:
    jobs = []

    def add(study, name, overrides):
        if study in only:
            jobs.append({"study": study, "name": name, "overrides": overrides})

    add("regions", "DEQ (hand-built, m = 6)", ["experiment=linear_regions", "deq=true"])
    for depth in (2, 3, 4, 7):
        add("regions", f"FFN depth {depth}", ["experiment=linear_regions", "deq=false", f"depth={depth}"])
    add("regions", "FFN depth 3, 64 neurons (reference)",
        ["experiment=linear_regions", "deq=false", "depth=3", "model.width=64"])
    add("implicit_bias", "diagonal linear DEQ", ["experiment=implicit_bias", "model.arch=diag_deq"])
    add("implicit_bias", "diagonal linear network", ["experiment=implicit_bias", "model.arch=diag_net"])
    adam = ["model.optimizer.name=adam", "model.optimizer.lr=1e-3"]
    for tag, extra in (("dense", []), ("sparse", ["data.task_kwargs.support=3"])):
        add("gotu", f"diagonal linear DEQ ({tag})", ["experiment=gotu", "model.arch=diag_deq", *extra])
        add("gotu", f"diagonal linear network ({tag})", ["experiment=gotu", "model.arch=diag_net", *extra])
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
    for delta_exp in (10, 20):
        for deq in ("true", "false"):
            add("steep", f"{'DEQ' if deq == 'true' else 'FFN'} d=10 delta=2^-{delta_exp}",
                ["experiment=steep", f"deq={deq}", "data.dim=10", f"data.task_kwargs.delta={2.0 ** -delta_exp!r}"])
    add("signal", "DEQ width 32", ["experiment=high_frequency", "deq=true"])
    add("signal", "DEQ width 32, spectral λ = 1.1",
        ["experiment=high_frequency", "deq=true", "deq.norm=spectral", "deq.norm_lambda=1.1"])
    add("signal", "FFN equal params (depth 3)", ["experiment=high_frequency", "deq=false"])
    add("signal", "FFN equal FLOPs (width 32, depth 13)",
        ["experiment=high_frequency", "deq=false", "model.match=none", "model.hidden=32", "depth=13"])
    return jobs


def slug(job) -> str:
    return "".join(ch if ch.isascii() and ch.isalnum() else "_" for ch in f"{job['study']}_{job['name']}").strip("_")


def run_job(job, runs: Path, rerun: bool) -> dict:
    """One study job (one torch thread); its record with the metrics, or the error of a failed run."""
    run_dir = runs / slug(job)
    job = {**job, "command": "python -m src.train " + " ".join(shlex.quote(o) for o in job["overrides"]),
           "run_dir": str(run_dir.relative_to(ROOT)) if run_dir.is_relative_to(ROOT) else str(run_dir)}
    ran = train_job([*job["overrides"], "trainer.enable_progress_bar=false"], run_dir, thread_env(1), rerun)
    job["wall_s"] = float("nan") if ran["wall_s"] is None else ran["wall_s"]  # nan: reused, time not known
    if not ran["ok"]:
        job["error"] = ran["error"]
        print(f"FAILED {job['name']}: {job['error'][-400:]}", flush=True)
        return job
    metrics = json.loads((run_dir / "metrics.json").read_text())
    job["metrics"] = {k: v for k, v in metrics.items() if isinstance(v, (int, float)) and not isinstance(v, bool)}
    print(f"done {job['name']} ({job['wall_s']:.0f} s)", flush=True)
    return job


# ------------------------------------------------------------------------------------------ report
def _m(jobs, name, key, default=float("nan")):
    for j in jobs:
        if j["name"] == name and "metrics" in j:
            return j["metrics"].get(key, default)
    return default


def _fmt(v, digits=3):
    if v is None or (isinstance(v, float) and math.isnan(v)):
        return "—"
    if isinstance(v, float) and (abs(v) >= 1e4 or (0 < abs(v) < 1e-3)):
        return f"{v:.2e}"
    return f"{v:.{digits}g}" if isinstance(v, float) else str(v)


def figures(jobs, exact, out: Path) -> list[str]:
    plt = _plt()
    made = []
    by = {j["name"]: j for j in jobs if "metrics" in j}
    # Theorem 1: regions vs width (construction) and FFN regions/L∞ vs depth
    fig, (a1, a2) = plt.subplots(1, 2, figsize=(10, 3.2))
    ms = [r["m"] for r in exact["theorem1"]]
    a1.semilogy(ms, [r["regions"] for r in exact["theorem1"]], "o", label="ReLU DEQ construction (counted)")
    a1.semilogy(ms, [2 ** m for m in ms], "k-", lw=0.8, label="2^m")
    a1.semilogy(ms, [m + 1 for m in ms], "--", label="1-hidden-layer FFN bound m + 1")
    a1.set_xlabel("width m (neurons)"), a1.set_ylabel("linear regions on [0, 1]"), a1.legend(fontsize=7)
    depths = [d for d in (2, 3, 4, 7) if f"FFN depth {d}" in by]
    if depths:
        a2.plot(depths, [by[f"FFN depth {d}"]["metrics"].get("test/regions") for d in depths], "o-", label="FFN regions")
        a2.axhline(64, color="k", lw=0.8, label="target: 2^6 = 64")
        a2b = a2.twinx()
        a2b.plot(depths, [by[f"FFN depth {d}"]["metrics"]["test/linf"] for d in depths], "s--", color="C3",
                 label="FFN L∞ error")
        a2b.set_ylabel("L∞ error", color="C3")
        a2.set_xlabel("FFN depth (6 neurons in all)"), a2.set_ylabel("regions"), a2.legend(fontsize=7, loc="center left")
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
            a1.plot(ds, [by[f"{kind} d={d}"]["metrics"]["test/linf"] for d in ds], "o-", label=kind)
            a2.plot(ds, [by[f"{kind} d={d}"]["metrics"]["test/weight_inf_norm"] for d in ds], "o-", label=kind)
        a1.set_xlabel("d (δ = 2^-d)"), a1.set_ylabel("test L∞ error"), a1.legend()
        a2.set_xlabel("d (δ = 2^-d)"), a2.set_ylabel("‖θ‖∞ (DEQ: normalised W)"), a2.legend()
        fig.tight_layout()
        fig.savefig(out / "separation_steep.png", dpi=110)
        plt.close(fig)
        made.append("separation_steep.png")
    # Theorem 3: the DEQ run's figure
    j = by.get("diagonal linear DEQ")
    if j:
        shutil.copy(ROOT / j["run_dir"] / "implicit_bias.png", out / "separation_implicit_bias.png")
        made.append("separation_implicit_bias.png")
    # GOTU heatmaps
    names = [n for n in ("FFN depth 33 (dense)", "FFN depth 4 (dense)", "diagonal linear DEQ (dense)",
                         "vanilla DEQ (dense)", "diagonal linear network (dense)") if n in by]
    if names:
        fig, axes = plt.subplots(1, len(names), figsize=(3.3 * len(names), 3))
        for ax, n in zip(np.atleast_1d(axes), names):
            F = np.abs(np.load(ROOT / by[n]["run_dir"] / "features.npz")["features"])
            ax.imshow((F / max(F.max(), 1e-300)).T, aspect="auto", cmap="viridis", vmin=0, vmax=1)
            ax.set_title(f"{n.replace(' (dense)', '')}\nparticipation "
                         f"{by[n]['metrics']['test/feature_participation']:.2f}", fontsize=8)
            ax.set_xlabel("sample"), ax.set_ylabel("unit")
        fig.tight_layout()
        fig.savefig(out / "separation_gotu_features.png", dpi=110)
        plt.close(fig)
        made.append("separation_gotu_features.png")
    # high frequency: per-tone error
    sig = [j for j in jobs if j["study"] == "signal" and "metrics" in j]
    if sig:
        keys = sorted((k for k in sig[0]["metrics"] if k.startswith("test/band_err_") and k[-1].isdigit()),
                      key=lambda k: float(k.rsplit("_", 1)[1]))
        fig, ax = plt.subplots(figsize=(7, 3))
        w = 0.8 / len(sig)
        for i, j in enumerate(sig):
            ax.bar(np.arange(len(keys)) + i * w, [j["metrics"][k] for k in keys], w, label=j["name"])
        ax.set_xticks(np.arange(len(keys)) + 0.4 - w / 2, [k.rsplit("_", 1)[1] + " cycles" for k in keys])
        ax.set_ylabel("relative error of the tone"), ax.legend(fontsize=7)
        fig.tight_layout()
        fig.savefig(out / "separation_signal.png", dpi=110)
        plt.close(fig)
        made.append("separation_signal.png")
    for j in jobs:  # the per-run figures, for the record
        if "metrics" in j and j["study"] == "regions" and j["name"].startswith("DEQ"):
            shutil.copy(ROOT / j["run_dir"] / "regions.png", out / "separation_regions_deq_fit.png")
            made.append("separation_regions_deq_fit.png")
    return made


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


def markdown(jobs, exact, made, meta) -> str:
    """The report: :data:`TEMPLATE` filled in with what was measured (a pure function of the saved JSON)."""
    section, row = template()

    def rows(name, items) -> str:
        return "\n".join(row[name].substitute(item) for item in items)

    def ran(study) -> list[dict]:
        return [j for j in jobs if j["study"] == study and "metrics" in j]

    by = {j["name"]: j for j in jobs if "metrics" in j}
    out = [section["head"].substitute(machine=meta["machine"], date=meta["date"])]
    failed = [j["name"] for j in jobs if "error" in j]
    if failed:
        out.append(section["failed"].substitute(failed=", ".join(failed)))

    # ---------------------------------------------------------------- Theorem 1
    t1 = exact["theorem1"]
    ffn = [by[n]["metrics"] for n in by if n.startswith("FFN depth") and "reference" not in n]
    reference = "FFN depth 3, 64 neurons (reference)"
    out.append(section["regions"].substitute(
        theorem1_rows=rows("theorem1", [{**r, "seconds": f"{r['seconds']:.2f}"} for r in t1]),
        regions_rows=rows("regions", [
            {"name": j["name"], "regions": _fmt(j["metrics"].get("test/regions")), "linf": _fmt(j["metrics"]["test/linf"]),
             "mse": _fmt(j["metrics"]["test/mse"]), "params": int(j["metrics"]["n_params"]), "command": j["command"]}
            for j in ran("regions")]),
        regions_verdict=_verdict(all(r["regions"] == r["two_to_m"] and r["breakpoints_dyadic"] for r in t1)),
        picard_max=max(r["picard_from_zero_max"] for r in t1),
        convergence_verdict=_verdict(all(r["picard_from_zero_max"] <= r["m"] and r["rebuttal_init_one_step_unchanged"]
                                         for r in t1)),
        best_ffn_regions=_fmt(max((m.get("test/regions", 0) for m in ffn), default=float("nan"))),
        best_ffn_linf=_fmt(min((m["test/linf"] for m in ffn), default=float("nan"))),
        reference_regions=_fmt(_m(jobs, reference, "test/regions")), reference_linf=_fmt(_m(jobs, reference, "test/linf"))))

    # ---------------------------------------------------------------- Theorem 3
    t3 = exact["theorem3"]
    ib_rows = []
    for j in ran("implicit_bias"):
        m = j["metrics"]
        ib_rows.append({
            "name": j["name"], "train_loss": _fmt(m["test/train_loss"]),
            "gap": _fmt(m.get("test/gap_to_q_minimiser", m.get("test/gap_to_hyperbolic_minimiser"))),
            "closed_form": (f"{_fmt(m['test/closed_form_gap_beta'])}; {_fmt(m['test/closed_form_gap_mirror'])}"
                            if "test/closed_form_gap_beta" in m else _fmt(None)),
            "participation": _fmt(m["test/beta_participation"]), "mse": _fmt(m["test/mse"]), "command": j["command"]})
    out.append(section["implicit_bias"].substitute(
        problem=t3["problem"], flow_closed_form_gap=_fmt(t3["gradient_flow_closed_form_gap"]),
        flow_gap_to_q=_fmt(t3["gradient_flow_gap_to_q_minimiser"]), q_kkt=_fmt(t3["q_minimiser_kkt_stationarity"]),
        flow_kkt_plus=_fmt(t3["gradient_flow_kkt_q_plus"]), flow_kkt_minus=_fmt(t3["gradient_flow_kkt_q_minus"]),
        gd_rows=rows("gd", [{"lr": lr, "gap": _fmt(r["gap_to_q"]), "mirror": _fmt(r["closed_form_mirror_gap_max"])}
                            for lr, r in t3["gd"].items()]),
        richardson_gap=_fmt(t3["gd_richardson_gap_to_q"]),
        diag_net_rows=rows("diag_net", [
            {"alpha": a, "gap": _fmt(r["gap_gd_to_hyperbolic"]), "gap_l1": _fmt(r["gap_to_min_l1"]),
             "participation": _fmt(r["participation"])} for a, r in t3["diag_net"].items()]),
        participation_rows=rows("participation", [{"name": n, "value": _fmt(v)}
                                                  for n, v in t3["participation"].items()]),
        implicit_bias_rows=rows("implicit_bias", ib_rows),
        flow_verdict=_verdict(t3["gradient_flow_gap_to_q_minimiser"] <= 1e-6
                              and t3["gradient_flow_closed_form_gap"] <= 1e-6),
        q_minus_unbounded=t3["q_minus_unbounded_on_feasible_set"],
        q_minus_ray=", ".join(_fmt(v) for v in (t3["q_minus_along_ray"] or [])),
        participation_deq=_fmt(t3["participation"]["q_minimiser (diag. DEQ)"]),
        participation_network=_fmt(t3["diag_net"]["0.01"]["participation"]),
        participation_min_l1=_fmt(t3["participation"]["min l1"])))

    # ---------------------------------------------------------------- GOTU
    out.append(section["gotu"].substitute(gotu_rows=rows("gotu", [
        {"name": j["name"], "gotu": _fmt(j["metrics"]["test/gotu_error"]),
         "unseen": _fmt(j["metrics"]["test/gotu_error_unseen"]), "seen": _fmt(j["metrics"]["test/seen_error"]),
         "beta_frozen": _fmt(j["metrics"].get("test/beta_frozen")), "bias": _fmt(j["metrics"].get("test/bias")),
         "participation": _fmt(j["metrics"]["test/feature_participation"]), "command": j["command"]}
        for j in ran("gotu")])))
    g = {n: by[n]["metrics"] for n in by if by[n]["study"] == "gotu"}
    deq_d, dln_d = g.get("diagonal linear DEQ (dense)", {}), g.get("diagonal linear network (dense)", {})
    if deq_d and dln_d:
        dense = {n.replace(" (dense)", ""): m["test/feature_participation"] for n, m in g.items() if n.endswith("(dense)")}
        ffns = [n for n in ("FFN depth 4", "FFN depth 33") if n in dense]
        out.append(section["gotu_claims"].substitute(
            deq_dense=_fmt(deq_d["test/gotu_error"]), network_dense=_fmt(dln_d["test/gotu_error"]),
            ffn4_dense=_fmt(g.get("FFN depth 4 (dense)", {}).get("test/gotu_error")),
            ffn33_dense=_fmt(g.get("FFN depth 33 (dense)", {}).get("test/gotu_error")),
            vanilla_dense=_fmt(g.get("vanilla DEQ (dense)", {}).get("test/gotu_error")),
            deq_sparse=_fmt(g.get("diagonal linear DEQ (sparse)", {}).get("test/gotu_error")),
            network_sparse=_fmt(g.get("diagonal linear network (sparse)", {}).get("test/gotu_error")),
            gotu_verdict=_verdict(deq_d["test/gotu_error"] < dln_d["test/gotu_error"]),
            participations=", ".join(f"{n} {_fmt(v)}" for n, v in dense.items()),
            density_verdicts="; ".join(row["density"].substitute(deq=n, ffn=f, verdict=_verdict(dense[n] > dense[f]))
                                       for n in ("diagonal linear DEQ", "vanilla DEQ") if n in dense for f in ffns)))

    # ---------------------------------------------------------------- Theorem 2
    steep_rows = []
    for j in ran("steep"):
        m = j["metrics"]
        steep_rows.append({
            "kind": j["name"].split()[0], "dim": int(m["test/dim"]), "log2_inv_delta": f"{m['test/log2_inv_delta']:.0f}",
            "linf": _fmt(m["test/linf"]), "err_at_peak": _fmt(m["test/err_at_peak"]), "mse": _fmt(m["test/mse"]),
            "weight_norm": _fmt(m["test/weight_inf_norm"]), "params": int(m["n_params"]),
            "deq_iterations": _fmt(m["test/deq_iterations"]), "command": j["command"]})
    out.append(section["steep"].substitute(
        solver_rows=rows("solver", [{**r, "log2_inv_eps": f"{r['log2_inv_eps']:.1f}"} for r in exact["steep"]]),
        steep_rows=rows("steep", steep_rows)))
    ds = [d for d in (5, 10, 15, 20) if f"DEQ d={d}" in by and f"FFN d={d}" in by]
    if ds:
        def norms(kind, key="test/weight_inf_norm"):
            return [by[f"{kind} d={d}"]["metrics"][key] for d in ds if f"{kind} d={d}" in by]

        fw, dw, fl, dl = norms("FFN"), norms("DEQ"), norms("FFN", "test/linf"), norms("DEQ", "test/linf")
        sw = norms("DEQ-spectral")
        sw = sw if len(sw) == len(ds) else []
        fitted = max(max(dl), max(fl)) < 0.1  # both models approximate f_δ: only then do their norms mean anything
        joined = lambda vs: ", ".join(_fmt(v) for v in vs)
        out.append(section["steep_claims"].substitute(
            dims=ds, ffn_norms=joined(fw), deq_norms=joined(dw), deq_linf=joined(dl), ffn_linf=joined(fl),
            grows_verdict=AGREE if all(a <= b for a, b in itertools.pairwise(fw)) else row["not_monotone"].template,
            caveat="" if fitted else row["caveat"].template,
            lower_verdict=_verdict(all(a < b for a, b in zip(dw, fw))),
            spectral_norms=row["spectral_norms"].substitute(norms=joined(sw)) if sw else "",
            spectral_verdict=(row["spectral_verdict"].substitute(verdict=_verdict(all(a < b for a, b in zip(sw, fw))))
                              if sw else "")))

    # ---------------------------------------------------------------- signal
    sig = ran("signal")
    if sig:
        keys = sorted((k for k in sig[0]["metrics"] if k.startswith("test/band_err_") and k[-1].isdigit()),
                      key=lambda k: float(k.rsplit("_", 1)[1]))
        hi = keys[-2:]
        best_deq = min(sum(j["metrics"][k] for k in hi) for j in sig if j["name"].startswith("DEQ"))
        out.append(section["signal"].substitute(
            tone_heads=" | ".join(row["tone_head"].substitute(frequency=k.rsplit("_", 1)[1]) for k in keys),
            tone_rule="|---|" + "---|" * (len(keys) + 6),
            signal_rows=rows("signal", [
                {"name": j["name"], "tones": " | ".join(_fmt(j["metrics"][k]) for k in keys),
                 "other": _fmt(j["metrics"].get("test/band_err_other")), "mse": _fmt(j["metrics"]["test/mse"]),
                 "params": int(j["metrics"]["n_params"]), "flops": _fmt(j["metrics"]["test/flops_per_forward"]),
                 "deq_iterations": _fmt(j["metrics"]["test/deq_iterations"]), "command": j["command"]} for j in sig]),
            highest_tones="; ".join(row["highest_tones"].substitute(
                name=j["name"], errors=", ".join(_fmt(j["metrics"][k]) for k in hi)) for j in sig),
            signal_verdicts="; ".join(row["signal_verdict"].substitute(
                ffn=j["name"], verdict=_verdict(best_deq < sum(j["metrics"][k] for k in hi)))
                for j in sig if not j["name"].startswith("DEQ"))))

    total = sum(j.get("wall_s", 0) for j in jobs if not math.isnan(j.get("wall_s", float("nan"))))
    out.append(section["run_times"].substitute(
        run_time_rows=rows("run_time", [{"study": j["study"], "name": j["name"], "wall_s": _fmt(j.get("wall_s"))}
                                        for j in jobs]), total_wall_s=f"{total:.0f}"))
    out.append(section["figures"].substitute(figure_list=rows("figure", [{"file": f} for f in made])))
    return "".join(out)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--only", default=",".join(STUDIES), help=f"comma-separated subset of {','.join(STUDIES)}")
    p.add_argument("--runs", default=str(ROOT / "outputs" / "benchmarks" / "separation"))
    p.add_argument("--out", default=str(RESULTS))
    p.add_argument("--rerun", action="store_true")
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
    meta = {"machine": f"{platform.machine()} {platform.processor() or ''} {os.cpu_count()} CPUs".strip(),
            "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "python": platform.python_version()}
    t0 = time.perf_counter()
    exact = {"theorem1": exact_theorem1(), "theorem3": exact_theorem3(), "steep": exact_steep()}
    print(f"exact checks: {time.perf_counter() - t0:.1f} s", flush=True)
    previous = {}
    if (out / "separation.json").exists():
        previous = {j.get("run_dir"): j.get("wall_s") for j in json.loads((out / "separation.json").read_text())["jobs"]}
    jobs = []
    for j in grid(only):
        job = run_job(j, runs, args.rerun)
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
