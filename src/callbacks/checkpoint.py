"""``checkpoints/last.ckpt``: the newest state of a run, for resuming it exactly (docs/usage.md, "Resume and checkpoints").

One callback owns ``last.ckpt`` (``callbacks.last_checkpoint``). It saves the run's state

- every ``every_n_train_steps`` optimiser steps (null: never mid-epoch), keeping each of those states as
  ``step_XXXXXXX.ckpt`` too when ``keep_steps`` is true; when a validation runs right after that step, the
  state is saved after it (Lightning, resuming from a state saved before, would skip that validation);
- at the end of every training epoch (after its last batch, or after the validation that follows it) and when
  training ends.

Every checkpoint the run writes — a step file, the best ``epoch_*.ckpt`` of ``model_checkpoint``, the files of
another ``ModelCheckpoint`` in another folder — is written *as* ``last.ckpt``: :class:`~src.runtime.checkpoints.AtomicCheckpointIO` writes ``last.ckpt`` atomically
first and gives the other file the same content under its own name (a hard link), so a kill at any moment leaves
``last.ckpt`` at the newest state saved, never behind a step file, and there is never a ``last-v1.ckpt``.
Lightning runs checkpoint callbacks after all others, so the EMA average of a step is updated before it is
saved. When a run starts or resumes in the folder, unfinished ``.*.ckpt.*.tmp`` files of a run killed while
saving are removed.
"""

from __future__ import annotations

from pathlib import Path

import lightning.pytorch as L
from lightning.pytorch.callbacks import Checkpoint
from lightning.pytorch.trainer.states import TrainerFn

from src.runtime.checkpoints import AtomicCheckpointIO, remove_stale_temporaries

LAST = "last.ckpt"


class LastCheckpoint(Checkpoint):
    def __init__(self, dirpath: str, every_n_train_steps: int | None = None, keep_steps: bool = False):
        if every_n_train_steps is not None and (isinstance(every_n_train_steps, bool)
                                                or int(every_n_train_steps) < 1):
            raise ValueError(f"last_checkpoint every_n_train_steps={every_n_train_steps!r} is invalid: an integer "
                             ">= 1, or null for epoch ends only")
        self.dirpath = str(dirpath)
        self.every_n_train_steps = None if every_n_train_steps is None else int(every_n_train_steps)
        self.keep_steps = bool(keep_steps)
        self.last_model_path = str(Path(self.dirpath) / LAST)
        self._saved_step: int | None = None
        self._pending: str | None = None  # a step checkpoint deferred to the end of the validation after it

    def setup(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        if stage != "fit":
            return
        io = trainer.strategy.checkpoint_io
        if not isinstance(io, AtomicCheckpointIO):
            raise TypeError("LastCheckpoint needs src.runtime.checkpoints.AtomicCheckpointIO as the trainer's checkpoint IO "
                            "(plugins=[AtomicCheckpointIO()]), which writes every checkpoint as last.ckpt first")
        io.last_path = Path(self.last_model_path)
        if trainer.is_global_zero:
            remove_stale_temporaries(self.dirpath)

    def _active(self, trainer: L.Trainer) -> bool:
        return not trainer.fast_dev_run and not trainer.sanity_checking and trainer.state.fn == TrainerFn.FITTING

    def _save(self, trainer: L.Trainer, name: str = LAST) -> None:
        # every rank (collective); rank 0 writes. The whole state (weights_only=False here means "not only the
        # weights" in Lightning's save_checkpoint, nothing about loading)
        trainer.save_checkpoint(str(Path(self.dirpath) / name), weights_only=False)
        self._saved_step = trainer.global_step

    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self._saved_step = trainer.global_step  # 0, or the resumed checkpoint's step

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        n = self.every_n_train_steps
        step = trainer.global_step
        # a crossed multiple of n, not step % n == 0: a manual-optimisation family may take several steps a batch
        step_due = bool(n) and step // n != (self._saved_step or 0) // n
        # the epoch's end is saved here (or after its validation), not at on_train_epoch_end: Lightning resumes a
        # state saved there with the finished epoch's batch count (measured: the next epoch then ran 1 of 2 batches)
        epoch_end = bool(trainer.fit_loop.epoch_loop.batch_progress.is_last_batch)
        if not (step_due or epoch_end) or not self._active(trainer):
            return
        name = f"step_{step:07d}.ckpt" if step_due and self.keep_steps else LAST
        if self._validation_follows(trainer):
            # Lightning, resuming from a state saved here, would count the validation due after this batch as
            # done and skip it (a different best checkpoint, other test metrics): save once it has run
            self._pending, self._saved_step = name, step
            return
        self._save(trainer, name)

    @staticmethod
    def _validation_follows(trainer: L.Trainer) -> bool:
        loop = trainer.fit_loop.epoch_loop
        try:  # Lightning's own decision, made right after this hook (private API: without it, save now)
            return bool(loop._should_check_val_fx(trainer.fit_loop._data_fetcher))
        except AttributeError:  # pragma: no cover
            return False

    def on_validation_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if self._pending is not None and self._active(trainer):
            name, self._pending = self._pending, None
            self._save(trainer, name)

    def on_train_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if self._active(trainer) and self._saved_step != trainer.global_step:
            self._save(trainer)
