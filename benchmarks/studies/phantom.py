"""App. C of the paper as a command: how close is the phantom gradient to exact implicit differentiation?

    python -m benchmarks.studies.phantom --root <data dir> --steps 200 --every 10 --out outputs/phantom

DEQ-DKEF is trained on UCI Parkinsons with the paper's phantom gradient (K = 2). Every ``--every`` steps,
on a fresh batch, the phantom quantities for each K of ``--ks`` are compared with the exact implicit ones
(``deq.backward=implicit``, eqs. 8–9):

- relative score error ‖s_K − s*‖ / ‖s*‖ per sample (paper Fig. 5),
- cosine similarity of s_K and s* per sample (Fig. 6),
- cosine similarity of the parameter gradients ∂L/∂θ of the SM and the SSM loss (Fig. 7), with α refitted
  in the same mode so every path through the DEQ is included.

Writes PNG histograms (K = 2) and ``phantom_summary.json`` with mean / median / max per K and per loss.
"""

from __future__ import annotations

import argparse
import json
import math
from pathlib import Path

import torch

from benchmarks.lib.deq_backward import set_backward
from src.data.datamodules import UCIDataModule
from src.deq.config import deq_setting
from src.models.dkef import DKEF
from src.objectives.base import compute_score
from src.objectives.sm import sm
from src.objectives.ssm import ssm


def param_grad(model: DKEF, x_fit, x_loss, loss: str, v: torch.Tensor | None) -> torch.Tensor:
    alpha = model.fit_alpha(x_fit, "exact" if loss == "sm" else "sliced", n_projections=1)
    target = model.with_alpha(alpha)
    if loss == "sm":
        out = sm(target, x_loss, trace_route="loop")
    else:
        out = ssm(target, x_loss, v=v)
    params = [p for p in model.parameters() if p.requires_grad]
    grads = torch.autograd.grad(out.loss, params, allow_unused=True)
    return torch.cat([(g if g is not None else torch.zeros_like(p)).flatten() for g, p in zip(grads, params)])


def compare(model: DKEF, x: torch.Tensor, ks: list[int], seed: int) -> dict:
    half = x.shape[0] // 2
    x_fit, x_loss = x[:half], x[half:]
    model.fit_alpha_on(x_fit, "exact")  # a fixed α for the score comparison
    set_backward(model, "implicit")
    s_star = compute_score(model, x_loss, create_graph=False).detach()
    g = torch.Generator().manual_seed(seed)
    v = (torch.randint(0, 2, x_loss.shape, generator=g) * 2 - 1).to(x_loss)[None]
    torch.manual_seed(seed)
    g_star = {loss: param_grad(model, x_fit, x_loss, loss, v) for loss in ("sm", "ssm")}
    out = {}
    for k in ks:
        set_backward(model, "phantom", k)
        s_k = compute_score(model, x_loss, create_graph=False).detach()
        rel = (s_k - s_star).norm(dim=-1) / s_star.norm(dim=-1).clamp_min(1e-30)
        cos = torch.nn.functional.cosine_similarity(s_k, s_star, dim=-1)
        torch.manual_seed(seed)
        gcos = {
            loss: torch.nn.functional.cosine_similarity(param_grad(model, x_fit, x_loss, loss, v), g_star[loss], dim=0).item()
            for loss in ("sm", "ssm")
        }
        out[k] = {"rel_error": rel.tolist(), "score_cos": cos.tolist(), "grad_cos": gcos}
    return out


def summarise(values: list[float]) -> dict:
    t = torch.tensor(values, dtype=torch.float64)
    return {"mean": t.mean().item(), "median": t.median().item(), "min": t.min().item(), "max": t.max().item(),
            "n": t.numel()}


def histograms(records: dict, k: int, out: Path) -> list[Path]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    paths = []
    specs = [
        ("rel_error", "relative score error ||s_K - s*|| / ||s*||", "fig5_score_rel_error.png"),
        ("score_cos", "cosine similarity of s_K and s*", "fig6_score_cosine.png"),
    ]
    for key, label, name in specs:
        fig, ax = plt.subplots(figsize=(5, 3.2))
        ax.hist(records[k][key], bins=50, color="C0")
        ax.set_xlabel(label)
        ax.set_ylabel("samples")
        ax.set_title(f"phantom gradient K={k} vs implicit (DKEF, Parkinsons)", fontsize=9)
        fig.tight_layout()
        fig.savefig(out / name, dpi=120)
        plt.close(fig)
        paths.append(out / name)
    fig, axes = plt.subplots(1, 2, figsize=(8, 3.2))
    for ax, loss in zip(axes, ("sm", "ssm")):
        gap = [max(1.0 - c, 1e-17) for c in records[k][f"grad_cos_{loss}"]]
        ax.hist([math.log10(g) for g in gap], bins=30, color="C1")
        ax.set_xlabel(f"log10(1 - cos(dL/dθ phantom, implicit)), {loss.upper()}")
        ax.set_ylabel("training steps")
    fig.suptitle(f"parameter-gradient cosine similarity, K={k}", fontsize=9)
    fig.tight_layout()
    fig.savefig(out / "fig7_param_grad_cosine.png", dpi=120)
    plt.close(fig)
    paths.append(out / "fig7_param_grad_cosine.png")
    return paths


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--root", default="data", help="data.root holding parkinsons-telemonitoring/ (default: ./data)")
    p.add_argument("--data", default="parkinsons", choices=["parkinsons", "redwine", "whitewine"])
    p.add_argument("--steps", type=int, default=200, help="training steps (phantom K=2, as the paper)")
    p.add_argument("--every", type=int, default=10, help="compare every N steps")
    p.add_argument("--ks", default="1,2,4,8,16", help="phantom steps K to compare")
    p.add_argument("--batch-size", type=int, default=128)
    p.add_argument("--norm-lambda", type=float, default=2.0)
    p.add_argument("--n-inducing", type=int, default=200)
    p.add_argument("--tol", type=float, default=1e-9, help="solver tolerance (abs); float32 bottoms out near 1e-6")
    p.add_argument("--dtype", choices=["float64", "float32"], default="float64",
                   help="float64 (default) keeps the implicit reference exact to ~1e-12; float32 floors at ~1e-6")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", type=Path, default=Path("outputs/phantom"))
    args = p.parse_args(argv)
    ks = sorted({int(k) for k in args.ks.split(",")} | {2})
    args.out.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(args.seed)

    dm = UCIDataModule(args.data, args.root, batch_size=args.batch_size)
    dm.setup("fit")
    deq = {"enabled": True, "solver": "anderson", "tol": args.tol, "max_iter": 200, "phantom_steps": 2,
           "warm_start": False, "norm_lambda": args.norm_lambda, "backward": "phantom"}
    dtype = getattr(torch, args.dtype)
    model = DKEF(dm.dim, deq=deq_setting(deq), depth=1, n_inducing=args.n_inducing).to(dtype)
    with torch.no_grad():
        model.inducing.copy_(dm.train_data[torch.randperm(dm.train_data.shape[0])[: args.n_inducing]].to(dtype))
    opt = torch.optim.Adam(model.parameters(), lr=1e-3, weight_decay=1e-12)
    loader = dm.train_dataloader()
    records = {k: {"rel_error": [], "score_cos": [], "grad_cos_sm": [], "grad_cos_ssm": []} for k in ks}
    step = 0
    while step < args.steps:
        for x in loader:
            if step >= args.steps:
                break
            x = x.to(dtype)
            if step % args.every == 0:
                res = compare(model, x, ks, seed=args.seed + step)
                for k, r in res.items():
                    records[k]["rel_error"] += r["rel_error"]
                    records[k]["score_cos"] += r["score_cos"]
                    records[k]["grad_cos_sm"].append(r["grad_cos"]["sm"])
                    records[k]["grad_cos_ssm"].append(r["grad_cos"]["ssm"])
                print(f"step {step}: K=2 rel. score error {sum(res[2]['rel_error']) / len(res[2]['rel_error']):.3e}, "
                      f"1 - grad cos SM {1 - res[2]['grad_cos']['sm']:.2e} SSM {1 - res[2]['grad_cos']['ssm']:.2e}", flush=True)
            set_backward(model, "phantom", 2)
            half = x.shape[0] // 2
            alpha = model.fit_alpha(x[:half], "exact")
            loss = sm(model.with_alpha(alpha), x[half:]).loss
            opt.zero_grad()
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 100.0)
            opt.step()
            step += 1
    summary = {
        "settings": vars(args) | {"out": str(args.out), "ks": ks},
        "per_k": {str(k): {name: summarise(vals) for name, vals in rec.items() if vals} for k, rec in records.items()},
    }
    rel_means = [summary["per_k"][str(k)]["rel_error"]["mean"] for k in ks]
    summary["geometric_rate_of_rel_error"] = [
        (rel_means[i + 1] / rel_means[i]) ** (1 / (ks[i + 1] - ks[i])) if rel_means[i] > 0 else math.nan
        for i in range(len(ks) - 1)
    ]
    (args.out / "phantom_summary.json").write_text(json.dumps(summary, indent=2))
    plots = histograms(records, 2, args.out)
    print(json.dumps(summary["per_k"]["2"], indent=2))
    print("wrote", args.out / "phantom_summary.json", *plots)
    return summary


if __name__ == "__main__":
    main()
