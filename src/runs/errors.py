"""The entry points' one place for errors: the project's own messages as one line, not under a traceback.

deqsm refuses bad input with one clear, actionable line — a configuration value (``deq.max_iter=0``,
``deq.norm_lambda=0.5``: :mod:`src.deq.config`), a missing data file (:mod:`src.data`), a checkpoint of another
run (:mod:`src.runtime.checkpoints`, :mod:`src.runs.identity`). :func:`is_project_error` tells such an error from a
failure elsewhere: one of :data:`PROJECT_ERRORS` *raised in deqsm's own code* (the innermost frame of its
traceback is under ``src/``), so a ``ValueError`` raised inside torch keeps its traceback.

- ``src.train`` (a Hydra app) runs under :func:`one_line_errors`, which re-raises a project error as
  :class:`ProjectError`, a Hydra ``CompactHydraException``: Hydra prints it as the line
  ``<ErrorType>: <message>`` (after its own ``Error executing job with overrides: [...]``) and exits 1; with
  ``HYDRA_FULL_ERROR=1`` Hydra prints the whole traceback, the original error's included (chained).
- ``src.evaluate`` and ``src.sample`` (plain entry points) run under :func:`report_errors`: the same line on
  stderr and exit status 1; ``HYDRA_FULL_ERROR=1`` re-raises the error with its traceback, as Hydra does.
"""

from __future__ import annotations

import contextlib
import os
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TypeVar

from hydra.errors import CompactHydraException

from src.data.contract import DataContractError
from src.runtime.checkpoints import CheckpointError
from src.runtime.run_dir import RunDirInUse

SRC_DIR = Path(__file__).resolve().parents[1]  # the src/ package
# the error types deqsm raises for bad input (a value, a file, a checkpoint, a run directory in use, data that
# break the data contract) and for a run that diverged (non-finite loss or state: the message names what to try)
PROJECT_ERRORS = (ValueError, TypeError, FileNotFoundError, CheckpointError, RunDirInUse, DataContractError,
                  FloatingPointError)
FULL_ERROR_ENV = "HYDRA_FULL_ERROR"  # Hydra's own switch for the full traceback

T = TypeVar("T")


class ProjectError(CompactHydraException):
    """A project error as Hydra prints it: one line, ``<ErrorType>: <message>`` (the original is its cause)."""


def raised_in_project(exc: BaseException) -> bool:
    """Whether the innermost frame of ``exc``'s traceback is deqsm's own code (``src/``)."""
    tb = exc.__traceback__
    if tb is None:
        return False
    while tb.tb_next is not None:
        tb = tb.tb_next
    try:
        return Path(tb.tb_frame.f_code.co_filename).resolve().is_relative_to(SRC_DIR)
    except (OSError, ValueError):
        return False


def is_project_error(exc: BaseException) -> bool:
    """One of :data:`PROJECT_ERRORS`, raised by deqsm itself (module docstring)."""
    return isinstance(exc, PROJECT_ERRORS) and raised_in_project(exc)


def one_line(exc: BaseException) -> str:
    """``<ErrorType>: <message>`` of ``exc`` (its first line, should a message ever hold more)."""
    lines = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {lines[0] if lines else ''}".rstrip()


def full_error_wanted() -> bool:
    return os.environ.get(FULL_ERROR_ENV, "") not in ("", "0")


@contextlib.contextmanager
def one_line_errors() -> Iterator[None]:
    """Inside a Hydra task function: a project error leaves as :class:`ProjectError` (module docstring)."""
    try:
        yield
    except Exception as exc:
        if is_project_error(exc):
            raise ProjectError(one_line(exc)) from exc
        raise


def report_errors(func: Callable[[], T]) -> T:
    """Run a plain entry point: a project error becomes its one line on stderr and exit status 1 (its traceback
    with ``HYDRA_FULL_ERROR=1``); every other error propagates with its traceback."""
    try:
        return func()
    except Exception as exc:
        if full_error_wanted() or not is_project_error(exc):
            raise
        sys.stderr.write(one_line(exc) + os.linesep)
        raise SystemExit(1) from None
