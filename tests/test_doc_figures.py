"""Every figure README.md and docs/results.md quote as a measurement comes from a committed results file.

``docs/figures.yaml`` is the figure-to-file index: each entry names a passage of a doc (``quote``, an exact
substring once line breaks, ``**`` and the typographic minus are normalised), the results JSON it comes from
(``file``, under ``benchmarks/results``), and each number the passage prints (``figures``: printed number → an
expression over the JSON; ``"276 #sigma"`` keys the same printed number a second time). The test checks that the
passage is in the doc, that every number in it is either a figure or one of its ``given`` settings (step counts,
seeds, sample sizes, the paper's figures), and that each figure equals its expression at the printed precision —
so a doc that quotes a number its JSON does not hold, or a passage that drifts from the index, fails. A passage
the doc marks as not a committed result (``committed: false``) must say so in its own words.

Expressions: ``at("a/b/*/c")`` reads the JSON (a ``*`` matches every key or item: a list of values; a key may
itself hold ``/``, as ``test/fid``: the longest key that matches is taken), ``at("other.json:a/b")`` another
committed file; ``select("a/rows", "key", arm="x")`` the ``key`` of the rows of a list whose fields match; ``mean``,
``sd`` (sample), ``lo`` / ``hi`` (min / max), ``seeds`` (the ``n`` of a list), ``pct`` (× 100), ``two_se(a, b)``
and ``welch_p(a, b)`` (the verdicts' two rules), ``paired(a, b)`` (per-image differences pooled over seeds),
``se`` (standard error of a mean) and ``paired_p``; names given in ``let`` stand for their ``at(...)``.
"""

from __future__ import annotations

import json
import math
import re
import statistics
from functools import cache
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results"
INDEX = ROOT / "docs" / "figures.yaml"
NUMBER = re.compile(r"(?<![\w.])\d+(?:\.\d+)?")


def normalised(text: str) -> str:
    return re.sub(r"\s+", " ", text.replace("−", "-").replace("**", ""))


@cache
def _json(path: Path):
    return json.loads(path.read_text())


def _walk(node, parts: list[str]) -> list:
    if not parts:
        return [node]
    if parts[0] == "*":
        children = node.values() if isinstance(node, dict) else node
        return [v for child in children for v in _walk(child, parts[1:])]
    if isinstance(node, list):
        return _walk(node[int(parts[0])], parts[1:])
    for k in range(len(parts), 0, -1):  # the longest key that matches: keys may hold "/" ("test/fid")
        key = "/".join(parts[:k])
        if key in node:
            return _walk(node[key], parts[k:])
    raise KeyError(f"no key {parts[0]!r} (of {'/'.join(parts)!r}) among {list(node)[:12]}")


def reader(default_file: str, results: Path = RESULTS):
    def at(path: str):
        name, _, inner = path.rpartition(".json:")
        data = _json(results / (name + ".json" if name else default_file))
        found = _walk(data, inner.split("/") if inner else [])
        return found if "*" in inner.split("/") else found[0]
    return at


def _values(xs) -> list[float]:
    vals = [float(x) for x in (xs if isinstance(xs, list) else [xs]) if x is not None]
    assert vals, "no values"
    return vals


def _two_se(a, b) -> float:
    """Twice the standard error of the difference of two means (the verdicts' 2 s.e. rule)."""
    a, b = _values(a), _values(b)
    return 2 * math.sqrt(statistics.variance(a) / len(a) + statistics.variance(b) / len(b))


def _welch_p(a, b) -> float:
    """Welch's two-sided p of two samples (the verdicts' t-test, benchmarks.lib.results.welch_t_test)."""
    from benchmarks.lib.results import welch_t_test

    a, b = _values(a), _values(b)
    return welch_t_test(*((statistics.mean(x), statistics.stdev(x), len(x)) for x in (a, b)))[2]


def _paired(a: list[list[float]], b: list[list[float]]) -> list[float]:
    """Differences a − b paired by position (the same test image) within each seed, pooled over seeds."""
    return [u - w for xs, ys in zip(a, b, strict=True) for u, w in zip(xs, ys, strict=True)]


def _p_one_sample(d: list[float]) -> float:
    """The paired t-test's two-sided p of mean 0 (benchmarks.lib.results.one_sample_t_test)."""
    from benchmarks.lib.results import one_sample_t_test

    return one_sample_t_test((statistics.mean(d), statistics.stdev(d), len(d)))[2]


NAMESPACE = {"mean": lambda xs: statistics.mean(_values(xs)), "sd": lambda xs: statistics.stdev(_values(xs)),
             "lo": lambda xs: min(_values(xs)), "hi": lambda xs: max(_values(xs)),
             "seeds": lambda xs: len(_values(xs)), "pct": lambda x: 100 * x, "abs": abs,
             "two_se": _two_se, "welch_p": _welch_p, "paired": _paired, "paired_p": _p_one_sample,
             "se": lambda xs: statistics.stdev(_values(xs)) / math.sqrt(len(_values(xs)))}


def evaluate(expr: str, file: str, let: dict[str, str] | None, results: Path = RESULTS):
    at = reader(file, results)

    def select(path: str, key: str, **match):
        """``key`` (a path inside the row: ``metrics/test/sm_loss``) of every row of the list at ``path`` whose
        fields equal ``match`` (None where a row lacks it)."""
        def get(row):
            try:
                return _walk(row, key.split("/"))[0]
            except KeyError:
                return None
        return [get(row) for row in at(path) if all(row.get(k) == v for k, v in match.items())]

    names = {name: at(path) for name, path in (let or {}).items()}
    # one namespace as the globals: comprehensions see only globals
    return eval(expr, {"__builtins__": {}, **NAMESPACE, "at": at, "select": select, **names})


def matches(printed: str, value: float) -> bool:
    """``value`` shows as ``printed`` at its precision (half a unit of the last printed digit, either way)."""
    decimals = len(printed.split(".")[1]) if "." in printed else 0
    return abs(value - float(printed)) <= 0.5 * 10**-decimals * (1 + 1e-9) + 1e-12


ENTRIES = yaml.safe_load(INDEX.read_text())


def _id(entry: dict) -> str:
    return f"{entry['doc']}: {entry['quote'][:48]}"


def problems(entry: dict, doc_text: str, results: Path = RESULTS) -> list[str]:
    """What is wrong with one index entry against its doc's text and its results file (nothing: [])."""
    doc, quote = normalised(doc_text), normalised(entry["quote"])
    if quote not in doc:
        return [f"{entry['doc']} no longer says {entry['quote']!r}: update docs/figures.yaml"]
    if entry.get("committed") is False:
        said = re.search(r"not a committed result|no committed result|not committed|not supported", quote)
        return [] if said else [f"{entry['quote']!r} is indexed as uncommitted but does not say so"]
    figures = {str(k): v for k, v in entry["figures"].items()}
    printed_numbers = {key.split(" #")[0] for key in figures}  # "276 #sigma": one printed number a second time
    given = {str(g) for g in entry.get("given", [])}
    out = [f"{entry['doc']} prints {token} in {entry['quote']!r}, which docs/figures.yaml neither indexes nor gives"
           for token in NUMBER.findall(quote)
           if token not in given and token not in printed_numbers and f"-{token}" not in printed_numbers]
    for key, expr in figures.items():
        printed = key.split(" #")[0]
        if not re.search(rf"(?<![\w.]){re.escape(printed)}(?![\d])", quote):
            out.append(f"{printed} is not in the quote {entry['quote']!r}")
            continue
        value = evaluate(expr, entry["file"], entry.get("let"), results)
        if not matches(printed, value):
            out.append(f"{entry['doc']} prints {printed}; {entry['file']}: {expr} = {value!r}")
    return out


@pytest.mark.parametrize("entry", ENTRIES, ids=[_id(e) for e in ENTRIES])
def test_each_quoted_figure_is_in_its_doc_and_in_its_results_file(entry):
    assert problems(entry, (ROOT / entry["doc"]).read_text()) == []


def test_the_figure_checks_catch_a_wrong_number_a_drifted_quote_and_an_unindexed_one(tmp_path):
    assert matches("208.4", 208.43) and matches("-26.07", -26.0733) and matches("0.149", 0.14949)
    assert not matches("208.4", 208.46) and not matches("9.4", 9.34) and not matches("-26.07", 26.07)
    (tmp_path / "r.json").write_text(json.dumps(
        {"runs": {"a": {"0": {"test/fid": 200.0}, "1": {"test/fid": 210.0}}}, "meta": {"real_fid": 20.5}}))
    entry = {"doc": "d.md", "quote": "FID 205.0 ± 7.1 over 2 seeds, 10.0× the floor", "file": "r.json",
             "given": [2], "figures": {"205.0": 'mean(at("runs/a/*/test/fid"))', "7.1": 'sd(at("runs/a/*/test/fid"))',
                                       "10.0": 'mean(at("runs/a/*/test/fid")) / at("meta/real_fid")'}}
    doc = "# Results\n\nThe arm: FID 205.0 ± 7.1 over\n2 seeds, **10.0×** the floor.\n"
    assert problems(entry, doc, tmp_path) == []  # line breaks and emphasis do not matter
    assert problems(entry, doc.replace("205.0", "206.0"), tmp_path)[0].startswith("d.md no longer says")
    wrong = dict(entry, quote="FID 206.0 ± 7.1 over 2 seeds, 10.0× the floor",
                 figures=dict(entry["figures"], **{"206.0": entry["figures"]["205.0"]}))
    del wrong["figures"]["205.0"]
    assert problems(wrong, doc.replace("205.0", "206.0"), tmp_path) == [
        'd.md prints 206.0; r.json: mean(at("runs/a/*/test/fid")) = 205.0']
    unindexed = dict(entry, given=[])
    assert problems(unindexed, doc, tmp_path) == [
        f"d.md prints 2 in {entry['quote']!r}, which docs/figures.yaml neither indexes nor gives"]
    with pytest.raises(KeyError, match="no key 'fid'"):
        evaluate('at("runs/a/0/fid")', "r.json", None, tmp_path)
    assert math.isclose(NAMESPACE["sd"]([1.0, 3.0]), 2 ** 0.5) and NAMESPACE["pct"](0.5) == 50.0
    assert problems({"doc": "d.md", "quote": "the floor", "committed": False}, doc, tmp_path) == [
        "'the floor' is indexed as uncommitted but does not say so"]


def test_the_index_covers_both_docs_and_names_committed_files_only():
    covered = [e for e in ENTRIES if e.get("committed") is not False]
    assert {e["doc"] for e in covered} == {"README.md", "docs/results.md"}
    assert all((RESULTS / e["file"]).is_file() for e in covered)
    assert sum(len(e["figures"]) for e in covered) >= 300
