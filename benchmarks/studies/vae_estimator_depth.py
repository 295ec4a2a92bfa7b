"""Does a deep MLP score estimator s(z|x) learn? A controlled check behind the MNIST SSM-VAE curves.

The Aug(16) MLP estimator of ``experiment=vae_mnist`` (256 units, lr 1e-3) stayed at s ≈ 0 (test SSM loss ≈ 0)
in ``vae_mnist_curves.md`` while Aug(8) and the DEQ learned. This isolates the estimator from the VAE: the
same ``ScoreEstimator`` (``arch=mlp``, 256 units, He-initialised extra layers) is trained alone by SSM
(Gaussian projections, Adam, batch 128, 1500 steps) on a known conditional Gaussian q(z|x) = N(Ax, diag σ(x)²)
with binary 784-d x and D_z = 8, whose score −(z − Ax)/σ(x)² is exact; reported: the relative squared error
of s against it on 1024 fresh draws (1 = the trivial s = 0), for depth k ∈ {0, 8, 16} × lr ∈ {1e-3, 1e-4}.

    python -m benchmarks.studies.vae_estimator_depth      # -> benchmarks/results/vae_estimator_depth.{json,md}
"""

from __future__ import annotations

import argparse
import json
import math
import platform
import time

import torch

from benchmarks.lib.results import rendered, result_options, script_command
from src.models.vae import ConditionalScore, ScoreEstimator
from src.objectives.ssm import ssm
from src.reports.tables import markdown_table, write_results

D, DZ = 784, 8


def draw(n: int, a: torch.Tensor, g: torch.Generator):
    x = (torch.rand(n, D, generator=g) < 0.3).float()
    mu = x @ a
    sigma = (0.3 + 0.7 * torch.sigmoid(x @ a[:, :1])).expand(-1, DZ)
    z = mu + sigma * torch.randn(n, DZ, generator=g)
    return x.reshape(n, 1, 28, 28), z, -(z - mu) / sigma**2


def run(depth: int, lr: float, steps: int, width: int) -> dict:
    g = torch.Generator().manual_seed(0)
    a = torch.randn(D, DZ, generator=g) / math.sqrt(D)
    torch.manual_seed(1)
    est = ScoreEstimator((1, 28, 28), DZ, arch="mlp", channels=width, depth=depth)
    opt = torch.optim.Adam(est.parameters(), lr=lr, weight_decay=1e-12)
    t0 = time.perf_counter()
    for _ in range(steps):
        x, z, _ = draw(128, a, g)
        loss = ssm(ConditionalScore(est, x), z, projection="gaussian").loss
        opt.zero_grad()
        loss.backward()
        opt.step()
    x, z, true = draw(1024, a, g)
    with torch.no_grad():
        err = (est(z, x) - true).pow(2).sum(1).mean() / true.pow(2).sum(1).mean()
    return {"depth": depth, "lr": lr, "relative_error": float(err), "final_ssm_loss": float(loss.detach()),
            "seconds": time.perf_counter() - t0}


def render(res: dict) -> str:
    head = ["depth k", "lr", "relative squared error of s (1 = s ≡ 0)", "last SSM loss", "s"]
    rows = [[r["depth"], f"{r['lr']:g}", f"{r['relative_error']:.3f}", f"{r['final_ssm_loss']:.2f}",
             f"{r['seconds']:.0f}"] for r in res["rows"]]
    m = res["meta"]
    return "\n".join(["# Deep MLP score estimators: depth × learning rate", "",
                      (f"`{m['command']}` — {m['machine']}, torch {m['torch']}, 1 thread; {m['steps']} SSM steps, "
                      f"width {m['width']}, batch 128, known conditional Gaussian score (see the script)."), "",
                      *markdown_table(head, rows), ""])


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=int, default=1500)
    ap.add_argument("--width", type=int, default=256)
    result_options(ap)
    args = ap.parse_args(argv)
    if rendered(args, "vae_estimator_depth", render):
        return
    torch.set_num_threads(1)
    rows = []
    for lr in (1e-3, 1e-4):
        for depth in (0, 8, 16):
            rows.append(run(depth, lr, args.steps, args.width))
            print(json.dumps(rows[-1]), flush=True)
    res = {"meta": {"command": script_command("benchmarks.studies.vae_estimator_depth"), "machine": f"{platform.machine()} CPU",
                    "torch": torch.__version__, "steps": args.steps, "width": args.width}, "rows": rows}
    write_results(args.out, "vae_estimator_depth", res, render)


if __name__ == "__main__":
    main()
