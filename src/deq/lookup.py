"""Find the DEQ blocks of any module: the one finder every caller uses (monitor, resume, memory estimate,
profiling, the supervised studies)."""

from __future__ import annotations

from torch import nn

from src.deq.block import DEQBlock


def blocks_of(module: nn.Module) -> list[tuple[str, DEQBlock]]:
    """``[(qualified name, block)]`` of every :class:`~src.deq.block.DEQBlock` inside ``module`` (itself
    included), in ``named_modules`` order; empty for an explicit network."""
    return [(name, m) for name, m in module.named_modules() if isinstance(m, DEQBlock)]
