"""Memory and time of NCSN score networks at the CIFAR-10 size: RefineNet vs TwoRes vs DEQ (paper Table 5).

Each variant is the score network of ``src.lit.ncsn.NCSNLitModule`` at 3×32×32, ngf 128, 10 noise levels,
trained by the σ²-weighted noise-conditional SSM-VR loss (the paper's), measured after ``--warmup`` steps:

- ``params``;
- ``score``: the score s(x̃, i) computed with autograd on (x̃ and the parameters) — the graph SSM-VR
  differentiates, the paper's "memory of ∇ₓ log p̃'s graph" — saved-for-backward MB and ms;
- ``step``: one whole training step, ``NCSNLitModule.training_step`` itself (run outside a Trainer by
  ``_common.training_step``: loss with create_graph, backward to every parameter, the Adam step of
  ``conf/model/ncsn.yaml``) — saved MB and ms;
- DEQ solver iterations (forward) and the contraction rate of the map at the fixed point.

Saved bytes come from ``torch.autograd.graph.saved_tensors_hooks`` (distinct storages; the same on any
device). The paper's figures (Table 5) are for batch 128 on a GPU; a CPU run here uses a small
batch (``--batch``, default 2), so compare ratios between rows, not absolute numbers.

    python benchmarks/ncsn_memory.py                      # CPU, 1 thread, batch 2
    python benchmarks/ncsn_memory.py --device cuda --batch 128

Results are merged by (device, batch) into ``benchmarks/results/ncsn_memory.json`` and rendered to
``benchmarks/results/ncsn_memory.md``.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
from pathlib import Path

import torch
from _common import RESULTS, ROOT, measured, trainer_free, training_step
from omegaconf import OmegaConf

from src.deq.config import DEQConfig
from src.lit.ncsn import NCSNLitModule
from src.reporting import load_results, markdown_table, rerender, write_results

# (row, arch, deq enabled, depth, deq overrides): the paper's three rows of Table 5, and the DEQ with the spectral
# bound on its convolutions (deq.norm=spectral) — with a relative stopping tolerance: its map contracts at ≈ 0.08,
# and an absolute 1e-5 per sample on a 128×32×32 state (‖z*‖ ≈ 10²) sits at float32's round-off floor, so
# Picard stalled at residual ≈ 1.1e-5 and ran to max_iter (measured)
VARIANTS = [("SSM-VR NCSN (RefineNet)", "refinenet", False, None, {}),
            ("TwoRes-SSM-VR NCSN (DEQ off)", "deq", False, 1, {}),
            ("DEQ-SSM-VR NCSN", "deq", True, None, {}),
            ("DEQ-SSM-VR NCSN (spectral norm)", "deq", True, None, {"norm": "spectral", "stop_mode": "rel"})]
PAPER = {  # Table 5 (batch 128, GPU): FID, ms/iteration, params, memory of the score graph, total memory
    "SSM-VR NCSN (RefineNet)": ("40.31 ± 1.4", "871 ± 10", "28M", "7536 MiB", "40.4 GB"),
    "TwoRes-SSM-VR NCSN (DEQ off)": ("50.77 ± 1.5", "391 ± 10", "9M", "1701 MiB", "18.5 GB"),
    "DEQ-SSM-VR NCSN": ("40.99 ± 1.0", "481 ± 25", "9M", "2104 MiB", "20.1 GB"),
    "DEQ-SSM-VR NCSN (spectral norm)": ("–", "–", "–", "–", "–"),
}
MB = 2**20


def build(arch: str, deq: bool, depth: int | None, ngf: int, device: str, overrides: dict | None = None
          ) -> NCSNLitModule:
    """The ``model=ncsn`` module at 3×32×32 with the SSM-VR loss and the optimiser of ``conf/model/ncsn.yaml``;
    DEQ settings: ``conf/deq/true.yaml``'s defaults (Picard, K = 2 phantom) with ``overrides``."""
    deq_cfg = {"enabled": deq, **DEQConfig().to_dict(), **(overrides or {})}
    optimizer = OmegaConf.to_container(OmegaConf.load(ROOT / "conf" / "model" / "ncsn.yaml").optimizer)
    return NCSNLitModule((3, 32, 32), loss={"name": "ssm_vr"}, deq=deq_cfg, depth=depth, arch=arch, ngf=ngf,
                         optimizer=optimizer).to(device)


def measure(module: NCSNLitModule, batch: int, warmup: int, steps: int, device: str) -> dict:
    """Per step: the score s(x̃, i) alone (seeded x̃, i), then the module's own training step on x."""
    net = module.net
    optimizers = trainer_free(module, device)
    g = torch.Generator().manual_seed(0)
    cuda = device.startswith("cuda")
    score_t, score_b, step_t, step_b, iters, score_peak, step_peak = [], [], [], [], [], [], []
    for k in range(warmup + steps):
        x = torch.rand(batch, 3, 32, 32, generator=g).to(device)
        labels = torch.randint(0, net.sigmas.numel(), (batch,), generator=g).to(device)
        xt = (x + net.sigmas[labels].reshape(-1, 1, 1, 1) * torch.randn(x.shape, generator=g).to(device))
        xt.requires_grad_(True)
        base = torch.cuda.memory_allocated(device) if cuda else 0
        score = measured(lambda xt=xt, labels=labels: net.score(xt, labels), device)
        del score["result"]  # free the score's graph before the step
        step = measured(lambda x=x: training_step(module, x, optimizers), device)
        if cuda:  # the score: the allocator's peak above what was allocated before (graph, workspaces)
            score_peak.append(score["peak_cuda_bytes"] - base)
            step_peak.append(step["peak_cuda_bytes"])
        block = net.deq_block()
        if block is not None:
            iters.append(block.last_stats["iterations"])
        if k >= warmup:
            score_t.append(1e3 * score["seconds"])
            score_b.append(score["saved_bytes"])
            step_t.append(1e3 * step["seconds"])
            step_b.append(step["saved_bytes"])
    rec = {"score_ms": statistics.median(score_t), "score_saved_MB": max(score_b) / MB,
           "step_ms": statistics.median(step_t), "step_saved_MB": max(step_b) / MB}
    if score_peak:
        rec["score_peak_cuda_MB"], rec["step_peak_cuda_MB"] = max(score_peak) / MB, max(step_peak) / MB
    block = net.deq_block()
    if block is not None:
        rec["deq_iterations"] = statistics.mean(iters)
        x = torch.rand(batch, 3, 32, 32, generator=g).to(device)
        labels = torch.arange(batch, device=device) % net.sigmas.numel()
        with torch.no_grad():
            y = net.deq_input(x, labels)
        rec["contraction_rate"] = block.contraction_rate(y, labels)
    return rec


def render(results: dict) -> str:
    lines = ["# NCSN at the CIFAR-10 size: RefineNet vs TwoRes vs DEQ (paper Table 5)", "",
             ("`python benchmarks/ncsn_memory.py` — 3×32×32, ngf 128, 10 noise levels, the noise-conditional "
             "SSM-VR step (σ²-weighted, one Rademacher projection), Adam; DEQ: Picard, tol 1e-5, K = 2 phantom "
             "steps, warm start. *score* = s(x̃, i) with autograd (the graph SSM-VR differentiates); *step* = the "
             "whole training step. Saved MB = bytes autograd saves for backward (distinct storages). Untrained "
             "networks (initial weights)."), ""]
    for key, res in sorted(results.items()):
        meta = res["meta"]
        lines += [f"## {key}", "",
                  (f"{meta['device_name']}, torch {meta['torch']}, {meta['threads']} thread(s), batch {meta['batch']}, "
                  f"median of {meta['steps']} steps after {meta['warmup']} warm-up. {meta['note']}"), ""]
        cuda = all("score_peak_cuda_MB" in r for r in res["rows"])
        head = ["method", "params", "score saved MB", "score ms", "step saved MB", "step ms", "DEQ iters",
                "contraction", "paper: params / score-graph memory / total memory / ms per it (batch 128, GPU)"]
        if cuda:
            head[6:6] = ["score peak CUDA MB", "step peak CUDA MB"]
        body = []
        for row in res["rows"]:
            p = PAPER[row["method"]]
            iters = f"{row['deq_iterations']:.1f}" if "deq_iterations" in row else "–"
            rate = f"{row['contraction_rate']:.1e}" if "contraction_rate" in row else "–"
            body.append([row["method"], f"{row['params'] / 1e6:.2f}M", f"{row['score_saved_MB']:.1f}",
                         f"{row['score_ms']:.0f}", f"{row['step_saved_MB']:.1f}", f"{row['step_ms']:.0f}", iters,
                         rate, f"{p[2]} / {p[3]} / {p[4]} / {p[1]}"])
            if cuda:
                body[-1][6:6] = [f"{row['score_peak_cuda_MB']:.0f}", f"{row['step_peak_cuda_MB']:.0f}"]
        lines += markdown_table(head, body)
        rows = {r["method"]: r for r in res["rows"]}
        ref, two, deq = (rows[v[0]] for v in VARIANTS[:3])
        lines += ["", "Ratios (ours; the paper's in brackets, from Table 5):", "",
                  f"- params DEQ / RefineNet: {deq['params'] / ref['params']:.2f} (9M / 28M = 0.32)",
                  (f"- score-graph memory DEQ / RefineNet: {deq['score_saved_MB'] / ref['score_saved_MB']:.2f} "
                  "(2104 / 7536 = 0.28); DEQ / TwoRes: "
                  f"{deq['score_saved_MB'] / two['score_saved_MB']:.2f} (2104 / 1701 = 1.24)"),
                  (f"- step memory DEQ / RefineNet: {deq['step_saved_MB'] / ref['step_saved_MB']:.2f} "
                  "(total memory 20.1 / 40.4 GB = 0.50); DEQ / TwoRes: "
                  f"{deq['step_saved_MB'] / two['step_saved_MB']:.2f} (20.1 / 18.5 = 1.09)"),
                  (f"- time per step DEQ / RefineNet: {deq['step_ms'] / ref['step_ms']:.2f} (481 / 871 = 0.55); "
                  f"DEQ / TwoRes: {deq['step_ms'] / two['step_ms']:.2f} (481 / 391 = 1.23)"), ""]
        if "contraction_rate" in deq:
            lines += [(f"At initialisation the DEQ map contracts at {deq['contraction_rate']:.1e} and the solver stops "
                       f"after {deq['deq_iterations']:.1f} iterations (paper, trained: 16.6): Frobenius-normalised "
                       "128-channel 3×3 kernels (÷ λ·3, the Lipschitz-safe factor) have an operator norm far below "
                       "1/λ, so the untrained block is close to one explicit residual branch and its memory is "
                       "TwoRes's. The rate after training is what `test/deq_contraction_rate` reports."), ""]
        spec = rows.get(VARIANTS[3][0])
        if spec is not None and "contraction_rate" in spec:
            lines += [(f"With `deq.norm=spectral deq.stop_mode=rel` (each kernel ÷ λ·‖conv‖₂, power iteration; the "
                       "solver stops at ‖f(z) − z‖ ≤ 1e-5·‖f(z)‖, since an absolute 1e-5 on this state is at float32's "
                       "round-off floor and stalled at 1.1e-5 for 128 iterations) the same untrained map "
                       f"contracts at {spec['contraction_rate']:.1e} in {spec['deq_iterations']:.1f} iterations: "
                       f"score {spec['score_saved_MB']:.1f} MB / {spec['score_ms']:.0f} ms, step "
                       f"{spec['step_saved_MB']:.1f} MB / {spec['step_ms']:.0f} ms."), ""]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--batch", type=int, default=2)
    ap.add_argument("--ngf", type=int, default=128)
    ap.add_argument("--warmup", type=int, default=1)
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--note", default="No GPU was lent for this run: CPU figures only.")
    ap.add_argument("--out", type=Path, default=RESULTS)
    ap.add_argument("--render", action="store_true", help="only rebuild the markdown from the saved JSON")
    args = ap.parse_args(argv)
    if args.render:
        rerender(args.out, "ncsn_memory", render)
        return
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    rows = []
    for method, arch, deq, depth, overrides in VARIANTS:
        module = build(arch, deq, depth, args.ngf, args.device, overrides)
        rec = {"method": method, "params": sum(p.numel() for p in module.parameters()),
               **measure(module, args.batch, args.warmup, args.steps, args.device)}
        print(json.dumps(rec), flush=True)
        rows.append(rec)
    name = (torch.cuda.get_device_name() if args.device.startswith("cuda") else platform.processor() or "CPU")
    key = f"{args.device} batch {args.batch} ngf {args.ngf}"
    meta = {"device_name": name, "torch": torch.__version__, "threads": args.threads, "batch": args.batch,
            "steps": args.steps, "warmup": args.warmup, "note": args.note}
    results = load_results(args.out, "ncsn_memory")
    results[key] = {"meta": meta, "rows": rows}
    write_results(args.out, "ncsn_memory", results, render, indent=2, sort_keys=True)
    print(f"-> {args.out / 'ncsn_memory'}.json and .md")


if __name__ == "__main__":
    main()
