"""One command for a lent CUDA machine: the paper's memory/time tables, DDP scaling and a short FID run.

Three parts, each timed against its share of ``--budget-s`` (default 540 s, under 10 minutes in all, counted from
the start: imports and CUDA start-up included; a smaller budget runs fewer repeats and steps, a row or job that
would not fit in what is left is skipped and says so, and a job still running at its part's end is stopped and
recorded as such — the FID job, the last, may run 10% of the budget past it):

1. ``memory`` — the paper's Table 1 rows (SSM VAE, Aug(8), Aug(16), DEQ; CIFAR-10 size, conv architecture, m =
   64, D_z = 32) and Table 5 rows (NCSN RefineNet, TwoRes, DEQ; CIFAR-10 size, ngf 128) at batch 128. Each row
   is the module's *own* training step (``benchmarks.lib.step``), built by
   ``step_cases.vae_module`` and ``step_cost.ncsn.build``; the NCSN rows are measured by ``step_cost.ncsn.measure``
   itself. Per row: peak CUDA memory (``torch.cuda.max_memory_allocated`` with the peak reset before the
   step: parameters, optimiser state, activations and workspaces), graph memory (bytes autograd saves for
   backward, ``SavedTensorsMeter``; the NCSN rows also give the score graph's alone, the paper's "memory of
   ∇ₓ log p̃'s graph"), and s/iter (CUDA-synchronised, one warm-up step excluded, median of the repeats). A row
   that runs out of memory (or fails otherwise) is recorded as such and the suite goes on.
2. ``ddp`` — ``python -m src.train`` of NCSN on MNIST (DEQ, SSM-VR, ngf 64, batch 128 per device) with
   ``trainer=ddp`` on 1 … N GPUs (N = ``torch.cuda.device_count()``; 1 and N first, then the powers of two
   between while time is left): seconds per step (``profile/time_per_step_s``, the first step excluded) and
   images per second. With one GPU this is one point.
3. ``fid`` — ``python -m src.train experiment=ncsn_mnist trainer.accelerator=gpu`` for 100 (``--budget-s 150``)
   to 500 steps, then its test phase (eval preset ``standard``: the experiment's sampler): FID on the shipped
   MNIST classifier's features of 250 to 1000 samples, with its sample count and wall times.

    python -m benchmarks.tools.gpu_suite --root <data dir>                  # ~9 minutes on one GPU
    python -m benchmarks.tools.gpu_suite --budget-s 150 --root <data dir>   # every table, fewer repeats and steps
    python -m benchmarks.tools.gpu_suite --dry-run --root <data dir>        # CPU, tiny sizes: the same code path

Writes ``benchmarks/results/gpu_suite.json`` and ``.md`` (a ``--dry-run`` writes to ``outputs/gpu_suite_dry_run``
unless ``--out`` is given) with the device, torch, CUDA and every command (data root shown as ``<data dir>``).
Without a CUDA device (and without ``--dry-run``) it exits with a one-line message.
"""

from __future__ import annotations

import argparse
import gc
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

from benchmarks.lib import paper
from benchmarks.lib.jobs import thread_env, train_job
from benchmarks.lib.results import DATA_ROOT, RESULTS, ROOT, machine_facts, script_command
from benchmarks.lib.step import measured, trainer_free, training_step
from benchmarks.lib.step_cases import vae_module
from benchmarks.lib.step_cost import ncsn as ncsn_cost
from benchmarks.lib.step_cost import vae as vae_cost

T0 = time.perf_counter()  # the budget counts from here: imports and CUDA start-up included
MB = 2**20
DEFAULT_BUDGET_S = 540.0
SHARES = {"memory": 0.45, "ddp": 0.3, "fid": 0.25}  # of the budget; what a part leaves over goes to the next
PARTS = tuple(SHARES)
# sizes of a real run and of a dry run (CPU, tiny: the same code path in seconds)
SIZES = {
    "real": {"batch": 128, "vae_channels": 64, "vae_latent": 32, "ngf": 128, "max_repeats": 10,
             "ddp": ["model.ngf=64", "data.batch_size=128"], "ddp_steps": (20, 100),
             "fid_steps": (100, 500), "fid_samples": (250, 1000), "fid": []},
    "dry": {"batch": 2, "vae_channels": 4, "vae_latent": 4, "ngf": 8, "max_repeats": 1,
            "ddp": ["model.ngf=8", "data.batch_size=2", "data.limit=64"], "ddp_steps": (2, 2),
            "fid_steps": (2, 2), "fid_samples": (8, 8),
            "fid": ["model.ngf=8", "data.batch_size=2", "data.eval_batch_size=16", "data.limit=64",
                    "model.metrics.noise_conditional.test_points=16", "model.n_samples_grid=4"]},
}
# every src.train job here: no W&B, no progress bar, no checkpoints, no start-up memory probes
QUIET = ["logger=none", "trainer.enable_progress_bar=false", "callbacks.progress_bar=null",
         "callbacks.model_checkpoint=null", "callbacks.last_checkpoint=null", "callbacks.memory_estimate=null"]
MIN_JOB_S = 25.0  # below this much time left, a src.train job on a GPU (start-up alone: ~10-20 s) is skipped
FID_GRACE = 0.1  # the FID job (the last) may run this fraction of the whole budget past it before it is stopped


def min_job_s(accelerator: str) -> float:
    return MIN_JOB_S if accelerator == "gpu" else 1.0


class Clock:
    """The suite's budget: a part's allowance is its share of the budget plus what earlier parts left."""

    def __init__(self, budget_s: float, t0: float = T0):
        self.budget_s, self.t0 = budget_s, t0

    def elapsed(self) -> float:
        return time.perf_counter() - self.t0

    def left(self) -> float:
        return self.budget_s - self.elapsed()

    def allowance(self, part: str, parts: list[str]) -> float:
        rest = [p for p in parts[parts.index(part):]]
        return max(0.0, self.left() * SHARES[part] / sum(SHARES[p] for p in rest))


def scaled(pair: tuple[int, int], budget_s: float) -> int:
    """``lo`` at a budget of 150 s or less, ``hi`` at the default budget, linear between."""
    lo, hi = pair
    f = min(1.0, max(0.0, (budget_s - 150.0) / (DEFAULT_BUDGET_S - 150.0)))
    return round(lo + f * (hi - lo))


PRIVATE: dict[str, str] = {str(ROOT): "<repo>", tempfile.gettempdir(): "<tmp>"}  # + the data root, in main


def private(text: str) -> str:
    """``text`` with this machine's paths replaced (data root, repository, temporary folder): what a result
    file may show."""
    for path, shown_as in sorted(PRIVATE.items(), key=lambda kv: -len(kv[0])):
        text = text.replace(path, shown_as)
    return text


def one_line(err: BaseException) -> str:
    text = f"{type(err).__name__}: {err}".strip().splitlines()
    return private(text[0][:300] if text else type(err).__name__)


def _free(device: str) -> None:
    import torch

    gc.collect()
    if device.startswith("cuda"):
        torch.cuda.empty_cache()


# ----------------------------------------------------------------------------------------- part 1: memory
def _vae_row(name: str, depth, deq: bool, size: dict, device: str, time_left) -> dict:
    """One Table 1 row: :func:`~benchmarks.lib.step_cases.vae_module` at the CIFAR-10 size, its own training step
    timed by :func:`~benchmarks.lib.step.measured` (warm-up, then repeats while ``time_left()`` allows)."""
    import torch

    shape = vae_cost.SIZES["CIFAR-10"]
    torch.manual_seed(0)
    module = vae_module(shape, depth, deq, size["vae_latent"], size["vae_channels"])
    optimizers = trainer_free(module, device)
    x = torch.rand(size["batch"], *shape, device=device) * 2 - 1

    def step():
        return training_step(module, x, optimizers)

    first = measured(step, device)  # warm-up (and the DEQ's warm start)
    runs = [measured(step, device)]
    while len(runs) < size["max_repeats"] and time_left() > 2 * runs[-1]["seconds"]:
        runs.append(measured(step, device))
    peaks = [r["peak_cuda_bytes"] for r in [first, *runs] if r["peak_cuda_bytes"] is not None]
    row = {"params": sum(p.numel() for p in module.parameters()),
           "graph_MB": max(r["saved_bytes"] for r in runs) / MB,
           "peak_cuda_MB": max(peaks) / MB if peaks else None,
           "s_per_iter": statistics.median(r["seconds"] for r in runs), "repeats": len(runs),
           "warmup_s": first["seconds"]}
    if deq:
        row["deq_iterations"] = module.score_net.block.last_stats.get("iterations")
    return row


def _ncsn_row(arch: str, deq: bool, depth, overrides: dict, size: dict, device: str, time_left) -> dict:
    """One Table 5 row: ``step_cost.ncsn.build`` (CIFAR-10 size) measured by ``step_cost.ncsn.measure`` — first one
    warm-up step and one measured step, then, while ``time_left()`` allows, a second call of more steps (warm
    by then), which gives the reported medians; peaks are the larger of the two calls'."""
    import torch

    torch.manual_seed(0)
    module = ncsn_cost.build(arch, deq, depth, size["ngf"], device, overrides)
    params = sum(p.numel() for p in module.parameters())
    t0 = time.perf_counter()
    rec = ncsn_cost.measure(module, size["batch"], 1, 1, device)
    per_step = (time.perf_counter() - t0) / 2
    steps = min(size["max_repeats"], int(time_left() / (1.5 * per_step)))
    if steps >= 2:
        more = ncsn_cost.measure(module, size["batch"], 0, steps, device)
        for key in ("score_peak_cuda_MB", "step_peak_cuda_MB"):
            if key in more:
                more[key] = max(more[key], rec[key])
        rec = more
    row = {"params": params, "graph_MB": rec["step_saved_MB"], "score_graph_MB": rec["score_saved_MB"],
           "peak_cuda_MB": rec.get("step_peak_cuda_MB"), "score_peak_cuda_MB": rec.get("score_peak_cuda_MB"),
           "s_per_iter": rec["step_ms"] / 1e3, "score_s": rec["score_ms"] / 1e3, "repeats": max(steps, 1)}
    for key in ("deq_iterations", "contraction_rate"):
        if key in rec:
            row[key] = rec[key]
    return row


def memory_rows() -> list[tuple[str, str, object]]:
    """(table, method, how to measure it): paper Table 1 (CIFAR-10) and Table 5's three rows."""
    rows = [("Table 1", name, lambda s, d, t, a=(name, depth, deq): _vae_row(*a, s, d, t))
            for name, depth, deq in vae_cost.VARIANTS]
    rows += [("Table 5", method, lambda s, d, t, a=(arch, deq, depth, ov): _ncsn_row(*a, s, d, t))
             for method, arch, deq, depth, ov in ncsn_cost.VARIANTS[:3]]
    return rows


def paper_figures(table: str, method: str) -> str:
    if table == "Table 1":
        return paper.VAE.get(("CIFAR-10", method), "–")
    p = paper.NCSN.get(method)
    return f"{p[2]}; score graph {p[3]}; total {p[4]}; {p[1]} ms" if p else "–"


def run_memory(size: dict, device: str, allowance: float) -> dict:
    import torch

    t0 = time.perf_counter()
    rows = memory_rows()
    out = {"budget_s": allowance, "batch": size["batch"],
           "settings": {"vae": f"CIFAR-10 3x32x32, conv, m = {size['vae_channels']}, D_z = {size['vae_latent']}, "
                                "Gaussian decoder, conf/model/vae.yaml optimisers",
                        "ncsn": f"CIFAR-10 3x32x32, ngf {size['ngf']}, 10 noise levels, SSM-VR, "
                                "conf/model/ncsn.yaml optimiser, DEQ: conf/deq/true.yaml"},
           "rows": []}
    for i, (table, method, fn) in enumerate(rows):
        left = allowance - (time.perf_counter() - t0)
        share = left / (len(rows) - i)
        row = {"table": table, "method": method, "paper": paper_figures(table, method)}
        if left <= 0:
            row.update(status="skipped", note=f"the part's {allowance:.0f} s were spent")
        else:
            row_t0 = time.perf_counter()
            try:
                row.update(fn(size, device, lambda s=share, t=row_t0: s - (time.perf_counter() - t)), status="ok")
            except torch.OutOfMemoryError as err:
                row.update(status="OOM", note=f"out of CUDA memory at batch {size['batch']}: {one_line(err)}")
            except Exception as err:  # noqa: BLE001  one failing row must not end the suite; it is recorded
                row.update(status="failed", note=one_line(err))
            row["wall_s"] = time.perf_counter() - row_t0
        _free(device)
        print(json.dumps(row), flush=True)
        out["rows"].append(row)
    out["wall_s"] = time.perf_counter() - t0
    return out


# --------------------------------------------------------------------------------- jobs (parts 2 and 3)
def shown(overrides: list[str]) -> str:
    """The command a result records: ``python -m src.train …`` with the data root as ``<data dir>``."""
    return private(" ".join(["python -m src.train", *overrides]))


def suite_job(overrides: list[str], timeout_s: float, threads: int | None) -> dict:
    """:func:`benchmarks.lib.jobs.train_job` in a temporary run directory, stopped (with its DDP ranks) after
    ``timeout_s``; a failure's error is its output's last line, with no path of this machine."""
    env = {**thread_env(threads), "HYDRA_FULL_ERROR": "1"}  # the exception's own message as the last line
    res = train_job(overrides, None, env, timeout_s=timeout_s)
    if not res["ok"] and not res.get("stopped"):
        tail = [ln for ln in res["error"].strip().splitlines() if ln.strip()]
        res["error"] = private((tail[-1] if tail else res["error"])[:300])
    return res


# ------------------------------------------------------------------------------------------ part 2: DDP
def device_counts(n: int) -> list[int]:
    """1 and n first (the two ends of the curve), then the powers of two between."""
    counts = [1] + ([n] if n > 1 else [])
    return counts + [k for k in (2 ** i for i in range(1, 8)) if 1 < k < n]


def run_ddp(size: dict, root: str, n_devices: int, accelerator: str, budget: float, total_s: float, threads
            ) -> dict:
    t0 = time.perf_counter()
    steps = scaled(size["ddp_steps"], total_s)
    base = ["experiment=ncsn_mnist", "trainer=ddp", f"trainer.accelerator={accelerator}",
            *paper.PAPER_NCSN_BLOCK, *size["ddp"],
            f"trainer.max_steps={steps}", "++trainer.num_sanity_val_steps=0", "test=false", *QUIET,
            f"data.root={root}"]
    out = {"budget_s": budget, "family": "NCSN on MNIST (DEQ, SSM-VR), experiment=ncsn_mnist",
           "steps": steps, "visible_devices": n_devices, "points": []}
    for k in device_counts(n_devices):
        overrides = [*base[:3], f"trainer.devices={k}", *base[3:]]
        point = {"devices": k, "command": shown(overrides)}
        left = budget - (time.perf_counter() - t0)
        if left < min_job_s(accelerator):
            point.update(status="skipped", note=f"{max(left, 0):.0f} s left of the part's {budget:.0f} s")
        else:
            res = suite_job(overrides, left, threads)
            point["wall_s"] = res["wall_s"]
            if res["ok"]:
                m = res["metrics"]
                s = m["profile/time_per_step_s"]
                batch = m["config"]["data"]["batch_size"]
                point.update(status="ok", s_per_step=s, images_per_s=k * batch / s, batch_per_device=batch,
                             world_size=m.get("ddp/world_size", 1), steps=m["global_step"],
                             ranks_identical=m.get("ddp/ranks_identical", True))
            else:
                point.update(status="stopped" if res.get("stopped") else "failed", note=res["error"])
        print(json.dumps(point), flush=True)
        out["points"].append(point)
    out["points"].sort(key=lambda p: p["devices"])
    ok = [p for p in out["points"] if p["status"] == "ok"]
    one = next((p for p in ok if p["devices"] == 1), None)
    for p in ok:
        if one is not None:
            p["speedup"] = p["images_per_s"] / one["images_per_s"]
    out["wall_s"] = time.perf_counter() - t0
    return out


# ------------------------------------------------------------------------------------------ part 3: FID
def run_fid(size: dict, root: str, accelerator: str, budget: float, total_s: float, threads) -> dict:
    steps = scaled(size["fid_steps"], total_s)
    n = scaled(size["fid_samples"], total_s)
    overrides = ["experiment=ncsn_mnist", *paper.PAPER_NCSN_BLOCK, f"trainer.accelerator={accelerator}",
                 "trainer.devices=1", f"trainer.max_steps={steps}", f"model.metrics.fid.n_samples={n}",
                 *size["fid"], *QUIET, f"data.root={root}"]
    out = {"budget_s": budget, "command": shown(overrides), "steps": steps, "n_samples": n}
    if budget < min_job_s(accelerator):
        out.update(status="skipped", note=f"{max(budget, 0):.0f} s left in the budget")
        return out
    res = suite_job(overrides, budget + FID_GRACE * total_s, threads)
    out["wall_s"] = res["wall_s"]
    if not res["ok"]:
        out.update(status="stopped" if res.get("stopped") else "failed", note=res["error"])
        return out
    m = res["metrics"]
    sampling = m["config"]["model"]["sampling"]
    out.update(status="ok", fid=m["test/fid"], fid_n_samples=m["test/fid_n_samples"], global_step=m["global_step"],
               fit_s=m["time/fit_s"], test_s=m["time/test_s"], s_per_step=m["profile/time_per_step_s"],
               eval_preset=m.get("eval/preset"), sampler=f"T = {sampling['n_steps_each']}, "
                                                         f"eps = {sampling['step_lr']:g}")
    return out


# ----------------------------------------------------------------------------------------------- report
def _f(x, fmt: str) -> str:
    return "–" if x is None else format(x, fmt)


def render(res: dict) -> str:
    meta, parts = res["meta"], res["parts"]
    lines = ["# GPU suite: paper Tables 1 and 5 at batch 128, DDP scaling, a short FID run", "",
             f"Command: `{meta['command']}` (`<data dir>`: the data root). Device: **{meta['device']}** "
             f"(×{meta['n_devices']}); torch {meta['torch']}, CUDA {meta['cuda']}, cuDNN {meta['cudnn']}; "
             f"{meta['machine']}. Budget {meta['budget_s']:.0f} s, used {meta['wall_s']:.0f} s."
             + (" **Dry run** (CPU, tiny sizes: checks the code path; the figures mean nothing)."
                if meta["dry_run"] else ""), ""]
    if "memory" in parts:
        p = parts["memory"]
        lines += [f"## Memory and time per training step (batch {p['batch']})", "",
                  (f"Each row is the module's own training step. SSM VAE rows: {p['settings']['vae']}; NCSN rows: "
                   f"{p['settings']['ncsn']}. *Peak CUDA*: `torch.cuda.max_memory_allocated` over one step (reset "
                   "before it; parameters and optimiser state included). *Graph*: bytes autograd saves for "
                   "backward during the step (distinct storages); for the NCSN rows also the score s(x̃, i)'s graph "
                   "alone (the paper's 'memory of the score graph'). *s/iter*: CUDA-synchronised, warm-up "
                   f"excluded, median of *n*. Part budget {p['budget_s']:.0f} s, used {p['wall_s']:.0f} s."), ""]
        head = ["table", "method", "params", "peak CUDA MB", "graph MB", "score graph MB", "s / iter", "n",
                "DEQ iters", "status", "paper (batch 128)"]
        body = []
        for r in p["rows"]:
            ok = r["status"] == "ok"
            it = r.get("deq_iterations")
            body.append([r["table"], r["method"], f"{r['params'] / 1e6:.2f}M" if ok else "–",
                         _f(r.get("peak_cuda_MB"), ".0f"), _f(r.get("graph_MB"), ".1f"),
                         _f(r.get("score_graph_MB"), ".1f"), _f(r.get("s_per_iter"), ".4f"),
                         str(r.get("repeats", "–")), "–" if it is None else f"{it:.1f}",
                         "ok" if ok else f"**{r['status']}**: {r.get('note', '')}", r["paper"]])
        lines += _table(head, body) + [""]
    if "ddp" in parts:
        p = parts["ddp"]
        lines += ["## DDP scaling", "",
                  (f"{p['family']}, {p['steps']} steps per run, the same batch per device (weak scaling): "
                   f"s/step = `profile/time_per_step_s` (first step excluded), images/s = devices × batch / "
                   f"s/step. {p['visible_devices']} device(s) visible"
                   + (" — one point only: scaling needs more than one GPU." if p["visible_devices"] == 1 else ".")
                   + f" Part budget {p['budget_s']:.0f} s, used {p['wall_s']:.0f} s."), ""]
        body = [[str(q["devices"]), _f(q.get("s_per_step"), ".4f"), _f(q.get("images_per_s"), ".0f"),
                 _f(q.get("speedup"), ".2f"), _f(q.get("wall_s"), ".0f"),
                 "ok" if q["status"] == "ok" else f"**{q['status']}**: {q.get('note', '')}", f"`{q['command']}`"]
                for q in p["points"]]
        lines += _table(["devices", "s / step", "images / s", "speed-up", "job wall s", "status", "command"],
                        body) + [""]
    if "fid" in parts:
        p = parts["fid"]
        lines += ["## Short FID run", "", f"`{p['command']}`", ""]
        if p["status"] == "ok":
            lines += [(f"FID **{p['fid']:.1f}** on n = {p['fid_n_samples']:.0f} samples (MNIST classifier features; "
                       f"biased upwards at small n) after {p['global_step']} steps; sampler {p['sampler']}, eval "
                       f"preset {p['eval_preset']}. Wall: {p['wall_s']:.0f} s in all (fit {p['fit_s']:.0f} s, "
                       f"test {p['test_s']:.0f} s), {p['s_per_step']:.4f} s/step."), ""]
        else:
            lines += [f"**{p['status']}**: {p.get('note', '')}", ""]
    return "\n".join(lines)


def _table(head: list[str], body: list[list[str]]) -> list[str]:
    from src.reports.tables import markdown_table

    return markdown_table(head, body)


# ------------------------------------------------------------------------------------------------- main
def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--budget-s", type=float, default=DEFAULT_BUDGET_S, help="seconds for the whole suite")
    ap.add_argument("--root", default=str(DATA_ROOT), help="data root holding MNIST (data.root)")
    ap.add_argument("--parts", default=",".join(PARTS), help=f"comma-separated, of {', '.join(PARTS)}")
    ap.add_argument("--dry-run", action="store_true", help="CPU, tiny sizes: the same code path in seconds")
    ap.add_argument("--out", type=Path, default=None,
                    help="results folder (default benchmarks/results; with --dry-run outputs/gpu_suite_dry_run)")
    ap.add_argument("--name", default="gpu_suite", help="result file stem")
    ap.add_argument("--render", action="store_true", help="run nothing: rebuild the markdown from the JSON")
    args = ap.parse_args(argv)
    out = args.out or (ROOT / "outputs" / "gpu_suite_dry_run" if args.dry_run else RESULTS)
    from benchmarks.lib.results import rerender, write_results

    if args.render:
        return rerender(out, args.name, render)
    parts = [p.strip() for p in args.parts.split(",") if p.strip()]
    if not parts or any(p not in PARTS for p in parts):
        ap.error(f"--parts takes a comma-separated list of {', '.join(PARTS)}")
    if args.budget_s <= 0:
        ap.error("--budget-s must be positive")
    import torch

    if not args.dry_run and not torch.cuda.is_available():
        sys.exit("gpu_suite: no CUDA device found; run it on a GPU machine, or pass --dry-run to check it on the CPU")
    clock = Clock(args.budget_s, T0 if argv is None else time.perf_counter())  # in-process: from the call
    size = SIZES["dry" if args.dry_run else "real"]
    device, accelerator = ("cpu", "cpu") if args.dry_run else ("cuda", "gpu")
    threads = 1 if args.dry_run else None
    if args.dry_run:
        torch.set_num_threads(1)
    n_devices = 1 if args.dry_run else torch.cuda.device_count()
    command = script_command("benchmarks.tools.gpu_suite", argv, data_root=args.root)
    args.root = str(Path(args.root).resolve())  # absolute: the jobs run in the repository
    PRIVATE[args.root] = "<data dir>"
    res = {"meta": {"command": private(command),
                    "device": torch.cuda.get_device_name() if device == "cuda" else "CPU (dry run)",
                    "n_devices": n_devices, "torch": torch.__version__, "cuda": torch.version.cuda or "none",
                    "cudnn": torch.backends.cudnn.version() if device == "cuda" else "none",
                    "machine": machine_facts().split("; torch")[0], "budget_s": args.budget_s,
                    "dry_run": args.dry_run, "parts": parts, "wall_s": 0.0},
           "parts": {}}

    def save():
        res["meta"]["wall_s"] = clock.elapsed()
        write_results(out, args.name, res, render)

    for part in parts:
        allowance = clock.allowance(part, parts)
        print(f"gpu_suite: part {part}, {allowance:.0f} s of {clock.left():.0f} s left", flush=True)
        if part == "memory":
            res["parts"]["memory"] = run_memory(size, device, allowance)
        elif part == "ddp":
            res["parts"]["ddp"] = run_ddp(size, args.root, n_devices, accelerator, allowance, args.budget_s,
                                           threads)
        else:
            res["parts"]["fid"] = run_fid(size, args.root, accelerator, allowance, args.budget_s, threads)
        _free(device)
        save()
    save()
    print(f"-> {Path(out) / args.name}.json and .md ({clock.elapsed():.0f} s)")
    return res


if __name__ == "__main__":
    main()
