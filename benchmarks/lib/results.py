"""What a benchmark result is: where it lives, what it records, its files and their ``--render``.

- paths: :data:`ROOT` (the repository), :data:`RESULTS` (``benchmarks/results``), :data:`DATA_ROOT` (the
  default ``data.root``, the config's ``paths.data_dir``);
- what a result records: :func:`machine_facts`, :func:`script_command` (``python -m benchmarks.<module> …``),
  :func:`shown` and :func:`rel` (a command or path as a user types it: no path of this machine),
  :func:`made_by` (what a table says made it);
- result files: :func:`result_options` (``--out``, ``--name``, ``--render``), :func:`rendered` (``--render``: the
  markdown rebuilt from the saved JSON, nothing run), :func:`note_lines`, :func:`fmt` (a ``mean ± std`` cell);
- studies of trained checkpoints (``--ckpt LABEL=PATH …``): :func:`checkpoint_options` and
  :func:`checkpoint_study`;
- result files: :func:`write_results` (``<stem>.json`` atomically, then ``<stem>.md`` rendered from it),
  :func:`load_results` (a saved JSON to merge into), :func:`rerender` (the markdown again from a saved JSON);
- verdicts: :func:`seed_verdict` (is one method better than another over seeds: agree / disagree / undecided at
  twice the standard error of the difference).

The reporting library they share with ``python -m src.report`` (rows, mean ± std, markdown tables, figures) is
:mod:`src.reports.tables`.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import shlex
import sys
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path

from src.reports.tables import summarise

ROOT = Path(__file__).resolve().parents[2]
RESULTS = ROOT / "benchmarks" / "results"
DATA_ROOT = ROOT / "data"


def machine_facts() -> str:
    """``"x86_64, 2 cores; python 3.11.7; torch 2.13.0; cpu, 1 thread(s)"``: the machine line of a result."""
    import torch

    return (f"{platform.machine()}, {os.cpu_count()} cores; python {platform.python_version()}; "
            f"torch {torch.__version__}; cpu, {torch.get_num_threads()} thread(s)")


def script_command(module: str, argv: Sequence[str] | None = None, data_root: str | None = None,
                   placeholders: dict[str, str] | None = None) -> str:
    """``python -m <module> <argv>`` (this process's arguments by default), each argument quoted as a shell
    needs it: the command a result records. ``module`` is the tool's or study's dotted name
    (``benchmarks.tools.run_grid``); an argument equal to ``data_root`` is shown as ``<data dir>``, one equal to
    a key of ``placeholders`` as its value (paths of this machine: ``{work: "<work dir>"}``)."""
    argv = sys.argv[1:] if argv is None else argv
    shown_as = dict(placeholders or {}, **({data_root: "<data dir>"} if data_root is not None else {}))
    shown_args = [shown_as[a] if a in shown_as else shlex.quote(a) for a in argv]
    return " ".join(["python", "-m", module, *shown_args])


def shown(cmd: Sequence[str]) -> str:
    """A command as a user types it: ``python`` for this interpreter, repository-relative paths."""
    parts = ["python", *cmd[1:]]
    return " ".join(shlex.quote(p.replace(str(ROOT) + os.sep, "")) for p in parts)


def rel(path: Path) -> str:
    """A path as the recorded commands show it: relative to the repository when inside it (no path of this
    machine in a committed result)."""
    try:
        return str(Path(path).resolve().relative_to(ROOT))
    except ValueError:
        return str(path)


def result_options(ap: argparse.ArgumentParser, name: str | None = None) -> None:
    """``--out`` (the results folder, default ``benchmarks/results``), ``--name`` (the result's file stem,
    when ``name`` is given as its default) and ``--render`` (rebuild the markdown from the saved JSON)."""
    ap.add_argument("--out", type=Path, default=RESULTS, help="results folder")
    if name is not None:
        ap.add_argument("--name", default=name, help="result file stem")
    ap.add_argument("--render", action="store_true", help="run nothing: rebuild the markdown from the JSON")


def rendered(args, stem: str, render: Callable[[dict], str]) -> bool:
    """With ``--render``: ``<out>/<stem>.md`` rebuilt from ``<out>/<stem>.json`` (True: nothing else to do). With
    ``--note FILE`` too: a finding written after the run, stored in the JSON's ``meta.note`` first."""
    if not args.render:
        return False

    if getattr(args, "note", None):
        res = load_results(args.out, stem)
        res["meta"]["note"] = Path(args.note).read_text()
        write_results(args.out, stem, res, render)
    else:
        rerender(args.out, stem, render)
    return True


def made_by(recorded: str | None, legacy: str, current: str) -> str:
    """How a table names what made it: ``legacy`` (its script's name before the benchmarks moved to
    ``benchmarks/{tools,studies}``) when the recorded command ran that script or the result records none (the
    committed tables made before the move, which must rebuild byte for byte), else ``current``."""
    return legacy if not recorded or recorded.startswith("python benchmarks/") else current


def fmt(values, digits, key):
    """The ``mean ± std`` cell of one metric over seeds (bytes in MB)."""
    from src.reports.tables import format_summary, summarise

    return format_summary(key, *summarise(values), digits)


def note_lines(meta: dict) -> list[str]:
    """A result's ``--note`` (a finding, written below its table) as markdown lines, or none."""
    return [meta["note"].strip(), ""] if meta.get("note") else []


def checkpoint_options(ap: argparse.ArgumentParser, name: str, what: str) -> None:
    """The options every study of trained checkpoints has: ``--ckpt LABEL=PATH`` (repeatable), ``--root``,
    ``--n``, ``--seed``, ``--note``, ``--out``, ``--name`` (default ``name``), ``--render``."""

    ap.add_argument("--ckpt", action="append", default=[], type=labelled_checkpoint,
                    help=f"LABEL=PATH of {what} (repeatable; split at the last =)")
    ap.add_argument("--root", default=None, help="data.root")
    ap.add_argument("--n", type=int, default=64)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--note", default=None, help="a markdown file appended to the table (the finding)")
    result_options(ap, name)


def checkpoint_study(ap: argparse.ArgumentParser, args, module: str, render: Callable[[dict], str],
                     measure: Callable[[object], dict], **meta) -> None:
    """Run a study parsed with :func:`checkpoint_options`: ``measure(module)`` for each ``--ckpt`` (loaded by
    ``src.runs.load.load_module``, torch threads from ``OMP_NUM_THREADS``), ``<out>/<name>.json`` and ``.md``
    rewritten after each; ``meta`` (the study's settings) is recorded beside the machine and the command.
    With ``--render`` only the markdown is rebuilt from the saved JSON."""

    if rendered(args, args.name, render):
        return
    if not args.ckpt:
        ap.error("give at least one --ckpt LABEL=PATH")
    import torch

    from src.runs.load import load_module
    from src.runtime import progress

    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    overrides = [f"data.root={args.root}"] if args.root else []
    res = {"meta": {"machine": machine_facts(), "command": script_command(module, data_root=args.root), "n": args.n,
                    **meta,
                    "seed": args.seed, "note": Path(args.note).read_text() if args.note else None},
           "checkpoints": {}}
    for label, path in args.ckpt:
        module = load_module(path, overrides)[0]
        print(f"{label}: measuring", flush=True)
        with progress.outside_a_trainer():  # a module's long phases (sampling, metrics) show progress here too
            res["checkpoints"][label] = {"checkpoint": path, **measure(module)}
        write_results(args.out, args.name, res, render)
        print(f"{label}: done", flush=True)
    print(f"-> {Path(args.out) / args.name}.md")


# ------------------------------------------------------------------- result files and verdicts
def seed_verdict(a: Iterable[float | None], b: Iterable[float | None], lower_is_better: bool
                 ) -> tuple[str, float, float]:
    """Verdict of the claim 'a is better than b' from two sets of seeds, with the two means: agree / disagree
    when the means differ by more than twice the standard error of their difference (Welch: sd²/n of each side
    summed; with no spread on either side, any difference decides), undecided otherwise, for equal means, or with
    fewer than 2 finite values on a side."""
    ma, sa, na = summarise(a)
    mb, sb, nb = summarise(b)
    if na < 2 or nb < 2:
        return "undecided (fewer than 2 seeds)", ma, mb
    se = math.sqrt(sa**2 / na + sb**2 / nb)
    diff = (mb - ma) if lower_is_better else (ma - mb)  # > 0: a is better
    if diff == 0:
        return "undecided (equal means)", ma, mb
    if se > 0 and abs(diff) <= 2 * se:
        return f"undecided (difference {abs(diff):.2f} ≤ 2 s.e. = {2 * se:.2f})", ma, mb
    return ("agree" if diff > 0 else "disagree") + f" (difference {abs(diff):.2f}, 2 s.e. = {2 * se:.2f})", ma, mb

def labelled_checkpoint(spec: str) -> tuple[str, str]:
    """argparse ``type`` of a benchmark's ``--ckpt LABEL=PATH``: split at the *last* ``=``, since labels may
    hold one (``'trained with K=2=outputs/…/step_0000600.ckpt'``) and checkpoint paths do not."""
    if "=" not in spec:
        raise argparse.ArgumentTypeError(f"{spec!r}: write LABEL=PATH")
    label, path = spec.rsplit("=", 1)
    return label, path

def write_results(out: Path, stem: str, res: dict, render: Callable[[dict], str], indent: int = 1,
                  **dumps) -> None:
    """``<out>/<stem>.json`` (written to a temporary file and renamed: a killed run never leaves half a file)
    and ``<out>/<stem>.md`` = ``render(res)``. ``indent`` and ``dumps`` (``sort_keys``, ``default``) go to
    ``json.dumps``."""
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    tmp = out / f"{stem}.json.tmp"
    tmp.write_text(json.dumps(res, indent=indent, **dumps))
    tmp.replace(out / f"{stem}.json")
    (out / f"{stem}.md").write_text(render(res))

def load_results(out: Path, stem: str) -> dict:
    """The saved ``<out>/<stem>.json`` (``{}`` when there is none): what a benchmark that merges its runs by
    device or setting adds its new section to."""
    path = Path(out) / f"{stem}.json"
    return json.loads(path.read_text()) if path.exists() else {}

def rerender(out: Path, stem: str, render: Callable[[dict], str]) -> dict:
    """Rewrite ``<out>/<stem>.md`` from the saved ``<out>/<stem>.json`` (nothing is run); return the JSON."""
    res = json.loads((Path(out) / f"{stem}.json").read_text())
    (Path(out) / f"{stem}.md").write_text(render(res))
    return res
