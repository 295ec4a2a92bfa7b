"""What a run written by an older deqsm needs to load today: the one home of old-run compatibility.

``src.evaluate``, ``src.sample`` and the benchmarks load a finished run's saved ``.hydra/config.yaml``
(:mod:`src.runs.load`); what changed in the config since such a run was written is read back here, and only here:

- :func:`clear_stale_norm_of_normalized_block`: runs of ``deq.block=normalized_residual`` saved while ``deq.norm`` /
  ``deq.norm_lambda`` defaulted to frobenius / 2 store those defaults, which that block never used and now refuses;
- :func:`composed_preset`: a run config written before ``eval=auto`` composed its evaluation presets into
  ``cfg.eval`` (:mod:`src.metrics.presets` asks for the preset here when the run's config lacks it);
- :func:`upgrade_optimizer_config` / :func:`upgrade_identity`: runs written while ``model.optimizer`` was a flat
  mapping (``{name: adam, lr, weight_decay, scheduler: cosine, params: […]}``) read as today's partial
  ``torch.optim`` classes (``model.optimizer._target_``, ``model.scheduler``), in a run's config (``src.evaluate``,
  ``src.sample``) and in a checkpoint's recorded run (a resume, :mod:`src.runs.identity`);
- :func:`old_override`: a command-line override in an old spelling: ``model.optimizer[.<name>].name=sgd`` (in
  recorded commands, e.g. benchmarks/results/separation.md) still works, read as
  ``model.optimizer[.<name>]._target_=torch.optim.SGD``; ``model.optimizer.scheduler`` and ``.params`` stop in one
  line naming today's spelling.

Config keys that moved (``model.evaluation.*`` → ``model.metrics.*``) are no longer translated: no committed run
holds them; docs/usage.md lists where each went.
"""

from __future__ import annotations

import re
from typing import Any

from omegaconf import DictConfig, OmegaConf


def clear_stale_norm_of_normalized_block(cfg: DictConfig) -> None:
    """Runs of ``deq.block=normalized_residual`` saved while ``deq.norm`` / ``deq.norm_lambda`` defaulted to
    frobenius / 2 store those defaults, which that block never used and now refuses (``src.deq.config``): read
    them as unset. Any other stored value was an override the block ignored — left, so that loading says so."""
    model = cfg.get("model")
    for deq in (cfg.get("deq"), model.get("deq") if isinstance(model, DictConfig) else None):
        if (isinstance(deq, DictConfig) and deq.get("block") == "normalized_residual"
                and deq.get("norm") == "frobenius" and deq.get("norm_lambda") in (2, 2.0)):
            deq.norm = deq.norm_lambda = None


def composed_preset(name: str) -> DictConfig:
    """The evaluation preset ``name`` as Hydra composes ``eval=<name>`` from the config groups of this version (for
    a run config written before eval=auto composed its presets)."""
    from hydra import compose, initialize
    from hydra.core.global_hydra import GlobalHydra

    if GlobalHydra.instance().is_initialized():  # inside a Hydra app: its own config search path
        return compose(config_name="train", overrides=[f"eval={name}"]).eval
    with initialize(config_path="../../conf", version_base="1.3"):
        return compose(config_name="train", overrides=[f"eval={name}"]).eval


_OPTIMIZER_ARGS = {"lr", "weight_decay", "betas", "eps", "momentum", "name", "amsgrad", "scheduler", "params"}
COSINE = "torch.optim.lr_scheduler.CosineAnnealingLR"  # what ``scheduler: cosine`` was: to 1 % of lr over the run


def optimizer_path(name: str) -> str:
    """The ``_target_`` of an old ``model.optimizer.name`` (``adam`` -> ``torch.optim.Adam``); the name as given
    when no ``torch.optim`` class has it (refused where the optimiser is built)."""
    import torch

    for attr in dir(torch.optim):
        cls = getattr(torch.optim, attr)
        if attr.lower() == str(name).lower() and isinstance(cls, type) and issubclass(cls, torch.optim.Optimizer):
            return f"torch.optim.{attr}"
    return str(name)


def _upgrade_spec(spec: dict) -> dict | None:
    """One old optimiser mapping as today's partial (in place); its old ``scheduler`` as today's ``model.scheduler``
    (None when it had none)."""
    spec.pop("params", None)  # the family says which sub-modules each optimiser updates (optimized_modules)
    kind = spec.pop("scheduler", None)
    target = optimizer_path(spec.pop("name", "adam"))
    spec.update({"_target_": target, "_partial_": True, **{k: v for k, v in spec.items() if k != "_target_"}})
    if kind is None:
        return None
    if kind != "cosine":
        raise ValueError(f"model.optimizer.scheduler={kind!r} (an old run's) is unknown; it was cosine or null")
    return {"_target_": COSINE, "_partial_": True, "eta_min": float(spec.get("lr", 1e-3)) * 1e-2}


def upgrade_optimizer_mapping(optimizer: Any) -> tuple[Any, dict | None]:
    """``(optimizer, scheduler)`` of an old run's ``model.optimizer`` mapping (plain dicts) as today's partials; a
    mapping already in today's form is returned as it is, with scheduler None."""
    if not isinstance(optimizer, dict) or not optimizer or "_target_" in optimizer:
        return optimizer, None
    if set(optimizer) & _OPTIMIZER_ARGS or not all(isinstance(v, dict) for v in optimizer.values()):
        specs = {"": optimizer}
    else:
        specs = optimizer
    scheduler = None
    for spec in specs.values():
        if "_target_" not in spec:
            scheduler = _upgrade_spec(spec) or scheduler
    return optimizer, scheduler


def upgrade_optimizer_config(cfg: DictConfig) -> None:
    """A run config written while ``model.optimizer`` was a flat mapping: today's partial classes (in place)."""
    model = cfg.get("model")
    if not isinstance(model, DictConfig) or not isinstance(model.get("optimizer"), DictConfig):
        return
    optimizer = OmegaConf.to_container(model.optimizer, resolve=True)
    if "_target_" in optimizer or all(isinstance(v, dict) and "_target_" in v for v in optimizer.values()):
        return
    optimizer, scheduler = upgrade_optimizer_mapping(optimizer)
    model.optimizer = optimizer
    if model.get("scheduler") is None:
        model.scheduler = scheduler


def upgrade_identity(identity: dict[str, Any]) -> dict[str, Any]:
    """A recorded run identity (``{dotted key: value}``, :mod:`src.runs.identity`) of a run written while
    ``model.optimizer`` was a flat mapping, as today's keys: ``model.optimizer[.<name>]._target_`` / ``_partial_``
    for ``.name``, ``model.scheduler.*`` for ``.scheduler``, ``.params`` dropped. Today's identities unchanged."""
    prefix = "model.optimizer."
    keys = [k[len(prefix):] for k in identity if k.startswith(prefix)]
    if not keys or any(k == "_target_" or k.endswith("._target_") for k in keys):
        return dict(identity)
    nested: dict[str, Any] = {}
    for key in keys:
        *path, last = key.split(".")
        node = nested
        for part in path:
            node = node.setdefault(part, {})
        node[last] = identity[prefix + key]
    optimizer, scheduler = upgrade_optimizer_mapping(nested)
    out = {k: v for k, v in identity.items() if not k.startswith(prefix)}

    def flatten(value: Any, where: str) -> None:
        if isinstance(value, dict) and value:
            for k, v in value.items():
                flatten(v, f"{where}.{k}")
        else:
            out[where] = value

    flatten(optimizer, "model.optimizer")
    if "model.scheduler" not in out and not any(k.startswith("model.scheduler.") for k in out):
        if scheduler is None:
            out["model.scheduler"] = None
        else:
            flatten(scheduler, "model.scheduler")
    return out


OLD_NAME = re.compile(r"^model\.optimizer(\.\w+)?\.name$")  # model.optimizer[.<name>].name=<optimiser>
# old command-line spellings refused: (pattern of the key, what to write today)
OLD_OVERRIDES = (
    (OLD_NAME, "model.optimizer{group}._target_=torch.optim.<Class> (e.g. torch.optim.SGD)"),
    (re.compile(r"^model\.optimizer(\.\w+)?\.scheduler$"),
     "model.scheduler='{{_target_: torch.optim.lr_scheduler.CosineAnnealingLR, _partial_: true, eta_min: <1 % of lr>}}'"),
    (re.compile(r"^model\.optimizer(\.\w+)?\.params$"),
     "nothing: the family fixes which sub-modules each optimiser updates (optimized_modules)"),
)


def old_override(key: str, value: Any, sweep: bool = False, text: str | None = None) -> tuple[str, str] | None:
    """Today's ``(key, value)`` of a command-line override in an older spelling that still works (``sweep``: a
    sweep's value list cannot be translated, it is refused); None for any other override; a ``ValueError`` in one
    line for an old spelling that no longer works, naming today's (``text``: the override as typed)."""
    match = OLD_NAME.match(str(key))
    if match and not sweep and isinstance(value, str) and optimizer_path(value).startswith("torch.optim."):
        return f"model.optimizer{match.group(1) or ''}._target_", optimizer_path(value)
    for pattern, today in OLD_OVERRIDES:
        match = pattern.match(str(key))
        if match:
            new = today.format(group=match.group(1) or "")
            if pattern is OLD_NAME and isinstance(value, str) and optimizer_path(value).startswith("torch.optim."):
                new = new.replace("<Class> (e.g. torch.optim.SGD)", optimizer_path(value).split(".")[-1])
            raise ValueError(f"{text or f'{key}={value}'} is an old spelling (model.optimizer is a partial torch.optim class now, "
                             f"src/lit/optimizers.py): write {new}")
    return None
