"""Validation leaves the training RNG where it found it.

Whether (and how often) validation runs must not change the training that follows: a validation metric or
diagnostic that draws from the global RNG (a projection, a loader's base seed, NCSN's contraction check through
``split_tensor``) would otherwise shift every later noise draw, so a resumed run (no sanity check) or a run
validating at another interval would train on other noise. :class:`EvaluationRngGuard` captures the Python,
numpy, torch (and CUDA) RNG states as validation starts during ``fit`` (the sanity check included) and restores
them as it ends — before the checkpoint callbacks save at ``on_validation_end`` (Lightning runs checkpoint
callbacks last), so a checkpoint written after validation holds the training RNG. Every
:class:`~src.lit.base.DeqsmModule` adds it (``configure_callbacks``).
"""

from __future__ import annotations

import lightning.pytorch as L
from lightning.pytorch.trainer.states import TrainerFn


class EvaluationRngGuard(L.Callback):
    def __init__(self):
        self._saved: dict | None = None

    def on_validation_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        from src.lit.base import capture_rng_states

        self._saved = capture_rng_states() if trainer.state.fn == TrainerFn.FITTING else None

    def on_validation_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        from src.lit.base import restore_rng_states

        if self._saved is not None:
            restore_rng_states(self._saved)
            self._saved = None
