"""Switch a trained model's DEQ blocks between backward modes (paper §3.3 and App. C): the phantom gradient with
K steps, or exact implicit differentiation (eqs. 8–9), to measure one against the other on the same weights."""

from __future__ import annotations

import torch


def deq_blocks(model: torch.nn.Module) -> list:
    """Every :class:`src.deq.block.DEQBlock` in ``model``."""
    from src.deq.block import DEQBlock

    return [m for m in model.modules() if isinstance(m, DEQBlock)]


def set_backward(model: torch.nn.Module, backward: str, k: int | None = None) -> None:
    """Every DEQ block of ``model`` differentiates with ``backward`` (``"phantom"`` or ``"implicit"``); with
    ``k``, the phantom gradient takes K = ``k`` steps."""
    for block in deq_blocks(model):
        block.config.backward = backward
        if k is not None:
            block.config.phantom_steps = k
