"""How much each family's DEQ block recurs, and the DEQ-vs-explicit decision against a one-pass control.

The recurrence share of a DEQ block is ‖z* − φ(0; p)‖ / ‖z*‖: what its fixed point adds to one explicit pass of
the same map (src/deq/diagnostics.py). Three grids, each job one ``python -m src.train`` process with one torch
thread, in its own run directory ``<work>/<grid>/<family>/<arm>_seed<S>/`` (console output in ``stdout.log``,
Hydra's log in ``train.log``), ``--parallel`` at once (``benchmarks.lib.jobs.run_parallel``); a job whose
``metrics.json`` exists is reused (resumable), and one whose ``pid`` file names a live process (another driver's)
is left alone:

- ``candidates``: short trainings of each family with candidate DEQ blocks (the paper's Frobenius λ = 2, spectral
  normalisation, smaller λ); the recurrence share, branch ratio, contraction rate and iterations at the last
  step's validation. Chooses each family's DEQ block of record.
- ``decision``: DKEF RedWine (SM), NICE (SSM), the SSM-VAE and the NCSN on MNIST, 3 seeds of each arm: the DEQ
  of record, the paper's Frobenius DEQ (not the VAE), the one-pass control of the DEQ of record
  (``deq.one_pass=true``: z* replaced by φ(0; p), trained as an explicit network) and the explicit baseline
  (TwoRes for the NCSN; for it also the spectral block and its one-pass control); each family's test figures
  (:data:`DECISION_METRICS`) with the share and iterations beside each row.
- ``protocol``: each family's default DEQ run (its experiment with ``deq=true``: the block of record) at the
  experiment's own length and validation schedule, seed 0, no test: the share at the end of the committed protocol.
- ``stoprule``: where Picard on a CIFAR-sized float32 state bottoms out, and the iterations each stop rule needs.

    python -m benchmarks.studies.deq_recurrence candidates --root <data dir> --work <dir> --parallel 2
    python -m benchmarks.studies.deq_recurrence decision --root <data dir> --work <dir> --parallel 2
    python -m benchmarks.studies.deq_recurrence protocol --root <data dir> --work <dir> --parallel 2
    python -m benchmarks.studies.deq_recurrence report --work <dir>     # tables only, from finished jobs
    python -m benchmarks.studies.deq_recurrence stoprule
    python -m benchmarks.studies.deq_recurrence --render                # the markdown from the JSON

Writes ``benchmarks/results/deq_recurrence.{json,md}`` (``--out``), merging the grids it ran into what is
there: every job's command (with ``<data dir>`` for the data root) and its figures, the command that wrote each
section, and the machine facts.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

from benchmarks.lib.jobs import resume_overrides, run_parallel, thread_env
from benchmarks.lib.paper import PAPER_NCSN_BLOCK
from benchmarks.lib.results import (
    load_results,
    machine_facts,
    note_lines,
    rendered,
    result_options,
    script_command,
    seed_verdict,
    shown,
    write_results,
)
from src.reports.tables import format_summary, summarise

MODULE = "benchmarks.studies.deq_recurrence"
STEM = "deq_recurrence"
SECTIONS = ("stoprule", "candidates", "protocol", "decision_short", "decision_full")  # the result's sections

VAL_EVERY = {"vae": 2}  # Lightning steps per training batch (the VAE's two optimizers step in turn)
FAMILIES = {  # base overrides and short-run length of each family (the issue's probe protocols)
    "dkef": ("experiment=dkef_uci data=redwine loss=sm", 600),
    "nice": ("experiment=nice_mnist loss=ssm", 200),
    "vae": ("experiment=vae_mnist", 300),
    "ncsn": ("experiment=ncsn_mnist data.batch_size=32", 300),
}
PAPER = "deq=true deq.norm=frobenius deq.norm_lambda=2"  # the paper's block (§3.2), its tables' setting
CANDIDATES = {
    "dkef": {"frobenius_l2": PAPER, "frobenius_l1.05": "deq=true deq.norm=frobenius deq.norm_lambda=1.05",
             "spectral_l2": "deq=true deq.norm=spectral deq.norm_lambda=2",
             "spectral_l1.2": "deq=true deq.norm=spectral deq.norm_lambda=1.2"},
    "nice": {"frobenius_l2": PAPER, "spectral_l2": "deq=true deq.norm=spectral deq.norm_lambda=2",
             "spectral_l1.2": "deq=true deq.norm=spectral deq.norm_lambda=1.2",
             "spectral_l1.05": "deq=true deq.norm=spectral deq.norm_lambda=1.05",
             "spectral_l1.1_depth2": "deq=true depth=2 deq.norm=spectral deq.norm_lambda=1.1"},
    "vae": {"frobenius_l2": PAPER, "spectral_l2": "deq=true deq.norm=spectral deq.norm_lambda=2",
            "spectral_l1.2": "deq=true deq.norm=spectral deq.norm_lambda=1.2"},
    "ncsn": {"frobenius_l2": PAPER, "spectral_l2": "deq=true deq.norm=spectral deq.norm_lambda=2",
             "normalized_residual": "deq=true deq.block=normalized_residual",
             "spectral_l1.5": "deq=true deq.norm=spectral deq.norm_lambda=1.5",
             "spectral_l2_implicit": "deq=true deq.norm=spectral deq.norm_lambda=2 deq.backward=implicit",
             "spectral_l1.5_implicit": "deq=true deq.norm=spectral deq.norm_lambda=1.5 deq.backward=implicit",
             # converges under SSM-VR with the exact backward (benchmarks/results/ncsn_block_divergence.md)
             "normalized_residual_implicit": "deq=true deq.block=normalized_residual deq.backward=implicit"},
}
SEEDS = (0, 1, 2)
EXPLICIT = {"dkef": "deq=false", "nice": "deq=false", "vae": "deq=false",  # the SSM VAE's MLP score estimator
            "ncsn": "deq=false depth=1"}  # TwoRes: a plain ResBlock where the DEQ-ResBlock was
KEYS = ("deq_recurrence_share", "deq_recurrence_share_max", "deq_branch_ratio", "deq_contraction_rate",
        "deq_iterations", "deq_hit_cap")


RECORD = {  # each family's DEQ block of record (chosen on the candidates grid; its conf/experiment default)
    "dkef": "deq=true deq.norm=spectral deq.norm_lambda=2",
    "nice": "deq=true deq.norm=spectral deq.norm_lambda=1.2",
    "vae": "deq=true deq.norm=spectral deq.norm_lambda=2",
    # the authors' normalised ResBlock with the exact backward: share 14.0 % (the spectral blocks: ≤ 6.7 %)
    "ncsn": "deq=true deq.block=normalized_residual deq.backward=implicit",
}
# Extra NCSN arms: the spectral block measured before the normalised one converged (share 5.8 %), and its
# one-pass control.
SPECTRAL_NCSN = "deq=true deq.block=null deq.norm=spectral deq.norm_lambda=1.5 deq.backward=implicit"
FULL_STEPS = {"dkef": 2700, "nice": 1000}  # the committed protocols: DKEF 300 epochs of RedWine, NICE 1000 steps
# The short decision protocol where it differs from the candidates' length: the SSM-VAE's 300 steps (150
# iterations) leave every arm at the same AIS log p(x) (−186 ± 5 nats, seed 0: nothing trained yet), while a
# step costs 0.02 s; 4000 steps (2000 iterations, a fifth of the experiment's) take ~1.5 min on one thread.
DECISION_STEPS = {"vae": 4000}
# What a decision job evaluates at its test beyond the run's own preset (keys given on the command line win over
# eval=auto's quick caps): the SSM-VAE's AIS log p(x) on 100 test images with 300 intermediate distributions
# (a lower bound like every AIS estimate; the same schedule for every arm); the NCSN's FID of 500 samples with
# its bootstrap sd, white-out and test DSM (eval=standard) with Langevin T = 10 steps per level at 5e-5, half the
# experiment's T = 20 at 2e-5 and equal to it within the FID's noise on a trained checkpoint (489 vs 460, bootstrap
# sd ~20: benchmarks/results/ncsn_langevin_step.md), and an EMA decay of 0.99: at 300 steps the experiment's 0.999
# would leave 0.999^300 = 74 % of the initial weights in the averaged model that validates, tests and samples.
DECISION_TEST = {
    "vae": "model.metrics.log_likelihood.test_points=100 model.metrics.log_likelihood.ais.n_steps=300",
    "ncsn": ("eval=standard model.metrics.fid.n_samples=500 model.metrics.fid.bootstrap=100 "
             "model.sampling.n_steps_each=10 model.sampling.step_lr=5e-5 callbacks.ema.decay=0.99"),
}
# The test figures each family is decided on: (key, label, lower is better).
DECISION_METRICS = {
    "dkef": (("test/sm_loss", "test SM loss", True),),
    "nice": (("test/log_likelihood", "test log-likelihood (nats)", False), ("test/sm_loss", "test SM loss", True)),
    "vae": (("test/log_likelihood", "AIS log p(x) (nats, 100 images)", False),),
    "ncsn": (("test/fid", "FID (500 samples)", True), ("test/dsm_loss", "test DSM loss", True)),
}
SHOWN = {"ncsn": (("test/fid_bootstrap_sd", "FID bootstrap sd"), ("test/white_fraction", "white-out")),
         # the score estimator's SSM loss on its own encoder's latents: each arm's q(z|x) differs, so not decided on
         "vae": (("test/log_likelihood_stderr", "AIS s.e. over images"), ("test/score_ssm_loss", "estimator SSM loss"))}


CHOICE = """Blocks of record, chosen on the candidates grid below (seed 0, short runs; each family's share at
the paper's Frobenius λ = 2 block is near-inert, below 10 %):

- DKEF RedWine (SM, 600 steps): spectral λ = 2, share 25.5 % (max 28.6 %), contraction 0.40, 8 iterations;
  paper Frobenius λ = 2: 5.6 %; Frobenius λ = 1.05: 10.7 %.
- SSM-VAE (300 steps): spectral λ = 2, share 15.2 %, contraction 0.35; paper Frobenius λ = 2: 3.8 %.
- NICE (SSM, 200 steps): spectral λ = 1.2, share 7.0 % (max 8.3 %), contraction 0.24, 5.5 iterations; spectral
  λ = 2: 5.2 %; paper Frobenius λ = 2: 1.2 %. No candidate reaches 10 %: at λ = 1.05 (bound 0.95) the mean over
  the four couplings is 7.9 % (3.7 / 9.4 / 4.3 / 14.0 %) with val SM 943 against 897, and the trained maps
  contract at 0.21–0.32 whatever the bound, so the bound is not what keeps them near-inert; two layers inside
  the map (depth=2, spectral λ = 1.1) fall to 2.8 %. λ = 1.2 stays the record.
- NCSN (ncsn_mnist, batch 32, 300 steps): the record is the authors' normalised ResBlock with the implicit
  backward (deq.block=normalized_residual deq.backward=implicit), share 14.0 % (max 14.6 %), branch ratio 0.15,
  contraction 0.79, 9 iterations, no cap hit, val DSM 72.9 (EMA 0.99). With the phantom K = 2 backward the same
  block stopped converging at step ~59 (cap, residual 5–13) and was stopped at step 109: SSM-VR through the
  truncated derivative drives its contraction rate past 1 (benchmarks/results/ncsn_block_divergence.md). Every
  weight-bounded block stayed below 10 %: spectral λ = 1.5 implicit 5.8 % (branch ratio 0.37, contraction
  0.15), spectral λ = 2 6.7 % (phantom) and 3.4 % (implicit); the paper's block 0.08 % (branch ratio 0.05,
  contraction 0.002). The spectral rows' val DSM (262–270 against the paper block's 68) is the EMA at 0.999:
  74 % of the averaged weights that validate a 300-step run are the initial ones; the same spectral λ = 1.5 run
  validates at 74 with EMA 0.99 (its decision_short row, deq_spectral seed 0).
- Shares at the end of the committed protocols (protocol grid, seed 0): DKEF 34.7 %, NICE 16.6 % (1000 steps;
  19.6 / 22.7 / 8.4 / 15.8 % per coupling), SSM-VAE 33.4 % (20 000 steps), NCSN 14.4 %
  (500 steps at batch 64; contraction 0.89, 11 iterations).
- DKEF frobenius rows ran under the former stop rule (absolute 1e-5); every other row under rel 1e-4.
- NCSN decision: three jobs (deq_paper seed 2, deq_spectral and one_pass_spectral seeds 1-2) first ran the
  normalised block, whose experiment default ignored their deq.norm overrides; they were rerun with
  deq.block=null (the arms' commands below), which deq.norm now requires with that experiment. Why the
  300-step NCSNs white out: benchmarks/results/ncsn_white_out.md (the sampler's U(0, 1) start, not the DEQ)."""


PROTOCOL = {  # each family's experiment with its DEQ block of record, at the experiment's own length
    "dkef": "experiment=dkef_uci data=redwine loss=sm deq=true",  # 300 epochs of RedWine (~2700 steps)
    "nice": "experiment=nice_mnist deq=true",  # 1000 steps
    "vae": "experiment=vae_mnist deq=true",  # 20 000 steps (10^4 iterations)
    "ncsn": "experiment=ncsn_mnist deq=true",  # 500 steps at batch 64
}


def decision_arms(family: str) -> dict[str, str]:
    """The arms of the decision grid: the DEQ of record, the paper's DEQ (DKEF, NICE, NCSN: the paper's claims), the
    one-pass control of the DEQ of record (the same network, z* replaced by φ(0; p), trained as an explicit net)
    and the explicit network (the SSM VAE; TwoRes for the NCSN)."""
    arms = {"deq_record": RECORD[family]}
    if family in ("dkef", "nice", "ncsn"):  # the paper's tables: DKEF, NICE; its DEQ-NCSN against TwoRes (§4.4)
        # the NCSN's experiment defaults to the normalised block, which ignores deq.norm: pin the paper's
        arms["deq_paper"] = f"deq=true {' '.join(PAPER_NCSN_BLOCK)}" if family == "ncsn" else PAPER
    arms["one_pass"] = f"{RECORD[family]} deq.one_pass=true"
    arms["explicit"] = EXPLICIT[family]
    if family == "ncsn":
        arms["deq_spectral"] = SPECTRAL_NCSN
        arms["one_pass_spectral"] = f"{SPECTRAL_NCSN} deq.one_pass=true"
    return arms


def jobs(grid: str, protocol: str = "short") -> list[dict]:
    out = []
    if grid == "protocol":
        return [{"family": fam, "arm": "deq_record", "seed": 0, "steps": None, "overrides": over, "test": False}
                for fam, over in PROTOCOL.items()]
    if grid == "candidates":  # round robin over the families: each family's first candidates come first
        for i in range(max(len(v) for v in CANDIDATES.values())):
            for fam, variants in CANDIDATES.items():
                if i < len(variants):
                    base, steps = FAMILIES[fam]
                    name, over = list(variants.items())[i]
                    out.append({"family": fam, "arm": name, "seed": 0, "steps": steps,
                                "overrides": f"{base} {over}", "test": False})
    else:
        for fam in RECORD if protocol == "short" else FULL_STEPS:  # full: the families with a committed protocol
            base, steps = FAMILIES[fam]
            steps = FULL_STEPS[fam] if protocol == "full" else DECISION_STEPS.get(fam, steps)
            extra = f" {DECISION_TEST[fam]}" if fam in DECISION_TEST else ""
            for seed in SEEDS:
                for arm, over in decision_arms(fam).items():
                    out.append({"family": fam, "arm": arm, "seed": seed, "steps": steps,
                                "overrides": f"{base} {over}{extra}", "test": True})
    return out


def command(job: dict, root: str, run_dir: str) -> list[str]:
    """The training command of ``job``: validation at the last step (the shares are read there); a job with no
    ``steps`` (the ``protocol`` grid) keeps its experiment's length and validation schedule."""
    length = []
    if job["steps"] is not None:
        length = [f"trainer.max_steps={job['steps']}",
                  f"trainer.val_check_interval={job['steps'] // VAL_EVERY.get(job['family'], 1)}",
                  "trainer.check_val_every_n_epoch=null"]
    return ["python", "-m", "src.train", *job["overrides"].split(), f"data.root={root}", f"seed={job['seed']}",
            *length, "logger=csv", f"test={str(job['test']).lower()}", f"hydra.run.dir={run_dir}"]


def run_dir(work: Path, job: dict) -> Path:
    return work / job["family"] / f"{job['arm']}_seed{job['seed']}"


def running(rd: Path) -> bool:
    """Whether another driver's training of this run directory is alive (its ``pid`` file names a process)."""
    try:
        os.kill(int((rd / "pid").read_text()), 0)
    except (FileNotFoundError, ValueError, ProcessLookupError, PermissionError):
        return False
    return True


def run_jobs(todo: list[dict], work: Path, root: str, parallel: int) -> None:
    """Train the jobs of ``todo`` not finished (no ``metrics.json``) nor running elsewhere, ``parallel`` at once,
    one torch thread each."""
    pending = [j for j in todo if not (run_dir(work, j) / "metrics.json").exists() and not running(run_dir(work, j))]
    run_parallel([(f"{j['family']}/{j['arm']} seed {j['seed']}",
                   [sys.executable, *command(j, root, str(run_dir(work, j)))[1:], *resume_overrides(run_dir(work, j))],
                   run_dir(work, j) / "stdout.log") for j in pending],
                 max(1, parallel), env=dict(thread_env(1), WANDB_MODE="disabled"))


def collect(job: dict, work: Path) -> dict:
    """A job's row: its settings, its command as recorded, and its figures when its ``metrics.json`` exists."""
    metrics = run_dir(work, job) / "metrics.json"
    row = {**job, "command": shown(command(job, "<data dir>", "<run dir>"))}
    if not metrics.exists():
        row["status"] = "missing"
        return row
    m = json.loads(metrics.read_text())
    row["status"] = "done"
    for key in KEYS:  # one block: val/<key>; several: the mean over blocks of val/<key>/<block>
        for stage in ("val", "test"):
            vals = [v for k, v in m.items() if k == f"{stage}/{key}" or k.startswith(f"{stage}/{key}/")]
            if vals:
                row[f"{stage}/{key}"] = statistics.mean(vals)
                row[f"{stage}/{key}_blocks"] = vals
    for key in ("test/sm_loss", "test/ssm_loss", "test/log_likelihood", "test/log_likelihood_stderr", "test/fid",
                "test/fid_bootstrap_sd", "test/fid_n_samples", "test/white_fraction", "test/white_fraction_real",
                "test/dsm_loss", "test/ssm_vr_loss", "test/score_ssm_loss", "val/sm_loss", "val/dsm_loss",
                "val/ssm_vr_loss", "val/ssm_loss", "profile/deq_iterations_mean", "profile/deq_hit_cap_count",
                "profile/time_per_step_s"):
        if key in m:
            row[key] = m[key]
    return row


def stop_rule(batch: int = 4, iters: int = 60) -> list[dict]:
    """Picard from z = 0 on a CIFAR-sized float32 state [B, 128, 32, 32] (input [B, 3, 32, 32] ~ N(0, 1)) of the
    convolutional DEQ blocks at initialisation: the relative residual ‖f(z) − z‖/‖f(z)‖ it bottoms out at, the
    absolute one, and the iterations each stop rule needs (None: never met in ``iters``)."""
    import torch

    from src.deq import ConvDEQBlock, DEQConfig, ResidualDEQBlock

    torch.manual_seed(0)
    rows = []
    for norm, lam in (("frobenius", 2.0), ("spectral", 2.0), ("spectral", 1.5), ("spectral", 1.05)):
        for cls in (ResidualDEQBlock, ConvDEQBlock):
            block = cls(3, 128, config=DEQConfig(norm=norm, norm_lambda=lam)).eval()
            x = torch.randn(batch, 3, 32, 32)
            with torch.no_grad():
                p = block.map_params(x)
                z, trace = torch.zeros(block.state_shape(x)), []
                for it in range(1, iters + 1):
                    fz = block.phi(z, *p)
                    ab = (fz - z).flatten(1).norm(dim=1)
                    trace.append((it, float((ab / fz.flatten(1).norm(dim=1)).max()), float(ab.max())))
                    z = fz
            first = {f"rel {t:g}": next((i for i, r, _ in trace if r <= t), None) for t in (1e-3, 1e-4, 1e-5)}
            first["abs 1e-5"] = next((i for i, _, a in trace if a <= 1e-5), None)
            rows.append({"block": cls.__name__, "norm": norm, "lambda": lam, "floor_rel": min(r for _, r, _ in trace),
                         "floor_abs": min(a for *_, a in trace), "norm_z": float(z.flatten(1).norm(dim=1).mean()),
                         "iterations_to": first})
    return rows


def stop_rule_markdown(section: dict) -> str:
    rows = section["rows"]
    keys = list(rows[0]["iterations_to"])
    lines = ["## stop rule (float32, state [4, 128, 32, 32], Picard from 0, blocks at initialisation)", "",
             "| block | norm | λ | ‖z*‖ | floor rel | floor abs | " + " | ".join(f"iters to {k}" for k in keys) + " |",
             "|" + "---|" * (6 + len(keys))]
    for r in rows:
        lines.append("| " + " | ".join(fmt(v) for v in (r["block"], r["norm"], r["lambda"], r["norm_z"], r["floor_rel"],
                                                         r["floor_abs"], *r["iterations_to"].values())) + " |")
    lines += ["", f"Command: `{section['command']}`", ""]
    return "\n".join(lines)


def fmt(v) -> str:
    if v is None:
        return "–"
    if isinstance(v, float):
        return f"{v:.4g}"
    return str(v)


def grid_command(grid: str) -> str:
    """The command that runs a grid's jobs (``decision_full``: ``decision --protocol full``)."""
    args = {"candidates": "candidates", "protocol": "protocol", "decision_short": "decision",
            "decision_full": "decision --protocol full"}
    return f"python -m {MODULE} {args[grid]} --root <data dir> --work <dir> --parallel 2"


# The claims a decision grid decides, per family: (claim, arm a, arm b) read "a's test figure is better than b's".
CLAIMS = (("the recurrence helps: the DEQ of record beats its one-pass control", "deq_record", "one_pass"),
          ("the recurrence helps: the spectral DEQ beats its one-pass control", "deq_spectral", "one_pass_spectral"),
          ("the DEQ of record beats the explicit network", "deq_record", "explicit"),
          ("the paper's DEQ (Frobenius λ = 2) beats the explicit network", "deq_paper", "explicit"),
          ("the DEQ of record beats the paper's DEQ", "deq_record", "deq_paper"))


def decision_figure(row: dict) -> float | None:
    """The row's first decision figure (:data:`DECISION_METRICS`), shown in the grid's table."""
    return next((row[k] for k, _, _ in DECISION_METRICS.get(row["family"], ()) if k in row), None)


def decision_summary(rows: list[dict]) -> list[str]:
    """Per family: each arm's decision figures (:data:`DECISION_METRICS`, then :data:`SHOWN`) and recurrence share
    as mean ± sd over seeds, then a verdict per claim and figure (:data:`CLAIMS`) by both rules of
    :func:`benchmarks.lib.results.seed_verdict`, each named: at 2 s.e. of the difference over seeds, and by Welch's
    t-test."""
    lines = []
    for family in dict.fromkeys(r["family"] for r in rows):
        mine = [r for r in rows if r["family"] == family]
        arms = dict.fromkeys(r["arm"] for r in mine)
        metrics = [m for m in DECISION_METRICS.get(family, ()) if any(m[0] in r for r in mine)]
        shown = [m for m in SHOWN.get(family, ()) if any(m[0] in r for r in mine)]
        values = {(a, k): [r.get(k) for r in mine if r["arm"] == a] for a in arms for k, *_ in metrics + shown}
        lines += [f"### {family}: mean ± sd over seeds", "",
                  "| arm | seeds | " + " | ".join(label for _, label, *_ in metrics + shown) + " | recurrence share |"
                  " iterations |", "|---|---|" + "---|" * (len(metrics) + len(shown) + 2)]
        for arm in arms:
            share = [r.get("val/deq_recurrence_share") for r in mine if r["arm"] == arm]
            iters = [r.get("val/deq_iterations") for r in mine if r["arm"] == arm]
            n = sum(1 for r in mine if r["arm"] == arm)
            cells = [format_summary(k, *summarise(values[(arm, k)]), 3 if "white" in k else 2)
                     for k, *_ in metrics + shown]
            lines.append(f"| {arm} | {n} | " + " | ".join(cells) + f" | {format_summary('share', *summarise(share), 3)}"
                         f" | {format_summary('iterations', *summarise(iters), 1)} |")
        lines += ["", "| claim | figure | verdict |", "|---|---|---|"]
        for claim, a, b in CLAIMS:
            if a in arms and b in arms:
                for key, label, lower in metrics:
                    verdict, _, _ = seed_verdict(values[(a, key)], values[(b, key)], lower_is_better=lower)
                    lines.append(f"| {claim} | {label} ({'lower' if lower else 'higher'} is better) | {verdict} |")
        lines.append("")
    return lines[:-1]  # blank lines between families, none after the last


def markdown(section: dict, grid: str) -> str:
    rows = section["rows"]
    lines = [f"## {grid}", "", ("| family | arm | seed | share (mean over blocks) | share max | branch ratio | "
             "contraction | iterations | hit cap | val loss | test figure |"), "|" + "---|" * 11]
    for r in rows:
        val = next((r[k] for k in ("val/sm_loss", "val/ssm_loss", "val/ssm_vr_loss", "val/dsm_loss") if k in r), None)
        test = decision_figure(r)
        lines.append("| " + " | ".join(fmt(x) for x in (
            r["family"], r["arm"], r["seed"], r.get("val/deq_recurrence_share"), r.get("val/deq_recurrence_share_max"),
            r.get("val/deq_branch_ratio"), r.get("val/deq_contraction_rate"), r.get("val/deq_iterations"),
            r.get("val/deq_hit_cap"), val, test)) + " |")
    if grid.startswith("decision"):
        lines += ["", *decision_summary(rows)]
    lines += ["", f"Jobs run by `{grid_command(grid)}`; table written by `{section['command']}`. Each job:", ""]
    lines += [f"- {r['family']}/{r['arm']} seed {r['seed']}: `{r['command']}`" for r in rows]
    return "\n".join(lines) + "\n"


def render(res: dict) -> str:
    """The markdown of ``deq_recurrence.json``: the choice of the blocks of record, then each grid's table and
    the stop-rule table (``--render`` rebuilds it byte for byte)."""
    meta = res["meta"]
    md = [f"# DEQ recurrence share (`python -m {MODULE}`)", "", *note_lines(meta),
          ("share = ‖z* − φ(0; p)‖/‖z*‖ per sample, mean over samples (and over blocks for DKEF / NICE), at the "
           f"last step's validation; near-inert below 10 %. Machine: {meta['machine']}; one torch thread per job; "
           f"written {meta['written']}."), ""]
    for grid in SECTIONS[1:]:
        if grid in res:
            md.append(markdown(res[grid], grid))
    if "stoprule" in res:
        md.append(stop_rule_markdown(res["stoprule"]))
    return "\n".join(md)


def legacy_layout(res: dict) -> dict:
    """A result written before this study ran as ``python -m`` (sections as bare row lists, the machine facts as
    a dict under ``machine``) in today's layout: each section ``{"command", "rows"}``, ``meta`` rewritten."""
    if "meta" in res or not res:
        return res
    res = dict(res)
    res.pop("machine", None)
    for grid, rows in list(res.items()):
        if isinstance(rows, list):
            args = "stoprule" if grid == "stoprule" else "report --work <dir>"
            res[grid] = {"command": f"python benchmarks/studies/deq_recurrence.py {args}", "rows": rows}
    return res


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("grid", nargs="?", choices=("candidates", "protocol", "decision", "report", "stoprule"))
    ap.add_argument("--root", default="data", help="data directory (data.root)")
    ap.add_argument("--work", default=None, help="directory of the run directories (outside the repository)")
    ap.add_argument("--parallel", type=int, default=2)
    ap.add_argument("--families", default=",".join(FAMILIES), help="comma-separated subset of the families")
    ap.add_argument("--arms", default=None, help="comma-separated family:arm subset (default: all)")
    ap.add_argument("--protocol", choices=("short", "full"), default="short",
                    help="decision grid: short = the probe lengths (DKEF 600, NICE 200 steps), full = the committed "
                         "protocols (DKEF 2700 ≈ 300 epochs, NICE 1000)")
    result_options(ap)
    args = ap.parse_args(argv)
    if rendered(args, STEM, render):
        return
    if not args.grid:
        ap.error("name a grid (candidates, protocol, decision, report, stoprule) or give --render")
    if args.grid != "stoprule" and not args.work:
        ap.error(f"{args.grid} needs --work <dir> (the run directories, outside the repository)")
    work = Path(args.work or ".")
    cmd = script_command(MODULE, sys.argv[1:] if argv is None else argv, data_root=args.root,
                         placeholders={args.work: "<dir>", str(args.out): "<out dir>"})
    import torch

    torch.set_num_threads(1)  # the stop-rule measurement runs here; each job has one thread too
    fams = set(args.families.split(","))
    results = {}
    if args.grid == "stoprule":
        results["stoprule"] = {"command": cmd, "rows": stop_rule()}
    for grid in () if args.grid == "stoprule" else (("candidates", "protocol", "decision") if args.grid == "report"
                                                     else (args.grid,)):
        todo = [j for j in jobs(grid, args.protocol) if j["family"] in fams
                and (not args.arms or f"{j['family']}:{j['arm']}" in args.arms.split(","))]
        name = f"decision_{args.protocol}" if grid == "decision" else grid
        if args.grid != "report":
            run_jobs(todo, work / name, args.root, args.parallel)
        rows = [r for r in (collect(j, work / name) for j in todo) if r["status"] == "done" or args.grid != "report"]
        if rows:
            results[name] = {"command": cmd, "rows": rows}
    res = legacy_layout(load_results(args.out, STEM))
    res.update(results)
    res["meta"] = {"machine": machine_facts(), "written": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
                   "commands": list(dict.fromkeys(res[g]["command"] for g in SECTIONS if g in res)),
                   "note": CHOICE}
    write_results(args.out, STEM, res, render)
    print(render(res))


if __name__ == "__main__":
    main()
