"""Samples of a trained generative model from any of its checkpoints (what ``python -m src.sample`` runs):
a PNG grid and the ``[n, C, H, W]`` tensor in [0, 1] beside it."""

from __future__ import annotations

from pathlib import Path

import torch

from src.runs.load import load_module
from src.sampling.grids import save_image_grid


def sample_from_checkpoint(ckpt_path: str | Path, n: int = 64, seed: int = 0, out: str | Path | None = None,
                           overrides: list[str] | None = None, trust: bool = False) -> Path:
    """Samples of the model in ``ckpt_path``: returns the PNG path (the ``.pt`` tensor lies beside it)."""
    if int(n) < 1:
        raise ValueError(f"n={n}: ask for at least one sample")
    model, datamodule, _, run_dir = load_module(ckpt_path, overrides, trust=trust)
    images = model.sample_pixels(int(n), seed=int(seed))
    if images is None:
        raise ValueError(f"{type(model).__name__} does not generate samples (or {type(datamodule).__name__} "
                         "holds no images)")
    path = Path(out) if out is not None else run_dir / f"samples_{Path(ckpt_path).stem}.png"
    save_image_grid(images, path)
    torch.save(images, path.with_suffix(".pt"))
    print(f"{images.shape[0]} samples -> {path} (+ {path.with_suffix('.pt').name})")
    return path
