"""``callbacks=early_stopping``: Lightning's ``EarlyStopping``, exact across a kill and a resume.

Lightning's callback does the job while a run lives; two of its states are lost when a run is killed and resumed
from ``checkpoints/last.ckpt`` (``src/callbacks/checkpoint.py``), which is why this subclass exists:

- **The check after an epoch's validation.** With validation at every epoch's end the check runs in
  ``on_train_epoch_end``, after the validation; ``last.ckpt`` is saved at the end of that validation, before the
  check. A run resumed from it re-runs the epoch's end, but the validation's metrics are gone
  (``trainer.callback_metrics`` starts empty): Lightning's check raises ("Early stopping conditioned on metric …
  which is not available"; measured on a Table 3 run killed during its test) or, not strict, skips the check and
  the run trains an epoch the uninterrupted run did not. Here the monitored value of each validation is kept in
  the callback's state until its check has used it, and a resumed check reads it from there.
- **A run that has stopped.** ``trainer.should_stop`` is not in Lightning's checkpoint: a run resumed from a state
  saved after the stop (the check in ``on_validation_end``, validation inside an epoch) would train on. Here a
  restored stop stops the resumed run before its first step, so it goes straight to its test.

Both keep the resumed run's steps, best checkpoint and test equal to the uninterrupted run's
(tests/test_early_stopping.py kills runs at both places).
"""

from __future__ import annotations

import logging

import lightning.pytorch as L
import torch
from lightning.pytorch.callbacks import EarlyStopping
from lightning.pytorch.callbacks.early_stopping import EarlyStoppingReason

log = logging.getLogger(__name__)


class ResumableEarlyStopping(EarlyStopping):
    """``lightning.pytorch.callbacks.EarlyStopping`` (same arguments) whose resume is exact (module docstring)."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self._unchecked: float | None = None  # the monitored value of a validation whose check has not run yet
        self._legacy = False  # restored from a checkpoint without that value (Lightning's own EarlyStopping)

    def on_validation_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if self._check_on_train_epoch_end and not self._should_skip_check(trainer):
            value = trainer.callback_metrics.get(self.monitor)
            self._unchecked = None if value is None else float(value)
        super().on_validation_end(trainer, pl_module)

    def on_train_epoch_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if not self._check_on_train_epoch_end or self._should_skip_check(trainer):
            return
        metrics = trainer.callback_metrics
        restored = self.monitor not in metrics and self._unchecked is not None
        if self.monitor not in metrics and self._unchecked is None and self._legacy and self.strict:
            raise RuntimeError(
                f"early stopping: this run resumed between a validation and its early-stopping check from a "
                f"checkpoint written before deqsm kept the validated {self.monitor} in it, so the check cannot "
                f"run. Resume with callbacks.early_stopping.strict=false to skip that one check (the run may then "
                f"train one epoch more than an uninterrupted run), or start the run anew")
        if restored:  # resumed between the validation and its check: the value the killed run would have used
            metrics[self.monitor] = torch.tensor(self._unchecked)
        try:
            super().on_train_epoch_end(trainer, pl_module)
        finally:
            self._unchecked = None
            if restored:
                metrics.pop(self.monitor, None)

    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if self.stopping_reason != EarlyStoppingReason.NOT_STOPPED and not trainer.should_stop:
            log.info("early stopping: this run stopped at epoch %d (%s); the resumed run trains no further",
                     self.stopped_epoch, self.stopping_reason_message or self.stopping_reason.value)
            trainer.should_stop = True

    def state_dict(self) -> dict:
        return {**super().state_dict(), "unchecked": self._unchecked}

    def load_state_dict(self, state_dict: dict) -> None:
        super().load_state_dict(state_dict)
        self._unchecked = state_dict.get("unchecked")  # absent in a checkpoint of Lightning's own callback
        self._legacy = "unchecked" not in state_dict

    @property
    def state_key(self) -> str:
        """Lightning's own key (``EarlyStopping{…}``), so a checkpoint written with ``EarlyStopping`` resumes here."""
        return f"EarlyStopping{ {'monitor': self.monitor, 'mode': self.mode}!r}"
