"""One training step as a training run takes it, outside a ``Trainer``, and what it costs.

:func:`trainer_free` and :func:`training_step` run a LightningModule's *own* ``training_step`` with its *own*
configured optimisers (Lightning Fabric), so a memory benchmark measures the step a training run takes, not a copy
of it; :func:`measured` gives the wall time, the bytes autograd saves for backward and the CUDA peak of one call;
:func:`device_name` names the device.
"""

from __future__ import annotations

import platform
import time
from collections.abc import Callable


def trainer_free(module, device: str = "cpu"):
    """``module`` (a LightningModule) set up to run its own ``training_step`` without a ``Trainer``: moved to
    ``device``, its ``configure_optimizers()`` set up with Lightning Fabric (so ``self.optimizers()``,
    ``manual_backward`` and ``self.log`` work as in training; nothing is logged). Returns the optimisers."""
    from lightning.fabric import Fabric

    accelerator = "cuda" if str(device).startswith("cuda") else "cpu"
    fabric = Fabric(accelerator=accelerator, devices=1, loggers=[])
    optimizers = module.configure_optimizers()
    optimizers = optimizers if isinstance(optimizers, (list, tuple)) else [optimizers]
    _, *optimizers = fabric.setup(module, *optimizers)
    return optimizers


def training_step(module, batch, optimizers, batch_idx: int = 0):
    """One training step of a module prepared by :func:`trainer_free`, as the Trainer takes it: with manual
    optimisation the module's ``training_step`` updates itself; with automatic optimisation its returned loss
    is backpropagated and every optimiser steps (Lightning's loop: zero_grad, training_step, backward, step)."""
    if not module.automatic_optimization:
        return module.training_step(batch, batch_idx)
    for opt in optimizers:
        opt.zero_grad(set_to_none=True)
    loss = module.training_step(batch, batch_idx)
    module.manual_backward(loss)
    for opt in optimizers:
        opt.step()
    return loss


def _sync(device: str) -> None:
    import torch

    if str(device).startswith("cuda"):
        torch.cuda.synchronize()


def measured(fn: Callable[[], object], device: str = "cpu") -> dict:
    """Call ``fn()`` once; return ``{"result", "seconds" (CUDA-synchronised wall time), "saved_bytes" (bytes
    of the distinct storages autograd saves for backward during the call), "peak_cuda_bytes" (on a GPU:
    ``torch.cuda.max_memory_allocated`` with the peak reset before the call; else None)}``."""
    import torch

    from src.callbacks.profiling import SavedTensorsMeter

    cuda = str(device).startswith("cuda")
    _sync(device)
    if cuda:
        torch.cuda.reset_peak_memory_stats(device)
    t0 = time.perf_counter()
    with SavedTensorsMeter() as meter:
        result = fn()
    _sync(device)
    seconds = time.perf_counter() - t0
    return {"result": result, "seconds": seconds, "saved_bytes": meter.bytes,
            "peak_cuda_bytes": torch.cuda.max_memory_allocated(device) if cuda else None}


def device_name(device: str) -> str:
    """The GPU's name for a CUDA device, else the CPU's (``platform.processor()``, or ``"cpu"``)."""
    import torch

    if str(device).startswith("cuda"):
        return torch.cuda.get_device_name()
    return platform.processor() or "cpu"


