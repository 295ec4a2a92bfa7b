"""Forward-solver benchmark: iterations and wall time to tolerance for picard, anderson and broyden.

    python -m benchmarks.studies.deq_solvers [--root data] [--train-steps 150] [--tol 1e-5]

Three blocks:
- a *trained* DKEF feature block (DEQ-DKEF trained with exact SM on RedWine for ``--train-steps`` steps of
  ``DKEFLitModule.training_objective``, α fitted on one half of each batch, the loss on the other);
- a NICE-sized block (in 392 → width 1000, as one coupling of DEQ-NICE), on MNIST logit-space halves;
- a slow block: W ≈ rank one, the slowest contraction the Frobenius normalization allows (rate ≈ 1/λ).
Each block is solved at the training normalization (λ = 2: fast contraction) and at λ = 1.1 (slow
contraction, rate up to 0.91, where acceleration should pay). Each solver is run cold (z0 = 0) and
warm-started in two ways: from the previous batch's fixed point
("warm: previous batch"), and from the same samples' fixed point before one optimiser step ("warm: same
samples, after a step" — the by-sample-index warm start of training). Results go to
``benchmarks/results/deq_solvers.json`` and ``.md``.
"""

from __future__ import annotations

import argparse
import platform
import sys
import time

import torch

from benchmarks.lib.results import DATA_ROOT, rendered, result_options
from src.data.datamodules import UCIDataModule
from src.deq.block import DenseDEQBlock
from src.deq.config import DEQConfig
from src.deq.solvers import solve
from src.lit.dkef import DKEFLitModule
from src.reports.tables import write_results

SOLVERS = ("picard", "anderson", "broyden")


def block_map(block: DenseDEQBlock, x: torch.Tensor):
    """The block's fixed-point map z -> f(z; x) with the input injection computed once."""
    with torch.no_grad():
        return block.fixed_point_map(x)


def time_solve(f, z0, method: str, tol: float, max_iter: int, repeats: int = 3):
    best, res = float("inf"), None
    for _ in range(repeats):
        t0 = time.perf_counter()
        res = solve(f, z0, method=method, tol=tol, max_iter=max_iter, stop_mode="abs")
        best = min(best, time.perf_counter() - t0)
    return res, best


def bench_block(name: str, block: DenseDEQBlock, batches: list[torch.Tensor], step_fn, tol: float, max_iter: int):
    rows = []
    for method in SOLVERS:
        cold_it, cold_t, prev_it, prev_t, same_it, same_t = [], [], [], [], [], []
        z_prev = None
        for x in batches:
            f = block_map(block, x)
            z0 = torch.zeros(x.shape[0], block.width)
            r, t = time_solve(f, z0, method, tol, max_iter)
            cold_it.append(r.iterations)
            cold_t.append(t)
            if z_prev is not None and z_prev.shape == z0.shape:
                r2, t2 = time_solve(f, z_prev, method, tol, max_iter)
                prev_it.append(r2.iterations)
                prev_t.append(t2)
            z_prev = r.z
            # same samples after one optimiser step: the old fixed point is the start
            if step_fn is not None:
                saved = {k: v.clone() for k, v in block.state_dict().items()}
                step_fn(x)
                f_new = block_map(block, x)
                r3, t3 = time_solve(f_new, r.z, method, tol, max_iter)
                same_it.append(r3.iterations)
                same_t.append(t3)
                block.load_state_dict(saved)

        def avg(v):
            return sum(v) / len(v) if v else float("nan")

        rows.append({
            "block": name, "solver": method,
            "cold_iters": avg(cold_it), "cold_ms": 1e3 * avg(cold_t),
            "warm_prev_batch_iters": avg(prev_it), "warm_prev_batch_ms": 1e3 * avg(prev_t),
            "warm_same_samples_iters": avg(same_it), "warm_same_samples_ms": 1e3 * avg(same_t),
        })
    return rows


def trained_dkef_block(root: str, steps: int, seed: int):
    """DEQ-DKEF (``DKEFLitModule``, exact SM, depth 1, Picard) trained ``steps`` Adam steps on RedWine; its
    feature block, 8 full training batches, and the module's own training step on a batch (the "step")."""
    torch.manual_seed(seed)
    dm = UCIDataModule("redwine", root, batch_size=128)
    dm.setup("fit")
    deq = {"enabled": True, "solver": "picard", "tol": 1e-5, "max_iter": 128, "phantom_steps": 2,
           "warm_start": True, "norm_lambda": 2.0}
    module = DKEFLitModule(dm.dim, loss={"name": "sm"}, deq=deq, depth=1)
    with torch.no_grad():
        module.net.inducing.copy_(dm.train_data[torch.randperm(dm.train_data.shape[0])[:200]])
    opt = torch.optim.Adam(module.parameters(), lr=1e-3, weight_decay=1e-12)

    def step_fn(x):
        """One optimiser step of the whole model on x (the block gets new weights)."""
        loss = module.training_objective(x).loss
        opt.zero_grad()
        loss.backward()
        opt.step()

    done = 0
    while done < steps:
        for x in dm.train_dataloader():
            if done >= steps:
                break
            step_fn(x)
            done += 1
    block = module.net.features[0].block
    batches = list(dm.train_data[: 8 * 128].split(128))  # 8 full batches: warm starts need equal shapes
    return block, batches, step_fn


def adam_step_on_output_norm(block: DenseDEQBlock):
    """A stand-alone block's "optimiser step": one Adam step on mean z*(x)², so its weights move a little."""
    opt = torch.optim.Adam(block.parameters(), lr=1e-3)

    def step_fn(xb):
        out = block(xb).pow(2).mean()
        opt.zero_grad()
        out.backward()
        opt.step()

    return step_fn


def nice_block(root: str, seed: int):
    torch.manual_seed(seed)
    from src.data.mnist import MNISTDataModule

    deq = DEQConfig(norm_lambda=2.0)
    injection = torch.nn.Sequential(torch.nn.Linear(392, 1000), torch.nn.Softplus())
    block = DenseDEQBlock(392, 1000, injection=injection, config=deq, name="nice-sized")
    dm = MNISTDataModule(root, limit=2000)
    dm.setup("fit")
    x = dm.train_data[:, ::2][: 8 * 128]
    batches = list(x.split(128))
    return block, batches, adam_step_on_output_norm(block)


def slow_block(seed: int, width: int = 64, in_dim: int = 11):
    """The slowest contraction the normalization allows: W ≈ rank one, so ‖W‖₂ ≈ ‖W‖_F and the rate is ≈ 1/λ.

    Random (and, as the table shows, trained) weights have ‖W‖₂ ≪ ‖W‖_F, which makes the Frobenius-normalized
    map contract much faster than 1/λ; this block shows how the solvers behave when it does not.
    """
    g = torch.Generator().manual_seed(seed)
    block = DenseDEQBlock(in_dim, width, config=DEQConfig(norm_lambda=2.0), name="rank-one")
    with torch.no_grad():
        u, v = torch.rand(width, 1, generator=g), torch.rand(1, width, generator=g)
        block.weights[0].copy_(u @ v + 0.01 * torch.randn(width, width, generator=g))
    batches = list(torch.randn(8 * 128, in_dim, generator=g).split(128))
    return block, batches, adam_step_on_output_norm(block)


def to_markdown(rows, meta) -> str:
    head = ("| block | solver | cold iters | cold ms | warm (prev batch) iters | ms | warm (same samples, after a step) "
            "iters | ms |\n|---|---|---|---|---|---|---|---|\n")
    body = "".join(
        f"| {r['block']} | {r['solver']} | {r['cold_iters']:.1f} | {r['cold_ms']:.1f} | {r['warm_prev_batch_iters']:.1f} | "
        f"{r['warm_prev_batch_ms']:.1f} | {r['warm_same_samples_iters']:.1f} | {r['warm_same_samples_ms']:.1f} |\n"
        for r in rows
    )
    return f"Tolerance {meta['tol']} (absolute, per sample), {meta['threads']} CPU thread(s), {meta['machine']}.\n\n" + head + body


def render(res: dict) -> str:
    """The markdown of a saved ``deq_solvers.json``."""
    return to_markdown(res["rows"], res["meta"])


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--root", default=str(DATA_ROOT), help="data.root (RedWine and MNIST)")
    p.add_argument("--train-steps", type=int, default=150)
    p.add_argument("--tol", type=float, default=1e-5)
    p.add_argument("--max-iter", type=int, default=500)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--lambdas", default="2.0,1.1",
                   help="norm_lambda values to solve each block at: 2.0 trains (fast contraction, ~6 iterations); "
                        "values near 1 give the slow contraction (rate up to 1/lambda) where acceleration matters")
    result_options(p)
    args = p.parse_args(argv)
    if rendered(args, "deq_solvers", render):
        return
    torch.set_num_threads(args.threads)
    rows = []
    blocks = [("DKEF (trained, width 64)", trained_dkef_block(args.root, args.train_steps, args.seed)),
              ("NICE-sized (width 1000)", nice_block(args.root, args.seed)),
              ("slow: rank-one W (width 64)", slow_block(args.seed))]
    for name, (block, batches, step_fn) in blocks:
        for lam in (float(v) for v in args.lambdas.split(",")):
            block.config.norm_lambda = lam
            rows += bench_block(f"{name}, λ={lam:g}", block, batches, step_fn, args.tol, args.max_iter)
    meta = {"tol": args.tol, "threads": args.threads, "machine": f"{platform.machine()} {platform.processor() or ''}".strip(),
            "torch": torch.__version__, "command": "python -m benchmarks.studies.deq_solvers " + " ".join(argv or sys.argv[1:])}
    write_results(args.out, "deq_solvers", {"meta": meta, "rows": rows}, render, indent=2)
    print(render({"meta": meta, "rows": rows}))


if __name__ == "__main__":
    main()
