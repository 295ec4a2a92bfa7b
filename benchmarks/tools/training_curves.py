"""Train the variants of a generative model for the same number of steps, keep a checkpoint every N steps,
and evaluate every checkpoint: metrics (FID, AIS log-likelihood, test losses) against steps and wall time.

    python -m benchmarks.tools.training_curves vae  --root data [--steps 6000] [--every 1500] [--ais-points 16]
    python -m benchmarks.tools.training_curves ncsn --root data [--steps 1000] [--every 500] [--fid-samples 250]
    python -m benchmarks.tools.training_curves vae --render            # rebuild the markdown and figure from the JSON
    python -m benchmarks.tools.training_curves ncsn --merge A.json B.json --name N   # variants run side by side, as one

``vae`` is the paper's Table 1 protocol on binarised MNIST (`experiment=vae_mnist`: SSM VAE, Aug(8), Aug(16),
DEQ), ``ncsn`` its Table 5 protocol on MNIST (`experiment=ncsn_mnist`: RefineNet, TwoRes, DEQ, SSM-VR).
Each variant is one ``python -m src.train`` process (the command a user types, plus a second
``ModelCheckpoint`` that keeps ``step_XXXXXXX.ckpt`` every ``--every`` steps; ``test=false``), run directory
``--runs``/<grid>/<variant>. Then every kept checkpoint is tested with ``src.evaluate`` and the overrides of
``--eval``-type options. The wall time of a checkpoint is the training time that produced it: the profiling
callback's summed step times, saved in the checkpoint (validation, test and start-up excluded).

Resumable and extendable: a variant whose run directory holds ``metrics.json`` of a run that reached
``--steps`` is not trained again; an interrupted one, or one asked for more steps than it ran, continues from
its ``last.ckpt``; a checkpoint already in the results JSON is not evaluated again. Results are
rewritten after every evaluation: ``<name>.json`` (machine, commands, every point), ``<name>.md`` (one table
per variant, a summary table) and ``<name>.png`` (each metric against steps and against wall time), plus the
last checkpoint's sample grid per variant, ``<name>_<variant>_samples.png``, in ``--out``.

Side by side: with two cores, one process per variant (each ``--variants V --name <part>``, the same
``--runs``, ``--steps``, ``--every`` and eval options) finishes sooner than one process training them in turn;
``--merge`` then joins the parts into ``<name>`` (refused if their protocols or seeds differ).

Seeds: ``--seed S`` trains every variant with ``seed=S`` in its own run directory (``<variant>_seed<S>`` for
S ≥ 1); one result per seed (``--name <grid>_seed<S>``), then ``benchmarks/tools/generative_seeds.py`` puts the seeds
side by side (mean ± sd, error bands, verdicts).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import sys
import time
from pathlib import Path

from benchmarks.lib.generative_grids import GRIDS
from benchmarks.lib.jobs import run_module
from benchmarks.lib.results import ROOT, note_lines, shown, write_results
from benchmarks.lib.runs import merge_curves as merge
from benchmarks.lib.runs import run_dir_name, slug
from src.reports.tables import figure, markdown_table

SUMMARY = [("n_params", "params", "{:,.0f}"), ("profile/time_per_step_s", "s / step", "{:.3f}"),
           ("profile/saved_bytes_mean", "saved MB / step", "{:.1f}"), ("profile/deq_iterations_mean", "DEQ iters",
                                                                       "{:.1f}")]



def machine_facts(threads: int, train_overrides: list[str], eval_overrides: list[str], concurrent: int = 1) -> str:
    """Machine, versions and the device of training and of evaluation (a checkpoint is tested where its run
    trained unless ``--eval-extra`` names another accelerator); with ``concurrent`` > 1, that this process shared
    the machine with others (``seeds_campaign.py --parallel``), so its wall times include their load."""
    import torch

    def device(overrides: list[str], default: str) -> str:
        for o in reversed(overrides):
            if o in ("trainer=gpu", "trainer.accelerator=gpu", "trainer.accelerator=cuda"):
                return f"cuda ({torch.cuda.get_device_name(0)})" if torch.cuda.is_available() else "cuda"
            if o in ("trainer=cpu", "trainer.accelerator=cpu"):
                return "cpu"
        return default

    train = device(train_overrides, "cpu")
    where = f"device {train}" if device(eval_overrides, train) == train else \
        f"training on {train}, evaluation on {device(eval_overrides, train)}"
    shared = f"; {concurrent} processes at once (wall times include the others' load)" if concurrent > 1 else ""
    return (f"{platform.machine()}, {os.cpu_count()} cores; python {platform.python_version()}; torch "
            f"{torch.__version__}; {where}, {threads} torch thread(s) per process{shared}")


def train_command(grid: dict, variant: str, args, run_dir: Path) -> list[str]:
    ckpt_dir = run_dir / "step_checkpoints"
    cmd = [sys.executable, "-m", "src.train", grid["experiment"], *grid["variants"][variant],
           f"data.root={args.root}", f"trainer.max_steps={args.steps}", f"seed={args.seed}", "test=false",
           "logger=csv", "trainer.enable_progress_bar=false", f"hydra.run.dir={run_dir}",
           "+callbacks.step_checkpoint._target_=lightning.pytorch.callbacks.ModelCheckpoint",
           f"+callbacks.step_checkpoint.dirpath={ckpt_dir}",
           '+callbacks.step_checkpoint.filename="step_{step:07d}"',
           "+callbacks.step_checkpoint.auto_insert_metric_name=false",
           f"+callbacks.step_checkpoint.every_n_train_steps={args.every}",
           "+callbacks.step_checkpoint.save_top_k=-1", *args.extra]
    last = run_dir / "checkpoints" / "last.ckpt"
    if last.is_file():  # an interrupted run: continue it
        cmd.append(f"ckpt_path={last}")
    return cmd


def eval_overrides(grid_name: str, args) -> list[str]:
    extra = args.eval_extra.split()
    if grid_name == "vae":
        return [f"model.metrics.fid.n_samples={args.fid_samples}",
                f"model.metrics.log_likelihood.test_points={args.ais_points}", *extra]
    return [f"model.metrics.fid.n_samples={args.fid_samples}", *extra]


def tested_checkpoints(run_dir: Path, test_every: int | None) -> list[Path]:
    """The kept step checkpoints to test, in step order: all of them, or (``test_every``) those at multiples of
    ``test_every`` steps and the last one (a curve on some seeds, the final point on the others)."""
    kept = sorted((run_dir / "step_checkpoints").glob("step_*.ckpt"))
    if not test_every:
        return kept
    return [c for i, c in enumerate(kept) if i == len(kept) - 1 or int(c.stem.split("_")[1]) % test_every == 0]


def checkpoint_facts(path: Path) -> dict:
    from src.runtime.checkpoints import load_checked

    ckpt = load_checked(path)  # weights-only (src.runtime.checkpoints)
    wall = None
    for key, state in (ckpt.get("callbacks") or {}).items():
        if "ProfilingCallback" in str(key) and isinstance(state, dict):
            wall = state.get("train_time_s")
    return {"step": int(ckpt["global_step"]), "train_time_s": wall}


def real_data_fid(run_dir: Path, n: int, root: str) -> float:
    """FID of ``n`` real training images against the ``n`` test images the FID metric compares samples with:
    what a perfect sampler would score at this sample size (FID is biased upwards at small n)."""
    from hydra.utils import instantiate
    from omegaconf import OmegaConf

    from src.metrics.fid import build_fid

    cfg = OmegaConf.load(run_dir / ".hydra" / "config.yaml")
    cfg.data.root = root
    dm = instantiate(cfg.data)
    dm.setup("fit")
    dm.setup("test")
    fid_cfg = cfg.model.metrics.fid
    fid = build_fid(fid_cfg.kind, fid_cfg.get("weights"), fid_cfg.get("sha256"))
    fid.update(dm.to_pixels(dm.split_tensor("train", n)).float(), real=False)
    fid.update(dm.to_pixels(dm.split_tensor("test", n)).float(), real=True)
    return float(fid.compute())


def evaluate_final(run: dict, run_dir: Path, args, evaluate) -> None:
    """vae: the last checkpoint again with AIS on ``--final-ais-points`` test images (mean ± standard error
    over images), kept as ``run["final"]``; not repeated when the JSON holds it for that checkpoint and size."""
    ckpts = sorted((run_dir / "step_checkpoints").glob("step_*.ckpt"))
    if not ckpts:
        return
    last, n = ckpts[-1], int(args.final_ais_points)
    done = run.get("final") or {}
    if done.get("checkpoint") == last.name and done.get("ais_points") == n:
        return
    overrides = [o for o in eval_overrides("vae", args)
                 if not o.startswith("model.metrics.log_likelihood.test_points=")]
    t0 = time.time()
    metrics = evaluate(last, [*overrides, f"model.metrics.log_likelihood.test_points={n}"])
    run["final"] = checkpoint_facts(last) | {"checkpoint": last.name, "ais_points": n, "eval_s": time.time() - t0,
                                             "metrics": {k: v for k, v in metrics.items()
                                                         if isinstance(v, (int, float))},
                                             # AIS per test image (the same first n images in every run): the
                                             # arms compare paired by image (generative_seeds.py)
                                             "per_point": metrics.get("test/log_likelihood_per_point")}
    print(f"{last.name}: AIS on {n} test images in {time.time() - t0:.0f} s", flush=True)


def save(res: dict, args) -> None:
    write_results(args.out, args.name, res, render)
    plot(res, Path(args.out) / f"{args.name}.png")



def _fmt(fmt: str, value) -> str:
    return "—" if value is None else fmt.format(value)


def _cell(metrics: dict, key: str, fmt: str) -> str:
    """One checkpoint's metric, with its bootstrap sd (``<key>_bootstrap_sd``: the FID's) when the test measured one."""
    sd = metrics.get(f"{key}_bootstrap_sd")
    return _fmt(fmt, metrics.get(key)) + ("" if sd is None or metrics.get(key) is None else f" ± {fmt.format(sd)}")


def render(res: dict) -> str:
    grid = GRIDS[res["meta"]["grid"]]
    per_it = grid["steps_per_iteration"]
    if res["meta"].get("commands"):  # merged parts, run side by side
        ran = ["Commands, one process per variant, run side by side and merged with `--merge`:", "", "```bash",
               *res["meta"]["commands"], "```"]
    else:
        ran = [f"Command: `{res['meta']['command']}`"]
    lines = [f"# Training curves: {res['meta']['grid']} ({res['meta']['experiment']})", "", *ran, "",
             f"Machine: {res['meta']['machine']}", "", *note_lines(res["meta"]),
             f"Each checkpoint tested with `python -m src.evaluate ckpt_path=<checkpoint> "
             f"{' '.join(res['meta']['eval_overrides'])}`. Wall time = summed training step time "
             "(validation, test and start-up excluded)." + (
                 f" Steps are Lightning optimiser steps: {per_it} per model iteration." if per_it > 1 else "") + (
                 " FID ± its bootstrap sd (both image sets resampled with replacement)." if any(
                     "test/fid_bootstrap_sd" in p["metrics"] for r in res["runs"].values()
                     for p in r.get("points", {}).values()) else ""), ""]
    if res["meta"].get("real_fid") is not None:
        lines += [(f"Reference: FID of {res['meta']['real_fid_n']} real training images against the test images "
                   f"the metric uses: {res['meta']['real_fid']:.1f} (the floor at this sample size)."), ""]
    head = ["variant", *(h for _, h, _ in SUMMARY)]
    rows = []
    for name, run in res["runs"].items():
        t = run.get("train", {})
        rows.append([name, *(_fmt(f, t.get(k) / 1e6 if k.endswith("bytes_mean") and t.get(k) else t.get(k))
                             for k, _, f in SUMMARY)])
    lines += ["## Variants", "", *markdown_table(head, rows), "", "Training commands:", "", "```bash",
              *(run["command"] for run in res["runs"].values() if run.get("command")), "```", ""]
    finals = {name: run["final"] for name, run in res["runs"].items() if run.get("final")}
    if finals:
        ref = res["runs"].get("Aug(16)-SSM VAE", {}).get("train", {}).get("profile/saved_bytes_mean")
        head = ["variant", "step", "AIS log p(x) ± s.e.", "images", "FID", "recon −log p(x\\|z)", "saved MB / step",
                "saved bytes / Aug(16)'s"]
        rows = []
        for name, f in finals.items():
            m, saved = f["metrics"], res["runs"][name].get("train", {}).get("profile/saved_bytes_mean")
            ll, se = m.get("test/log_likelihood"), m.get("test/log_likelihood_stderr")
            rows.append([name, f["step"], "—" if ll is None else f"{ll:.2f} ± {se:.2f}" if se else f"{ll:.2f}",
                         f["ais_points"], _fmt("{:.1f}", m.get("test/fid")), _fmt("{:.2f}", m.get("test/recon_error")),
                         _fmt("{:.1f}", saved / 1e6 if saved else None),
                         _fmt("{:.2f}", saved / ref if saved and ref else None)])
        lines += ["## Last checkpoint, AIS on more test images", "",
                  ("The last checkpoint of each variant tested again with AIS on the first N test images (the same "
                  "images for every variant, so differences between rows are paired and vary less than the "
                  "standard errors over images suggest)."), "", *markdown_table(head, rows), ""]
    for name, run in res["runs"].items():
        pts = sorted(run.get("points", {}).values(), key=lambda p: p["step"])
        if not pts:
            continue
        head = ["step", "iteration", "wall s", *(h for _, h, _ in grid["metrics"])]
        rows = [[p["step"], p["step"] // per_it, _fmt("{:.0f}", p.get("train_time_s")),
                 *(_cell(p["metrics"], k, f) for k, _, f in grid["metrics"])] for p in pts]
        lines += [f"## {name}", "", *markdown_table(head, rows), ""]
        if run.get("samples"):
            lines += [f"Samples of the last checkpoint: ![{name}]({run['samples']})", ""]
    return "\n".join(lines) + "\n"


def plot(res: dict, path: Path) -> None:
    metrics = [m for m in GRIDS[res["meta"]["grid"]]["metrics"]
               if any(p["metrics"].get(m[0]) is not None for r in res["runs"].values()
                      for p in r.get("points", {}).values())]
    if not metrics:
        return
    with figure(path, len(metrics), 2, figsize=(9, 2.8 * len(metrics))) as (_fig, axes):
        for i, (key, label, _) in enumerate(metrics):
            for name, run in res["runs"].items():
                pts = sorted((p for p in run.get("points", {}).values() if p["metrics"].get(key) is not None),
                             key=lambda p: p["step"])
                if not pts:
                    continue
                axes[i][0].plot([p["step"] for p in pts], [p["metrics"][key] for p in pts], "o-", label=name)
                if all(p.get("train_time_s") is not None for p in pts):
                    axes[i][1].plot([p["train_time_s"] for p in pts], [p["metrics"][key] for p in pts], "o-",
                                    label=name)
            axes[i][0].set(xlabel="training steps", ylabel=label)
            axes[i][1].set(xlabel="training wall time (s)", ylabel=label)
        axes[0][0].legend(fontsize=7)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("grid", choices=sorted(GRIDS))
    ap.add_argument("--root", default="data", help="data.root of every job")
    ap.add_argument("--steps", type=int, default=None, help="trainer.max_steps (default: vae 6000, ncsn 1000)")
    ap.add_argument("--every", type=int, default=None, help="keep a checkpoint every this many steps")
    ap.add_argument("--test-every", type=int, default=None,
                    help="test only the kept checkpoints at multiples of this many steps, and the last one "
                         "(default: every kept checkpoint; the others stay on disk to test later)")
    ap.add_argument("--variants", default=None, help="comma-separated variant names (default: all)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--fid-samples", type=int, default=1000)
    ap.add_argument("--ais-points", type=int, default=16, help="vae: AIS on the first this-many test images")
    ap.add_argument("--final-ais-points", type=int, default=0,
                    help="vae: test the last checkpoint again with AIS on this many test images (0: not)")
    ap.add_argument("--threads", type=int, default=1, help="torch threads of training and evaluation")
    ap.add_argument("--concurrent", type=int, default=1,
                    help="how many such processes share the machine (recorded: wall times include their load)")
    ap.add_argument("--extra", default="", help="extra overrides for every training job, space separated")
    ap.add_argument("--eval-extra", default="", help="extra overrides for every checkpoint's test, space separated")
    ap.add_argument("--keep-fid-samples", type=Path, default=None, metavar="DIR",
                    help="save each test's generated images behind its FID in the run directory "
                         "(fid_samples/<checkpoint>.pt, uint8: model.metrics.fid.samples_file) and copy the last "
                         "checkpoint's to DIR as <name>_<variant>_seed<seed>_<checkpoint>.pt")
    ap.add_argument("--runs", default="outputs/benchmarks/curves")
    ap.add_argument("--out", default="benchmarks/results")
    ap.add_argument("--name", default=None, help="result file stem (default: <grid>_mnist_curves)")
    ap.add_argument("--render", action="store_true", help="run nothing: rebuild markdown and figure from JSON")
    ap.add_argument("--merge", nargs="+", type=Path, default=None, metavar="JSON",
                    help="run nothing: join these partial results (one grid and protocol) into --out/--name")
    ap.add_argument("--note", type=Path, default=None,
                    help="with --render or --merge: a markdown note about how the result was made (e.g. which points "
                         "were copied from another result), stored in the JSON's meta.note and shown below the "
                         "machine line")
    args = ap.parse_args(argv)
    grid = GRIDS[args.grid]
    args.name = args.name or f"{args.grid}_mnist_curves"
    args.steps = args.steps or {"vae": 6000, "ncsn": 1000, "ncsn_long": 6000}[args.grid]
    args.every = args.every or args.steps // 4
    args.extra = args.extra.split()
    res_path = Path(args.out) / f"{args.name}.json"
    if args.render or args.merge:
        res = json.loads(res_path.read_text()) if args.render else merge(args.merge, Path(args.out), args.name)
        if args.note:
            res["meta"]["note"] = args.note.read_text()
        save(res, args)
        return
    os.environ["OMP_NUM_THREADS"] = str(args.threads)
    import torch

    torch.set_num_threads(args.threads)
    from src.runs.evaluation import evaluate

    res = json.loads(res_path.read_text()) if res_path.is_file() else {"runs": {}}
    kept = {k: v for k, v in res.get("meta", {}).items() if k in ("real_fid", "real_fid_n")}  # not recomputed
    machine = machine_facts(args.threads, args.extra, args.eval_extra.split(), args.concurrent)
    res["meta"] = {"grid": args.grid, "experiment": grid["experiment"], "machine": machine,
                   "concurrent": args.concurrent, "command": shown([sys.executable, "-m", "benchmarks.tools.training_curves", *sys.argv[1:]]), "seed": args.seed,
                   "eval_overrides": eval_overrides(args.grid, args),
                   **kept}
    names = args.variants.split(",") if args.variants else list(grid["variants"])
    for name in names:
        if name not in grid["variants"]:
            raise SystemExit(f"unknown variant {name!r}; valid: {', '.join(grid['variants'])}")
        run_dir = (ROOT / args.runs / args.grid / run_dir_name(name, args.seed)).resolve()
        run = res["runs"].setdefault(name, {"points": {}})
        done = run_dir / "metrics.json"
        if not done.is_file() or json.loads(done.read_text()).get("global_step", 0) < args.steps:
            cmd = train_command(grid, name, args, run_dir)
            run["command"] = shown([c for c in cmd if not c.startswith("ckpt_path=")])
            t0 = time.time()
            code, _ = run_module("src.train", cmd[3:], capture=False)
            if code != 0:
                print(f"{name}: training failed (exit {code}); see {run_dir}/train.log", flush=True)
                continue
            print(f"{name}: trained in {time.time() - t0:.0f} s", flush=True)
        else:
            run.setdefault("command", shown(train_command(grid, name, args, run_dir)))
        train = json.loads((run_dir / "metrics.json").read_text())
        run["train"] = {k: train.get(k) for k, _, _ in SUMMARY} | {"global_step": train.get("global_step")}
        for ckpt in tested_checkpoints(run_dir, args.test_every):
            if ckpt.name in run["points"]:
                continue
            facts = checkpoint_facts(ckpt)
            t0 = time.time()
            keep = [f"model.metrics.fid.samples_file={run_dir / 'fid_samples' / (ckpt.stem + '.pt')}"] \
                if args.keep_fid_samples else []
            metrics = evaluate(ckpt, eval_overrides(args.grid, args) + keep)
            run["points"][ckpt.name] = facts | {"eval_s": time.time() - t0, "metrics": {
                k: v for k, v in metrics.items() if isinstance(v, (int, float))}}
            save(res, args)
            print(f"{name} {ckpt.name}: evaluated in {time.time() - t0:.0f} s", flush=True)
        if args.final_ais_points and args.grid == "vae":
            evaluate_final(run, run_dir, args, evaluate)
            save(res, args)
        kept = sorted((run_dir / "fid_samples").glob("step_*.pt")) if args.keep_fid_samples else []
        if kept:  # the last checkpoint's FID samples, committed beside the result (uint8, ~0.8 MB a 1000)
            target = f"{args.name}_{slug(name)}_seed{args.seed}_{kept[-1].stem}.pt"
            args.keep_fid_samples.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(kept[-1], args.keep_fid_samples / target)
            run["fid_samples"] = str(Path(args.keep_fid_samples.name) / target)
        samples = run_dir / "samples.png"  # the test of the last checkpoint evaluated wrote it
        if samples.is_file():
            target = f"{args.name}_{slug(name)}_samples.png"
            Path(args.out).mkdir(parents=True, exist_ok=True)
            shutil.copyfile(samples, Path(args.out) / target)
            run["samples"] = target
        save(res, args)
        if res["meta"].get("real_fid_n") != args.fid_samples:
            res["meta"]["real_fid"] = real_data_fid(run_dir, args.fid_samples, args.root)
            res["meta"]["real_fid_n"] = args.fid_samples
            save(res, args)


if __name__ == "__main__":
    main()
