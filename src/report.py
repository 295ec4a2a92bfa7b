"""Turn sweeps into a table and figures, the way the paper's tables read.

    python -m src.report outputs/train/multiruns/<time> [more sweep dirs ...] [--out DIR]

Every ``metrics.json`` under the given directories is one job. Jobs are grouped by the overrides that vary
between them (read from each job's ``.hydra/overrides.yaml``), seeds excluded; each group gets mean ± std
over its seeds. Writes ``report.md`` (markdown table), ``report.json`` and two PNG plots — memory (bytes
saved for backward per step) against depth, and test SM loss against training wall time — into ``--out``
(default: the first directory).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from src.reports.sweeps import load_jobs, plot, summarise_jobs, to_markdown


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("dirs", nargs="+", type=Path, help="sweep (multirun) directories")
    parser.add_argument("--out", type=Path, default=None, help="where to write report.md/json and plots")
    args = parser.parse_args(argv)
    out = args.out or args.dirs[0]
    out.mkdir(parents=True, exist_ok=True)
    jobs = load_jobs(args.dirs)
    report = summarise_jobs(jobs, args.dirs)
    md = to_markdown(report)
    (out / "report.md").write_text(md)
    (out / "report.json").write_text(json.dumps(report, indent=2))
    plots = plot(jobs, out)
    print(md)
    print(f"wrote {out / 'report.md'}, {out / 'report.json'}, " + ", ".join(str(p) for p in plots))
    return report


if __name__ == "__main__":
    main()
