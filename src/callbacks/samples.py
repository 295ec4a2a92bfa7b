"""Sample grids during training: a Lightning callback over the grid writer of :mod:`src.sampling.grids`.

:class:`SampleGridCallback` turns a generative module's ``sample_pixels(n)`` into
``<default_root_dir>/samples/step_XXXXXXX.png`` every ``every_n_steps`` optimiser steps and
``<default_root_dir>/samples.png`` at the end of ``fit``, and hands each file to the loggers
(:func:`src.sampling.grids.log_image`).
"""

from __future__ import annotations

from pathlib import Path

import lightning.pytorch as L
import torch

from src.runtime.rng import seeded_rng
from src.sampling.grids import log_image, save_image_grid


class SampleGridCallback(L.Callback):
    """Write (and log) a grid of ``pl_module.sample_pixels(n)`` during and at the end of ``fit``.

    - every ``every_n_steps`` optimiser steps (``None`` or 0: never): ``<default_root_dir>/samples/
      step_XXXXXXX.png`` (global step, 7 digits), logged under key ``samples``;
    - at the end of ``fit`` when ``at_end``: ``<default_root_dir>/samples.png``.

    Only global rank 0 samples and writes. The module is sampled in eval mode (its previous mode is
    restored) with the global RNGs forked and, when ``seed`` is not None, seeded with ``seed``: every grid
    uses the same noise, and training's random stream (hence a resumed run) is unaffected by sampling.
    A module without ``sample_pixels`` or returning ``None`` gets no file.
    """

    def __init__(self, every_n_steps: int | None = None, n: int = 64, at_end: bool = True,
                 nrow: int | None = None, seed: int | None = 0, log_key: str = "samples"):
        if every_n_steps is not None and every_n_steps < 0:
            raise ValueError(f"every_n_steps must be None or >= 0, got {every_n_steps}")
        if n < 1:
            raise ValueError(f"n must be >= 1, got {n}")
        self.every_n_steps = every_n_steps
        self.n = n
        self.at_end = at_end
        self.nrow = nrow
        self.seed = seed
        self.log_key = log_key
        self.written: list[Path] = []
        self._last_step = -1

    def _sample(self, pl_module: L.LightningModule) -> torch.Tensor | None:
        sample = getattr(pl_module, "sample_pixels", None)
        if sample is None:
            return None
        was_training = pl_module.training
        pl_module.eval()
        try:
            with seeded_rng(self.seed, pl_module.device):  # the grid repeats; the training RNG stays put
                images = sample(self.n)
        finally:
            pl_module.train(was_training)
        return None if images is None else images.detach().cpu()

    def write(self, trainer: L.Trainer, pl_module: L.LightningModule, path: Path) -> Path | None:
        """Sample, write the grid to ``path`` and log it (rank 0 only); returns the path or None."""
        if not trainer.is_global_zero:
            return None
        images = self._sample(pl_module)
        if images is None:
            return None
        save_image_grid(images, path, nrow=self.nrow)
        log_image(trainer, self.log_key, path)
        self.written.append(path)
        return path

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        step = trainer.global_step
        if not self.every_n_steps or step == 0 or step % self.every_n_steps or step == self._last_step:
            return
        self._last_step = step  # several batches share a step under gradient accumulation
        self.write(trainer, pl_module, Path(trainer.default_root_dir) / "samples" / f"step_{step:07d}.png")

    def on_fit_end(self, trainer, pl_module) -> None:
        if self.at_end:
            self.write(trainer, pl_module, Path(trainer.default_root_dir) / "samples.png")
