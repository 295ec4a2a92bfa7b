"""UCI data sets of the DKEF experiments (paper Table 2; docs/data.md §1): file specs, parsers, loading.

- ``redwine`` / ``whitewine``: ``winequality-{red,white}.csv`` (UCI id 186), ``;``-separated with a quoted
  header (a ``,``-separated re-saved copy, as the DEQ repo uses, is accepted too, and so is a leading
  unnamed index column that pandas' ``to_csv`` writes). The ``quality`` column is dropped: D = 11.
  These are dequantised in preprocessing (see :mod:`src.data.preprocessing`).
- ``parkinsons``: ``parkinsons_updrs.data`` (UCI id 189), ``,``-separated with a header. Columns
  ``subject#, age, sex`` are dropped (the reference's ``[:, 3:]``), then :func:`drop_correlated_columns`
  repeatedly removes the first column whose |corr| > 0.98 with another column: D = 15 (the DKEF paper's).
  The reference code takes |·| on the first pass only (a bug); on this file both give the same 15 columns.

:func:`load_uci` returns the raw feature matrix (float64, file row order) and the column names;
:func:`src.data.preprocessing.preprocess` turns it into whitened train/val/test splits.
"""

from __future__ import annotations

import io
import os
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from src.data.download import RemoteFile, ensure_file

UCI_BASE = "https://archive.ics.uci.edu/ml/machine-learning-databases/"
CORR_THRESHOLD = 0.98


# ---------------------------------------------------------------------------------------------- parsing
def read_table(path: str | os.PathLike) -> tuple[np.ndarray, list[str]]:
    """A numeric CSV with one header row: (float64 values [N, C], column names without quotes).

    The delimiter is ``;`` if the header has one, else ``,``. Blank lines are skipped.
    """
    path = Path(path)
    text = path.read_text(encoding="utf-8-sig")
    lines = [ln for ln in text.splitlines() if ln.strip()]
    if len(lines) < 2:
        raise ValueError(f"{path}: expected a header row and data rows, found {len(lines)} non-empty lines")
    header = lines[0]
    delimiter = ";" if ";" in header else ","
    names = [h.strip().strip('"').strip("'").strip() for h in header.split(delimiter)]
    try:
        values = np.loadtxt(io.StringIO("\n".join(lines[1:])), delimiter=delimiter, dtype=np.float64, ndmin=2)
    except ValueError as err:
        raise ValueError(
            f"{path}: not a numeric '{delimiter}'-separated table after the header ({err}); "
            "is it the original file (not an HTML error page or a zip)?"
        ) from err
    if values.shape[1] != len(names):
        raise ValueError(f"{path}: the header has {len(names)} columns but the rows have {values.shape[1]}")
    return values, names


def _drop_index_column(values: np.ndarray, names: list[str]) -> tuple[np.ndarray, list[str]]:
    """Drop a leading unnamed index column (``''`` or ``Unnamed: 0``, as pandas writes it)."""
    if names and (names[0] == "" or names[0].lower().startswith("unnamed")):
        return values[:, 1:], names[1:]
    return values, names


def parse_wine(path: str | os.PathLike) -> tuple[np.ndarray, list[str]]:
    """``winequality-*.csv`` → (features [N, 11] without ``quality``, their names)."""
    values, names = _drop_index_column(*read_table(path))
    lowered = [n.lower() for n in names]
    if "quality" not in lowered:
        raise ValueError(f"{path}: no 'quality' column in the header {names}; is this a wine-quality file?")
    keep = [i for i, n in enumerate(lowered) if n != "quality"]
    values, names = values[:, keep], [names[i] for i in keep]
    if values.shape[1] != 11:
        raise ValueError(
            f"{path}: expected 11 feature columns besides 'quality', found {len(names)}: {names}"
        )
    return values, names


def drop_correlated_columns(
    values: np.ndarray, names: list[str] | None = None, threshold: float = CORR_THRESHOLD
) -> tuple[np.ndarray, list[str]]:
    """Repeatedly delete the first column whose |Pearson corr| > ``threshold`` with another column."""
    values = np.asarray(values, dtype=np.float64)
    names = list(names) if names is not None else [str(i) for i in range(values.shape[1])]
    while values.shape[1] > 1:
        with np.errstate(invalid="ignore", divide="ignore"):
            corr = np.abs(np.corrcoef(values, rowvar=False))
        np.fill_diagonal(corr, 0.0)
        flagged = np.flatnonzero((np.nan_to_num(corr) > threshold).any(axis=1))
        if flagged.size == 0:
            break
        j = int(flagged[0])
        values = np.delete(values, j, axis=1)
        del names[j]
    return values, names


def parse_parkinsons(path: str | os.PathLike) -> tuple[np.ndarray, list[str]]:
    """``parkinsons_updrs.data`` → (features [N, 15], their names): drop subject#, age, sex, then
    :func:`drop_correlated_columns`."""
    values, names = _drop_index_column(*read_table(path))
    expected = ["subject#", "age", "sex"]
    if [n.lower() for n in names[:3]] != expected:
        raise ValueError(
            f"{path}: expected the first columns to be {expected}, got {names[:3]}; "
            "is this parkinsons_updrs.data?"
        )
    return drop_correlated_columns(values[:, 3:], names[3:])


# ---------------------------------------------------------------------------------------------- data sets
@dataclass(frozen=True)
class UCIDataset:
    name: str
    file: RemoteFile
    parser: Callable[[str | os.PathLike], tuple[np.ndarray, list[str]]]
    dequantize: bool
    dim: int  # D after parsing (the DKEF paper's)


DATASETS: dict[str, UCIDataset] = {
    "redwine": UCIDataset(
        "redwine",
        RemoteFile(
            "winequality-red.csv",
            "wine-quality",
            UCI_BASE + "wine-quality/winequality-red.csv",
            md5="2daeecee174368f8a33b82c8cccae3a5",
        ),
        parse_wine,
        dequantize=True,
        dim=11,
    ),
    "whitewine": UCIDataset(
        "whitewine",
        RemoteFile(
            "winequality-white.csv",
            "wine-quality",
            UCI_BASE + "wine-quality/winequality-white.csv",
            md5="5d9ff0f7f716dace19e3ab4578775fd7",
        ),
        parse_wine,
        dequantize=True,
        dim=11,
    ),
    "parkinsons": UCIDataset(
        "parkinsons",
        RemoteFile(
            "parkinsons_updrs.data",
            "parkinsons-telemonitoring",
            UCI_BASE + "parkinsons/telemonitoring/parkinsons_updrs.data",
            md5="4f97310e2c9fbeedb72e8a37822fee45",
        ),
        parse_parkinsons,
        dequantize=False,
        dim=15,
    ),
}


def get_dataset(name: str) -> UCIDataset:
    key = str(name).lower()
    if key not in DATASETS:
        raise ValueError(f"unknown UCI data set {name!r}: valid names are {', '.join(DATASETS)}")
    return DATASETS[key]


def locate_uci(name: str, root: str | os.PathLike, download: bool = True) -> Path:
    """The data file of ``name`` under ``root`` (downloaded when missing and ``download``); else
    FileNotFoundError naming the file, the paths searched and the URL."""
    return ensure_file(get_dataset(name).file, root, download=download)


def load_uci(name: str, root: str | os.PathLike, download: bool = True) -> tuple[np.ndarray, list[str]]:
    """(raw features float64 [N, D] in file order, column names) of UCI data set ``name``."""
    ds = get_dataset(name)
    return ds.parser(locate_uci(name, root, download))
