"""The fault suite's table: case, what is checked, result — from the JSON ``tests/test_faults.py`` writes.

The suite itself is the slow test module (``make faults``: ``FAULTS_OUT=benchmarks/results python -m pytest -q -s
-m slow tests/test_faults.py``); it records its rows and machine facts in ``faults.json`` and renders the markdown
with :func:`render`, which this command runs again on the JSON alone:

    python -m benchmarks.tools.fault_table --render     # benchmarks/results/faults.md from faults.json
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from benchmarks.lib.results import RESULTS

STEM = "faults"


def table(rows: list[dict]) -> str:
    """The markdown table of the cases (the suite also prints it)."""
    lines = ["| case | what is checked | result | s |", "|---|---|---|---|"]
    for r in rows:
        result = r["result"] + (f" ({r['detail']})" if r.get("detail") else "")
        lines.append(f"| {r['case']} | {r['checked']} | {result} | {r['seconds']} |")
    return "\n".join(lines)


def render(data: dict) -> str:
    """``faults.md`` from ``{"meta": facts, "rows": [...]}``."""
    facts = data["meta"]
    head = (f"# Fault suite\n\nCommand: `make faults` (`FAULTS_OUT=benchmarks/results {facts['command']}`). "
            f"{facts['date_utc']} UTC, "
            f"Python {facts['python']}, torch {facts['torch']}, {facts['machine']}, {facts['cpus']} CPUs: "
            f"{facts['passed']} of {facts['cases']} cases pass.\n\n")
    return head + table(data["rows"]) + "\n"


def write(out: Path, data: dict) -> None:
    """``faults.json`` and ``faults.md`` in ``out``."""
    out.mkdir(parents=True, exist_ok=True)
    (out / f"{STEM}.json").write_text(json.dumps(data, indent=2) + "\n")
    (out / f"{STEM}.md").write_text(render(data))


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, default=RESULTS, help="results folder")
    ap.add_argument("--render", action="store_true", help="rebuild the markdown from the JSON (the only mode)")
    args = ap.parse_args(argv)
    if not args.render:
        raise SystemExit("the fault suite runs as `make faults`; this command only renders: add --render")
    data = json.loads((args.out / f"{STEM}.json").read_text())
    (args.out / f"{STEM}.md").write_text(render(data))


if __name__ == "__main__":
    main()
