"""Seconds per training step, before and after, per family, from ONE run: the code at ``--before`` (default
b3facaa, before the speed work of issue #26) against this checkout, on the same machine, same protocol.

Each case of ``_step_cases.py`` (DKEF exact SM on RedWine, NICE SSM, NCSN SSM-VR, SSM-VAE; the DEQ variant and
the explicit one it is compared with) is its LightningModule's own ``training_step`` with its own optimisers
(``_common.training_step``, outside a Trainer). Two long-lived worker processes, one per code tree, each with
one torch thread, build the same seeded modules and batches — both cases of a family in both trees — and after
``--warmup`` steps of each, the parent asks for ``--steps`` timed steps of each (case, tree) in turn, the first
of the four rotating from round to round, ``--repeats`` rounds: interleaved repeats, so load on a shared
machine falls alike on both trees (the speed-ups) and on both cases of a family (the DEQ / explicit ratios).
The figure is the median s/step.

Each tree is ``git archive <commit> src conf`` unpacked into a temporary folder (removed afterwards) and put
first on its worker's ``sys.path``: "after" is ``--after`` (default HEAD) as committed, so edits in the working
tree neither change nor break a run; the results record the commits, not the folders.

    python benchmarks/speed.py                                   # every case, b3facaa vs HEAD
    python benchmarks/speed.py --cases dkef/deq,dkef/3-layer --repeats 15
    python benchmarks/speed.py --render                          # rebuild the markdown from the JSON

Writes ``benchmarks/results/speed.json`` and ``.md`` (targets of issue #26 checked; ``--note`` appends a
markdown file: what the profile says about a missed target).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent

# issue #26's targets: (what, kind, case(s), bound)
TARGETS = [
    ("DKEF RedWine exact-SM step (DEQ) >= 1.5x faster than before", "speedup", ("dkef/deq",), 1.5),
    ("DKEF RedWine exact-SM step (3-layer) >= 1.5x faster than before", "speedup", ("dkef/3-layer",), 1.5),
    ("NICE DEQ-SSM step <= 1.0x the explicit SSM step", "ratio", ("nice/deq-ssm", "nice/ssm"), 1.0),
    ("VAE DEQ iteration <= 1.5x SSM VAE", "ratio", ("vae/deq", "vae/ssm"), 1.5),
    ("NCSN DEQ step <= 1.1x TwoRes", "ratio", ("ncsn/deq", "ncsn/twores"), 1.1),
]


# ----------------------------------------------------------------------------------------------- worker
def worker(tree: Path, data_root: str | None) -> None:
    """Serve ``{"cmd": "build"|"time"|"drop", "case", "steps"}`` lines from stdin with ``tree``'s ``src``."""
    tree = tree.resolve()
    if str(ROOT) not in sys.path:
        sys.path.append(str(ROOT))  # so ``_common`` does not put this checkout's ``src`` first
    sys.path.insert(0, str(tree))
    import torch
    from _common import trainer_free, training_step
    from _step_cases import build_case, deq_iterations

    import src

    torch.set_num_threads(1)
    assert Path(src.__file__).resolve().parent == tree / "src", src.__file__
    live: dict[str, tuple] = {}
    out = sys.stdout
    sys.stdout = sys.stderr  # anything the modules print stays off the protocol
    for line in sys.stdin:
        msg = json.loads(line)
        case = msg["case"]
        if msg["cmd"] == "build":
            module, batches, facts = build_case(case, tree, data_root)
            live[case] = (module, batches, trainer_free(module), [0])
            reply = {"facts": facts}
        elif msg["cmd"] == "time":
            module, batches, optimizers, count = live[case]
            times = []
            for _ in range(int(msg["steps"])):
                x = batches[count[0] % len(batches)]
                count[0] += 1
                t0 = time.perf_counter()
                training_step(module, x, optimizers)
                times.append(time.perf_counter() - t0)
            reply = {"times": times, "deq_iterations": deq_iterations(module)}
        else:
            live.pop(case, None)
            reply = {}
        out.write(json.dumps(reply) + "\n")
        out.flush()


class Worker:
    def __init__(self, tree: Path, data_root: str | None):
        env = dict(os.environ, OMP_NUM_THREADS="1", MKL_NUM_THREADS="1")
        cmd = [sys.executable, str(HERE / "speed.py"), "--worker", str(tree)]
        if data_root:
            cmd += ["--root", data_root]
        self.proc = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env,
                                     cwd=str(tree))

    def ask(self, **msg) -> dict:
        self.proc.stdin.write(json.dumps(msg) + "\n")
        self.proc.stdin.flush()
        line = self.proc.stdout.readline()
        if not line:
            raise RuntimeError(f"speed worker died (exit code {self.proc.wait()}); see its stderr above")
        return json.loads(line)

    def close(self) -> None:
        self.proc.stdin.close()
        self.proc.wait()


# ----------------------------------------------------------------------------------------------- parent
def _families(cases) -> list[list[str]]:
    """``cases`` grouped by family, in order: ``["dkef/deq", "dkef/3-layer", "nice/ssm"]`` -> 2 groups."""
    groups: dict[str, list[str]] = {}
    for case in cases:
        groups.setdefault(case.split("/")[0], []).append(case)
    return list(groups.values())


def measure(cases, before: str, after: str, data_root, warmup: int, repeats: int, steps: int) -> dict:
    from _step_cases import snapshot

    results = {}
    with tempfile.TemporaryDirectory(prefix="deqsm_speed_") as tmp:
        trees = {}
        for k, rev in (("before", before), ("after", after)):
            (Path(tmp) / k).mkdir()
            trees[k] = snapshot(rev, Path(tmp) / k)
        workers = {k: Worker(t, data_root) for k, t in trees.items()}
        try:
            for group in _families(cases):  # a family's cases and both trees interleaved together
                facts = {(c, k): w.ask(cmd="build", case=c)["facts"] for c in group for k, w in workers.items()}
                combos = list(facts)
                for c, k in combos:
                    workers[k].ask(cmd="time", case=c, steps=warmup)
                times = {ck: [] for ck in combos}
                iters = {}
                for r in range(repeats):
                    for c, k in combos[r % len(combos):] + combos[:r % len(combos)]:  # rotating first
                        reply = workers[k].ask(cmd="time", case=c, steps=steps)
                        times[(c, k)] += reply["times"]
                        iters[(c, k)] = reply["deq_iterations"]
                for c, k in combos:
                    workers[k].ask(cmd="drop", case=c)
                for case in group:
                    results[case] = {"facts": facts[(case, "after")],
                                     **{k: {"median_s": statistics.median(times[(case, k)]), "min_s": min(times[(case, k)]),
                                            "max_s": max(times[(case, k)]), "n": len(times[(case, k)]),
                                            "deq_iterations": iters[(case, k)]} for k in workers}}
                    r = results[case]
                    print(f"{case}: before {r['before']['median_s']:.4f} s, after {r['after']['median_s']:.4f} s "
                          f"({r['before']['median_s'] / r['after']['median_s']:.2f}x)", flush=True)
        finally:
            for w in workers.values():
                w.close()
    return results


def evaluate(cases: dict) -> list[dict]:
    rows = []
    for what, kind, keys, bound in TARGETS:
        if not all(k in cases for k in keys):
            continue
        if kind == "speedup":
            c = cases[keys[0]]
            value = {"before": None, "after": c["before"]["median_s"] / c["after"]["median_s"]}
            ok = value["after"] >= bound
        else:
            a, b = cases[keys[0]], cases[keys[1]]
            value = {t: a[t]["median_s"] / b[t]["median_s"] for t in ("before", "after")}
            ok = value["after"] <= bound
        rows.append({"target": what, "kind": kind, "bound": bound, "value": value, "met": ok})
    return rows


def render(res: dict) -> str:
    meta = res["meta"]
    lines = ["# Seconds per training step: before (b3facaa) and after (issue #26)", "",
             (f"Command: `{meta['command']}` (`<data dir>`: the data root). Machine: {meta['machine']}. Load "
             f"average (1, 5, 15 min) at the start {meta['load_start']}, at the end {meta['load_end']} — a shared "
             "2-core machine: other jobs ran throughout, so absolute times are noisy; the interleaved medians and "
             "the ratios taken within one tree are what to compare."), "",
             (f"*before* = commit `{meta['before']}`; *after* = commit `{meta['after']}` (each tree's `src` and "
             "`conf` as committed). Protocol: each case is the module's own "
             f"`training_step` (`benchmarks/_step_cases.py`), one torch thread per worker, {meta['warmup']} "
             f"warm-up steps, then {meta['repeats']} interleaved rounds of {meta['steps']} step(s) per (case, tree), "
             "both cases of a family and both trees in each round (the first rotating); median s/step."), ""]
    head = ["case", "before s/step", "after s/step", "speed-up", "DEQ iters (after)", "what one step is"]
    lines += ["| " + " | ".join(head) + " |", "|---|---:|---:|---:|---:|---|"]
    for case, r in res["cases"].items():
        facts = ", ".join(f"{k} {v}" for k, v in r["facts"].items() if k != "params")
        it = r["after"].get("deq_iterations")
        lines.append(f"| {case} | {r['before']['median_s']:.4f} | {r['after']['median_s']:.4f} | "
                     f"{r['before']['median_s'] / r['after']['median_s']:.2f}× | "
                     f"{'' if it is None else f'{it:.1f}'} | {facts} |")
    lines += ["", "## Targets (issue #26)", "", "| target | before | after | met |", "|---|---:|---:|---|"]
    for t in res["targets"]:
        v = t["value"]
        b = "–" if v["before"] is None else f"{v['before']:.2f}"
        lines.append(f"| {t['target']} | {b} | {v['after']:.2f} | {'yes' if t['met'] else '**no**'} |")
    lines.append("")
    from _common import note_lines

    lines += note_lines(meta)
    return "\n".join(lines)


def main(argv=None) -> dict:
    from _step_cases import CASES

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--worker", type=Path, default=None, help=argparse.SUPPRESS)
    ap.add_argument("--cases", default=",".join(CASES), help=f"comma-separated, of {', '.join(CASES)}")
    ap.add_argument("--before", default="b3facaa", help="the commit measured as 'before'")
    ap.add_argument("--after", default="HEAD", help="the commit measured as 'after'")
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=7, help="interleaved rounds per case")
    ap.add_argument("--steps", type=int, default=1, help="timed steps per round and tree")
    ap.add_argument("--root", default=str(ROOT / "data"), help="data root (RedWine for the DKEF cases)")
    ap.add_argument("--note", default=None, help="a markdown file appended below the tables (with --render: added to the saved results)")
    ap.add_argument("--out", type=Path, default=HERE / "results")
    ap.add_argument("--name", default="speed")
    ap.add_argument("--render", action="store_true", help="run nothing: rebuild the markdown from the JSON")
    args = ap.parse_args(argv)
    if args.worker is not None:
        worker(args.worker, args.root)
        return {}
    import _common
    from _step_cases import commit_of

    from src.reporting import load_results, write_results

    if _common.rendered(args, args.name, render):
        return {}
    cases = [c.strip() for c in args.cases.split(",") if c.strip()]
    unknown = [c for c in cases if c not in CASES]
    if unknown:
        ap.error(f"unknown case(s) {', '.join(unknown)}; valid: {', '.join(CASES)}")
    shown = [("<data dir>" if a == args.root else a) for a in (argv if argv is not None else sys.argv[1:])]
    load_start = " ".join(f"{x:.2f}" for x in os.getloadavg())
    measured = measure(cases, args.before, args.after, args.root, args.warmup, args.repeats, args.steps)
    res = load_results(args.out, args.name) or {}
    merged = {**res.get("cases", {}), **measured}
    res = {"meta": {"command": _common.script_command("speed.py", shown),
                    "machine": _common.machine_facts().rsplit(";", 1)[0]
                    + "; 1 torch thread per worker",
                    "before": commit_of(args.before), "after": commit_of(args.after),
                    "load_start": load_start, "load_end": " ".join(f"{x:.2f}" for x in os.getloadavg()),
                    "warmup": args.warmup, "repeats": args.repeats, "steps": args.steps,
                    "note": Path(args.note).read_text() if args.note else res.get("meta", {}).get("note")},
           "cases": {c: merged[c] for c in CASES if c in merged}}
    res["targets"] = evaluate(res["cases"])
    write_results(args.out, args.name, res, render)
    print(f"-> {args.out / args.name}.md")
    return res


if __name__ == "__main__":
    main()
