"""Failed trials of an Optuna sweep (``hparams_search=…``): the sweep goes on and says which failed and why.

Hydra's Optuna sweeper marks a trial FAILED when its job raised (``src.train`` raises when the run never logged
``optimized_metric``: :class:`src.runs.training.OptimizedMetricNotLogged`) and, with
``hydra.sweeper.max_failure_rate`` at 1.0 (conf/hparams_search/), asks for the next trial. What it does not do is
say at the end which trials failed, and when none completed it dies in ``study.best_trial`` with Optuna's "No
trials are completed yet". :class:`FailedTrialsReport`, a Hydra callback (Hydra's public hook,
``hydra.callbacks`` in conf/hparams_search/dkef_optuna.yaml), collects every job's return as the job ends, and

- at the end of the sweep the failed trials (job number, its overrides, the one-line reason) are logged and written
  to ``<sweep dir>/failed_trials.yaml`` (the fixed command-line overrides are left out);
- when the sweep's last trial ends and no trial completed, ``<sweep dir>/optimization_results.yaml`` says so
  (``best_params: null``) and the sweep ends there with :class:`NoTrialCompleted` (exit status 1), one line naming
  the count and the first reason, before the sweeper would ask Optuna for a best trial that does not exist.
"""

from __future__ import annotations

import logging
from pathlib import Path

from hydra.experimental.callback import Callback

log = logging.getLogger(__name__)


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


class FailedTrialsReport(Callback):
    """The Hydra callback of an Optuna sweep (see the module docstring): every trial's return, the failed ones
    reported at the end, and a sweep in which no trial completed ended in one line."""

    def __init__(self) -> None:
        self.returns: list = []
        self.sweep_dir: Path | None = None
        self.arguments: list[str] = []
        self.n_trials: int | None = None

    def on_multirun_start(self, config, **kwargs) -> None:
        self.returns = []
        self.sweep_dir = Path(config.hydra.sweep.dir)
        self.arguments = [str(o) for o in config.hydra.overrides.task]
        n_trials = config.hydra.sweeper.get("n_trials")
        self.n_trials = int(n_trials) if n_trials is not None else None

    def on_job_end(self, config, job_return, **kwargs) -> None:
        if self.sweep_dir is None:  # not a sweep (a single run with this callback configured)
            return
        self.returns.append(job_return)
        if len(self.returns) == self.n_trials and all(failure_reason(r) is not None for r in self.returns):
            failed = summarise(self.returns, self.sweep_dir, self.arguments)
            from omegaconf import OmegaConf

            OmegaConf.save(OmegaConf.create({"name": "optuna", "best_params": None, "best_value": None,
                                             "n_failed": len(failed)}), self.sweep_dir / "optimization_results.yaml")
            raise NoTrialCompleted(f"no trial of the sweep completed: all {len(self.returns)} failed (reasons in "
                                   f"{self.sweep_dir / 'failed_trials.yaml'}); trial 0: {failed[0]['reason']}")

    def on_multirun_end(self, config, **kwargs) -> None:
        if self.sweep_dir is not None:
            summarise(self.returns, self.sweep_dir, self.arguments)
