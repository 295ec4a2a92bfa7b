"""How far is the SSM-VR loss a DEQ-NCSN trains on from the one it means? Phantom vs implicit, per checkpoint.

SSM-VR's loss contains vᵀ∇ₓs v, a derivative *through* the DEQ. With ``deq.backward=phantom`` that derivative
is the K-term Neumann series of the implicit one (docs/deq.md §5), so the loss value itself — not only its
parameter gradient — is truncated, with an error that grows with the map's contraction rate ρ like ρᴷ. A
network that trains on the truncated loss can lower it in ways the exact loss does not reward. For each
checkpoint this evaluates, on the same ``--n`` training images with the same noise levels, noise and
projections, the σ²-weighted SSM-VR loss with the phantom backward for each K of ``--ks`` and with the exact
implicit backward (eq. 8), the σ²-weighted DSM loss (no derivative through the DEQ: the same in every mode),
and the learned map's contraction rate at the fixed point.

    python -m benchmarks.studies.ncsn_phantom_bias --root data --ckpt 'DEQ=outputs/…/step_0000600.ckpt' \\
        [--ckpt …] [--n 64] [--ks 1,2,4,8]
    python -m benchmarks.studies.ncsn_phantom_bias --render

Writes ``<out>/<name>.json`` and ``.md`` (default ``benchmarks/results/ncsn_phantom_bias``).
"""

from __future__ import annotations

import argparse

from benchmarks.lib.deq_backward import set_backward
from benchmarks.lib.results import checkpoint_options, checkpoint_study, note_lines
from src.reports.tables import markdown_table


def losses(module, x, seed: int) -> dict[str, float]:
    """σ²-weighted SSM-VR and DSM losses of ``module.net`` on ``x`` with seeded levels, noise, projections."""
    from src.objectives.conditional import noise_conditional
    from src.objectives.registry import get_objective
    from src.runtime.rng import seeded_rng

    out = {}
    for name in ("ssm_vr", "dsm"):
        with seeded_rng(seed, x.device):
            res = noise_conditional(get_objective(name), module.net, x, module.net.sigmas,
                                    anneal_power=module.anneal_power, create_graph=False)
        out[name] = float(res.loss)
    return out


def measure(module, n: int, ks: list[int], seed: int) -> dict:
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
        set_backward(module.net, "phantom", k)
        rows[f"phantom K={k}"] = losses(module, x, seed)
    set_backward(module.net, "implicit")
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
    return "\n".join(lines + note_lines(meta))


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    checkpoint_options(ap, "ncsn_phantom_bias", "a DEQ-NCSN checkpoint")
    ap.add_argument("--ks", default="1,2,4,8", help="phantom steps K to evaluate")
    args = ap.parse_args(argv)
    ks = [int(k) for k in args.ks.split(",")]
    checkpoint_study(ap, args, "benchmarks.studies.ncsn_phantom_bias", render, lambda module: measure(module, args.n, ks, args.seed))


if __name__ == "__main__":
    main()
