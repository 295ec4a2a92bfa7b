"""Recompute the test metrics of a finished run from a checkpoint.

    python -m src.evaluate ckpt_path=outputs/train/runs/<time>/checkpoints/last.ckpt [trust_checkpoint=true]

The run's composed config is read from ``<run dir>/.hydra/config.yaml`` (the checkpoint's run directory);
any further ``key=value`` arguments override it (e.g. ``data.root=...``). The metrics are printed and
written to ``<run dir>/eval_metrics.json`` (the run's own metrics.json is never touched). The checkpoint loads
weights-only (:mod:`src.runtime.checkpoints`); ``trust_checkpoint=true`` loads one holding other pickled objects (only
a file you trust). A checkpoint of another family or other sizes is refused in one line naming both.
"""

from __future__ import annotations

import sys

from src.runs.errors import report_errors
from src.runs.evaluation import evaluate
from src.runs.load import parse_trust, split_arguments

_OWN_KEYS = ("ckpt_path", "trust_checkpoint")


def main(argv: list[str] | None = None) -> None:
    own, overrides = split_arguments(list(sys.argv[1:] if argv is None else argv), _OWN_KEYS)
    if "ckpt_path" not in own:
        raise SystemExit("usage: python -m src.evaluate ckpt_path=<run dir>/checkpoints/last.ckpt "
                         "[trust_checkpoint=true] [key=value ...]")
    evaluate(own["ckpt_path"], overrides, trust=parse_trust(own.get("trust_checkpoint", "false")))


if __name__ == "__main__":
    report_errors(main)  # the project's own errors as one line (HYDRA_FULL_ERROR=1: the traceback)
