"""Which Langevin step size for MNIST? FID of one NCSN checkpoint's samples over step_lr × T (× update).

``src.sampling.annealed_langevin`` takes the reference code's step x ← x + αᵢ·s + √(2αᵢ)·z, αᵢ = ε·σᵢ²/σ_L² (ε = ``step_lr``).
This sweeps ε and T (steps per level) on ONE trained checkpoint, with the same seed for every setting (the
same start x₀ and the same noise draws, so the settings differ only in ε and T), and reports the FID of
``--n`` samples against ``--n`` test images on the shipped MNIST classifier's features — the protocol of
``model.metrics.fid`` (``src/metrics/fid.py``: real images from ``split_tensor("test", n)``), with
the FID of ``--n`` real training images against the same test images as the floor at this sample size.
``--update euler authors`` adds the step rule as a third axis (``model.sampling.update``: the Euler step or the
DEQ paper authors' code's, see ``src.sampling.annealed_langevin``); each setting also records its white-out, the
share of pixels above ``src.metrics.fid.WHITE`` (0.99), and with ``--bootstrap B`` its FID's bootstrap sd.

    python -m benchmarks.studies.ncsn_langevin_step --ckpt <run>/checkpoints/last.ckpt --root <data dir> \\
        [--step-lr 5e-6 1e-5 2e-5 5e-5 1e-4] [--n-steps-each 10 30] [--n 300] [--seed 0] [--denoise]
        [--update euler authors] [--bootstrap 100]      # the step rule axis; each FID's bootstrap sd
        [--grid-step-lr 5e-5 --grid-n-steps-each 30]   # also write a sample grid of that setting
        [--keep-samples DIR]                            # each setting's images as DIR/eps<ε>_T<T>.pt
        [--override deq.warm_start=false --name N]      # the checkpoint's run config changed (a controlled run)
    python -m benchmarks.studies.ncsn_langevin_step --render   # rebuild the markdown from the JSON
    python -m benchmarks.studies.ncsn_langevin_step --merge A.json B.json [--name N]   # settings run side by side
        [--keep-samples DIR --grid-step-lr ε --grid-n-steps-each T]   # + the grid of a kept setting
        [--keep-samples DIR --paired-bootstrap 200]   # + each update's FID difference from Euler's, paired
    python -m benchmarks.studies.ncsn_langevin_step --combine A.json B.json --labels a b --name N [--note F]
        # results of different checkpoints, one section each

Resumable: a setting already in the JSON is not sampled again. Writes ``<out>/<name>.json`` and ``.md``
(default ``benchmarks/results/ncsn_langevin_step``) after every setting.
"""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path

from benchmarks.lib.results import RESULTS, machine_facts, rerender, script_command, write_results
from src.reports.tables import markdown_table
from src.runtime import progress
from src.sampling.annealed_langevin import UPDATES


def key_of(step_lr: float, n_steps_each: int, update: str = "euler") -> str:
    """A setting's key: ``ε/T`` for the Euler step (the keys of results made before the update axis), ``ε/T/update``
    for another step rule."""
    return f"{step_lr:g}/{int(n_steps_each)}" + ("" if update == "euler" else f"/{update}")


def samples_file(step_lr: float, n_steps_each: int, update: str = "euler") -> str:
    """The file name of a setting's kept images (``--keep-samples``)."""
    return f"eps{step_lr:g}_T{int(n_steps_each)}" + ("" if update == "euler" else f"_{update}") + ".pt"


def render(res: dict) -> str:
    if "checkpoints" in res:
        return render_combined(res)
    meta = res["meta"]
    lines = ["# NCSN on MNIST: FID against the Langevin step size ε (step_lr) and steps per level T", "",
             *render_body(res)]
    if meta.get("note"):
        lines += [meta["note"].strip(), ""]
    return "\n".join(lines)


def render_combined(res: dict) -> str:
    """Results of several checkpoints (``--combine``): the note, then one section per checkpoint."""
    meta = res["meta"]
    lines = [f"# {meta['title']}", ""]
    if meta.get("note"):
        lines += [meta["note"].strip(), ""]
    lines += ["Commands:", "", "```bash", *meta["commands"], "```", ""]
    for label, part in res["checkpoints"].items():
        lines += [f"## {label}: `{part['meta']['checkpoint']}`", "", *render_body(part, commands=False)]
    return "\n".join(lines)


def render_body(res: dict, commands: bool = True) -> list[str]:
    """One checkpoint's protocol and table (the update and white-out columns only where the results hold them)."""
    meta = res["meta"]
    lines = [("Step x ← x + αᵢ·s(x, i) + √(2αᵢ)·z, αᵢ = ε·σᵢ²/σ_L² (the NCSN/NCSNv2 reference code's; the paper's "
              "Alg. 1 writes (α/2)·s + √α·z, i.e. its α is 2ε). Before this convention was fixed the project took "
              "x + (ε/2)·s + √ε·z: an old ε equals a new ε/2 (the old `ncsn_mnist` default ε = 1·10⁻⁴ at T = 20 "
              "is ε = 5·10⁻⁵ here; the curves' ε = 2·10⁻⁴ at T = 10 is ε = 1·10⁻⁴ here)."), ""]
    if commands:
        lines += ["Commands:", "", "```bash", *meta.get("commands", [meta.get("command")]), "```", ""]
    lines += [f"Checkpoint trained with: `{meta['train_command']}`", "",
             f"Machine: {meta['machine']}", "",
             (f"{meta['n']} samples per setting (seed {meta['seed']}: the same start and noise draws for every "
              f"setting), FID against {meta['n']} test images on the MNIST classifier features; final denoising "
              f"step {'on' if meta['denoise'] else 'off'}. Reference: FID of {meta['n']} real training images "
              f"against the same test images: {meta['real_fid']:.1f} (the floor at this sample size)."), ""]
    records = list(res["settings"].values())
    steps = sorted({r["n_steps_each"] for r in records})
    lrs = sorted({r["step_lr"] for r in records})
    with_update = any("update" in r for r in records)  # results made before the update axis: no column
    updates = sorted({r.get("update", "euler") for r in records}, key=lambda u: (u != "euler", u))
    fields = [("fid", "{:.1f}", "FID"), ("outside", "{:.1%}", "pixels outside [0, 1]")]
    if any("white" in r for r in records):
        fields.append(("white", "{:.1%}", "white-out (pixels > 0.99)"))
    head = [*(["update"] if with_update else []), "ε (step_lr)",
            *[f"{label}, T = {t}" for _, _, label in fields for t in steps]]
    rows = []
    for update in updates:
        for lr in lrs:
            cells = [*([update] if with_update else []), f"{lr:g}"]
            for field, fmt, _ in fields:
                for t in steps:
                    r = res["settings"].get(key_of(lr, t, update))
                    cell = fmt.format(r[field]) if r and field in r else "—"
                    if r and field == "fid" and "fid_boot_sd" in r:
                        cell += f" ± {r['fid_boot_sd']:.0f}" if not with_update else f" ± {r['fid_boot_sd']:.1f}"
                    cells.append(cell)
            rows.append(cells)
    lines += markdown_table(head, rows) + [""]
    if meta.get("bootstrap_draws") and meta.get("bootstrap_both"):
        lines += [(f"± : the standard deviation of the FID over {meta['bootstrap_draws']} bootstrap resamples of both "
                   "the setting's samples and the test images (`src.metrics.fid.bootstrap_fid_sd`, as "
                   "`model.metrics.fid.bootstrap`), the sampling noise of one FID at this n."), ""]
    elif meta.get("bootstrap_draws"):
        lines += [(f"± : the standard deviation of the FID over {meta['bootstrap_draws']} bootstrap resamples of the "
                   "setting's samples (test-image statistics fixed), the sampling noise of one FID at this n."), ""]
    for r in records:
        if "fid_diff" in r:
            lines += [(f"{r['update']} − euler at ε {r['step_lr']:g}, T = {r['n_steps_each']}: ΔFID = "
                       f"{r['fid_diff']:+.1f} ± {r['fid_diff_boot_sd']:.1f} (paired bootstrap, "
                       f"{meta['paired_bootstrap_draws']} draws: the same resampled chains — same start and noise "
                       "draws under both rules — and test images for both FIDs)."), ""]
    lines += ["Sampling seconds per setting: " + ", ".join(
        f"{r['update'] + ' ' if with_update else ''}ε {r['step_lr']:g} T {r['n_steps_each']}: {r['seconds']:.0f}"
        for r in records), ""]
    if meta.get("grid"):
        lines += [(f"Samples at ε = {meta['grid']['step_lr']:g}, T = {meta['grid']['n_steps_each']} (the first 64 of "
                  f"the FID set): ![samples]({meta['grid']['file']})"), ""]
    return lines


def merge(parts: list[dict]) -> dict:
    """One result from several processes' results of the same checkpoint and protocol (settings joined)."""
    same = ("checkpoint", "n", "seed", "denoise", "real_fid")
    first = parts[0]["meta"]
    for part in parts[1:]:
        diff = [k for k in same if part["meta"].get(k) != first.get(k)]
        if diff:
            raise SystemExit(f"cannot merge results that differ in {diff}")
    meta = {**first, "commands": [c for p in parts for c in p["meta"].get("commands", [p["meta"]["command"]])]}
    meta.pop("command", None)
    for part in parts:
        meta["grid"] = part["meta"].get("grid") or meta.get("grid")
        meta["note"] = part["meta"].get("note") or meta.get("note")
    return {"meta": meta, "settings": {k: v for p in parts for k, v in p["settings"].items()}}


def bootstrap_sd(res: dict, folder: Path, draws: int, root: str | None, trust: bool = False) -> None:
    """Each kept setting's FID noise: the standard deviation of its FID over ``draws`` bootstrap resamples of
    its samples (real statistics fixed), stored as ``fid_boot_sd``."""
    import torch

    from src.metrics.fid import build_fid
    from src.runs.load import load_module

    _, dm, _, _ = load_module(res["meta"]["checkpoint"], [f"data.root={root}"] if root else [],
                              **({"trust": True} if trust else {}))
    fid = build_fid("mnist", reset_real_features=False)
    fid.update(dm.to_pixels(dm.split_tensor("test", res["meta"]["n"])).float(), real=True)
    g = torch.Generator().manual_seed(0)
    for r in res["settings"].values():
        path = folder / samples_file(r["step_lr"], r["n_steps_each"], r.get("update", "euler"))
        if not path.exists():
            continue
        images = torch.load(path, weights_only=True)
        values = []
        for _ in range(draws):
            fid.reset()
            fid.update(images[torch.randint(len(images), (len(images),), generator=g)], real=False)
            values.append(float(fid.compute()))
        r["fid_boot_sd"] = float(torch.tensor(values).std())
    res["meta"]["bootstrap_draws"] = draws


def paired_bootstrap(res: dict, folder: Path, draws: int, root: str | None, trust: bool = False) -> None:
    """Each non-Euler setting's FID minus the Euler setting's at the same ε and T (``fid_diff``) and its noise
    (``fid_diff_boot_sd``): the standard deviation of the difference over ``draws`` bootstrap replicates that
    resample the test images and the chains (sample i of both rules shares its start and noise draws) with the
    same indices for both FIDs (:func:`src.metrics.fid.fid_of_features` on kept samples)."""
    import torch

    from src.metrics.fid import build_fid, fid_of_features
    from src.runs.load import load_module

    _, dm, _, _ = load_module(res["meta"]["checkpoint"], [f"data.root={root}"] if root else [],
                              **({"trust": True} if trust else {}))
    fid = build_fid("mnist", reset_real_features=False)
    with torch.no_grad():
        real = fid.inception(dm.to_pixels(dm.split_tensor("test", res["meta"]["n"])).float()).double()
    for r in res["settings"].values():
        update, lr, t = r.get("update", "euler"), r["step_lr"], r["n_steps_each"]
        paths = folder / samples_file(lr, t, update), folder / samples_file(lr, t)
        if update == "euler" or key_of(lr, t) not in res["settings"] or not all(p.exists() for p in paths):
            continue
        with torch.no_grad():
            other, euler = (fid.inception(torch.load(p, weights_only=True)).double() for p in paths)
        g = torch.Generator().manual_seed(0)
        diffs = []
        for _ in range(draws):
            i = torch.randint(len(real), (len(real),), generator=g)
            j = torch.randint(len(other), (len(other),), generator=g)
            diffs.append(float(fid_of_features(real[i], other[j]) - fid_of_features(real[i], euler[j])))
        r["fid_diff"] = float(fid_of_features(real, other) - fid_of_features(real, euler))
        r["fid_diff_boot_sd"] = float(torch.tensor(diffs, dtype=torch.float64).std())
    res["meta"]["paired_bootstrap_draws"] = draws


def combine(parts: dict[str, dict], title: str, note: str | None) -> dict:
    """Results of different checkpoints side by side (each keeps its own protocol and commands)."""
    return {"meta": {"title": title, "note": note,
                     "commands": [c for p in parts.values() for c in p["meta"].get("commands") or [p["meta"]["command"]]]
                     + [script_command("benchmarks.studies.ncsn_langevin_step")]},
            "checkpoints": parts}


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--ckpt", help="an NCSN checkpoint (model=ncsn) with its run directory's .hydra config")
    ap.add_argument("--root", default=None, help="data.root for the real images")
    ap.add_argument("--step-lr", type=float, nargs="+", default=[5e-6, 1e-5, 2e-5, 5e-5, 1e-4])
    ap.add_argument("--n-steps-each", type=int, nargs="+", default=[10, 30])
    ap.add_argument("--n", type=int, default=300, help="samples per setting = test images compared with")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--denoise", action=argparse.BooleanOptionalAction, default=True,
                    help="final denoising step (ncsn_mnist's setting)")
    ap.add_argument("--update", nargs="+", default=["euler"], choices=UPDATES,
                    help="the Langevin step rule(s) (model.sampling.update)")
    ap.add_argument("--grid-step-lr", type=float, default=None)
    ap.add_argument("--grid-n-steps-each", type=int, default=None)
    ap.add_argument("--trust-checkpoint", action="store_true",
                    help="load a checkpoint that holds pickled objects beyond tensors (only a file you trust)")
    ap.add_argument("--keep-samples", default=None, help="a folder: save each setting's images there (.pt)")
    ap.add_argument("--bootstrap", type=int, default=0,
                    help="FID's bootstrap standard deviation over this many draws (when sampling, or with --merge "
                         "and --keep-samples)")
    ap.add_argument("--paired-bootstrap", type=int, default=0,
                    help="with --merge and --keep-samples: each other update's FID difference from the Euler step's "
                         "and its paired bootstrap sd over this many draws")
    ap.add_argument("--override", nargs="*", default=[],
                    help="run-config overrides for the loaded checkpoint (deq.warm_start=false); use another --name")
    ap.add_argument("--train-command", default="", help="recorded in the results: how the checkpoint was trained")
    ap.add_argument("--note", default=None, help="a markdown file appended to the table (the finding)")
    ap.add_argument("--out", default=str(RESULTS))
    ap.add_argument("--name", default="ncsn_langevin_step")
    ap.add_argument("--render", action="store_true", help="run nothing: rebuild the markdown from the JSON")
    ap.add_argument("--merge", nargs="+", default=None, help="run nothing: join results JSONs of one checkpoint")
    ap.add_argument("--combine", nargs="+", default=None,
                    help="run nothing: results JSONs of different checkpoints, one section each (with --labels)")
    ap.add_argument("--labels", nargs="+", default=None, help="with --combine: each result's section title")
    ap.add_argument("--title", default="NCSN on MNIST: FID of Langevin sampler settings on several checkpoints")
    args = ap.parse_args(argv)
    if args.render:
        rerender(args.out, args.name, render)
        return
    if args.combine:
        if not args.labels or len(args.labels) != len(args.combine):
            ap.error("--combine needs one --labels entry per result")
        parts = {label: json.loads(Path(p).read_text()) for label, p in zip(args.labels, args.combine)}
        write_results(args.out, args.name, combine(parts, args.title, Path(args.note).read_text() if args.note
                                                   else None), render)
        return
    if args.merge:
        res = merge([json.loads(Path(p).read_text()) for p in args.merge])
        if args.keep_samples and args.grid_step_lr is not None and args.grid_n_steps_each is not None:
            import torch

            from src.sampling.grids import save_image_grid

            lr, t = args.grid_step_lr, args.grid_n_steps_each
            images = torch.load(Path(args.keep_samples) / f"eps{lr:g}_T{t}.pt", weights_only=True)
            save_image_grid(images[:64], Path(args.out) / f"{args.name}_samples.png")
            res["meta"]["grid"] = {"step_lr": lr, "n_steps_each": t, "file": f"{args.name}_samples.png"}
        if args.keep_samples and args.bootstrap:
            bootstrap_sd(res, Path(args.keep_samples), args.bootstrap, args.root, args.trust_checkpoint)
        if args.keep_samples and args.paired_bootstrap:
            paired_bootstrap(res, Path(args.keep_samples), args.paired_bootstrap, args.root, args.trust_checkpoint)
        res["meta"]["commands"].append(script_command("benchmarks.studies.ncsn_langevin_step"))
        write_results(args.out, args.name, res, render)
        return
    if not args.ckpt:
        ap.error("give --ckpt PATH")
    if args.n < 2:
        ap.error("--n must be at least 2")
    import torch

    from src.metrics.fid import WHITE, bootstrap_fid_sd, build_fid, fid_of_features
    from src.runs.load import load_module

    if args.bootstrap == 1 or args.bootstrap < 0:
        ap.error("--bootstrap: 0 (off) or at least 2 draws")
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    trust = {"trust": True} if args.trust_checkpoint else {}
    overrides = [*([f"data.root={args.root}"] if args.root else []), *args.override]
    module, dm, _, _ = load_module(args.ckpt, overrides, **trust)
    if not hasattr(module, "net") or not hasattr(module.net, "sigmas"):
        raise SystemExit(f"{args.ckpt}: not an NCSN checkpoint (model=ncsn)")
    json_path = Path(args.out) / f"{args.name}.json"
    res = json.loads(json_path.read_text()) if json_path.exists() else {"settings": {}}
    held = res.get("meta", {})
    if (held.get("checkpoint") not in (None, args.ckpt) or held.get("n") not in (None, args.n)
            or (held and held.get("overrides", []) != args.override)):
        raise SystemExit(f"{json_path} holds another checkpoint, --n or --override: choose another --name")
    fid = build_fid("mnist", reset_real_features=False)
    real = dm.to_pixels(dm.split_tensor("test", args.n)).float()
    fid.update(real, real=True)
    real_features = fid.inception(real).double() if args.bootstrap else None
    if res.get("meta", {}).get("real_fid") is None:
        fid.update(dm.to_pixels(dm.split_tensor("train", args.n)).float(), real=False)
        real_fid = float(fid.compute())
        fid.reset()
    else:
        real_fid = res["meta"]["real_fid"]
    res["meta"] = {**res.get("meta", {}),
                   "machine": machine_facts(),
                   "command": script_command("benchmarks.studies.ncsn_langevin_step", data_root=args.root),
                   "train_command": args.train_command, "checkpoint": args.ckpt, "n": args.n, "seed": args.seed,
                   "denoise": bool(args.denoise), "real_fid": real_fid, "overrides": list(args.override),
                   "note": Path(args.note).read_text() if args.note else None,
                   **({"bootstrap_draws": args.bootstrap, "bootstrap_both": True} if args.bootstrap else {})}
    settings = [(lr, t, u) for u in args.update for t in args.n_steps_each for lr in args.step_lr]
    grid = (args.grid_step_lr, args.grid_n_steps_each)
    if None not in grid and (*grid, "euler") not in settings:
        settings.append((*grid, "euler"))
    for lr, t, update in settings:
        want_grid = (lr, t) == grid and update == "euler"
        if key_of(lr, t, update) in res["settings"] and not want_grid:
            continue
        module.sampling = {**module.sampling, "step_lr": lr, "n_steps_each": t, "denoise": bool(args.denoise),
                           "update": update}
        start = time.perf_counter()
        print(f"setting ε {lr:g}, T {t}, {update}: sampling {args.n} images", flush=True)
        with progress.outside_a_trainer():  # the sampler's levels × steps as progress lines / a bar
            y = module.sample(args.n, generator=torch.Generator().manual_seed(args.seed))
        seconds = time.perf_counter() - start
        outside = float(((y < 0) | (y > 1)).float().mean())  # model space = [0, 1] pixels for MNIST
        images = dm.to_pixels(y).float()
        if args.keep_samples:
            Path(args.keep_samples).mkdir(parents=True, exist_ok=True)
            torch.save(images, Path(args.keep_samples) / samples_file(lr, t, update))
        record = {"update": update, "step_lr": lr, "n_steps_each": t, "outside": outside,
                  "white": float((images > WHITE).float().mean()), "seconds": seconds}
        if args.bootstrap:  # each image's features once: the FID and its bootstrap from them
            with torch.no_grad():
                fake_features = fid.inception(images).double()
            record["fid"] = float(fid_of_features(real_features, fake_features))
            record["fid_boot_sd"] = bootstrap_fid_sd(real_features, fake_features, args.bootstrap,
                                                     torch.Generator().manual_seed(args.seed))
        else:
            fid.reset()
            fid.update(images, real=False)
            record["fid"] = float(fid.compute())
        res["settings"][key_of(lr, t, update)] = record
        if want_grid:
            from src.sampling.grids import save_image_grid

            path = Path(args.out) / f"{args.name}_samples.png"
            save_image_grid(images[:64], path)
            res["meta"]["grid"] = {"step_lr": lr, "n_steps_each": t, "file": path.name}
        write_results(args.out, args.name, res, render)
        print(f"{update} eps {lr:g} T {t}: FID {record['fid']:.1f} white {record['white']:.1%} ({seconds:.0f} s)",
              flush=True)
    print(f"-> {json_path.with_suffix('.md')}")


if __name__ == "__main__":
    main()
