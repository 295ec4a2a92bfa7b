"""Switch a trained model's DEQ blocks between backward modes (paper §3.3 and App. C): the phantom gradient with
K steps, or exact implicit differentiation (eqs. 8–9), to measure one against the other on the same weights."""

from __future__ import annotations

import torch

from src.deq.lookup import blocks_of


def set_backward(model: torch.nn.Module, backward: str, k: int | None = None) -> None:
    """Every DEQ block of ``model`` differentiates with ``backward`` (``"phantom"`` or ``"implicit"``); with
    ``k``, the phantom gradient takes K = ``k`` steps."""
    for _, block in blocks_of(model):
        block.config.backward = backward
        if k is not None:
            block.config.phantom_steps = k
