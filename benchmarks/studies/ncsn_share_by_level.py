"""How much does the NCSN's DEQ block recur at each noise level? Recurrence share per σ of trained checkpoints.

The recurrence share ‖z* − φ(0)‖ / ‖z*‖ (:func:`src.deq.diagnostics.recurrence_share`, paper eq. 5) depends on the
block's input, and the NCSN's input depends on the noise level: at σ₁ = 16.9 (``experiment=ncsn_mnist_long``) a
perturbed image is nearly all noise, at σ_L = 0.01 it is the digit. Training draws the level of each sample
uniformly, so the share a training step sees is the mean over all L levels. For every level i this records, on
the same ``--n`` test images x perturbed as x + σᵢz (noise seeded by ``--seed``, the same for every checkpoint):

- the share (mean and max over the images), the branch ratio ‖h(z*)‖/‖g‖ and the forward solver's iterations and
  cap hits, each at the block's own solver settings;
- the contraction rate ‖∂φ/∂z‖₂ at z* every ``--rate-every`` levels (power iteration, the whole batch as one
  operator).

The summary per checkpoint: the share averaged over all levels (what training sees), over σ₁ … σ₁₆ (the levels the
run's ``val/deq_recurrence_share`` used before ``src.lit.ncsn.diagnostic_levels`` spread them: its 16 images
cycled through the levels from the largest), over the 16 spread levels it uses now, and over each third of the
levels (largest σ first).

    python -m benchmarks.studies.ncsn_share_by_level --root <data dir> \\
        --ckpt 'record 1500=<run>/step_checkpoints/step_0001500.ckpt' --ckpt 'record 6000=<run>/…' \\
        [--n 16] [--rate-every 10] [--seed 0] [--note notes/ncsn_share_by_level.md]
    python -m benchmarks.studies.ncsn_share_by_level --render     # rebuild the markdown from the JSON

Writes ``<out>/<name>.json`` and ``.md`` (default ``benchmarks/results/ncsn_share_by_level``).
"""

from __future__ import annotations

import argparse

from benchmarks.lib.results import checkpoint_options, checkpoint_study, note_lines
from src.reports.tables import markdown_table

OLD_DIAGNOSTIC_POINTS = 16  # the diagnostic's images before the spread: j = 0…15 at level j mod L (history, fixed)


def level_rows(module, n: int, seed: int, rate_every: int) -> list[dict]:
    """One row per noise level: the block's recurrence statistics on ``n`` test images perturbed at that level."""
    import torch

    from src.deq.diagnostics import recurrence_share

    net = module.net
    net.eval()
    block = net.deq_block()
    data = module.split_tensor("test", n).to(module.dtype)
    sigmas = [float(s) for s in net.sigmas]
    g = torch.Generator().manual_seed(seed)
    rows = []
    for i, sigma in enumerate(sigmas):
        z = torch.randn(data.shape, generator=g, dtype=data.dtype)
        labels = torch.full((data.shape[0],), i, dtype=torch.long)
        with torch.no_grad():
            y = net.deq_input(data + sigma * z, labels)
        rated = i % rate_every == 0 or i == len(sigmas) - 1
        stats = recurrence_share(block, y, labels, rate=rated)
        rows.append({"level": i, "sigma": sigma, **stats})
    return rows


def summary(rows: list[dict]) -> dict[str, float]:
    """Mean share over all levels, over the old and the new diagnostic's levels, and over each third."""
    from src.lit.ncsn import VAL_CONTRACTION_POINTS, diagnostic_levels

    L = len(rows)

    def mean(levels) -> float:
        levels = list(levels)
        return sum(rows[i]["share_mean"] for i in levels) / len(levels)

    thirds = [range(k * L // 3, (k + 1) * L // 3) for k in range(3)]
    return {"all_levels": mean(range(L)),
            "old_diagnostic": mean(j % L for j in range(OLD_DIAGNOSTIC_POINTS)),
            "spread_diagnostic": mean(int(i) for i in diagnostic_levels(VAL_CONTRACTION_POINTS, L)),
            "high_sigma_third": mean(thirds[0]), "mid_sigma_third": mean(thirds[1]),
            "low_sigma_third": mean(thirds[2]),
            "iterations_mean": sum(r["iterations"] for r in rows) / L,
            "hit_cap_levels": sum(r["hit_cap"] for r in rows)}


def _pct(v: float) -> str:
    return f"{100 * v:.2f} %"


def render(res: dict) -> str:
    meta = res["meta"]
    lines = ["# NCSN: the DEQ block's recurrence share per noise level", "",
             f"Command: `{meta['command']}`", "",
             (f"Machine: {meta['machine']}. {meta['n']} test images per level, noise seed {meta['seed']} (the same "
              "images and noise for every checkpoint); share = ‖z* − φ(0)‖/‖z*‖ (mean over the images), each solve "
              "at the block's own settings. Training draws levels uniformly: *all levels* is the share a training "
              f"step sees. *σ₁…σ₁₆* is what `val/deq_recurrence_share` measured before its {OLD_DIAGNOSTIC_POINTS} "
              "images were spread over the levels (`src.lit.ncsn.diagnostic_levels`), *spread* what it measures now "
              "(on validation images; here on test images)."), ""]
    head = ["checkpoint", "all levels", "σ₁…σ₁₆", "spread", "high-σ third", "mid third", "low-σ third",
            "iterations", "levels at cap"]
    rows = []
    for label, r in res["checkpoints"].items():
        s = r["summary"]
        rows.append([label, _pct(s["all_levels"]), _pct(s["old_diagnostic"]), _pct(s["spread_diagnostic"]),
                     _pct(s["high_sigma_third"]), _pct(s["mid_sigma_third"]), _pct(s["low_sigma_third"]),
                     f"{s['iterations_mean']:.1f}", f"{int(s['hit_cap_levels'])}"])
    lines += ["## Summary", ""] + markdown_table(head, rows) + [""]
    for label, r in res["checkpoints"].items():
        lines += [f"## {label}", "", f"Checkpoint: `{r['checkpoint']}`.", ""]
        head = ["level", "σ", "share", "share max", "branch ‖h‖/‖g‖", "iterations", "contraction"]
        table = []
        for row in r["levels"]:
            rate = row.get("contraction_rate")
            if rate is None:
                continue  # the per-level table lists the rated levels; the summary averages every level
            table.append([str(row["level"]), f"{row['sigma']:.3g}", _pct(row["share_mean"]), _pct(row["share_max"]),
                          f"{row.get('branch_mean', float('nan')):.3f}", f"{row['iterations']:.0f}", f"{rate:.3f}"])
        lines += markdown_table(head, table) + [""]
    return "\n".join(lines + note_lines(meta))


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    checkpoint_options(ap, "ncsn_share_by_level", "a DEQ-NCSN checkpoint")
    ap.add_argument("--rate-every", type=int, default=10, help="contraction rate at every k-th level (and the last)")
    ap.set_defaults(n=16)
    args = ap.parse_args(argv)
    if args.rate_every < 1:
        ap.error("--rate-every must be >= 1")

    def measure(module) -> dict:
        net = getattr(module, "net", None)
        if net is None or not hasattr(net, "sigmas"):
            raise SystemExit("not an NCSN checkpoint (model=ncsn)")
        if net.deq_block() is None:
            raise SystemExit("this NCSN has no DEQ block (deq=false): its recurrence share is not defined")
        rows = level_rows(module, args.n, args.seed, args.rate_every)
        return {"summary": summary(rows), "levels": rows}

    checkpoint_study(ap, args, "benchmarks.studies.ncsn_share_by_level", render, measure,
                     rate_every=args.rate_every)


if __name__ == "__main__":
    main()
