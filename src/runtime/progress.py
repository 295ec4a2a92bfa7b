"""Progress of the long phases that are not training epochs: Langevin sampling, AIS, FID, exact-SM test points.

Lightning's progress bar counts batches; one test batch of an image model can hide minutes of work (annealed
Langevin dynamics runs L levels × T steps per sample batch, AIS T annealing steps per test batch, the exact SM
loss D backward passes per point). :func:`phase` shows such a phase as its own task:

    with phase(module, "Langevin sampling (levels × steps)", total=L * T) as advance:
        annealed_langevin(..., progress=advance)      # advance(1) per step

- inside the run's live Rich progress bar (Lightning's ``RichProgressBar``, the default ``callbacks=`` set) as
  an extra task, removed when the phase ends;
- otherwise (another progress bar, e.g. ``callbacks=minimal``'s default one) as a ``tqdm`` bar on stderr;
- as log lines (start, every tenth, end, with the time left) when stderr is not a terminal (log files);
- silent — ``advance`` does nothing — with ``trainer.enable_progress_bar=false``, on ranks other than 0, and
  outside a Trainer, unless ``force=True`` or inside :func:`outside_a_trainer` (scripts and benchmarks that call a
  module's sampler or metrics themselves).
"""

from __future__ import annotations

import contextlib
import logging
import sys
import time
from collections.abc import Callable, Iterator

Advance = Callable[[int], None]
log = logging.getLogger(__name__)


_shown_without_trainer = False  # set by outside_a_trainer()


def _noop(n: int = 1) -> None:
    return None


@contextlib.contextmanager
def outside_a_trainer() -> Iterator[None]:
    """Show the phases a script runs without a Trainer (a benchmark calling ``module.sample``): inside this block
    every :class:`Phase` shows as if ``force=True`` — bars on a terminal, log lines (made visible by
    :func:`ensure_log_lines`) in a log file."""
    global _shown_without_trainer
    ensure_log_lines()
    before, _shown_without_trainer = _shown_without_trainer, True
    try:
        yield
    finally:
        _shown_without_trainer = before


def ensure_log_lines() -> None:
    """Let this module's log lines through where nothing configured logging (``src.evaluate``, scripts calling
    :func:`src.runs.evaluation.evaluate`; ``src.train``'s Hydra logging already does): a stderr handler at INFO on
    this module's logger, once, unless the root logger has handlers of its own."""
    if log.handlers or logging.getLogger().handlers:
        return
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(logging.Formatter("[%(asctime)s][%(name)s][%(levelname)s] - %(message)s"))
    log.addHandler(handler)
    log.setLevel(logging.INFO)


def test_progress_bar():
    """The progress bar of a test-only Trainer (``src.evaluate``): Lightning's tqdm bar on a terminal; in a log file
    its per-batch bar is off (refresh rate 0) while the long phases still log their lines (:class:`Phase`)."""
    from lightning.pytorch.callbacks import TQDMProgressBar

    return TQDMProgressBar(refresh_rate=1 if _interactive() else 0)


def _interactive() -> bool:
    """Whether stderr is a terminal (bars), or a file (log lines)."""
    return sys.stderr.isatty()


def _trainer_of(owner):
    """The Trainer behind ``owner`` (a LightningModule or a Trainer), or None."""
    if owner is None:
        return None
    if hasattr(owner, "progress_bar_callback"):
        return owner
    return getattr(owner, "_trainer", None)


def enabled(owner) -> bool:
    """Whether ``owner``'s run shows progress: a Trainer with a progress bar, on global rank 0."""
    trainer = _trainer_of(owner)
    if trainer is None or getattr(trainer, "progress_bar_callback", None) is None:
        return False
    return bool(getattr(trainer, "is_global_zero", True))


def _live_rich_progress(trainer):
    """Lightning's live Rich progress (``RichProgressBar.progress`` while it is started), else None."""
    from lightning.pytorch.callbacks import RichProgressBar

    cb = trainer.progress_bar_callback if trainer is not None else None
    if not isinstance(cb, RichProgressBar) or cb.progress is None or getattr(cb, "_progress_stopped", True):
        return None
    return cb


class Phase:
    """One phase's progress display, opened at construction; ``advance(n)`` and ``close()`` (idempotent).
    For phases that span several calls (a metric's test batches); :func:`phase` wraps it for one block.
    When stderr is not a terminal (a log file, ``nohup``) a bar would print nothing useful: the phase logs a
    line at its start, at every tenth of its total and at its end instead, with the elapsed and remaining time."""

    def __init__(self, owner, description: str, total: int | None, force: bool = False):
        self._bar = self._task = self._tqdm = None
        self._log = False
        trainer = _trainer_of(owner)
        if not (force or enabled(trainer) or (trainer is None and _shown_without_trainer)):
            return
        total = None if total is None else int(total)
        self.description, self.total, self.done, self._t0, self._next = description, total, 0, time.monotonic(), 0.1
        if not _interactive():
            self._log = True
            log.info("%s: started (%s)", description, "?" if total is None else f"{total} in all")
            return
        self._bar = _live_rich_progress(trainer)
        if self._bar is not None:
            self._task = self._bar.progress.add_task(description, total=total)
            return
        from tqdm.auto import tqdm

        self._tqdm = tqdm(total=total, desc=description, leave=False, dynamic_ncols=True, mininterval=1.0)

    @property
    def active(self) -> bool:
        return self._task is not None or self._tqdm is not None or self._log

    def advance(self, n: int = 1) -> None:
        if self._task is not None:
            self._bar.progress.update(self._task, advance=n)
            self._bar.refresh()
        elif self._tqdm is not None:
            self._tqdm.update(n)
        elif self._log:
            self.done += n
            if self.total and self.done >= self._next * self.total and self.done < self.total:
                elapsed = time.monotonic() - self._t0
                left = elapsed * (self.total - self.done) / self.done
                log.info("%s: %d %% (%d/%d), %.0f s, about %.0f s left", self.description,
                         100 * self.done // self.total, self.done, self.total, elapsed, left)
                self._next = (10 * self.done // self.total + 1) / 10

    __call__ = advance

    def close(self) -> None:
        if self._task is not None:
            with contextlib.suppress(Exception):  # the bar may have been torn down by an exception
                self._bar.progress.remove_task(self._task)
        if self._tqdm is not None:
            self._tqdm.close()
        if self._log:
            log.info("%s: done (%d) in %.1f s", self.description, self.done, time.monotonic() - self._t0)
        self._bar = self._task = self._tqdm = None
        self._log = False


@contextlib.contextmanager
def phase(owner, description: str, total: int | None, force: bool = False) -> Iterator[Advance]:
    """Show ``description`` with ``total`` units while the block runs; yields ``advance(n)`` (see the module
    docstring; a no-op when the run shows no progress). ``force``: show it even without a Trainer."""
    p = Phase(owner, description, total, force=force)
    try:
        yield p.advance if p.active else _noop
    finally:
        p.close()
