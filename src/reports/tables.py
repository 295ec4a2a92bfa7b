"""The reporting library: run metrics → grouped rows → mean ± std → markdown tables and figures.

Both report front ends use it: ``python -m src.report`` (any sweep directories → one table) and the benchmarks
(``benchmarks/tools/run_grid.py``: the paper's grids, with the paper's numbers and target verdicts beside ours),
whose own helpers — result files, verdicts over seeds — live in :mod:`benchmarks.lib.results`.
Everything here except :func:`load_run` and :func:`figure` is a pure function of plain dicts and lists, so
a table can be rebuilt from a saved JSON file without the run directories.

- runs: :func:`load_run` reads one run directory's ``metrics.json`` and its Hydra overrides;
- rows: :func:`group_rows` groups rows by a key, in first-seen order;
- summaries: :func:`summarise` (mean, std over seeds, count of finite values), :func:`summarise_metrics`
  (that for every column), :func:`format_summary` (the ``mean ± std`` cell: bytes shown in MB, std only when
  there are at least two values);
- markdown: :func:`markdown_table`;
- figures: :func:`figure` (headless matplotlib, ``tight_layout``, save, close).
"""

from __future__ import annotations

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
    "load_run",
    "markdown_table",
    "parse_overrides",
    "read_overrides",
    "scale_of",
    "summarise",
    "summarise_metrics",
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
