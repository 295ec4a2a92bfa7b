"""Singular values of the normalized DEQ weights Ŵ = W / (λ‖W‖_F) of a trained run's checkpoint.

    python -m benchmarks.studies.deq_spectrum outputs/benchmarks/nice/mnist_DEQ-SSM_seed0 [more run dirs] [--json out.json]

For each dense DEQ block (``*.block.weights.<i>`` in the state dict) prints σ₁, σ₂, σ₁ / (1/λ) (the share of
the normalization budget ‖Ŵ‖_F = 1/λ in the top direction), the stable rank ‖Ŵ‖_F² / σ₁², and |cos| between
the top singular vectors and the all-ones direction. At initialisation a 1000-wide block has σ₁ ≈ 0.03 of the
0.5 budget (λ = 2); a block whose Ŵ has collapsed to rank one has σ₁ ≈ 1/λ.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch


def spectrum(weight: torch.Tensor, norm_lambda: float) -> dict:
    w = weight.double()
    w_hat = w / (norm_lambda * (torch.linalg.vector_norm(w) + 1e-6))
    u, s, vh = torch.linalg.svd(w_hat)
    ones = torch.ones(w.shape[0], dtype=w.dtype) / w.shape[0] ** 0.5
    return {"sigma1": s[0].item(), "sigma2": s[1].item(), "budget_share": (s[0] * norm_lambda).item(),
            "stable_rank": (s.pow(2).sum() / s[0] ** 2).item(),
            "cos_left_ones": abs(torch.dot(u[:, 0], ones)).item(), "cos_right_ones": abs(torch.dot(vh[0], ones)).item()}


def run_dir_spectra(run: Path) -> dict:
    metrics = json.loads((run / "metrics.json").read_text())
    ckpt = Path(metrics.get("tested_checkpoint") or run / "checkpoints" / "last.ckpt")
    if not ckpt.is_absolute() and not ckpt.exists():
        ckpt = run / "checkpoints" / ckpt.name
    from src.deq.config import PAPER_NORM_LAMBDA
    from src.runtime.checkpoints import load_checked

    state = load_checked(ckpt)  # weights-only (src.runtime.checkpoints)
    lam = float(state["hyper_parameters"]["deq"].get("norm_lambda") or PAPER_NORM_LAMBDA)  # unset: the paper's
    out = {}
    for key, value in state["state_dict"].items():
        if ".block.weights." in key or (key.endswith(".weights.0") and value.dim() == 2):
            out[key] = spectrum(value, lam)
    return {"checkpoint": str(ckpt), "norm_lambda": lam, "blocks": out}


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("runs", nargs="+", type=Path)
    p.add_argument("--json", type=Path, default=None)
    args = p.parse_args(argv)
    results = {}
    for run in args.runs:
        res = run_dir_spectra(run)
        results[run.name] = res
        print(f"{run.name} ({res['checkpoint']}, λ = {res['norm_lambda']:g})")
        for key, r in res["blocks"].items():
            print(f"  {key}: σ₁ {r['sigma1']:.3f} (budget share {r['budget_share']:.2f}), σ₂ {r['sigma2']:.4f}, "
                  f"stable rank {r['stable_rank']:.2f}, |cos(u₁, 1)| {r['cos_left_ones']:.3f}, "
                  f"|cos(v₁, 1)| {r['cos_right_ones']:.3f}")
    if args.json:
        args.json.write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
