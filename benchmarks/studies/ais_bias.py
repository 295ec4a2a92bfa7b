"""Is AIS a stochastic lower bound? AIS log p(x) against the exact value, per HMC step-size rule.

A decoder with a 2-d latent, so that log p(x) = log ∫ p(x|z) N(z; 0, I) dz is exact by quadrature
(:func:`src.metrics.latent_quadrature.grid_log_marginal`, spacings h and 2h compared): a random
2-64-64-784 Softplus MLP (PyTorch's default initialisation, first and last weights ×4: posterior sd ≈ 0.1)
with Bernoulli outputs, on binarised MNIST test images (x ~ Bernoulli(v/255), seeded), float64. AIS
(:func:`src.metrics.ais.ais_log_likelihood`, sigmoid schedule, 10 leapfrog steps, 16 chains) with

- ``per_chain``: the rule before the fix (each chain's own step ×1.02 after its accept, ×0.98 after a
  reject), reproduced below only to measure it;
- ``pilot``, ``global``, ``fixed``: the ``adaptation`` options of :func:`~src.metrics.ais.ais_log_likelihood`
  (``global`` with all images in one call: the step adapted from 16 × images chains);
- ``global_per_image``: ``global`` with one image per call, the step adapted from that image's 16 chains
  only (a chain's own share of the adaptation signal 1/16 instead of 1/128 at 8 images).

For each T and rule: the mean over images of (estimate − exact) ± its standard error, and the share of
estimates above the exact value. An unbiased AIS has E[estimate] ≤ exact (Jensen), the gap shrinking with T.

``--vae-ckpt`` adds a trained VAE checkpoint (``model=vae``): AIS log p(x) of its first ``--vae-images``
test images with the per-chain and the pilot rule (its ``model.metrics.log_likelihood.ais`` settings otherwise).

    python -m benchmarks.studies.ais_bias --root <data dir> [--images 8] [--steps 1000 3000]
        [--rules per_chain pilot global] [--vae-ckpt PATH --vae-images 50 --vae-steps 1000]
    python -m benchmarks.studies.ais_bias --render     # rebuild the markdown from the JSON

Writes ``<out>/<name>.json`` and ``.md`` (default ``benchmarks/results/ais_bias``).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import re
import time
from pathlib import Path

from benchmarks.lib.results import RESULTS, machine_facts, script_command
from src.reports.tables import markdown_table, rerender, write_results

RULES = ("per_chain", "pilot", "global", "global_per_image", "fixed")


def per_chain_ais(log_likelihood, x, latent_dim, *, n_steps, n_chains, leapfrog=10, step_size=0.05,
                  generator=None):
    """The AIS of ``src/metrics/ais.py`` before the fix (git b3facaa), kept here only to measure its bias:
    each chain's leapfrog step is multiplied by 1.02 after that chain's accepted move and by 0.98 after a
    rejected one, so the kernel at step t depends on the chain's own path. Returns (estimates, acceptance)."""
    import torch

    from src.metrics.ais import sigmoid_schedule

    B, C = x.shape[0], int(n_chains)
    xr = x.repeat(C, *([1] * (x.dim() - 1)))
    betas = sigmoid_schedule(n_steps).tolist()
    z = torch.randn(C * B, latent_dim, dtype=x.dtype, generator=generator)
    eps = torch.full((C * B, 1), float(step_size), dtype=x.dtype)
    log_w = torch.zeros(C * B, dtype=torch.float64)
    accepted = 0.0

    def energy_and_grad(zz, beta):
        with torch.enable_grad():
            zz = zz.detach().requires_grad_(True)
            ll = log_likelihood(xr, zz)
            u = 0.5 * zz.pow(2).sum(-1) - beta * ll
            (g,) = torch.autograd.grad(u.sum(), zz)
        return u.detach(), g.detach(), ll.detach()

    with torch.no_grad():
        _, _, ll = energy_and_grad(z, 0.0)
        for t in range(1, len(betas)):
            beta = betas[t]
            log_w += (beta - betas[t - 1]) * ll.double()
            u0, g, _ = energy_and_grad(z, beta)
            p = torch.randn(z.shape, dtype=z.dtype, generator=generator)
            h0 = u0 + 0.5 * p.pow(2).sum(-1)
            zn, pn = z, p - 0.5 * eps * g
            for i in range(int(leapfrog)):
                zn = zn + eps * pn
                u1, g, ll1 = energy_and_grad(zn, beta)
                pn = pn - (eps if i < int(leapfrog) - 1 else 0.5 * eps) * g
            h1 = u1 + 0.5 * pn.pow(2).sum(-1)
            log_u = torch.rand(h0.shape, dtype=z.dtype, generator=generator).log()
            accept = (log_u < (h0 - h1)) & torch.isfinite(h1)
            z = torch.where(accept[:, None], zn, z)
            ll = torch.where(accept, ll1, ll)
            eps = torch.where(accept[:, None], eps * 1.02, eps * 0.98).clamp(1e-4, 0.5)
            accepted += float(accept.double().mean())
    est = torch.logsumexp(log_w.reshape(C, B), 0) - math.log(C)
    return est, accepted / max(len(betas) - 1, 1)


def run_rule(rule: str, log_likelihood, x, latent_dim: int, n_steps: int, n_chains: int, leapfrog: int,
             step_size: float, target_accept: float, seed: int) -> tuple[list[float], float, float, float]:
    """(estimates, mean acceptance of the estimating chains, wall seconds, CPU seconds) for one rule."""
    import torch

    from src.metrics.ais import ais_log_likelihood

    g = torch.Generator().manual_seed(seed)
    t0, c0 = time.perf_counter(), time.process_time()
    if rule == "per_chain":
        est, acc = per_chain_ais(log_likelihood, x, latent_dim, n_steps=n_steps, n_chains=n_chains,
                                 leapfrog=leapfrog, step_size=step_size, generator=g)
    elif rule == "global_per_image":  # one call per image: the step adapted from that image's own C chains
        parts = [run_rule("global", log_likelihood, x[i:i + 1], latent_dim, n_steps, n_chains, leapfrog,
                          step_size, target_accept, seed + 7919 * i) for i in range(x.shape[0])]
        est, acc = [p[0][0] for p in parts], sum(p[1] for p in parts) / len(parts)
    else:
        est, stats = ais_log_likelihood(log_likelihood, x, latent_dim, n_steps=n_steps, n_chains=n_chains,
                                        leapfrog=leapfrog, step_size=step_size, target_accept=target_accept,
                                        adaptation=rule, generator=g, return_stats=True)
        acc = stats["accept"]
    return [float(v) for v in est], float(acc), time.perf_counter() - t0, time.process_time() - c0


def summary(errors: list[float]) -> dict:
    n = len(errors)
    m = sum(errors) / n
    se = math.sqrt(sum((e - m) ** 2 for e in errors) / (n - 1) / n) if n > 1 else float("nan")
    return {"mean_error": m, "se": se, "above": sum(e > 0 for e in errors) / n}


def random_decoder(seed: int):
    """2-64-64-784 Softplus MLP, PyTorch's default init, first and last weights ×4, float64."""
    import torch

    torch.manual_seed(seed)
    net = torch.nn.Sequential(torch.nn.Linear(2, 64), torch.nn.Softplus(), torch.nn.Linear(64, 64),
                              torch.nn.Softplus(), torch.nn.Linear(64, 784)).double()
    with torch.no_grad():
        net[0].weight.mul_(4)
        net[4].weight.mul_(4)
    return net


def quadrature_section(args, res: dict) -> None:
    import torch
    import torch.nn.functional as F

    from src.data.mnist import load_mnist
    from src.metrics.latent_quadrature import grid_log_marginal

    net = random_decoder(args.seed)
    v = load_mnist(args.root, download=False)["test_images"][: args.images].reshape(args.images, -1)
    x = torch.bernoulli(v.double() / 255, generator=torch.Generator().manual_seed(args.seed))

    def log_lik(xx, z):
        return -F.binary_cross_entropy_with_logits(net(z), xx, reduction="none").sum(-1)

    def pairwise(z):
        logits = net(z)
        return logits @ x.T - F.softplus(logits).sum(-1, keepdim=True)

    t0 = time.perf_counter()
    exact, coarse = grid_log_marginal(pairwise, 2, half_width=6.0, h=args.h)
    q = {"h": args.h, "half_width": 6.0, "max_abs_h_vs_2h": float((exact - coarse).abs().max()),
         "exact": [float(v) for v in exact], "seconds": time.perf_counter() - t0}
    res["quadrature"] = q
    print(f"quadrature: {q['seconds']:.0f} s, |h − 2h| ≤ {q['max_abs_h_vs_2h']:.1e}", flush=True)
    rows = res.setdefault("rows", [])
    for T in args.steps:
        for rule in args.rules:
            est, acc, sec, cpu = run_rule(rule, log_lik, x, 2, T, args.chains, args.leapfrog, args.step_size,
                                          args.target_accept, args.seed + 1)
            errors = [e - t for e, t in zip(est, q["exact"])]
            rows.append({"T": T, "rule": rule, "accept": acc, "seconds": sec, "cpu_seconds": cpu,
                         "estimates": est, **summary(errors)})
            write_results(args.out, args.name, res, render)
            r = rows[-1]
            print(f"T={T} {rule}: {r['mean_error']:+.4f} ± {r['se']:.4f} nats, {100 * r['above']:.0f} % above, "
                  f"accept {acc:.3f}, {sec:.0f} s", flush=True)


def vae_section(args, res: dict) -> None:
    from src.runs.load import load_module

    module, _, _, _ = load_module(args.vae_ckpt, [f"data.root={args.root}"] if args.root else [])
    module.eval()
    c = module.ais_cfg
    x = module.split_tensor("test", args.vae_images).to(module.dtype)
    vae = {"checkpoint": args.vae_ckpt, "images": int(x.shape[0]), "T": args.vae_steps,
           "chains": int(c["n_chains"]), "leapfrog": int(c["leapfrog"]), "rules": {}}
    res["vae"] = vae
    for rule in ("per_chain", "pilot"):
        est, acc, sec, cpu = run_rule(rule, module.decoder.log_prob, x, module.latent_dim, args.vae_steps,
                                 int(c["n_chains"]), int(c["leapfrog"]), float(c["step_size"]),
                                 float(c["target_accept"]), args.seed + 1)
        s = summary(est)
        vae["rules"][rule] = {"estimates": est, "mean": s["mean_error"], "se": s["se"], "accept": acc,
                              "seconds": sec, "cpu_seconds": cpu}
        write_results(args.out, args.name, res, render)
        print(f"VAE {rule}: {s['mean_error']:.2f} ± {s['se']:.2f}, accept {acc:.3f}, {sec:.0f} s", flush=True)
    a, b = vae["rules"]["per_chain"]["estimates"], vae["rules"]["pilot"]["estimates"]
    vae["paired_difference"] = summary([u - w for u, w in zip(a, b)])
    write_results(args.out, args.name, res, render)


def cpu_cell(r: dict) -> str:
    """CPU seconds of the process; runs recorded before they were kept show their wall time, marked."""
    return f"{r['cpu_seconds']:.0f}" if "cpu_seconds" in r else f"({r['seconds']:.0f} wall)"


def render(res: dict) -> str:
    m = res["meta"]
    lines = ["# AIS against the exact log p(x): does the estimate stay below the truth?", "",
             "Commands:", "", *["    " + re.sub(r"--root (?:<[^>]*>|\S+)", "--root <data dir>", c) for c in m["commands"]], "",
             f"Machine: {m['machine']}", ""]
    q = res.get("quadrature")
    if q:
        lines += [("2-d latent Bernoulli decoder (random 2-64-64-784 Softplus MLP, first and last weights ×4), "
                   f"the first {m['images']} binarised MNIST test images (x ~ Bernoulli(v/255), seed {m['seed']}), "
                   f"float64; AIS with {m['chains']} chains, {m['leapfrog']} leapfrog steps, sigmoid schedule, "
                   f"first step {m['step_size']}, target acceptance {m['target_accept']}. Error = AIS estimate − "
                   "exact log p(x) (nats), mean over images ± standard error; an unbiased AIS has mean error ≤ 0 "
                   "(Jensen), shrinking with T. Rules: `per_chain` = the kernel before the fix (each chain's step "
                   "from its own accept history); `pilot` (default now) / `global` / `fixed` = "
                   "`src.metrics.ais.ais_log_likelihood(adaptation=...)`. Acceptance: mean over all T steps of "
                   "the estimating chains, the early steps included, where the posterior is as wide as the "
                   "prior and the step sits at its clamp 0.5. Wall times were measured on a 2-core machine "
                   "shared with other jobs (load ≈ 15): they say nothing about cost."), ""]
        ex = q["exact"]
        lines += [(f"Exact log p(x) by quadrature on [−{q['half_width']}, {q['half_width']}]², spacing h = "
                   f"{q['h']}: {min(ex):.2f} … {max(ex):.2f}; h and 2h agree to {q['max_abs_h_vs_2h']:.1e} "
                   "nats."), ""]
        rows = [[r["T"], f"`{r['rule']}`", f"{r['mean_error']:+.3f} ± {r['se']:.3f}", f"{100 * r['above']:.0f} %",
                 f"{r['accept']:.3f}", cpu_cell(r)] for r in res.get("rows", [])]
        lines += markdown_table(["T", "rule", "mean error (nats)", "above exact", "acceptance", "CPU s"], rows)
    v = res.get("vae")
    if v:
        lines += ["", "## A trained VAE, before and after", "",
                  (f"Checkpoint `{v['checkpoint']}`: AIS log p(x) of its first {v['images']} test images, "
                   f"T = {v['T']}, {v['chains']} chains, {v['leapfrog']} leapfrog steps; the same images and "
                   "checkpoint for both rules."), ""]
        if v.get("trained_with"):
            lines += [f"The checkpoint was trained with `{v['trained_with']}`.", ""]
        vrows = [[f"`{k}`", f"{r['mean']:.2f} ± {r['se']:.2f}", f"{r['accept']:.3f}", cpu_cell(r)]
                 for k, r in v["rules"].items()]
        lines += markdown_table(["rule", "AIS log p(x) ± s.e.", "acceptance", "CPU s"], vrows)
        d = v.get("paired_difference")
        if d:
            lines += ["", (f"Paired difference per_chain − pilot: {d['mean_error']:+.3f} ± {d['se']:.3f} nats "
                           f"(per_chain higher on {100 * d['above']:.0f} % of the images).")]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--root", default=None, help="data directory holding MNIST")
    ap.add_argument("--images", type=int, default=8)
    ap.add_argument("--steps", type=int, nargs="+", default=[1000, 3000])
    ap.add_argument("--rules", nargs="+", default=["per_chain", "pilot", "global"], choices=RULES)
    ap.add_argument("--chains", type=int, default=16)
    ap.add_argument("--leapfrog", type=int, default=10)
    ap.add_argument("--step-size", type=float, default=0.05)
    ap.add_argument("--target-accept", type=float, default=0.65)
    ap.add_argument("--h", type=float, default=0.02, help="quadrature grid spacing")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--vae-ckpt", default=None, help="also compare the rules on this model=vae checkpoint")
    ap.add_argument("--vae-images", type=int, default=50)
    ap.add_argument("--vae-steps", type=int, default=1000)
    ap.add_argument("--skip-quadrature", action="store_true", help="only the --vae-ckpt part")
    ap.add_argument("--out", default=str(RESULTS))
    ap.add_argument("--name", default="ais_bias")
    ap.add_argument("--render", action="store_true", help="rebuild the markdown from the saved JSON")
    ap.add_argument("--merge", default=None,
                    help="add the rows and commands of another result JSON (same settings) to <out>/<name>, rerender")
    ap.add_argument("--append", action="store_true",
                    help="add this run's rows to the saved JSON (same images, seed and AIS settings)")
    args = ap.parse_args(argv)
    if args.render:
        rerender(args.out, args.name, render)
        return
    if args.merge:
        res = json.loads((Path(args.out) / f"{args.name}.json").read_text())
        other = json.loads(Path(args.merge).read_text())
        keys = ("images", "seed", "chains", "leapfrog", "step_size", "target_accept")
        if any(res["meta"][k] != other["meta"][k] for k in keys):
            raise SystemExit(f"--merge: {args.merge} was run with other settings than {args.name}")
        res["meta"]["commands"] += other["meta"]["commands"]
        res["rows"] = res.get("rows", []) + other.get("rows", [])
        write_results(args.out, args.name, res, render)
        return
    if args.root is None:
        ap.error("give --root <data dir> (the directory holding MNIST)")
    import torch

    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    meta = {"machine": machine_facts(), "commands": [script_command("benchmarks.studies.ais_bias")], "images": args.images, "seed": args.seed, "chains": args.chains,
            "leapfrog": args.leapfrog, "step_size": args.step_size, "target_accept": args.target_accept}
    res = {"meta": meta}
    if args.append:
        res = json.loads((Path(args.out) / f"{args.name}.json").read_text())
        old = {k: res["meta"][k] for k in meta if k not in ("machine", "commands")}
        if old != {k: meta[k] for k in old}:
            raise SystemExit(f"--append: this run's settings {meta} differ from the saved {res['meta']}")
        res["meta"]["commands"] += meta["commands"]
    if not args.skip_quadrature:
        quadrature_section(args, res)
    if args.vae_ckpt:
        vae_section(args, res)
    print(f"-> {Path(args.out) / args.name}.md")


if __name__ == "__main__":
    main()
