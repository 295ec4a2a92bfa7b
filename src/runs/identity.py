"""What a run is, for a resume: the settings a checkpoint must share with the run that continues it.

A resume (``ckpt_path=…``) continues a run only as the run it was trained as. :func:`run_identity` flattens the
keys that make the run what it is — the family (``model._target_``), the objective (``loss.*``), the network's
sizes and its optimiser and schedule (``model.*``; a checkpoint recorded while ``model.optimizer`` was a flat mapping,
or while the network's sizes were flat ``model.*`` keys, is read with today's keys,
:func:`src.config.old_runs.upgrade_identity`), the DEQ block (``deq.*``, ``depth``) and the data (``data.*``) — into
``{dotted key: value}``; every checkpoint ``src.train`` writes holds them (``deqsm_run``, written by
:class:`src.runtime.checkpoints.AtomicCheckpointIO`), and :func:`check_same_run` refuses a checkpoint whose keys
differ from the run's, in one line naming each differing key with both values and the override that allows the
change on purpose, ``resume_allow=[<key or its group>, …]`` (``resume_allow=[loss]`` allows every ``loss.*`` key).

What may change on a resume passes silently: everything outside those groups (``trainer.*`` — max_steps,
devices, precision —, ``logger``, ``callbacks``, ``eval``, ``paths``, ``ema``), the evaluation keys of the model
(:data:`MODEL_MAY_CHANGE`: metrics, the sampler, sample grids, the monitored key) and where the data are read
from (:data:`DATA_MAY_CHANGE`: root, download, workers, evaluation batch size). A model key that only repeats
another group (``model.loss: ${loss}``, ``model.input_dim: ${data.dim}``) is compared once, under that group.

A checkpoint written before ``deqsm_run`` existed is compared through its saved hyper-parameters (the model's
keys, ``loss``, ``deq`` and ``depth``); its data cannot be checked, which the log says once.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Mapping
from typing import Any

from omegaconf import DictConfig, OmegaConf

from src.config.old_runs import upgrade_identity
from src.runtime.checkpoints import CheckpointError

log = logging.getLogger(__name__)

CHECKPOINT_KEY = "deqsm_run"  # the run identity inside every checkpoint src.train writes
ALLOW_KEY = "resume_allow"  # conf/train.yaml: the keys a resume may change on purpose
GROUPS = ("model", "loss", "deq", "depth", "data")  # the config that makes a run what it is
# evaluation settings of the model (eval presets set them) and what it merely records
MODEL_MAY_CHANGE = ("metrics", "sampling", "n_samples_grid", "monitor", "monitor_mode", "final_refit",
                    "alpha_refit_points", "val_seed")
# where and how fast the data are read, not what they are
DATA_MAY_CHANGE = ("root", "download", "num_workers", "eval_batch_size", "pin_memory", "persistent_workers")
# hyper-parameters of a checkpoint without deqsm_run that are whole groups of the run config
_HPARAM_GROUPS = {"loss": "loss", "deq": "deq", "depth": "depth", "input_dim": "data.dim"}


class ResumeMismatchError(CheckpointError):
    """A resume whose run differs from the checkpoint's in a key that makes the run what it is."""


def _flatten(value: Any, prefix: str, out: dict[str, Any]) -> None:
    if isinstance(value, Mapping) and value:
        for k, v in value.items():
            _flatten(v, f"{prefix}.{k}", out)
    else:
        out[prefix] = list(value) if isinstance(value, tuple) else value


def run_identity(cfg: DictConfig) -> dict[str, Any]:
    """``{dotted key: resolved value}`` of the keys of ``cfg`` a resume must keep (module docstring)."""
    out: dict[str, Any] = {}
    for group in GROUPS:
        if group not in cfg:
            continue
        node = cfg[group]
        if not isinstance(node, DictConfig):
            out[group] = node
            continue
        skip = MODEL_MAY_CHANGE if group == "model" else DATA_MAY_CHANGE if group == "data" else ()
        resolved = OmegaConf.to_container(node, resolve=True)
        for key in node:
            if key in skip or (group == "model" and OmegaConf.is_interpolation(node, key)):
                continue  # an evaluation setting, or a repeat of another group (compared there)
            _flatten(resolved[key], f"{group}.{key}", out)
    return out


def identity_of_hparams(hparams: Mapping) -> dict[str, Any]:
    """The identity a checkpoint written before :data:`CHECKPOINT_KEY` existed implies: its LightningModule's saved
    hyper-parameters as ``model.*``, those that are whole groups (``loss``, ``deq``, ``depth``) under their group."""
    out: dict[str, Any] = {}
    for key, value in hparams.items():
        if key in MODEL_MAY_CHANGE:
            continue
        _flatten(value, _HPARAM_GROUPS.get(key, f"model.{key}"), out)
    return out


def _allowed(key: str, allow: Iterable[str]) -> bool:
    return any(key == a or key.startswith(f"{a}.") for a in allow)


_ABSENT = object()  # a key one side does not have


def _show(value: Any) -> str:
    return "(absent)" if value is _ABSENT else "null" if value is None else str(value)


def differences(saved: Mapping[str, Any], here: Mapping[str, Any], allow: Iterable[str] = (),
                keys: Iterable[str] | None = None) -> list[str]:
    """``key=<saved> in the checkpoint, <here> here`` for each key whose values differ and is not allowed; only
    ``keys`` when given (an old checkpoint's known keys)."""
    allow = [str(a) for a in allow]
    names = sorted(set(saved) | set(here)) if keys is None else sorted(keys)
    found = []
    for key in names:
        a, b = saved.get(key, _ABSENT), here.get(key, _ABSENT)
        if a != b and not _allowed(key, allow):
            found.append(f"{key}: {_show(a)} in the checkpoint, {_show(b)} here")
    return found


def _allow_list(keys: list[str]) -> list[str]:
    """The shortest ``resume_allow`` entries covering ``keys``: a group (``loss``, ``deq``, ``data``) where two or
    more of its keys differ, else each key (``model`` is never allowed whole: it holds the network's sizes)."""
    groups = [k.split(".", 1)[0] for k in keys]
    out: list[str] = []
    for key, group in zip(keys, groups):
        entry = group if group != "model" and groups.count(group) > 1 else key
        if entry not in out:
            out.append(entry)
    return out


def check_same_run(checkpoint: Mapping, path: Any = "the checkpoint", *, identity: Mapping[str, Any],
                   allow: Iterable[str] = ()) -> None:
    """Refuse, in one line, a checkpoint whose run differs from ``identity`` (this run's :func:`run_identity`) in a
    key not in ``allow`` (``resume_allow``); a validator of the checkpoint src.train resumes from (before the run starts,
    and in AtomicCheckpointIO as Lightning loads it)."""
    allow = [str(a) for a in (allow or ())]
    saved = checkpoint.get(CHECKPOINT_KEY)
    if saved is not None:
        found = differences(upgrade_identity(saved), identity, allow)
    else:
        saved = upgrade_identity(identity_of_hparams(checkpoint.get("hyper_parameters") or {}),
                                 module=identity.get("model._target_"))
        found = differences(saved, identity, allow, keys=[k for k in saved if k in identity])
        log.info("checkpoint %s was written before checkpoints recorded their run (%s): its model, objective and "
                 "DEQ settings are checked from its hyper-parameters, its data are not", path, CHECKPOINT_KEY)
    if not found:
        return
    keys = _allow_list([f.split(":", 1)[0] for f in found])
    raise ResumeMismatchError(
        f"ckpt_path={path} was trained as another run — {'; '.join(found)}: resume with the settings it was "
        f"trained with, or continue it as a changed run on purpose with {ALLOW_KEY}=[{','.join(keys)}]")
