"""The multi-seed generative comparison in one command: every (seed, variant) of a ``training_curves.py`` grid
trained and tested as its own process, N at a time, then each seed's parts merged and the seeds put side by side
by ``generative_seeds.py`` (mean ± sd over seeds, the metrics' own sampling error, equal-step and equal-time
verdicts).

    python -m benchmarks.tools.seeds_campaign vae --root <data dir> --gpu --parallel 12      # one GPU, 12 processes
    python -m benchmarks.tools.seeds_campaign vae --root <data dir> --parallel 2             # a 2-core CPU
    python -m benchmarks.tools.seeds_campaign ncsn --root <data dir> --gpu --parallel 12 \\
        --eval-extra 'model.sampling.step_lr=<eps> model.sampling.n_steps_each=<T>'
    python -m benchmarks.tools.seeds_campaign vae --root <data dir> --dry-run                # CPU, tiny: seconds

The protocol is the decisive comparison's (docs/experiments.md, "The multi-seed generative comparison"):

- ``vae``: SSM VAE / Aug(8) / Aug(16) / DEQ (``experiment=vae_mnist``), 12 000 Lightning steps (6 000
  iterations), a checkpoint every 3 000, each tested with FID of 1 000 samples (bootstrap sd over 100
  resamplings) and AIS on 16 test images, the last one again with AIS on 500 test images;
- ``ncsn``: RefineNet / TwoRes / DEQ / DEQ spectral (``experiment=ncsn_mnist`` at batch 32), 3 000 steps, a
  checkpoint every 500, FID of 1 000 samples (bootstrap sd over 100 resamplings) and the test DSM / SSM-VR
  losses; the Langevin sampler is the experiment's unless ``--eval-extra`` names another (choose it on the
  RefineNet's held-out FID with ``benchmarks/studies/ncsn_langevin_step.py`` first).

Every option of the protocol can be changed (``--steps``, ``--every``, ``--fid-samples``, …); the defaults are
the protocol above. Each part is ``training_curves.py <grid> --variants V --seed S`` with its log in
``<work>/<part>.log``; a part that fails is reported and left out, the others go on. Everything is resumable the
way ``training_curves.py`` is: run the same command again and finished trainings and tested checkpoints are
reused. Arms may be started apart (``--variants``, the same ``--name`` and ``--work``): each seed's merge and the
comparison take every finished part of the name. ``--curve-seeds 0`` tests every kept checkpoint of seed 0 only
(the training curve) and the last checkpoint of the others (what the comparison reads), the others kept on disk.

Wall time: with ``--parallel`` above 1 the parts share the machine, so a part's training time (and so the
equal-wall-time comparison) includes the others' load, which changes as parts finish. Each part records how many
processes ran at once (``training_curves.py --concurrent``) and the seeds' table says so; for wall times that
compare cleanly run ``--parallel 1`` or take the per-step times of ``python -m benchmarks.tools.profile_step``.

Writes the per-seed results ``<name>_seed<S>.{json,md,png}`` and the parts under ``--work`` (default
``outputs/benchmarks/seeds/<grid>``), and the comparison ``<name>.{json,md,png}`` in ``--out`` (default
``benchmarks/results``; a ``--dry-run`` writes both under ``outputs/seeds_campaign_dry_run``). ``--name``
defaults to ``<grid>_mnist_seeds``.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

from benchmarks.lib.generative_grids import GRIDS
from benchmarks.lib.jobs import run_module, run_parallel
from benchmarks.lib.results import ROOT, rel, shown
from benchmarks.lib.runs import slug

# the decisive comparison's protocol per grid (training_curves.py options)
PROTOCOL = {
    "vae": {"steps": 12000, "every": 3000, "fid_samples": 1000, "ais_points": 16, "final_ais_points": 500,
            "extra": "", "eval_extra": "model.metrics.fid.bootstrap=100"},
    "ncsn": {"steps": 3000, "every": 500, "fid_samples": 1000, "ais_points": 16, "final_ais_points": 0,
             "extra": "data.batch_size=32", "eval_extra": "model.metrics.fid.bootstrap=100"},
    # conf/experiment/ncsn_mnist_long.yaml holds batch, EMA, noise, sampler and the FID's size and bootstrap
    "ncsn_long": {"steps": 6000, "every": 1500, "fid_samples": 1000, "ais_points": 16, "final_ais_points": 0,
                  "extra": "", "eval_extra": ""},
}
# a dry run: the same code path on the CPU at tiny sizes (data, model, sampler, AIS, FID)
DRY = {
    "vae": {"steps": 4, "every": 2, "fid_samples": 8, "ais_points": 2, "final_ais_points": 3,
            "extra": ("data.limit=256 data.batch_size=8 data.eval_batch_size=16 model.latent_dim=4 model.hidden=16 "
                      "model.channels=8 model.metrics.vae.val_points=8 trainer.val_check_interval=2 "
                      "trainer.limit_val_batches=1 callbacks.memory_estimate=null"),
            "eval_extra": ("model.metrics.fid.bootstrap=4 model.metrics.log_likelihood.ais.n_steps=5 "
                           "model.metrics.log_likelihood.ais.n_chains=2 model.metrics.log_likelihood.ais.leapfrog=2 "
                           "model.metrics.vae.test_points=16 trainer.limit_test_batches=1 model.n_samples_grid=4")},
    "ncsn": {"steps": 4, "every": 2, "fid_samples": 8, "ais_points": 2, "final_ais_points": 0,
             "extra": ("data.limit=200 data.batch_size=8 data.eval_batch_size=16 model.ngf=4 "
                       "model.noise.num_classes=3 trainer.val_check_interval=2 trainer.limit_val_batches=1 "
                       "callbacks.memory_estimate=null"),
             "eval_extra": ("model.metrics.fid.bootstrap=4 model.sampling.n_steps_each=1 "
                            "model.metrics.noise_conditional.test_points=8 trainer.limit_test_batches=1 "
                            "model.n_samples_grid=4")},
}
DRY["ncsn_long"] = DRY["ncsn"]
GPU = "trainer.accelerator=gpu trainer.devices=1"


def part_name(name: str, seed: int, variant: str) -> str:
    return f"{name}_seed{seed}_{slug(variant)}"


def part_command(args, seed: int, variant: str) -> list[str]:
    """One part: ``training_curves.py`` for one variant and one seed (the command a user could run alone)."""
    return [sys.executable, "-m", "benchmarks.tools.training_curves", args.grid, "--root", args.root, "--variants", variant,
            "--seed", str(seed), "--steps", str(args.steps), "--every", str(args.every),
            "--fid-samples", str(args.fid_samples), "--ais-points", str(args.ais_points),
            "--final-ais-points", str(args.final_ais_points), "--threads", str(args.threads),
            "--concurrent", str(args.parallel), "--extra", args.extra, "--eval-extra", args.eval_extra,
            "--runs", rel(args.runs), "--out", rel(args.work / "parts"),
            "--name", part_name(args.name, seed, variant),
            *(() if seed in args.curve_seeds else ("--test-every", str(args.steps)))]


def merged_overrides(protocol: str, user: str | None) -> str:
    """``key=value`` overrides of the protocol and then the user's, space separated, each key once: a key the user
    gives replaces the protocol's value where the protocol had it (Hydra would take the later of two anyway, but a
    recorded command that names a key twice reads as two settings)."""
    merged: dict[str, str] = {}
    for item in f"{protocol} {user or ''}".split():
        merged[item.split("=", 1)[0]] = item
    return " ".join(merged.values())


def finished_parts(paths: list[Path]) -> tuple[list[Path], list[Path]]:
    """``paths`` (part JSONs of one name and seed) split into finished ones and ones still under way. A part is
    finished when ``training_curves`` wrote its real-data FID reference (``meta.real_fid_n``), which it does after
    its last test; a part another campaign process is still testing (two processes sharing ``--name``) has runs
    but no reference yet, and merging it would refuse the whole seed (the protocols differ)."""
    finished, running = [], []
    for path in paths:
        res = json.loads(path.read_text())
        if res.get("runs"):
            (finished if res.get("meta", {}).get("real_fid_n") else running).append(path)
    return finished, running


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("grid", choices=sorted(GRIDS))
    ap.add_argument("--root", default="data", help="data.root of every job")
    ap.add_argument("--seeds", default="0,1,2")
    ap.add_argument("--variants", default=None, help="comma-separated variant names (default: all of the grid)")
    ap.add_argument("--curve-seeds", default=None,
                    help="seeds whose every kept checkpoint is tested (the training curve); the other seeds test "
                         "only their last checkpoint, the one the comparison reads (default: every seed)")
    ap.add_argument("--parallel", type=int, default=1, help="parts (processes) run at once")
    ap.add_argument("--threads", type=int, default=None,
                    help="torch threads per part (default: the cores shared among --parallel parts)")
    ap.add_argument("--gpu", action="store_true", help=f"train and test on the GPU ({GPU})")
    ap.add_argument("--dry-run", action="store_true", help="CPU, tiny sizes: the same code path in seconds")
    for key in ("steps", "every", "fid_samples", "ais_points", "final_ais_points"):
        ap.add_argument(f"--{key.replace('_', '-')}", type=int, default=None, help="default: the protocol's")
    ap.add_argument("--extra", default=None,
                    help="training overrides added to the protocol's (ncsn: data.batch_size=32), space separated")
    ap.add_argument("--eval-extra", default=None,
                    help="test overrides added to the protocol's (model.metrics.fid.bootstrap=100), space separated")
    ap.add_argument("--work", type=Path, default=None,
                    help="parts, logs and per-seed results (default outputs/benchmarks/seeds/<grid>)")
    ap.add_argument("--runs", type=Path, default=None, help="run directories (default <work>/runs)")
    ap.add_argument("--out", type=Path, default=None, help="the comparison's folder (default benchmarks/results)")
    ap.add_argument("--name", default=None, help="result file stem (default <grid>_mnist_seeds)")
    args = ap.parse_args(argv)

    preset = (DRY if args.dry_run else PROTOCOL)[args.grid]
    for key, value in preset.items():
        if key in ("extra", "eval_extra"):  # added to the protocol's overrides; the user's value of a key wins
            setattr(args, key, merged_overrides(value, getattr(args, key)))
        elif getattr(args, key) is None:
            setattr(args, key, value)
    if args.gpu and args.dry_run:
        ap.error("--dry-run runs on the CPU; drop --gpu")
    if args.gpu:
        import torch

        if not torch.cuda.is_available():
            raise SystemExit("seeds_campaign: --gpu but no CUDA device is visible; drop --gpu to run on the CPU")
        args.extra = merged_overrides(args.extra, GPU)
        args.eval_extra = merged_overrides(args.eval_extra, GPU)
    args.name = args.name or f"{args.grid}_mnist_seeds"
    base = ROOT / "outputs" / "seeds_campaign_dry_run" if args.dry_run else None
    args.work = (args.work or (base / "work" if base else ROOT / "outputs" / "benchmarks" / "seeds" / args.grid)).resolve()
    args.runs = (args.runs or args.work / "runs").resolve()
    args.out = (args.out or (base if base else ROOT / "benchmarks" / "results")).resolve()
    args.parallel = max(1, args.parallel)
    args.threads = args.threads or max(1, (os.cpu_count() or 1) // args.parallel)
    seeds = [int(s) for s in args.seeds.split(",")]
    args.curve_seeds = set(seeds if args.curve_seeds is None else (int(s) for s in args.curve_seeds.split(",")))
    variants = args.variants.split(",") if args.variants else list(GRIDS[args.grid]["variants"])
    unknown = [v for v in variants if v not in GRIDS[args.grid]["variants"]]
    if unknown:
        raise SystemExit(f"unknown variant(s) {', '.join(map(repr, unknown))}; valid: "
                         f"{', '.join(GRIDS[args.grid]['variants'])}")

    jobs = [(s, v, part_command(args, s, v)) for s in seeds for v in variants]
    print(f"{args.grid}: {len(jobs)} parts ({len(seeds)} seeds x {len(variants)} variants), {args.parallel} at "
          f"once, {args.threads} torch thread(s) each; logs in {args.work / 'logs'}", flush=True)
    t0 = time.time()
    status = run_parallel([(f"seed {s} {v}", cmd, args.work / "logs" / f"{part_name(args.name, s, v)}.log")
                           for s, v, cmd in jobs], args.parallel)

    per_seed = []
    for s in seeds:
        # every finished part of this name and seed, also of variants an earlier call ran (arms started apart)
        parts, running = finished_parts(sorted((args.work / "parts").glob(f"{args.name}_seed{s}_*.json")))
        parts = [rel(p) for p in parts]
        if running:
            print(f"seed {s}: left out until it finishes (another process still tests it): "
                  f"{', '.join(p.name for p in running)}", flush=True)
        if not parts:
            print(f"seed {s}: no part finished; left out", flush=True)
            continue
        merged, _ = run_module("benchmarks.tools.training_curves", [args.grid, "--merge", *parts, "--out",
                                                                      rel(args.work), "--name", f"{args.name}_seed{s}"],
                               capture=False)
        if merged == 0:
            per_seed.append(args.work / f"{args.name}_seed{s}.json")
    failed = [part for part, r in status.items() if r["code"] != 0]
    summary = {"parts": len(jobs), "failed": failed, "wall_s": time.time() - t0, "per_seed": list(map(str, per_seed)),
               "commands": [shown(c) for _, _, c in jobs]}
    if per_seed:
        code, _ = run_module("benchmarks.tools.generative_seeds", [
            args.grid, *(x for p in per_seed for x in ("--part", rel(p))), "--out", rel(args.out), "--name", args.name],
            capture=False)
        summary["comparison"] = str(args.out / f"{args.name}.md") if code == 0 else None
    print(f"{args.grid}: {len(jobs) - len(failed)}/{len(jobs)} parts finished in {summary['wall_s']:.0f} s"
          + (f"; failed: {', '.join(failed)}" if failed else ""), flush=True)
    if failed and not per_seed:
        raise SystemExit(f"seeds_campaign: every part failed; see the logs in {args.work / 'logs'}")
    return summary


if __name__ == "__main__":
    main()
