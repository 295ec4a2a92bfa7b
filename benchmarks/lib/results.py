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
  :func:`load_results` (a saved JSON to merge into), :func:`rerender` (the markdown again from a saved JSON),
  :func:`added_to_saved` (a grid's new jobs joined to a saved result whose run directories are gone),
  :func:`commands_so_far` (every command that built a result that later calls add to);
- verdicts: :func:`seed_verdict` (is one method better than another over seeds: agree / disagree / undecided at
  twice the standard error of the difference and by Welch's t-test: :func:`seed_rules`, :func:`welch_t_test`).

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
def welch_t_test(a: tuple[float, float, int], b: tuple[float, float, int]) -> tuple[float, float, float, float]:
    """Welch's unequal-variance t-test of two samples given as ``(mean, sample sd, n)`` (each n ≥ 2, not both sds
    0): ``(t, df, p, q)`` with t = (m_a − m_b) / se, se² = s_a²/n_a + s_b²/n_b, the Welch–Satterthwaite degrees of
    freedom df = se⁴ / ((s_a²/n_a)²/(n_a − 1) + (s_b²/n_b)²/(n_b − 1)) (Welch 1947, eq. 12 of Satterthwaite
    1946), the two-sided p-value 2·(1 − F_df(|t|)) of Student's t distribution and its 0.975 quantile q = F_df⁻¹(0.975)
    (the means differ at the 5 % level iff |m_a − m_b| > q·se: the t-based threshold beside the 2 s.e. rule)."""
    from scipy.special import stdtr, stdtrit

    (ma, sa, na), (mb, sb, nb) = a, b
    if na < 2 or nb < 2:
        raise ValueError(f"Welch's t-test needs ≥ 2 values a side, got {na} and {nb}")
    va, vb = sa**2 / na, sb**2 / nb
    if va + vb == 0:
        raise ValueError("Welch's t-test needs a spread on at least one side (both sds are 0)")
    se = math.sqrt(va + vb)
    t = (ma - mb) / se
    df = (va + vb) ** 2 / (va**2 / (na - 1) + vb**2 / (nb - 1))
    return t, df, float(2 * stdtr(df, -abs(t))), float(stdtrit(df, 0.975))


def one_sample_t_test(d: tuple[float, float, int]) -> tuple[float, float, float, float]:
    """Student's one-sample t-test of mean 0 (the paired t-test, on paired differences), the sample given as
    ``(mean, sample sd, n)`` with n ≥ 2 and sd > 0: ``(t, df, p, q)``, t = mean / (sd/√n), df = n − 1, two-sided
    p and q = t₀.₉₇₅(df), as :func:`welch_t_test`."""
    from scipy.special import stdtr, stdtrit

    m, sd, n = d
    if n < 2 or sd == 0:
        raise ValueError(f"the t-test needs ≥ 2 values with a spread, got n = {n}, sd = {sd}")
    t = m / (sd / math.sqrt(n))
    return t, n - 1.0, float(2 * stdtr(n - 1, -abs(t))), float(stdtrit(n - 1, 0.975))


def seed_rules(a: Iterable[float | None], b: Iterable[float | None], lower_is_better: bool) -> dict:
    """The claim 'a is better than b' over seeds by two rules: ``{"mean_a", "mean_b", "diff"`` (> 0: a better),
    ``"se"``, ``"by_2se"``, ``"by_welch"`` (each "agree" / "disagree" / "undecided"), ``"p"``, ``"df"``, ``"q"``
    (Welch's two-sided p, degrees of freedom and t₀.₉₇₅(df); None where the test does not apply), ``"why"`` (why
    both are undecided or decided without a test, else None)``}``. **At 2 s.e.**: agree / disagree when the means
    differ by more than twice the standard error of their difference (se² = sd_a²/n_a + sd_b²/n_b, sample sds; no
    t-correction, so lenient at 3 seeds). **By Welch's t-test** (:func:`welch_t_test`): agree / disagree when its
    two-sided p < 0.05, i.e. the difference exceeds t₀.₉₇₅(df)·se (4.30·se at df = 2, 2.78·se at df = 4). With no
    spread on either side any difference decides both; equal means, or fewer than 2 finite values on a side, are
    undecided by both."""
    ma, sa, na = summarise(a)
    mb, sb, nb = summarise(b)
    out = {"mean_a": ma, "mean_b": mb, "diff": float("nan"), "se": float("nan"), "by_2se": "undecided",
           "by_welch": "undecided", "p": None, "df": None, "q": None, "why": None}
    if na < 2 or nb < 2:
        return out | {"why": "fewer than 2 seeds"}
    diff = (mb - ma) if lower_is_better else (ma - mb)  # > 0: a is better
    se = math.sqrt(sa**2 / na + sb**2 / nb)
    out |= {"diff": diff, "se": se}
    if diff == 0:
        return out | {"why": "equal means"}
    word = "agree" if diff > 0 else "disagree"
    if se == 0:
        return out | {"by_2se": word, "by_welch": word, "why": "no spread on either side: any difference decides"}
    _t, df, p, q = welch_t_test((ma, sa, na), (mb, sb, nb))
    return out | {"by_2se": word if abs(diff) > 2 * se else "undecided",
                  "by_welch": word if abs(diff) > q * se else "undecided", "p": p, "df": df, "q": q}


def p_text(p: float) -> str:
    """``"p = 0.055"``, or ``"p < 0.001"``."""
    return "p < 0.001" if p < 1e-3 else f"p = {p:.3f}"


def seed_verdict(a: Iterable[float | None], b: Iterable[float | None], lower_is_better: bool,
                 detail: bool = True) -> tuple[str, float, float]:
    """The verdict of the claim 'a is better than b' over seeds by both rules of :func:`seed_rules`, each named in
    the text, with the two means: ``"agree at 2 s.e. (difference 4.00 > 2 s.e. = 2.58); undecided by Welch's
    t-test (p = 0.055, df = 2.9: needs > 3.22 s.e. = 4.16)"``; ``detail=False``: the two verdicts and the p-value
    only (``"agree at 2 s.e., undecided by Welch's t-test (p = 0.055)"``)."""
    r = seed_rules(a, b, lower_is_better)
    ma, mb = r["mean_a"], r["mean_b"]
    if r["why"] == "fewer than 2 seeds":
        return "undecided (fewer than 2 seeds: neither the 2 s.e. rule nor Welch's t-test applies)", ma, mb
    if r["p"] is None:
        return f"{r['by_2se']} ({r['why']}) at 2 s.e. and by Welch's t-test", ma, mb
    by_se, by_t, diff, se = r["by_2se"], r["by_welch"], abs(r["diff"]), r["se"]
    if not detail:
        return f"{by_se} at 2 s.e., {by_t} by Welch's t-test ({p_text(r['p'])})", ma, mb
    return (f"{by_se} at 2 s.e. (difference {diff:.2f} {'≤' if by_se == 'undecided' else '>'} 2 s.e. = "
            f"{2 * se:.2f}); {by_t} by Welch's t-test ({p_text(r['p'])}, df = {r['df']:.1f}: needs > "
            f"{r['q']:.2f} s.e. = {r['q'] * se:.2f})"), ma, mb


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


def commands_so_far(saved_meta: dict | None, command: str) -> list[str]:
    """Every command that built a result, in order: the saved result's (``commands``, else its one ``command``;
    none for a new result) then ``command``, a command run again listed once."""
    earlier = (saved_meta.get("commands") or [saved_meta["command"]]) if saved_meta else []
    return list(dict.fromkeys([*earlier, command]))


def added_to_saved(saved: dict, jobs: list[dict], meta: dict) -> tuple[list[dict], dict]:
    """The saved result's jobs with ``jobs`` added, a new job replacing a saved one of the same data set, method
    and seed; the grid commands of both, and every command that built the result in order (``meta["commands"]``,
    a command run again listed once), the saved note kept unless a new one is given."""
    def key(job):
        return job["group"], job["method"], job["seed"]

    new = {key(j) for j in jobs}
    merged = [j for j in saved["jobs"] if key(j) not in new] + jobs
    old = saved["meta"]
    meta = dict(meta, grid_commands=list(dict.fromkeys([*old["grid_commands"], *meta["grid_commands"]])),
                commands=commands_so_far(old, meta["command"]))
    if old.get("note"):
        meta.setdefault("note", old["note"])
    return merged, meta
