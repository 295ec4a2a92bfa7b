"""Failed trials of an Optuna sweep (``hparams_search=…``): the sweep goes on and says which failed and why.

Hydra's Optuna sweeper marks a trial FAILED when its job raised (``src.train`` raises when the run never logged
``optimized_metric``: :class:`src.train.OptimizedMetricNotLogged`) and, with ``hydra.sweeper.max_failure_rate``
at 1.0 (conf/hparams_search/), asks for the next trial. What it does not do is say at the end which trials
failed, and when none completed it dies in ``study.best_trial`` with Optuna's "No trials are completed yet".
:func:`install` wraps ``OptunaSweeperImpl.sweep`` (Hydra plugins must live in the ``hydra_plugins`` package,
so this is a wrapper, not a sweeper of our own): every job's return is collected, and at the end

- the failed trials (job number, its overrides, the one-line reason) are logged and written to
  ``<sweep dir>/failed_trials.yaml`` (the fixed command-line overrides are left out);
- when no trial completed, ``<sweep dir>/optimization_results.yaml`` says so (``best_params: null``) and the
  sweep ends with :class:`NoTrialCompleted` (exit status 1), one line naming the count and the first reason.

Installed by ``src.train`` on import; a no-op when the Optuna sweeper plugin is not installed.
"""

from __future__ import annotations

import functools
import logging
from pathlib import Path

log = logging.getLogger(__name__)
_INSTALLED = False


class NoTrialCompleted(SystemExit):
    """Every trial of the sweep failed: there is no best value. A ``SystemExit``: the process ends with status 1
    and this one line (Hydra would print a traceback of the sweeper for any other exception)."""


def failure_reason(ret) -> str | None:
    """The one-line reason a Hydra ``JobReturn`` failed as a trial, or None when it returned a number."""
    from hydra.core.utils import JobStatus

    if ret.status != JobStatus.COMPLETED:
        exc = ret._return_value
        text = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
        return f"{type(exc).__name__}: {text}" if text else type(exc).__name__
    try:
        float(ret._return_value)
    except (TypeError, ValueError):
        return f"returned {ret._return_value!r}, not a number"
    return None


_SWEEP_SYNTAX = ("choice(", "range(", "interval(", "tag(", ",")


def summarise(returns: list, sweep_dir: str | Path, arguments: list[str] = ()) -> list[dict]:
    """Log and write ``failed_trials.yaml`` for the failed ones of ``returns`` (Hydra ``JobReturn``s). The fixed
    command-line ``arguments`` every trial shares are left out of each trial's overrides: the sampled ones stay."""
    from omegaconf import OmegaConf

    fixed = {a.split("=", 1)[0].lstrip("+~") for a in arguments
             if "=" in a and not any(t in a.split("=", 1)[1] for t in _SWEEP_SYNTAX)}
    failed = []
    for i, ret in enumerate(returns):
        reason = failure_reason(ret)
        if reason is not None:
            failed.append({"job": i, "dir": str(ret.working_dir or ""), "reason": reason,
                           "overrides": [o for o in ret.overrides or [] if o.split("=", 1)[0].lstrip("+~") not in fixed]})
    if failed:
        log.warning("%d of %d trials failed:", len(failed), len(returns))
        for f in failed:
            log.warning("  trial %d (%s): %s", f["job"], " ".join(f["overrides"]), f["reason"])
        OmegaConf.save(OmegaConf.create({"n_trials": len(returns), "failed": failed}),
                       Path(sweep_dir) / "failed_trials.yaml")
    return failed


def install() -> None:
    """Wrap the Optuna sweeper (see the module docstring); idempotent."""
    global _INSTALLED
    if _INSTALLED:
        return
    try:
        from hydra_plugins.hydra_optuna_sweeper._impl import OptunaSweeperImpl
    except ImportError:
        return
    original = OptunaSweeperImpl.sweep

    @functools.wraps(original)
    def sweep(self, arguments):
        returns: list = []
        launch = self.launcher.launch

        def launch_and_keep(*args, **kwargs):
            out = launch(*args, **kwargs)
            returns.extend(out)
            return out

        self.launcher.launch = launch_and_keep
        sweep_dir = Path(self.config.hydra.sweep.dir)
        try:
            original(self, arguments)
        except ValueError as exc:
            if "No trials are completed yet" not in str(exc):
                raise
            failed = summarise(returns, sweep_dir, arguments)
            from omegaconf import OmegaConf

            OmegaConf.save(OmegaConf.create({"name": "optuna", "best_params": None, "best_value": None,
                                             "n_failed": len(failed)}), sweep_dir / "optimization_results.yaml")
            first = failed[0]["reason"] if failed else "no trial ran"
            raise NoTrialCompleted(f"no trial of the sweep completed: all {len(returns)} failed (reasons in "
                                   f"{sweep_dir / 'failed_trials.yaml'}); trial 0: {first}") from None
        finally:
            self.launcher.launch = launch
        summarise(returns, sweep_dir, arguments)

    OptunaSweeperImpl.sweep = sweep
    _INSTALLED = True
