"""Where does annealed Langevin dynamics leave the data? Per-level diagnostics of trained NCSN checkpoints.

Test losses measure the score on noisy *data* (x̃ = x + σᵢz); samples come from the score on the sampler's
*trajectory*. When two networks have the same per-level test DSM loss but one's samples saturate (the
MNIST DEQ-NCSN of ``benchmarks/results/ncsn_mnist_curves.md``), the trajectory has left the region the loss
measures. For each checkpoint and each noise level i this records, in model space ([0, 1] pixels for MNIST):

- **reference** (noisy test images x̃ = x + σᵢz, where the loss is measured): the mean of x̃, and the network's
  predicted noise e = σᵢ·s(x̃, i) — its mean (a perfect score has mean ≈ 0: E[z] = 0) and its RMS — and the
  denoising residual RMS(e + z) (the square root of the per-pixel DSM loss ×2);
- **trajectory** (annealed Langevin from the model's own start, U(0, 1), and, to separate the start from
  the score, from noisy test images x + σ₁z), after the T steps of level i: the mean of x, the share of
  pixels above 1 and below 0, e's mean and RMS at x, and the mean of Tweedie's denoised estimate x + σᵢe.

A score whose trajectory mean runs away from the reference mean while e's mean stays away from 0 has a
systematic drift that the loss on x̃ never sees.

    python -m benchmarks.studies.ncsn_sampler_drift --root data \\
        --ckpt 'TwoRes=outputs/…/step_0000600.ckpt' --ckpt 'DEQ=outputs/…/step_0000600.ckpt' \\
        [--n 64] [--n-steps-each 10] [--step-lr 1e-4] [--seed 0]
    python -m benchmarks.studies.ncsn_sampler_drift --render     # rebuild the markdown from the JSON

Writes ``<out>/<name>.json`` and ``.md`` (default ``benchmarks/results/ncsn_sampler_drift``).

``--step-lr`` is ε of :mod:`src.sampling.annealed_langevin` (x + αᵢ·s + √(2αᵢ)·z, αᵢ = ε·σᵢ²/σ_L², the reference code's step).
The committed ``ncsn_sampler_drift.md`` predates that convention: its ε = 2·10⁻⁴ took x + (ε/2)·s + √ε·z,
the chain that ``--step-lr 1e-4`` (the default) runs now.
"""

from __future__ import annotations

import argparse

from benchmarks.lib.results import checkpoint_options, checkpoint_study, note_lines
from src.reports.tables import markdown_table

INITS = ("uniform", "data")


def level_stats(net, x, i: int, sigma: float) -> dict[str, float]:
    """Statistics of the points ``x`` and of the predicted noise e = σᵢ·s(x, i) there."""
    import torch

    labels = torch.full((x.shape[0],), i, dtype=torch.long, device=x.device)
    with torch.no_grad():
        e = sigma * net.score(x, labels)
    return {"x_mean": float(x.mean()), "x_above_1": float((x > 1).float().mean()),
            "x_below_0": float((x < 0).float().mean()), "e_mean": float(e.mean()),
            "e_rms": float(e.pow(2).mean().sqrt()), "denoised_mean": float((x + sigma * e).mean())}


def diagnose(module, n: int, n_steps_each: int, step_lr: float, seed: int) -> dict:
    import torch

    from src.sampling.annealed_langevin import annealed_langevin

    net = module.net
    net.eval()
    sigmas = [float(s) for s in net.sigmas]
    data = module.split_tensor("test", n).to(module.dtype)
    g = torch.Generator().manual_seed(seed)
    reference = []
    for i, s in enumerate(sigmas):
        z = torch.randn(data.shape, generator=g, dtype=data.dtype)
        xt = data + s * z
        row = level_stats(net, xt, i, s)
        labels = torch.full((n,), i, dtype=torch.long)
        with torch.no_grad():
            row["dsm_residual_rms"] = float((s * net.score(xt, labels) + z).pow(2).mean().sqrt())
        reference.append({"level": i, "sigma": s, **row})
    trajectories = {}
    for init in INITS:
        x0 = (torch.rand(data.shape, generator=g, dtype=data.dtype) if init == "uniform"
              else data + sigmas[0] * torch.randn(data.shape, generator=g, dtype=data.dtype))
        if module.pixel_range == "symmetric" and init == "uniform":
            x0 = 2 * x0 - 1
        rows: list[dict] = trajectories.setdefault(init, [])

        def record(i, x, rows=rows):
            rows.append({"level": i, "sigma": sigmas[i], **level_stats(net, x, i, sigmas[i])})

        annealed_langevin(net.score, x0, net.sigmas.to(data.dtype), n_steps_each=n_steps_each, step_lr=step_lr,
                          generator=g, on_level_end=record)
    return {"data_mean": float(data.mean()), "reference": reference, "trajectory": trajectories}


def render(res: dict) -> str:
    meta = res["meta"]
    lines = ["# NCSN: annealed Langevin trajectory vs noisy data, per noise level", "",
             f"Command: `{meta['command']}`", "",
             (f"Machine: {meta['machine']}. Sampler: T = {meta['n_steps_each']} steps per level, ε = "
              f"{meta['step_lr']:g}, {meta['n']} chains, seed {meta['seed']}; no final denoising step."), "",
             ("e = σᵢ·s(x, i), the network's predicted noise (mean ≈ 0 and RMS ≈ 1 on noisy data for a good score "
              "at small σ). Reference = noisy test images x + σᵢz; trajectories start from U(0, 1) (the sampler's "
              "start) or from x + σ₁z. Pixels in model space ([0, 1] is the data range)."), ""]
    for label, r in res["checkpoints"].items():
        lines += [f"## {label}", "", f"Checkpoint: `{r['checkpoint']}`; test-image mean {r['data_mean']:.3f}.", ""]
        head = ["level", "σ", "ref x̃ mean", "ref e mean", "ref e RMS", "ref RMS(e+z)"]
        for init in INITS:
            head += [f"{init}: x mean", f"{init}: >1", f"{init}: e mean", f"{init}: e RMS"]
        rows = []
        for i, ref in enumerate(r["reference"]):
            cells = [str(i), f"{ref['sigma']:.3g}", f"{ref['x_mean']:.3f}", f"{ref['e_mean']:+.3f}",
                     f"{ref['e_rms']:.3f}", f"{ref['dsm_residual_rms']:.3f}"]
            for init in INITS:
                t = r["trajectory"][init][i]
                cells += [f"{t['x_mean']:.3f}", f"{100 * t['x_above_1']:.1f} %", f"{t['e_mean']:+.3f}",
                          f"{t['e_rms']:.3f}"]
            rows.append(cells)
        lines += markdown_table(head, rows) + [""]
    return "\n".join(lines + note_lines(meta))


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    checkpoint_options(ap, "ncsn_sampler_drift", "an NCSN checkpoint")
    ap.add_argument("--n-steps-each", type=int, default=10)
    ap.add_argument("--step-lr", type=float, default=1e-4)
    args = ap.parse_args(argv)

    def measure(module) -> dict:
        if not hasattr(module, "net") or not hasattr(module.net, "sigmas"):
            raise SystemExit("not an NCSN checkpoint (model=ncsn)")
        return diagnose(module, args.n, args.n_steps_each, args.step_lr, args.seed)

    checkpoint_study(ap, args, "benchmarks.studies.ncsn_sampler_drift", render, measure, n_steps_each=args.n_steps_each,
                     step_lr=args.step_lr)


if __name__ == "__main__":
    main()
