"""The cost of one training step of a family's models: bytes saved for backward, time, parameters (and on a GPU
the CUDA peak), DEQ against the explicit networks the paper compares it with.

    python -m benchmarks.tools.step_cost dkef [--device cuda] [--setting reference]   # Tables 2-3's headline
    python -m benchmarks.tools.step_cost ncsn [--settings table5] [--rounds 2]        # Table 5, the authors' code
    python -m benchmarks.tools.step_cost vae [--batch 128 --device cuda]              # Table 1
    python -m benchmarks.tools.step_cost FAMILY --render     # run nothing: the markdown again from the JSON

One family a call; ``python -m benchmarks.tools.step_cost FAMILY --help`` lists its options and says what one
step is. Each family writes ``benchmarks/results/<stem>.json`` and ``.md`` (``dkef_memory``, ``ncsn_memory``,
``vae_memory``; the dkef and ncsn results are merged by device and setting). The step is the module's own
``training_step`` (:mod:`benchmarks.lib.step`), the modules those of :mod:`benchmarks.lib.step_cases` and
:mod:`benchmarks.lib.step_cost`.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from benchmarks.lib.results import RESULTS, rerender, script_command
from benchmarks.lib.step_cost import dkef, ncsn, vae

FAMILIES = {"dkef": dkef, "ncsn": ncsn, "vae": vae}
MODULE = "benchmarks.tools.step_cost"


def parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    families = ap.add_subparsers(dest="family", required=True, metavar="FAMILY")
    for name, family in FAMILIES.items():
        sub = families.add_parser(name, description=family.__doc__,
                                  formatter_class=argparse.RawDescriptionHelpFormatter)
        sub.add_argument("--device", default="cpu")
        sub.add_argument("--threads", type=int, default=1, help="CPU threads (speed-ups are measured on one)")
        sub.add_argument("--out", type=Path, default=RESULTS, help="results folder")
        sub.add_argument("--render", action="store_true", help="run nothing: rebuild the markdown from the JSON")
        family.options(sub)
    return ap


def main(argv: list[str] | None = None):
    argv = sys.argv[1:] if argv is None else list(argv)
    args = parser().parse_args(argv)
    family = FAMILIES[args.family]
    if args.render:
        return rerender(args.out, family.STEM, family.render)
    args.command = script_command(MODULE, argv)
    return family.run(args)


if __name__ == "__main__":
    main()
