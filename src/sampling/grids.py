"""Sample images on disk and in the loggers: the PNG grid writer and the logger hand-off.

Every generative LightningModule offers ``sample_pixels(n) -> Tensor | None``: ``n`` samples as float images
[n, C, H, W] in [0, 1] on the CPU (C = 1 or 3), or ``None`` when the model does not generate.
:func:`save_image_grid` writes them as one PNG grid (atomically); :func:`log_image` hands a file to the loggers
(W&B's ``log_image``, TensorBoard's ``add_image``). Used at the end of a test (``samples.png``,
:class:`src.lit.base.DeqsmModule`), during training (:class:`src.callbacks.samples.SampleGridCallback`) and by
``src.sample`` (:mod:`src.runs.sampling`).
"""

from __future__ import annotations

import math
import os
from pathlib import Path

import lightning.pytorch as L
import numpy as np
import torch
from PIL import Image

from src.runtime.atomic import atomic_file


def _to_uint8(images: torch.Tensor) -> np.ndarray:
    """[B, C, H, W] floats in [0, 1] → uint8 floor(255·x + ½) (clamped, NaN → 0), as [B, H, W, C]."""
    x = torch.nan_to_num(images.detach().to("cpu", torch.float32), nan=0.0).clamp(0.0, 1.0)
    return x.mul(255.0).add(0.5).floor().to(torch.uint8).permute(0, 2, 3, 1).numpy()


def make_grid_array(images: torch.Tensor, nrow: int | None = None, padding: int = 2,
                    pad_value: float = 0.0) -> np.ndarray:
    """The grid as a uint8 array [H_grid, W_grid, C]: ``nrow`` images per row (default ⌈√B⌉), ``padding``
    pixels of ``pad_value`` around and between the images; empty cells of the last row are ``pad_value``.

    H_grid = rows·(H + padding) + padding, W_grid = nrow·(W + padding) + padding, rows = ⌈B / nrow⌉.
    """
    if not isinstance(images, torch.Tensor) or images.dim() != 4 or images.shape[1] not in (1, 3):
        shape = tuple(images.shape) if isinstance(images, torch.Tensor) else type(images).__name__
        raise ValueError(f"expected images [B, C, H, W] with C = 1 or 3, got {shape}")
    b, c, h, w = images.shape
    if b == 0:
        raise ValueError("no images to put in a grid")
    if padding < 0:
        raise ValueError(f"padding must be >= 0, got {padding}")
    ncol = min(b, nrow if nrow is not None else math.ceil(math.sqrt(b)))
    if ncol < 1:
        raise ValueError(f"nrow must be >= 1, got {nrow}")
    nrows = math.ceil(b / ncol)
    fill = math.floor(min(max(pad_value, 0.0), 1.0) * 255.0 + 0.5)
    grid = np.full((nrows * (h + padding) + padding, ncol * (w + padding) + padding, c), fill, np.uint8)
    for k, img in enumerate(_to_uint8(images)):
        r, q = divmod(k, ncol)
        top, left = padding + r * (h + padding), padding + q * (w + padding)
        grid[top : top + h, left : left + w] = img
    return grid


def save_image_grid(images: torch.Tensor, path: str | os.PathLike, nrow: int | None = None, padding: int = 2,
                    pad_value: float = 0.0) -> Path:
    """Write ``images`` ([B, C, H, W] floats in [0, 1], C = 1 grey or 3 RGB) as one grid image at ``path``.

    Layout as :func:`make_grid_array`; pixel values floor(255·x + ½) after clamping to [0, 1]. The format
    follows the suffix (PNG when it has none Pillow knows). The file is written to a temporary name in the
    same folder and renamed, so a reader never sees a half-written image. Returns the path.
    """
    grid = make_grid_array(images, nrow=nrow, padding=padding, pad_value=pad_value)
    img = Image.fromarray(grid[:, :, 0] if grid.shape[2] == 1 else grid)  # uint8 2-D → "L", [H, W, 3] → "RGB"
    path = Path(path)
    fmt = Image.registered_extensions().get(path.suffix.lower(), "PNG")
    with atomic_file(path) as fh:
        img.save(fh, format=fmt)
    return path


def log_image(trainer: L.Trainer, key: str, path: str | os.PathLike, step: int | None = None) -> int:
    """Send the image file at ``path`` to every logger of ``trainer`` that takes images.

    Loggers with ``log_image`` (W&B's ``WandbLogger``) get ``log_image(key=key, images=[path], step=step)``;
    loggers whose ``experiment`` has ``add_image`` (TensorBoard's ``SummaryWriter``) get the decoded image.
    Others (CSV) are skipped. ``step`` defaults to ``trainer.global_step``. Returns how many loggers took it.
    """
    step = trainer.global_step if step is None else step
    taken = 0
    array = None
    for lg in getattr(trainer, "loggers", None) or []:
        if hasattr(lg, "log_image"):
            lg.log_image(key=key, images=[str(path)], step=step)
            taken += 1
            continue
        experiment = getattr(lg, "experiment", None)
        if hasattr(experiment, "add_image"):
            if array is None:
                with Image.open(path) as im:
                    array = np.asarray(im.convert("L") if im.mode in ("L", "1", "I", "F") else im.convert("RGB"))
            experiment.add_image(key, array, global_step=step, dataformats="HW" if array.ndim == 2 else "HWC")
            taken += 1
    return taken
