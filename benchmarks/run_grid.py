"""Run a grid of `src.train` jobs and tabulate them (paper-table reproductions).

    python benchmarks/run_grid.py nice   --seeds 0,1,2 [--device cuda] [--root ../shared/data]
    python benchmarks/run_grid.py dkef_uci --seeds 0 --epochs 30

Each job is one `python -m src.train` process (the same command a user types) with its run directory under
``--runs`` (default ``outputs/benchmarks/<grid>``); the table (mean ± std over seeds) and the raw metrics go
to ``benchmarks/results/<grid>.md`` and ``.json``, with the commands and the machine they ran on.
"""

from __future__ import annotations

import argparse
import json
import platform
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from src.report import summarise  # noqa: E402

NICE_COLUMNS = [
    ("test/sm_loss", "test SM loss", 1), ("test/log_likelihood", "test LL (logit space)", 1),
    ("test/bits_per_dim", "bits/dim (pixels)", 3), ("n_params", "params", 0),
    ("profile/saved_bytes_mean", "saved MB/step", 1), ("profile/peak_cuda_bytes_max", "peak CUDA MB", 0),
    ("profile/time_per_step_s", "s/step", 4), ("profile/deq_iterations_mean", "DEQ iters", 1),
]
DKEF_COLUMNS = [
    ("test/sm_loss", "test SM loss", 2), ("test/log_likelihood", "test LL", 2),
    ("test/fisher_divergence", "Fisher div.", 2), ("n_params", "params", 0),
    ("profile/saved_bytes_mean", "saved MB/step", 1), ("profile/time_per_step_s", "s/step", 4),
    ("profile/deq_iterations_mean", "DEQ iters", 1),
]


def nice_grid(args) -> tuple[list[tuple[str, list[str]]], list]:
    base = ["experiment=nice_mnist", "loss=ssm", f"data.root={args.root}"]
    jobs = [
        ("SSM", [*base, "deq=false"]),
        ("DEQ-SSM", [*base, "deq=true"]),
        # two dense layers inside each coupling's DEQ map, as the paper authors' code (~11M parameters)
        ("DEQ-SSM (2 layers in f)", [*base, "deq=true", "depth=2"]),
    ]
    return jobs, NICE_COLUMNS


def dkef_uci_grid(args):
    jobs = []
    for data in args.datasets.split(","):
        base = ["experiment=dkef_uci", f"data={data}", f"data.root={args.root}", f"trainer.max_epochs={args.epochs}"]
        for loss in ("dsm", "cp", "ssm", "ssm_vr"):
            jobs.append((f"{data} {loss.upper()} (3-layer)", [*base, f"loss={loss}", "deq=false", "depth=3"]))
        for depth in (3, 8, 16):
            jobs.append((f"{data} SM {depth}-layer", [*base, "loss=sm", "deq=false", f"depth={depth}"]))
        jobs.append((f"{data} DEQ-SM", [*base, "loss=sm", "deq=true"]))
        jobs.append((f"{data} DEQ-SSM-VR", [*base, "loss=ssm_vr", "deq=true"]))
    return jobs, DKEF_COLUMNS


GRIDS = {"nice": nice_grid, "dkef_uci": dkef_uci_grid}


def fmt(values, digits, key):
    m, s, n = summarise(values)
    if n == 0:
        return "—"
    if "bytes" in key:
        m, s = m / 1e6, s / 1e6
    return f"{m:.{digits}f}" + (f" ± {s:.{digits}f}" if n > 1 else "")


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("grid", choices=sorted(GRIDS))
    p.add_argument("--seeds", default="0")
    p.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    p.add_argument("--root", default=str(ROOT.parent / "shared" / "data"))
    p.add_argument("--epochs", type=int, default=300, help="dkef grids: trainer.max_epochs")
    p.add_argument("--datasets", default="parkinsons,redwine,whitewine")
    p.add_argument("--runs", type=Path, default=None)
    p.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results")
    p.add_argument("--methods", default="", help="comma-separated labels to run (default: all of the grid)")
    p.add_argument("--extra", default="", help="extra overrides for every job, space separated")
    args = p.parse_args(argv)
    jobs, columns = GRIDS[args.grid](args)
    if args.methods:
        wanted = set(args.methods.split(","))
        jobs = [j for j in jobs if j[0] in wanted]
    runs = args.runs or ROOT / "outputs" / "benchmarks" / args.grid
    seeds = [int(s) for s in args.seeds.split(",")]
    results = []
    for label, overrides in jobs:
        for seed in seeds:
            safe = "".join(c if c.isalnum() or c in "-_" else "_" for c in label)
            run_dir = runs / f"{safe}_seed{seed}"
            cmd = [sys.executable, "-m", "src.train", *overrides, f"seed={seed}", "logger=csv",
                   "trainer.enable_progress_bar=false", f"hydra.run.dir={run_dir}", *args.extra.split()]
            if args.device == "cuda":
                cmd.append("trainer=gpu")
            t0 = time.time()
            proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True)
            wall = time.time() - t0
            ok = proc.returncode == 0 and (run_dir / "metrics.json").exists()
            metrics = json.loads((run_dir / "metrics.json").read_text()) if ok else {}
            metrics.pop("config", None)
            print(f"{label} seed={seed}: {'ok' if ok else 'FAILED'} in {wall:.0f}s", flush=True)
            if not ok:
                print(proc.stderr[-2000:], flush=True)
            results.append({"label": label, "seed": seed, "ok": ok, "wall_s": wall,
                            "command": "python -m src.train " + " ".join(cmd[3:]), "metrics": metrics})
    meta = {"machine": f"{platform.machine()}, {platform.node()}", "device": args.device, "python": platform.python_version(),
            "command": "python benchmarks/run_grid.py " + " ".join(argv if argv is not None else sys.argv[1:])}
    try:
        import torch

        meta["torch"] = torch.__version__
        meta["threads"] = torch.get_num_threads()
        if args.device == "cuda":
            meta["gpu"] = torch.cuda.get_device_name(0)
    except Exception:  # noqa: BLE001
        pass
    args.out.mkdir(parents=True, exist_ok=True)
    suffix = "" if args.device == "cpu" else f"_{args.device}"
    (args.out / f"{args.grid}{suffix}.json").write_text(json.dumps({"meta": meta, "jobs": results}, indent=2))
    labels = list(dict.fromkeys(r["label"] for r in results))
    head = ["method", "seeds", *(t for _, t, _ in columns)]
    lines = [f"Command: `{meta['command']}` — {meta}", "", "| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for label in labels:
        rows = [r for r in results if r["label"] == label and r["ok"]]
        cells = [label, str(len(rows))] + [fmt([r["metrics"].get(k) for r in rows], d, k) for k, _, d in columns]
        lines.append("| " + " | ".join(cells) + " |")
    md = "\n".join(lines) + "\n"
    (args.out / f"{args.grid}{suffix}.md").write_text(md)
    print(md)


if __name__ == "__main__":
    main()
