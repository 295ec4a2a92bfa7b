"""Evaluation presets (``eval=quick|standard|paper|auto``, conf/eval/): how much the test phase costs.

A preset is a list of settings of *existing* keys of the composed config — ``model.metrics.*`` (test points,
FID samples, the likelihood's AIS and DKEF's importance samples), ``model.sampling`` (the Langevin sampler
behind FID), ``trainer.limit_test_batches`` — applied once at start-up by :func:`apply_eval_preset`:

- ``mode: cap`` (quick): each value is an upper bound. A smaller configured value stays; null (no bound) is
  replaced. A mapping value is one unit (a sampler's steps T and its step size ε): applied whole when it lowers
  its first entry.
- ``mode: set`` (paper; standard sets nothing): each value replaces the configured one.

In both modes a key the model family does not have is skipped (a DKEF run has no ``model.metrics.fid``), a
metric switched off (``model.metrics.<name>: null``) stays off, and a key given on the command line wins over
the preset. ``eval=auto`` (the default) picks ``quick`` for a CPU run of at most ``eval.quick_max_steps``
training steps (or ``trainer.fast_dev_run``), else ``standard``; ``paper`` is only ever chosen by name.
The choice and the reason are logged at start-up; :func:`apply_eval_preset` returns ``eval/preset`` and the
value in force of every key the preset governs (``eval/<key>``), which ``src.train`` writes to metrics.json
beside the figures, so a quick FID is never mistaken for a paper FID.

Hydra composes every preset a run may need; nothing reads conf/ files by path. ``eval=<name>`` composes
that preset into ``cfg.eval`` itself (so ``eval.settings.*`` can be overridden); conf/eval/auto.yaml composes
the two it may choose through its defaults list, as ``cfg.eval.presets.quick`` and ``cfg.eval.presets.standard``
(:func:`preset_of`). A run directory written before that (its ``.hydra/config.yaml`` has ``eval: {name: auto,
quick_max_steps: …}`` and no ``presets``) is still evaluated: the preset is composed by Hydra from this version's
config groups, as the run itself then loaded it (:mod:`src.config.old_runs`), and the start-up log says so.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Mapping
from typing import Any

import torch
from omegaconf import DictConfig, OmegaConf, open_dict

from src.config.old_runs import composed_preset

log = logging.getLogger(__name__)

PRESETS = ("quick", "standard", "paper")
_MISSING = object()


def check_preset_name(name: str) -> None:
    """One clear error for a name that is not one of :data:`PRESETS`."""
    if name not in PRESETS:
        raise ValueError(f"eval={name!r} is not an evaluation preset; valid: auto, {', '.join(PRESETS)}")


def preset_of(cfg: DictConfig, name: str) -> DictConfig:
    """The preset ``name`` (one of :data:`PRESETS`) as composed into ``cfg.eval``: ``cfg.eval`` itself for
    ``eval=<name>``, ``cfg.eval.presets.<name>`` for ``eval=auto``; for a run config of an older version that
    lacks them, :func:`src.config.old_runs.composed_preset` (logged)."""
    check_preset_name(name)
    ev = cfg.get("eval")
    if ev is not None and ev.get("name") == name and "settings" in ev:
        return ev
    presets = ev.get("presets") if ev is not None else None
    if presets is not None and name in presets:
        return presets[name]
    log.info("evaluation preset %s is not composed into this config's eval node (a run config of an older "
             "version): composed from this version's conf/eval", name)
    return composed_preset(name)


def _on_gpu(trainer: Mapping) -> bool:
    acc = str(trainer.get("accelerator", "cpu")).lower()
    if acc == "auto":
        return torch.cuda.is_available()
    return acc in ("gpu", "cuda", "mps", "tpu")


def choose_preset(cfg: DictConfig) -> tuple[str, str]:
    """(preset name, reason) for ``cfg.eval`` (``auto`` resolved from the accelerator and the run's length)."""
    ev = cfg.get("eval")
    name = "standard" if ev is None else str(ev.get("name", "standard"))
    if name != "auto":
        check_preset_name(name)
        return name, f"eval={name}"
    trainer = cfg.get("trainer") or {}
    limit = int(ev.get("quick_max_steps", 2000))
    steps = int(trainer.get("max_steps", -1) or -1)
    if _on_gpu(trainer):
        return "standard", "eval=auto: a GPU run"
    if trainer.get("fast_dev_run"):
        return "quick", "eval=auto: a CPU fast_dev_run"
    if 0 < steps <= limit:
        return "quick", f"eval=auto: a CPU run of {steps} steps (<= eval.quick_max_steps={limit})"
    length = f"{steps} steps" if steps > 0 else "an epoch-based run"
    return "standard", f"eval=auto: a CPU run of {length}"


def hydra_override_keys() -> set[str]:
    """Keys set on the command line of the current Hydra run (empty outside one); config-group choices
    (``model=ncsn``, ``trainer=cpu``, ``experiment=…``) select configs, they set no key, so they are left out."""
    try:
        from hydra.core.hydra_config import HydraConfig

        hc = HydraConfig.get()
        task, groups = hc.overrides.task, set(hc.runtime.choices)
    except (ValueError, ImportError, AttributeError):
        return set()
    keys = {str(o).split("=", 1)[0].lstrip("+~") for o in task if "=" in str(o)}
    return {k for k in keys if k not in groups and k.split("@", 1)[0] not in groups}


def _is_explicit(key: str, explicit: Iterable[str]) -> bool:
    return any(key == e or key.startswith(e + ".") or e.startswith(key + ".") for e in explicit)


def _get(cfg: DictConfig, key: str):
    node = cfg
    for part in key.split("."):
        if not isinstance(node, DictConfig) or part not in node:
            return _MISSING
        node = node[part]
    return node


def _set(cfg: DictConfig, key: str, value) -> None:
    parent, _, leaf = key.rpartition(".")
    node = _get(cfg, parent) if parent else cfg
    with open_dict(node):
        node[leaf] = value


def _lowers(new, current) -> bool:
    """Cap mode: whether ``new`` is a tighter bound than ``current`` (None = unbounded)."""
    return current is None or (new is not None and float(new) < float(current))


def apply_eval_preset(cfg: DictConfig, explicit: Iterable[str] | None = None) -> dict[str, Any]:
    """Apply the preset ``cfg.eval`` names to ``cfg`` in place (see the module docstring); log the choice;
    return ``{"eval/preset": name, "eval/<key>": value in force, ...}``. ``explicit``: keys given on the
    command line (default: the current Hydra run's overrides)."""
    explicit = set(hydra_override_keys() if explicit is None else explicit)
    name, reason = choose_preset(cfg)
    ev = cfg.get("eval")
    preset = preset_of(cfg, name)
    cap = str(preset.get("mode", "set")) == "cap"
    record: dict[str, Any] = {"eval/preset": name}
    changed = []
    for key, value in (preset.get("settings") or {}).items():
        current = _get(cfg, key)
        if current is _MISSING:
            continue  # the family has no such key, or its metric is switched off (model.metrics.<name>: null)
        if isinstance(value, DictConfig):  # a unit (sampler steps and step size)
            if not isinstance(current, DictConfig):
                continue
            entries = list(value.items())
            first_key, first = entries[0]
            apply = not _is_explicit(key, explicit) and (not cap or _lowers(first, current.get(first_key)))
            for k, v in entries:
                if apply and current.get(k, _MISSING) != v:
                    changed.append(f"{key}.{k}={v} (was {current.get(k)})")
                    _set(cfg, f"{key}.{k}", v)
                record[f"eval/{key}.{k}"] = _get(cfg, f"{key}.{k}")
            continue
        if not _is_explicit(key, explicit) and (not cap or _lowers(value, current)) and current != value:
            changed.append(f"{key}={value} (was {current})")
            _set(cfg, key, value)
        record[f"eval/{key}"] = _get(cfg, key)
    if ev is not None:
        with open_dict(ev):
            ev.preset = name
    log.info("evaluation preset: %s (%s)%s%s", name, reason,
             "; " + ", ".join(changed) if changed else "; the configuration's own settings",
             "" if name == "paper" else ". eval=standard|paper for more test points and samples")
    return {k: (None if v is _MISSING else OmegaConf.to_container(v) if isinstance(v, DictConfig) else v)
            for k, v in record.items()}
