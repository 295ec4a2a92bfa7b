"""Plain training progress lines for logs (``nohup``, SLURM, submitit, ``> run.log``).

Lightning's progress bar redraws one terminal line; written to a file it shows nothing useful until the run
ends. When stdout is not a terminal, :class:`LogProgress` logs instead, on global rank 0, one line every
``every_n_steps`` optimiser steps and/or every ``every_s`` seconds (whichever comes first), and after the first step, e.g.

    epoch 2 step 1200/5000 (24 %): loss 1.2345, 0.081 s/step, ETA 5 min 08 s

plus, for a validation, one line when it starts (its batch count) and, if it takes longer than ``every_s``,
a line every ``every_s`` seconds with the batches done (a NICE validation computes the exact SM loss at
D = 784: minutes on a CPU), then one line with the logged ``val/`` scalars; and one at the end of training.
``when``: ``auto`` (only when stdout is not a terminal), ``always``, or ``never`` (silent). The long
evaluation phases (Langevin, AIS, FID, test points) log their own lines in that case: :mod:`src.runtime.progress`.
"""

from __future__ import annotations

import logging
import math
import sys
import time

import lightning.pytorch as L
import torch
from lightning.pytorch.callbacks import Callback

log = logging.getLogger(__name__)

_WHEN = ("auto", "always", "never")


def format_duration(seconds: float) -> str:
    """``75.3`` -> ``1 min 15 s``; ``4000`` -> ``1 h 06 min``; under a minute to a tenth of a second."""
    if not math.isfinite(seconds):
        return "?"
    if seconds < 60:
        return f"{seconds:.1f} s"
    minutes, secs = divmod(round(seconds), 60)
    if minutes < 60:
        return f"{minutes} min {secs:02d} s"
    hours, minutes = divmod(minutes, 60)
    return f"{hours} h {minutes:02d} min"


def _scalar(value) -> float | None:
    if torch.is_tensor(value) and value.numel() == 1:
        return float(value.detach())
    if isinstance(value, (int, float)):
        return float(value)
    return None


class LogProgress(Callback):
    """Training progress as plain log lines when stdout is not a terminal (see the module docstring)."""

    def __init__(self, every_n_steps: int | None = None, every_s: float | None = 30.0, when: str = "auto"):
        if when not in _WHEN:
            raise ValueError(f"callbacks.log_progress.when={when!r} is invalid: use one of {', '.join(_WHEN)}")
        for name, value in (("every_n_steps", every_n_steps), ("every_s", every_s)):
            if value is not None and value <= 0:
                raise ValueError(f"callbacks.log_progress.{name}={value} must be > 0 (or null: not by {name})")
        self.every_n_steps, self.every_s, self.when = every_n_steps, every_s, when
        self._t0 = self._t_last = 0.0
        self._step0 = self._step_last = 0
        self._total: int | None = None
        self._val_t0 = self._val_last = 0.0
        self._val_total: int | None = None
        self._val_done = 0

    def active(self, trainer: L.Trainer) -> bool:
        if self.when == "never" or not trainer.is_global_zero:
            return False
        if self.every_n_steps is None and self.every_s is None:
            return False
        return self.when == "always" or not sys.stdout.isatty()

    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self._t0 = self._t_last = time.monotonic()
        self._step0 = self._step_last = trainer.global_step
        total = trainer.max_steps if trainer.max_steps and trainer.max_steps > 0 else None
        if total is None:
            estimated = trainer.estimated_stepping_batches
            total = int(estimated) if math.isfinite(estimated) else None
        self._total = total
        if self.active(trainer):
            log.info("training: from step %d%s", trainer.global_step,
                     f" to {total}" if total is not None else "")

    def _loss(self, trainer: L.Trainer, outputs) -> float | None:
        if isinstance(outputs, dict):
            outputs = outputs.get("loss")
        value = _scalar(outputs)
        if value is not None:
            return value
        for key, metric in trainer.callback_metrics.items():  # manual optimisation: the logged train loss
            if key.startswith("train/") and "loss" in key and (value := _scalar(metric)) is not None:
                return value
        return None

    def on_train_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule, outputs, batch,
                           batch_idx: int) -> None:
        if not self.active(trainer):
            return
        step, now = trainer.global_step, time.monotonic()
        due_steps = self.every_n_steps is not None and step != self._step_last and step % self.every_n_steps == 0
        due_time = self.every_s is not None and now - self._t_last >= self.every_s
        first = step == self._step0 + 1  # the first step: the run is going, and a first ETA
        if not (due_steps or due_time or first) or step == self._step0:
            return
        s_per_step = (now - self._t0) / (step - self._step0)
        where = f"step {step}"
        eta = ""
        if self._total is not None:
            where += f"/{self._total} ({100 * step // max(self._total, 1)} %)"
            eta = f", ETA {format_duration(s_per_step * max(self._total - step, 0))}"
        loss = self._loss(trainer, outputs)
        loss_text = f"loss {loss:.6g}, " if loss is not None else ""
        log.info("epoch %d %s: %s%.3g s/step%s", trainer.current_epoch, where, loss_text, s_per_step, eta)
        self._t_last, self._step_last = now, step

    def on_validation_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if trainer.sanity_checking or not self.active(trainer):
            return
        batches = getattr(trainer, "num_val_batches", None) or [None]
        total = sum(int(b) for b in batches if b is not None and math.isfinite(b)) or None
        self._val_t0 = self._val_last = time.monotonic()
        self._val_total, self._val_done = total, 0
        log.info("validation at step %d: %s", trainer.global_step,
                 f"{total} batches" if total is not None else "started")

    def on_validation_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule, outputs, batch,
                                batch_idx: int, dataloader_idx: int = 0) -> None:
        if trainer.sanity_checking or not self.active(trainer) or self.every_s is None:
            return
        self._val_done += 1
        now = time.monotonic()
        if now - self._val_last >= self.every_s:
            of = f"/{self._val_total}" if self._val_total else ""
            log.info("validation at step %d: batch %d%s, %s", trainer.global_step, self._val_done, of,
                     format_duration(now - self._val_t0))
            self._val_last = now

    def on_validation_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if trainer.sanity_checking or not self.active(trainer):
            return
        values = {k: v for k, m in trainer.callback_metrics.items()
                  if k.startswith("val/") and k.count("/") == 1 and (v := _scalar(m)) is not None}
        shown = ", ".join(f"{k} {v:.6g}" for k, v in sorted(values.items())[:6])
        log.info("validation at epoch %d step %d: %s", trainer.current_epoch, trainer.global_step,
                 shown or "(no val/ scalars)")

    def on_train_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if not self.active(trainer):
            return
        steps = trainer.global_step - self._step0
        log.info("training done: %d steps in %s", steps, format_duration(time.monotonic() - self._t0))
