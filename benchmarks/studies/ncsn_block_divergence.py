"""Why does the normalized-residual DEQ-NCSN (``deq.block=normalized_residual``) stop converging? Short trainings.

The block φ(z; x) = (z + r(z))/w + x, r = conv∘ELU∘IN∘conv∘ELU∘IN, w = 2‖K₁‖_F‖K₂‖_F
(:class:`src.deq.block.NormalizedResidualDEQBlock`) has no bound on its Lipschitz constant: the chain bound
(1 + ‖K₂‖₂·G₂·‖K₁‖₂·G₁)/w, with Gᵢ = max γᵢ/std the instance norms' gains at the fixed point, is > 1 from
initialisation, so the contraction rate ρ (‖∂φ/∂z‖₂ at z*) is whatever training makes it. This study trains
``experiment=ncsn_mnist deq=true deq.block=normalized_residual`` for ``--steps`` steps in a plain loop (the
module's own objective and optimiser, one process) under several settings — the loss (SSM-VR, DSM), the
backward (phantom K = 2, implicit) and the block's w (the authors', or two variants from the kernels' operator
norms, :func:`use_w_variant`) — and every ``--every`` steps logs, on a fixed probe batch (one image per noise
level, seeded noise): ρ (power iteration), the σ²-weighted SSM-VR loss with the phantom K = 2 and with the exact
implicit backward (:func:`ssm_vr_truncation`), w, ‖K₁‖_F, the conv operator norms over their Frobenius norms
(‖Kᵢ‖₂/‖Kᵢ‖_F, the room the Frobenius w leaves), max γ₂, the second norm's gain G₂ = max γ₂/std(h₁), the
smallest per-channel spatial std of z*, and the chain bound; with the training loss and the training solve's
iterations. Past the step where the training solve hits ``deq.max_iter``, z* is the last iterate, not a fixed
point, and every figure is of that iterate.

    python -m benchmarks.studies.ncsn_block_divergence --root <data dir> [--steps 121] [--every 5] [--batch 32]
    python -m benchmarks.studies.ncsn_block_divergence --render

Writes ``<out>/<name>.json`` and ``.md`` (default ``benchmarks/results/ncsn_block_divergence``).
"""

from __future__ import annotations

import argparse
import os
import time

import torch
import torch.nn.functional as F

from benchmarks.lib.config import train_config
from benchmarks.lib.results import machine_facts, note_lines, rendered, result_options, script_command
from src.deq.maps import instance_norm
from src.deq.normalization import conv_spectral_normalize
from src.reports.tables import markdown_table, write_results
from src.runs.build import build

SETTINGS = {  # label: (overrides of experiment=ncsn_mnist deq=true deq.block=normalized_residual, w variant)
    "ssm_vr, phantom K=2 (the diverging run)": ([], None),
    "dsm, phantom K=2": (["loss=dsm"], None),
    "ssm_vr, implicit": (["deq.backward=implicit"], None),
    "ssm_vr, phantom K=2, w = 8 σ(K1) σ(K2)": ([], "spectral"),
    "ssm_vr, phantom K=2, w = 9 σ(K2)": ([], "spectral_k2"),
}
BASE = ["experiment=ncsn_mnist", "deq=true", "deq.block=normalized_residual", "logger=none"]
COLUMNS = [("train_loss", "loss", 1), ("ssm_vr_phantom2", "probe SSM-VR K=2", 1),
           ("ssm_vr_implicit", "probe SSM-VR exact", 1), ("train_iterations", "solve iters", 0), ("rate", "ρ", 3),
           ("w", "w", 2), ("k1", "‖K₁‖_F", 3), ("op1_over_f", "‖K₁‖₂/F", 3), ("op2_over_f", "‖K₂‖₂/F", 3),
           ("gamma2_max", "max γ₂", 3), ("in1_gain", "G₁", 2), ("in2_gain", "G₂", 2), ("std_z_min", "min std z*", 3),
           ("chain_bound", "chain bound", 2)]


def operator_norm(kernel: torch.Tensor, u: torch.Tensor, update: bool) -> torch.Tensor:
    """σ̂(K), the kernel's circular-convolution operator norm by one power step on ``u`` (autograd in K), from
    :func:`src.deq.normalization.conv_spectral_normalize` (K / (λσ̂) at λ = 2)."""
    return kernel.norm() / (2.0 * conv_spectral_normalize(kernel, u, 2.0, update=update).norm())


def use_w_variant(block, variant: str | None) -> None:
    """Replace the block's w = 2‖K₁‖_F‖K₂‖_F by a variant (this study's candidates, not library options):
    ``spectral`` w = 8·σ̂(K₁)·σ̂(K₂) (the operator norms the Frobenius norms stand for; 8 = 2 × the
    Frobenius-to-spectral ratio² of the initial 16-channel kernels: w starts 3 % above the authors'), ``spectral_k2``
    w = 9·σ̂(K₂) (r does not depend on K₁'s scale — the second instance norm removes it — so neither does w;
    9: w starts within 1 % of the authors'). σ̂ by one power step per training call on a persistent probe vector."""
    if variant is None:
        return
    if variant not in ("spectral", "spectral_k2"):
        raise ValueError(f"unknown w variant {variant!r}; valid: spectral, spectral_k2")
    probes = {}
    for name in ("kernel1", "kernel2"):
        kernel = getattr(block, name)
        u = torch.randn(1, kernel.shape[1], 16, 16, generator=torch.Generator().manual_seed(0)).to(kernel.dtype)
        u /= u.norm()
        with torch.no_grad():
            conv_spectral_normalize(kernel.detach(), u, 2.0, n_power_iterations=30)
        probes[name] = u

    def map_params(x, labels=None):
        update = block.training and torch.is_grad_enabled()
        s2 = operator_norm(block.kernel2, probes["kernel2"], update)
        w = 9.0 * s2 if variant == "spectral_k2" else 8.0 * operator_norm(block.kernel1, probes["kernel1"], update) * s2
        return (x, block.gamma1, block.beta1, block.kernel1, block.gamma2, block.beta2, block.kernel2,
                (1.0 / w).to(x.dtype))

    block.map_params = map_params


def compose_cfg(overrides: list[str]):
    return train_config([*BASE, *overrides])


def conv_operator_norm(kernel: torch.Tensor, hw: tuple[int, int], iters: int = 30) -> float:
    """‖conv(·, K)‖₂ of the same-padded convolution on an ``hw`` image, by power iteration (seeded)."""
    g = torch.Generator().manual_seed(0)
    v = torch.randn(1, kernel.shape[1], *hw, generator=g)
    sigma = 0.0
    for _ in range(iters):
        v = v / v.norm()
        u = F.conv2d(v, kernel, padding=kernel.shape[-1] // 2)
        sigma = float(u.norm())
        v = F.conv_transpose2d(u, kernel, padding=kernel.shape[-1] // 2)
    return sigma


@torch.no_grad()
def probe(net, x: torch.Tensor) -> dict[str, float]:
    """The block's state on ``x`` (image j at noise level j mod L, seeded noise): see the module doc."""
    block = net.deq_block()
    labels = torch.arange(x.shape[0]) % net.sigmas.numel()
    g = torch.Generator().manual_seed(1)
    xt = x + net.sigmas[labels].reshape(-1, 1, 1, 1) * torch.randn(x.shape, generator=g)
    y = net.deq_input(xt, labels)
    z = block(y, labels)
    iterations = int(block.last_stats["iterations"])
    h1 = F.conv2d(F.elu(instance_norm(z, block.gamma1, block.beta1)), block.kernel1, padding=1)
    k1, k2 = float(block.kernel1.norm()), float(block.kernel2.norm())
    op1, op2 = conv_operator_norm(block.kernel1, z.shape[2:]), conv_operator_norm(block.kernel2, z.shape[2:])
    g1 = float((block.gamma1.abs()[None] / z.std(dim=(2, 3))).max())
    g2 = float((block.gamma2.abs()[None] / h1.std(dim=(2, 3))).max())
    w = 1.0 / float(block.map_params(y, labels)[-1])  # the block's own w (authors' or spectral)
    return {"rate": block.contraction_rate(y, labels, iters=12), "probe_iterations": iterations, "w": w,
            "k1": k1, "k2": k2, "op1_over_f": op1 / k1, "op2_over_f": op2 / k2,
            "gamma1_max": float(block.gamma1.abs().max()), "gamma2_max": float(block.gamma2.abs().max()),
            "in1_gain": g1, "in2_gain": g2, "std_z_min": float(z.std(dim=(2, 3)).min()),
            "chain_bound": (1 + op2 * g2 * op1 * g1) / w}


def ssm_vr_truncation(module, x: torch.Tensor, seed: int = 2) -> dict[str, float]:
    """The σ²-weighted SSM-VR loss on ``x`` (one level per image, seeded noise and projections) with the phantom
    K = 2 backward and with the exact implicit one: the loss a phantom-trained network lowers and the one it
    means (the truncation of ``benchmarks.studies.ncsn_phantom_bias``, along the training)."""
    from benchmarks.lib.deq_backward import set_backward
    from src.objectives.conditional import noise_conditional
    from src.objectives.registry import get_objective
    from src.runtime.rng import seeded_rng

    block = module.net.deq_block()
    mode, k = block.config.backward, block.config.phantom_steps
    out = {}
    for label, backward in (("ssm_vr_phantom2", "phantom"), ("ssm_vr_implicit", "implicit")):
        set_backward(module.net, backward, 2)
        with seeded_rng(seed, x.device):
            res = noise_conditional(get_objective("ssm_vr"), module.net, x, module.net.sigmas,
                                    anneal_power=module.anneal_power, create_graph=False)
        out[label] = float(res.loss.detach())
    set_backward(module.net, mode, k)
    return out


def train_and_probe(overrides: list[str], variant: str | None, steps: int, every: int) -> list[dict]:
    """Train one setting for ``steps`` steps (plain loop: the module's objective and optimiser; ``variant``: the
    block's w, :func:`use_w_variant`), probing every ``every`` steps before the update."""
    import lightning.pytorch as L

    cfg = compose_cfg(overrides)
    L.seed_everything(int(cfg.seed), verbose=False)
    dm, module = build(cfg.data), build(cfg.model)
    dm.setup("fit")
    use_w_variant(module.net.deq_block(), variant)
    opt = module.configure_optimizers()
    opt = opt[0] if isinstance(opt, (list, tuple)) else opt
    opt = opt["optimizer"] if isinstance(opt, dict) else opt
    loader = dm.train_dataloader()
    first = next(iter(loader))
    probe_x = (first[0] if isinstance(first, (list, tuple)) else first)[: module.net.sigmas.numel()]
    block, rows, step, t0 = module.net.deq_block(), [], 0, time.perf_counter()
    while step < steps:
        for batch in loader:
            x = batch[0] if isinstance(batch, (list, tuple)) else batch
            row = None
            if step % every == 0:
                module.eval()
                row = {"step": step, **probe(module.net, probe_x), **ssm_vr_truncation(module, probe_x)}
                module.train()
            loss = module.training_objective(x).loss
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            if row is not None:
                row.update(train_loss=float(loss.detach()), train_iterations=int(block.last_stats["iterations"]),
                           train_hit_cap=bool(block.last_stats["hit_cap"]), elapsed_s=time.perf_counter() - t0)
                rows.append(row)
                print({k: round(v, 4) if isinstance(v, float) else v for k, v in row.items()}, flush=True)
            step += 1
            if step >= steps:
                break
    return rows


def render(res: dict) -> str:
    meta = res["meta"]
    setup = (f"Machine: {meta['machine']}. Overrides of `{' '.join(BASE)}`: "
             f"`data.batch_size={meta['batch']} seed={meta['seed']}`; probe: {meta['probe']}.")
    lines = ["# Normalized-residual DEQ-NCSN: what moves before the solve stops converging", "",
             f"`{meta['command']}`", "", setup, ""]
    for label, setting in res["settings"].items():
        caps = (f"Overrides: `{' '.join(setting['overrides']) or '(none)'}`, w: {setting['w']}; first probed "
                f"step whose training solve hit "
                f"the cap ({meta['max_iter']} iterations): {setting['first_cap_step']}.")
        lines += [f"## {label}", "", caps, ""]
        head = ["step", *[name for _, name, _ in COLUMNS]]
        body = [[r["step"], *[f"{r[key]:.{d}f}" for key, _, d in COLUMNS]] for r in setting["rows"]]
        lines += markdown_table(head, body) + [""]
    return "\n".join(lines + note_lines(meta))


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--root", default=None, help="data.root")
    ap.add_argument("--steps", type=int, default=121)
    ap.add_argument("--every", type=int, default=5)
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--only", action="append", default=None, help="a setting label (repeatable; default all)")
    ap.add_argument("--note", default=None, help="a markdown file appended to the tables (the finding)")
    result_options(ap, "ncsn_block_divergence")
    args = ap.parse_args(argv)
    if rendered(args, args.name, render):
        return
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    unknown = set(args.only or []) - set(SETTINGS)
    if unknown:
        ap.error(f"unknown --only {sorted(unknown)}; valid: {', '.join(SETTINGS)}")
    common = [f"data.batch_size={args.batch}", f"seed={args.seed}"] + ([f"data.root={args.root}"] if args.root else [])
    res = {"meta": {"machine": machine_facts(),
                    "command": script_command("benchmarks.studies.ncsn_block_divergence", data_root=args.root),
                    "batch": args.batch, "seed": args.seed, "max_iter": int(compose_cfg(common).deq.max_iter), "steps": args.steps, "every": args.every,
                    "probe": "the first training batch's first L images, image j at level j mod L, seeded noise; "
                             "ρ by 12 power iterations at the probe's fixed point"},
           "settings": {}}
    if args.note:
        with open(args.note) as fh:
            res["meta"]["note"] = fh.read()
    for label in args.only or list(SETTINGS):
        overrides, variant = SETTINGS[label]
        rows = train_and_probe([*common, *overrides], variant, args.steps, args.every)
        capped = [r["step"] for r in rows if r["train_hit_cap"]]
        res["settings"][label] = {"overrides": overrides, "w": variant or "authors", "rows": rows,
                                  "first_cap_step": capped[0] if capped else None}
        write_results(args.out, args.name, res, render)


if __name__ == "__main__":
    main()
