"""What an entry point does around a run (``src.train``, ``src.evaluate``, ``src.sample``): set the run's float
environment first, print the metrics table last."""

from __future__ import annotations

import logging
import os
from collections.abc import Mapping
from typing import Any

import torch

log = logging.getLogger(__name__)


def set_float_environment(cfg: Mapping) -> None:
    """Process-wide float settings of a run: ``flush_denormal`` (conf/train.yaml says why). Called first thing
    in a run: the CPU flag is per thread, and the intra-op thread pool inherits it only if it is created after
    (measured: set after a 2-thread op had built the pool, half the results stayed subnormal)."""
    flush = bool(cfg.get("flush_denormal", True))
    if not torch.set_flush_denormal(flush) and flush:
        log.warning("flush_denormal=true is not supported by this CPU (needs SSE3); subnormal floats stay slow")


def print_metrics(metrics: Mapping[str, Any], where: str | os.PathLike) -> None:
    """The numeric entries of ``metrics`` as a table (Rich), titled with the file they were written to."""
    rows = [(k, v) for k, v in metrics.items() if isinstance(v, (int, float)) and not isinstance(v, bool)]
    try:
        from rich.console import Console
        from rich.table import Table
    except ImportError:  # pragma: no cover
        for k, v in sorted(rows):
            print(f"{k}: {v}")
        return
    table = Table(title=f"metrics ({where})")
    table.add_column("metric")
    table.add_column("value", justify="right")
    for k, v in sorted(rows):
        table.add_row(k, f"{v:.6g}" if isinstance(v, float) else str(v))
    Console().print(table)
