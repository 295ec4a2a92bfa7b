"""How far is the SSM-VR loss a DEQ-NCSN trains on from the one it means? Phantom vs implicit, per checkpoint.

SSM-VR's loss contains vᵀ∇ₓs v, a derivative *through* the DEQ. With ``deq.backward=phantom`` that derivative
is the K-term Neumann series of the implicit one (docs/deq.md §5), so the loss value itself — not only its
parameter gradient — is truncated, with an error that grows with the map's contraction rate ρ like ρᴷ. A
network that trains on the truncated loss can lower it in ways the exact loss does not reward. For each
checkpoint this evaluates, on the same ``--n`` training images with the same noise levels, noise and
projections, the σ²-weighted SSM-VR loss with the phantom backward for each K of ``--ks`` and with the exact
implicit backward (eq. 8), the σ²-weighted DSM loss (no derivative through the DEQ: the same in every mode),
and the learned map's contraction rate at the fixed point.

    python benchmarks/ncsn_phantom_bias.py --root data --ckpt 'DEQ=outputs/…/step_0000600.ckpt' \\
        [--ckpt …] [--n 64] [--ks 1,2,4,8]
    python benchmarks/ncsn_phantom_bias.py --render

Writes ``<out>/<name>.json`` and ``.md`` (default ``benchmarks/results/ncsn_phantom_bias``).
"""

from __future__ import annotations

import argparse
import os
import platform
import shlex
import sys
from pathlib import Path

from _common import RESULTS

from src.reporting import labelled_checkpoint, markdown_table, rerender, write_results


def losses(module, x, seed: int) -> dict[str, float]:
    """σ²-weighted SSM-VR and DSM losses of ``module.net`` on ``x`` with seeded levels, noise, projections."""
    from src.metrics.evaluation import seeded_rng
    from src.objectives.conditional import noise_conditional
    from src.objectives.registry import get_objective

    out = {}
    for name in ("ssm_vr", "dsm"):
        with seeded_rng(seed, x.device):
            res = noise_conditional(get_objective(name), module.net, x, module.net.sigmas,
                                    anneal_power=module.anneal_power, create_graph=False)
        out[name] = float(res.loss)
    return out


def measure(module, n: int, ks: list[int], seed: int) -> dict:
    from src.analysis.phantom import set_mode

    block = module.net.deq_block()
    if block is None:
        raise SystemExit("not a DEQ-NCSN checkpoint (model.arch=deq with deq=true)")
    dm = module.datamodule()
    dm.setup("fit")
    x = module.split_tensor("train", n)
    labels = module.net.sigmas.new_zeros(n).long()
    rate = block.contraction_rate(module.net.deq_input(x, labels), labels)
    rows = {}
    for k in ks:
        set_mode(module.net, "phantom", k)
        rows[f"phantom K={k}"] = losses(module, x, seed)
    set_mode(module.net, "implicit")
    rows["implicit"] = losses(module, x, seed)
    return {"contraction_rate_level0": rate, "losses": rows}


def render(res: dict) -> str:
    meta = res["meta"]
    lines = ["# DEQ-NCSN: the SSM-VR loss with the phantom and the implicit backward", "",
             f"Command: `{meta['command']}`", "", f"Machine: {meta['machine']}.", "",
             (f"{meta['n']} training images, seed {meta['seed']}: the same noise levels, noise and projections "
              "in every column. SSM-VR's divergence term is a derivative through the DEQ, so the phantom "
              "backward changes the loss value itself; DSM has none (its column is the same in every mode). "
              "ρ: the learned map's contraction rate ‖∂f/∂z‖₂ at the fixed point (level 1 of 10)."), ""]
    modes = list(next(iter(res["checkpoints"].values()))["losses"])
    head = ["checkpoint", "ρ", *(f"SSM-VR {m}" for m in modes), "phantom K=2 − implicit", "DSM"]
    rows = []
    for label, r in res["checkpoints"].items():
        ls = r["losses"]
        gap = ls.get("phantom K=2", {}).get("ssm_vr")
        rows.append([label, f"{r['contraction_rate_level0']:.3f}", *(f"{ls[m]['ssm_vr']:.2f}" for m in modes),
                     "—" if gap is None else f"{gap - ls['implicit']['ssm_vr']:+.2f}", f"{ls['implicit']['dsm']:.2f}"])
    lines += markdown_table(head, rows) + [""]
    if meta.get("note"):
        lines += [meta["note"].strip(), ""]
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--ckpt", action="append", default=[], type=labelled_checkpoint,
                    help="LABEL=PATH of a DEQ-NCSN checkpoint (repeatable; split at the last =)")
    ap.add_argument("--root", default=None, help="data.root")
    ap.add_argument("--n", type=int, default=64)
    ap.add_argument("--ks", default="1,2,4,8", help="phantom steps K to evaluate")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--note", default=None, help="a markdown file appended to the table (the finding)")
    ap.add_argument("--out", default=str(RESULTS))
    ap.add_argument("--name", default="ncsn_phantom_bias")
    ap.add_argument("--render", action="store_true", help="run nothing: rebuild the markdown from the JSON")
    args = ap.parse_args()
    if args.render:
        rerender(args.out, args.name, render)
        return
    if not args.ckpt:
        ap.error("give at least one --ckpt LABEL=PATH")
    import torch

    from src.sample import load_module

    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    ks = [int(k) for k in args.ks.split(",")]
    overrides = [f"data.root={args.root}"] if args.root else []
    res = {"meta": {"machine": f"{platform.machine()}, {os.cpu_count()} cores; python {platform.python_version()}; "
                               f"torch {torch.__version__}; cpu, {torch.get_num_threads()} thread(s)",
                    "command": " ".join(["python", "benchmarks/ncsn_phantom_bias.py",
                                         *(shlex.quote(a) for a in sys.argv[1:])]),
                    "n": args.n, "seed": args.seed, "note": Path(args.note).read_text() if args.note else None},
           "checkpoints": {}}
    for label, path in args.ckpt:
        module, _, _, _ = load_module(path, overrides)
        res["checkpoints"][label] = {"checkpoint": path, **measure(module, args.n, ks, args.seed)}
        write_results(args.out, args.name, res, render)
        print(f"{label}: done", flush=True)
    print(f"-> {Path(args.out) / args.name}.md")


if __name__ == "__main__":
    main()
