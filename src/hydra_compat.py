"""Let boolean-looking config-group choices work: ``deq=true`` / ``deq=false``.

Hydra's override grammar parses ``true``/``false`` as booleans and then refuses them as config-group
choices ("Config group override must be a string or a list. Got bool"). Our ``deq`` group is switched
exactly that way, so for overrides that name an existing config group a boolean value is turned back into
the option name ``"true"``/``"false"`` before Hydra builds the defaults list. Nothing else changes: a
boolean for a plain key stays a boolean. Installed on ``import src`` (every entry point imports it), so
``hydra.compose(..., overrides=["deq=true"])`` works in tools that import the package first.

Every composition (command line, ``hydra.compose``, each sweep trial) is also checked for config keys that moved
(:data:`src.configs.MOVED_KEYS`): an override or a config file naming one is refused with one line naming the
new key, before Hydra's own "Could not override" (which would not say where the key went).

It also registers the ``sweep_direction`` resolver: ``${sweep_direction:${optimized_metric_mode}}`` turns the
checkpoint callback's ``min``/``max`` into the Optuna sweeper's ``minimize``/``maximize`` (conf/hparams_search/),
and the ``run_stamp`` resolver of conf/hydra/default.yaml: a run directory name unique per process
(:func:`src.run_dir.run_stamp`).
"""

from __future__ import annotations

import functools

_INSTALLED = False
_DIRECTIONS = {"min": "minimize", "max": "maximize"}


def sweep_direction(mode: str) -> str:
    """``optimized_metric_mode`` (min | max) as an Optuna study direction (minimize | maximize)."""
    if mode not in _DIRECTIONS:
        raise ValueError(f"optimized_metric_mode={mode!r} is invalid: use min or max")
    return _DIRECTIONS[mode]


def install() -> None:
    global _INSTALLED
    if _INSTALLED:
        return
    from omegaconf import OmegaConf

    if not OmegaConf.has_resolver("sweep_direction"):
        OmegaConf.register_new_resolver("sweep_direction", sweep_direction)
    if not OmegaConf.has_resolver("run_stamp"):
        from src.run_dir import run_stamp

        OmegaConf.register_new_resolver("run_stamp", run_stamp)
    from hydra._internal import defaults_list

    original = defaults_list.Overrides.__init__

    @functools.wraps(original)
    def __init__(self, repo, overrides_list):
        for override in overrides_list:
            if override.is_sweep_override() or not repo.group_exists(override.key_or_group):
                continue
            if isinstance(override._value, bool):
                override._value = "true" if override._value else "false"
        original(self, repo, overrides_list)

    defaults_list.Overrides.__init__ = __init__
    _refuse_moved_keys_on_compose()
    _INSTALLED = True


def _refuse_moved_keys_on_compose() -> None:
    """Before Hydra applies the command-line overrides to the composed config (config files merged, struct
    set), refuse a moved key in either with :func:`src.configs.moved_key_message`'s line."""
    from hydra._internal.config_loader_impl import ConfigLoaderImpl
    from hydra.errors import ConfigCompositionException

    from src.configs import moved_override_message, refuse_moved_keys

    original = ConfigLoaderImpl._apply_overrides_to_config

    @functools.wraps(original)
    def apply_overrides(overrides, cfg):
        message = moved_override_message(o.key_or_group for o in overrides)
        if message is not None:
            raise ConfigCompositionException(message)
        try:
            refuse_moved_keys(cfg, "a config file")
        except ValueError as exc:
            raise ConfigCompositionException(str(exc)) from None
        original(overrides, cfg)

    ConfigLoaderImpl._apply_overrides_to_config = staticmethod(apply_overrides)
