"""The OmegaConf resolvers the configs use.

``${sweep_direction:${optimized_metric_mode}}`` turns the checkpoint callback's ``min``/``max`` into the Optuna
sweeper's ``minimize``/``maximize`` (conf/hparams_search/); ``${run_stamp:}`` names a run directory uniquely per
process (:func:`src.runtime.run_dir.run_stamp`, conf/hydra/default.yaml).
"""

from __future__ import annotations

_DIRECTIONS = {"min": "minimize", "max": "maximize"}


def sweep_direction(mode: str) -> str:
    """``optimized_metric_mode`` (min | max) as an Optuna study direction (minimize | maximize)."""
    if mode not in _DIRECTIONS:
        raise ValueError(f"optimized_metric_mode={mode!r} is invalid: use min or max")
    return _DIRECTIONS[mode]


def register_resolvers() -> None:
    """Register every resolver above once (idempotent)."""
    from omegaconf import OmegaConf

    if not OmegaConf.has_resolver("sweep_direction"):
        OmegaConf.register_new_resolver("sweep_direction", sweep_direction)
    if not OmegaConf.has_resolver("run_stamp"):
        from src.runtime.run_dir import run_stamp

        OmegaConf.register_new_resolver("run_stamp", run_stamp)
