"""Annealed Langevin sampling time per image: a trained DEQ-NCSN checkpoint against TwoRes at the same settings
(issue 60, "nothing slower": DEQ sampling per image within 1.15x TwoRes').

For each ``--ckpt LABEL=PATH`` (a ``src.train`` NCSN run with a DEQ block, loaded weights-only through
:func:`src.runs.load.load_module`: the EMA weights it samples with) the TwoRes network is built from the same run
config with ``deq.enabled=false depth=1 model.arch=deq`` — the same data, noise levels and ``model.sampling``
(levels × Langevin steps, step size, the final denoising step). TwoRes is untrained (initialisation weights): its
sampling cost is the same whatever its weights (a fixed number of network evaluations, no solver), while the DEQ's
depends on its trained map through the solver's iterations, so only the DEQ needs its checkpoint. Both draw ``--n``
images with the module's own ``sample`` (annealed Langevin, ``src.sampling``), from the same seed, the DEQ's
warm-start cache cleared first; the two alternate ``--rounds`` times (the one that goes first alternating), one
torch thread. Per round: wall seconds and this process's CPU seconds (a loaded machine's other jobs do not count in
it) per image, and for the DEQ the forward solver's iterations per network evaluation (mean, max) and its cap hits
(:func:`src.deq.lookup.forward_infos`).

    python -m benchmarks.studies.ncsn_sampling_cost --ckpt 'record 500=<run dir>/checkpoints/last.ckpt' --n 16 \
        [--set model.sampling.n_steps_each=20 --set model.sampling.step_lr=2e-5] [--add]
    python -m benchmarks.studies.ncsn_sampling_cost --render

``--set KEY=VALUE`` overrides the run config of both networks (a run that ran only ``eval=quick``'s sampling is
measured at its experiment's Langevin settings this way); ``--add`` keeps the checkpoints already in the results
(each row records its own command).
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

from benchmarks.lib.results import (
    labelled_checkpoint,
    load_results,
    machine_facts,
    note_lines,
    rendered,
    result_options,
    script_command,
    write_results,
)

MODULE = "benchmarks.studies.ncsn_sampling_cost"
STEM = "ncsn_sampling_cost"
TWORES = ["deq.enabled=false", "depth=1", "model.arch=deq"]
BOUND = 1.15


def twores_like(ckpt: str, overrides: list[str]):
    """The TwoRes module of the run of ``ckpt`` (its config with :data:`TWORES`), untrained, set up as
    :func:`src.runs.load.load_module` sets up a loaded one (data module attached, eval mode)."""
    import lightning.pytorch as L
    from hydra.utils import instantiate

    from src.runs.load import run_of_checkpoint
    from src.runtime.environment import set_float_environment

    _, cfg, _ = run_of_checkpoint(ckpt, [*overrides, *TWORES])
    set_float_environment(cfg)
    L.seed_everything(int(cfg.seed), workers=True)
    datamodule = instantiate(cfg.data)
    model = instantiate(cfg.model)
    datamodule.prepare_data()
    datamodule.setup("test")
    model.attach_datamodule(datamodule)
    model.eval()
    return model


def timed_sample(module, n: int, seed: int) -> dict:
    """One call of ``module.sample(n)`` from ``seed``: wall and CPU seconds per image, and the DEQ solves' figures."""
    import torch

    from src.deq.lookup import blocks_of, forward_infos

    for _, block in blocks_of(module):
        block.reset_warm_start()
    g = torch.Generator().manual_seed(seed)
    with forward_infos(module) as infos:
        w0, c0 = time.perf_counter(), time.process_time()
        module.sample(n, generator=g)
        wall, cpu = time.perf_counter() - w0, time.process_time() - c0
    out = {"wall_s_per_image": wall / n, "cpu_s_per_image": cpu / n}
    its = [info.iterations for _, info in infos if info is not None]
    if its:
        out.update(evaluations=len(its), iterations_mean=statistics.mean(its), iterations_max=max(its),
                   cap_hits=sum(bool(info.hit_cap) for _, info in infos if info is not None))
    return out


def measure(label: str, ckpt: str, args, overrides: list[str]) -> dict:
    from src.runs.load import load_module
    from src.runtime.checkpoints import load_checked

    deq = load_module(ckpt, overrides)[0]
    twores = twores_like(ckpt, overrides)
    step = load_checked(ckpt, mmap=True).get("global_step")
    rounds = {"deq": [], "twores": []}
    for r in range(args.rounds):
        for arm in (("deq", "twores") if r % 2 == 0 else ("twores", "deq")):
            rounds[arm].append(timed_sample(deq if arm == "deq" else twores, args.n, args.seed))
            print(f"{label} round {r + 1}: {arm} {rounds[arm][-1]}", flush=True)
    sampling = dict(deq.sampling)
    return {"checkpoint": ckpt, "global_step": step, "levels": int(deq.net.sigmas.numel()),
            "n_steps_each": int(sampling["n_steps_each"]), "step_lr": float(sampling["step_lr"]),
            "denoise": bool(sampling["denoise"]), "rounds": rounds}


def _ratio(res: dict, key: str, agg) -> float:
    return agg(r[key] for r in res["rounds"]["deq"]) / agg(r[key] for r in res["rounds"]["twores"])


def render(res: dict) -> str:
    meta = res["meta"]
    commands = list(dict.fromkeys(r.get("command", meta["command"]) for r in res["checkpoints"].values()))
    lines = ["# NCSN sampling time per image: the DEQ against TwoRes", "", *[f"`{c}`" for c in commands], "",
             (f"Machine: {meta['machine']}; load average at the start of each command "
              f"{'; '.join(dict.fromkeys(r.get('load_average', '?') for r in res['checkpoints'].values()))}. "
              "Images a call and rounds as each command says; DEQ and TwoRes alternating (see the study's docstring: TwoRes "
              "is the run's config with `deq.enabled=false depth=1 model.arch=deq`, untrained, whose sampling cost "
              "does not depend on its weights). Seconds per image: min (median) over the rounds; CPU = this "
              f"process's CPU time (one torch thread). Bound (issue 60): DEQ ≤ {BOUND}× TwoRes."), ""]
    lines += note_lines(meta)
    lines += [("| checkpoint | step | sampling | DEQ wall s/img | TwoRes wall s/img | × (min, median) | DEQ CPU s/img "
               "| TwoRes CPU s/img | × CPU (min, median) | solver iters per evaluation (mean, max) | cap hits |"),
              "|---|---|---|---|---|---|---|---|---|---|---|"]
    for label, r in res["checkpoints"].items():
        d, t = r["rounds"]["deq"], r["rounds"]["twores"]

        def cell(rs, key):
            return f"{min(x[key] for x in rs):.3f} ({statistics.median(x[key] for x in rs):.3f})"

        its = [x for x in d if "iterations_mean" in x]
        solver = (f"{statistics.mean(x['iterations_mean'] for x in its):.1f}, {max(x['iterations_max'] for x in its)}"
                  if its else "–")
        caps = f"{sum(x['cap_hits'] for x in its)} of {sum(x['evaluations'] for x in its)}" if its else "–"
        lines.append(
            f"| {label} (`{r['checkpoint']}`) | {r['global_step']} | {r['levels']} levels × {r['n_steps_each']}, "
            f"ε {r['step_lr']:g}{', denoise' if r['denoise'] else ''} | {cell(d, 'wall_s_per_image')} | "
            f"{cell(t, 'wall_s_per_image')} | {_ratio(r, 'wall_s_per_image', min):.2f}, "
            f"{_ratio(r, 'wall_s_per_image', statistics.median):.2f} | {cell(d, 'cpu_s_per_image')} | "
            f"{cell(t, 'cpu_s_per_image')} | {_ratio(r, 'cpu_s_per_image', min):.2f}, "
            f"{_ratio(r, 'cpu_s_per_image', statistics.median):.2f} | {solver} | {caps} |")
    return "\n".join(lines + [""])


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--ckpt", action="append", default=[], type=labelled_checkpoint,
                    help="LABEL=PATH of a DEQ-NCSN src.train checkpoint (repeatable)")
    ap.add_argument("--root", default=None, help="data.root of the runs")
    ap.add_argument("--n", type=int, default=16, help="images a sampling call")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                    help="a run-config override for both networks (repeatable)")
    ap.add_argument("--add", action="store_true", help="keep the checkpoints already in the results")
    ap.add_argument("--note", default=None, help="a markdown file written below the table (the finding)")
    result_options(ap, STEM)
    args = ap.parse_args(argv)
    if rendered(args, args.name, render):
        return
    if not args.ckpt:
        ap.error("give at least one --ckpt LABEL=PATH")
    import os

    import torch

    torch.set_num_threads(1)
    overrides = ([f"data.root={args.root}"] if args.root else []) + list(args.set)
    old = load_results(args.out, args.name) if args.add else {}
    command = script_command(MODULE, argv, data_root=args.root)
    res = {"meta": {"command": command, "machine": machine_facts(),
                    "load_average": " ".join(f"{x:.2f}" for x in os.getloadavg()), "n": args.n,
                    "rounds": args.rounds, "seed": args.seed,
                    "note": Path(args.note).read_text() if args.note else old.get("meta", {}).get("note")},
           "checkpoints": dict(old.get("checkpoints", {}))}
    for label, path in args.ckpt:
        res["checkpoints"][label] = {**measure(label, path, args, overrides), "command": command,
                                     "load_average": res["meta"]["load_average"], "n": args.n}
        write_results(args.out, args.name, res, render)
    print(f"-> {Path(args.out) / args.name}.md")


if __name__ == "__main__":
    main()
