"""The reporting library: run metrics → grouped rows → mean ± std → markdown tables and figures.

Both report front ends use it: ``python -m src.report`` (any sweep directories → one table) and
``benchmarks/tools/run_grid.py`` (the paper's grids, with the paper's numbers and target verdicts beside ours).
Everything here except :func:`load_run` and :func:`figure` is a pure function of plain dicts and lists, so
a table can be rebuilt from a saved JSON file without the run directories.

- runs: :func:`load_run` reads one run directory's ``metrics.json`` and its Hydra overrides;
- rows: :func:`group_rows` groups rows by a key, in first-seen order;
- summaries: :func:`summarise` (mean, std over seeds, count of finite values), :func:`summarise_metrics`
  (that for every column), :func:`format_summary` (the ``mean ± std`` cell: bytes shown in MB, std only when
  there are at least two values), :func:`seed_verdict` (is one method better than another over seeds:
  agree / disagree / undecided at twice the standard error of the difference);
- markdown: :func:`markdown_table`;
- result files: :func:`write_results` (``<stem>.json`` atomically, then ``<stem>.md`` rendered from it),
  :func:`load_results` (a saved JSON to merge into) and :func:`rerender` (the markdown again from a saved
  JSON, the benchmarks' ``--render``);
- figures: :func:`figure` (headless matplotlib, ``tight_layout``, save, close).
"""

from __future__ import annotations

import argparse
import json
import math
from collections.abc import Callable, Hashable, Iterable, Iterator
from contextlib import contextmanager
from pathlib import Path
from statistics import mean, stdev

import yaml

__all__ = [
    "figure",
    "format_summary",
    "group_rows",
    "load_results",
    "load_run",
    "markdown_table",
    "parse_overrides",
    "read_overrides",
    "rerender",
    "scale_of",
    "seed_verdict",
    "summarise",
    "summarise_metrics",
    "write_results",
]

MISSING = "—"  # a cell with no finite value


# --------------------------------------------------------------------------------------------- runs
def read_overrides(run_dir: Path) -> list[str]:
    """The command-line overrides Hydra recorded for a run (``.hydra/overrides.yaml``), or ``[]``."""
    path = Path(run_dir) / ".hydra" / "overrides.yaml"
    if not path.exists():
        return []
    return [str(item) for item in (yaml.safe_load(path.read_text()) or [])]


def parse_overrides(overrides: Iterable[str]) -> dict[str, str]:
    """``["+a=1", "b=x"]`` → ``{"a": "1", "b": "x"}`` (Hydra's ``+``/``++``/``~`` prefixes dropped)."""
    parsed = {}
    for item in overrides:
        key, _, value = str(item).partition("=")
        parsed[key.lstrip("+~")] = value
    return parsed


def load_run(run_dir: Path) -> dict:
    """One finished run: ``{"dir", "metrics" (its metrics.json), "overrides" (raw list)}``.

    Raises ``FileNotFoundError`` when the run has no ``metrics.json`` and ``ValueError`` when it is not JSON.
    """
    run_dir = Path(run_dir)
    path = run_dir / "metrics.json"
    try:
        metrics = json.loads(path.read_text())
    except json.JSONDecodeError as exc:
        raise ValueError(f"{path} is not valid JSON ({exc}); re-run that job or delete the file") from exc
    return {"dir": str(run_dir), "metrics": metrics, "overrides": read_overrides(run_dir)}


# --------------------------------------------------------------------------------------------- rows
def group_rows(rows: Iterable[dict], key: Callable[[dict], Hashable]) -> dict[Hashable, list[dict]]:
    """``{key(row): [rows with that key]}``, keys and rows in the order first seen."""
    groups: dict[Hashable, list[dict]] = {}
    for row in rows:
        groups.setdefault(key(row), []).append(row)
    return groups


# ---------------------------------------------------------------------------------------- summaries
def summarise(values: Iterable[float | None]) -> tuple[float, float, int]:
    """(mean, sample std, n) over the finite values; std 0 for one value; (nan, nan, 0) for none."""
    vals = [v for v in values if v is not None and math.isfinite(v)]
    if not vals:
        return float("nan"), float("nan"), 0
    return mean(vals), (stdev(vals) if len(vals) > 1 else 0.0), len(vals)


def summarise_metrics(metric_dicts: list[dict], keys: Iterable[str]) -> dict[str, dict]:
    """``{key: {"mean", "std", "n"}}`` of each key over several runs' metrics (a run lacking it is skipped)."""
    out = {}
    for key in keys:
        m, s, n = summarise([d.get(key) for d in metric_dicts])
        out[key] = {"mean": m, "std": s, "n": n}
    return out


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


def scale_of(key: str) -> float:
    """Display unit of a metric: byte counts are shown in MB."""
    return 1e6 if "bytes" in key else 1.0


def format_summary(key: str, mean_: float, std: float, n: int, digits: int) -> str:
    """``"m ± s"`` with ``digits`` decimals (``"m"`` for one value, ``"—"`` for none), bytes in MB."""
    if n == 0:
        return MISSING
    scale = scale_of(key)
    text = f"{mean_ / scale:.{digits}f}"
    return text + (f" ± {std / scale:.{digits}f}" if n > 1 else "")


# ----------------------------------------------------------------------------------------- markdown
def markdown_table(head: list[str], rows: Iterable[list[str]]) -> list[str]:
    """A GitHub markdown table as lines (header, ``|---|`` rule, one line per row)."""
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    lines += ["| " + " | ".join(str(c) for c in cells) + " |" for cells in rows]
    return lines


# ------------------------------------------------------------------------------------- result files
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


# ------------------------------------------------------------------------------------------ figures
@contextmanager
def figure(path: Path, nrows: int = 1, ncols: int = 1, figsize: tuple[float, float] = (5, 3.5),
           dpi: int = 120) -> Iterator[tuple]:
    """``with figure(path) as (fig, axes): ...`` — a headless (Agg) figure, ``axes`` always a 2-d array
    (``axes[0][0]`` for one plot); on exit laid out tightly, saved to ``path`` and closed."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(nrows, ncols, figsize=figsize, squeeze=False)
    try:
        yield fig, axes
        fig.tight_layout()
        fig.savefig(path, dpi=dpi)
    finally:
        plt.close(fig)
