"""Find the DEQ blocks of any module: the one finder every caller uses (monitor, resume, memory estimate,
profiling, the supervised studies), and the record of their forwards (:func:`forward_infos`)."""

from __future__ import annotations

from contextlib import contextmanager

from torch import nn

from src.deq.block import DEQBlock


def blocks_of(module: nn.Module) -> list[tuple[str, DEQBlock]]:
    """``[(qualified name, block)]`` of every :class:`~src.deq.block.DEQBlock` inside ``module`` (itself
    included), in ``named_modules`` order; empty for an explicit network."""
    return [(name, m) for name, m in module.named_modules() if isinstance(m, DEQBlock)]


@contextmanager
def forward_infos(module: nn.Module):
    """Within the block, the info record (:class:`src.deq.core.EquilibriumInfo`) of every DEQ block forward
    inside ``module``, in call order, as ``[(block name, info)]`` — the list this yields, filled as the forwards
    run (by forward hooks on the blocks, removed on exit; the blocks keep nothing for it). A LightningModule
    wraps its training objective in it to collect each forward's Jacobian penalty or correction states."""
    infos: list = []
    handles = [block.register_forward_hook(lambda b, args, out, name=name: infos.append((name, b.last_info)))
               for name, block in blocks_of(module)]
    try:
        yield infos
    finally:
        for handle in handles:
            handle.remove()
