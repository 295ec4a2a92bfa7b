"""Let boolean-looking config-group choices work: ``deq=true`` / ``deq=false``.

Hydra's override grammar parses ``true``/``false`` as booleans and then refuses them as config-group
choices ("Config group override must be a string or a list. Got bool"). Our ``deq`` group is switched
exactly that way, so for overrides that name an existing config group a boolean value is turned back into
the option name ``"true"``/``"false"`` before Hydra builds the defaults list. Nothing else changes: a
boolean for a plain key stays a boolean. Installed on ``import src`` (every entry point imports it), so
``hydra.compose(..., overrides=["deq=true"])`` works in tools that import the package first.

It also registers the config's resolvers (:mod:`src.config.resolvers`), and reads a config override in a spelling of
an older deqsm (:func:`src.config.old_runs.old_override`): ``model.optimizer.name=sgd`` as
``model.optimizer._target_=torch.optim.SGD``, and one that no longer works (``model.optimizer.scheduler=cosine``) is
refused in one line naming today's (Hydra's own "Key 'scheduler' is not in struct" would not say what to write).
The flat network keys of a family depend on the model the command composes (``model.arch=deq`` is NCSN's TwoRes
network, ``model/net=twores``, but a key of its own for ``model=supervised``): :func:`composed_model` finds it from
the overrides, the experiment's defaults and the primary config's, before Hydra builds the defaults list.

Why a patch at all: ``deq=true`` must stay a config-group choice (``deq.solver=anderson`` beside it, sweeps
``deq=true,false``), and Hydra offers no hook to read ``true`` as a group option name.
It is the one patch of a private Hydra class in deqsm (``hydra._internal.defaults_list.Overrides``), kept small:
``tests/test_hydra_patch.py`` fails when Hydra's behaviour changes (the class patched here moves, or a Hydra that
accepts boolean group choices by itself makes this module unnecessary).
"""

from __future__ import annotations

import functools

_INSTALLED = False


def _model_of(repo, path: str, seen: int = 0) -> str | None:
    """The ``model`` group choice the config at ``path`` (``experiment/ncsn_mnist``, ``train``) makes in its defaults
    list, directly or through a config it includes (the last one wins); None when it makes none."""
    from hydra.core.default_element import ConfigDefault, GroupDefault

    result = repo.load_config(path) if seen < 8 else None
    for default in reversed(getattr(result, "defaults_list", None) or []):
        if isinstance(default, GroupDefault) and default.group.lstrip("/") == "model":
            return str(default.value) if isinstance(default.value, str) else None
        if isinstance(default, ConfigDefault) and default.path not in ("_self_", None):
            where = default.path.lstrip("/") if default.path.startswith("/") else \
                "/".join([*path.split("/")[:-1], default.path])
            found = _model_of(repo, where, seen + 1)
            if found is not None:
                return found
    return None


def composed_model(repo, overrides_list, primary: str = "train") -> str | None:
    """The model family (``model`` group choice) a composition with ``overrides_list`` builds: ``model=<name>``, else
    the experiment's, else the primary config's; None when it cannot say (a sweep over models)."""
    by_key = {o.key_or_group: o for o in overrides_list}
    model = by_key.get("model")
    if model is not None:
        return model._value if isinstance(model._value, str) and not model.is_sweep_override() else None
    experiment = by_key.get("experiment")
    if experiment is not None and isinstance(experiment._value, str) and not experiment.is_sweep_override():
        found = _model_of(repo, f"experiment/{experiment._value}")
        if found is not None:
            return found
    return _model_of(repo, primary)


def install() -> None:
    global _INSTALLED
    if _INSTALLED:
        return
    from src.config.resolvers import register_resolvers

    register_resolvers()
    from hydra._internal import defaults_list
    from hydra.core.override_parser.types import OverrideType
    from hydra.errors import ConfigCompositionException

    from src.config.old_runs import old_override

    original = defaults_list.Overrides.__init__

    @functools.wraps(original)
    def __init__(self, repo, overrides_list):
        family = None
        for override in overrides_list:
            if not repo.group_exists(override.key_or_group):
                if family is None and str(override.key_or_group).startswith("model."):
                    family = composed_model(repo, overrides_list) or ""
                try:
                    today = old_override(override.key_or_group, override._value, override.is_sweep_override(),
                                         override.input_line, family=family or None)
                except ValueError as exc:
                    raise ConfigCompositionException(str(exc)) from None
                if today is not None:
                    override.key_or_group, override._value = today
                    if override.key_or_group.startswith("++"):  # set whether or not the config holds it
                        override.key_or_group, override.type = override.key_or_group[2:], OverrideType.FORCE_ADD
                continue
            if override.is_sweep_override():
                continue
            if isinstance(override._value, bool):
                override._value = "true" if override._value else "false"
        original(self, repo, overrides_list)

    defaults_list.Overrides.__init__ = __init__
    _INSTALLED = True

