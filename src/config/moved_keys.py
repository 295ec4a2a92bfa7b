"""The table of config keys that moved.

:data:`MOVED_KEYS` lists keys that moved to a new home. A config naming one, on the command line or in a config
file (an experiment, a run's saved config), is refused with one line naming the new key
(:func:`moved_key_message`, :func:`moved_override_message`, :func:`refuse_moved_keys`): ``src.config.hydra_patch`` checks every composition, and
``src.evaluate`` a run's saved config, so an old key never silently does nothing.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

# old key (or prefix: everything below it moves with it) -> new key. Every evaluation setting lives in the
# model.metrics tree, beside the metric it configures (src.metrics.registry); DKEF's α refit is no metric.
MOVED_KEYS: dict[str, str] = {
    "model.evaluation.ll_samples": "model.metrics.log_likelihood.samples",
    "model.evaluation.ll_proposal_std": "model.metrics.log_likelihood.proposal_std",
    "model.evaluation.alpha_fit_points": "model.alpha_refit_points",
    "model.evaluation.ais.test_points": "model.metrics.log_likelihood.test_points",
    "model.evaluation.ais.seed": "model.metrics.log_likelihood.seed",
    "model.evaluation.ais": "model.metrics.log_likelihood.ais",
    "model.evaluation.val_sm_points": "model.metrics.exact_sm.val_points",
    "model.evaluation.test_sm_points": "model.metrics.exact_sm.test_points",
}
# a removed section: any key below it not listed above is refused with a pointer to its replacement
MOVED_SECTIONS: dict[str, str] = {"model.evaluation": "model.metrics"}


def moved_key_message(key: str) -> str | None:
    """The one-line refusal of a config key that moved (see :data:`MOVED_KEYS`), or None for any other key.
    ``key`` as written in an override: ``+``/``~`` prefixes are ignored."""
    key = key.lstrip("+~")
    for old in sorted(MOVED_KEYS, key=len, reverse=True):  # the most specific entry first
        if key == old or key.startswith(old + "."):
            section = next((s for s in MOVED_SECTIONS if old.startswith(s + ".")), old)
            return f"{key} is now {MOVED_KEYS[old] + key[len(old):]} ({section} was removed)"
    for old, new in MOVED_SECTIONS.items():
        if key == old or key.startswith(old + "."):
            moved = ", ".join(f"{o.removeprefix(old + '.')} -> {n}" for o, n in MOVED_KEYS.items() if o.startswith(old))
            return f"{key} is not a key: {old} was removed, its settings moved ({moved}); see {new} in the model's config"
    return None


def moved_override_message(keys: Iterable[str]) -> str | None:
    """The refusal of the first override key (as written: ``+``/``~`` prefixes ignored) that moved, or None."""
    return next((m for m in map(moved_key_message, keys) if m is not None), None)


def _leaf_keys(node: Any, prefix: str) -> Iterable[str]:
    if isinstance(node, Mapping) and node:
        for k, v in node.items():
            yield from _leaf_keys(v, f"{prefix}.{k}")
    else:
        yield prefix


def refuse_moved_keys(cfg: Mapping, where: str = "") -> None:
    """Raise a one-line ``ValueError`` when the composed config ``cfg`` holds a key that moved (the first one
    found); ``where`` (e.g. a file) prefixes the message."""
    for section in MOVED_SECTIONS:
        node: Any = cfg
        for part in section.split("."):
            if not isinstance(node, Mapping) or part not in node:
                break
            node = node[part]
        else:
            key = next(iter(_leaf_keys(_unresolved(node), section)))
            raise ValueError(f"{where}{': ' if where else ''}{moved_key_message(key)}")


def _unresolved(node: Any) -> Any:
    from omegaconf import OmegaConf

    return OmegaConf.to_container(node, resolve=False) if OmegaConf.is_config(node) else node
