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
- :func:`upgrade_net_config` / :func:`upgrade_identity`: runs written while a family's network sizes were flat
  ``model.*`` keys (``model.arch``, ``model.ngf``, ``model.hidden``, …: :data:`FLAT_NET_KEYS`) read as today's
  ``model.net`` (a partial network class, :mod:`src.lit.nets`; NCSN's ``model.arch`` as its ``model/net`` choice,
  with the keys that choice's config holds: :data:`NCSN_NETS`), in a run's config and in a checkpoint's recorded run;
- :func:`upgrade_run_overrides`: the flat network keys in the overrides of ``src.evaluate`` / ``src.sample``;
- :func:`old_override`: a command-line override in an old spelling: ``model.optimizer[.<name>].name=sgd`` (in
  recorded commands, e.g. benchmarks/results/separation.md) still works, read as
  ``model.optimizer[.<name>]._target_=torch.optim.SGD``; ``model.optimizer.scheduler`` and ``.params`` stop in one
  line naming today's spelling. So do the flat network keys (``model.arch=refinenet`` as ``model/net=refinenet``,
  ``model.ngf=16`` as ``model.net.ngf=16``), for the family the command composes (:func:`src.config.hydra_patch`
  finds it).

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


def upgrade_identity(identity: dict[str, Any], module: str | None = None) -> dict[str, Any]:
    """A recorded run identity (``{dotted key: value}``, :mod:`src.runs.identity`) of a run written by an older deqsm,
    as today's keys: while ``model.optimizer`` was a flat mapping, ``model.optimizer[.<name>]._target_`` /
    ``_partial_`` for ``.name``, ``model.scheduler.*`` for ``.scheduler``, ``.params`` dropped; while the network's
    sizes were flat (``model.ngf``), ``model.net.*`` (:func:`upgrade_net_mapping`; ``module``: the LightningModule's
    path when the identity does not record ``model._target_``). Today's identities unchanged."""
    identity = _upgrade_net_identity(dict(identity), module)
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


# The network keys that were flat model.* keys before model.net (issue 62), per family (its LightningModule), and the
# network model.net builds.
NET_TARGETS = {"dkef": "src.models.dkef.DKEF", "nice": "src.models.nice.build_nice",
               "vae": "src.models.vae.build_vae_networks", "ncsn": "src.models.ncsn.NCSN"}
FAMILY_OF_MODULE = {"src.lit.dkef.DKEFLitModule": "dkef", "src.lit.nice.NICELitModule": "nice",
                    "src.lit.vae.VAELitModule": "vae", "src.lit.ncsn.NCSNLitModule": "ncsn"}
FLAT_NET_KEYS = {
    "dkef": ("n_kernels", "n_inducing", "feature_dim", "hidden", "deq_width", "log_lambda_init", "q0_std", "exact_route"),
    "nice": ("n_couplings", "hidden", "deq_width"),
    "vae": ("arch", "latent_dim", "noise_dim", "hidden", "channels", "aug_init", "enc_channels", "likelihood",
            "log_sigma", "learn_sigma"),
    "ncsn": ("arch", "ngf", "conditioning", "cell", "scales", "groups", "cell_activation"),
}
# NCSN's old model.arch -> (its model/net choice, the keys conf/model/net/<choice>.yaml holds besides arch); the old
# flat config held every key for every arch, those a choice does not hold were unused by it
NCSN_NETS = {"deq": ("twores", ("ngf", "conditioning", "cell", "groups", "cell_activation")),
             "refinenet": ("refinenet", ("ngf", "conditioning")),
             "mdeq": ("mdeq", ("ngf", "conditioning", "cell", "scales", "groups", "cell_activation"))}
# the keys only some choices hold, and the value conf/model/ncsn.yaml gave each before model.net
NCSN_OPTIONAL = {"cell": "resblock", "scales": 2, "groups": 4, "cell_activation": "elu"}


def upgrade_net_mapping(model: dict[str, Any], family: str | None) -> dict[str, Any]:
    """An old run's ``model`` mapping (plain values) with its flat network keys moved into ``net`` (a new mapping);
    one that has ``net`` already, or of a family without one, as it is."""
    if family not in FLAT_NET_KEYS or "net" in model:
        return model
    out = dict(model)
    flat = {k: out.pop(k) for k in FLAT_NET_KEYS[family] if k in out}
    if family == "ncsn":  # a key the choice does not hold, at the value every old config wrote: not the run's own
        arch = flat.get("arch", "deq")
        keys = ("arch", *NCSN_NETS[arch][1]) if arch in NCSN_NETS else tuple(flat)
        flat = {k: v for k, v in flat.items() if k in keys or v != NCSN_OPTIONAL.get(k)}
    out["net"] = {"_target_": NET_TARGETS[family], "_partial_": True, **flat}
    return out


def upgrade_net_config(cfg: DictConfig) -> None:
    """A run config written while the network's sizes were flat ``model.*`` keys: today's ``model.net`` (in place;
    interpolations kept)."""
    model = cfg.get("model")
    if not isinstance(model, DictConfig) or "net" in model:
        return
    family = FAMILY_OF_MODULE.get(str(model.get("_target_")))
    if family is None:
        return
    cfg.model = upgrade_net_mapping(OmegaConf.to_container(model, resolve=False), family)


def _upgrade_net_identity(identity: dict[str, Any], module: str | None) -> dict[str, Any]:
    """``identity`` with a family's flat network keys (``model.ngf``) as ``model.net.*`` (:func:`upgrade_net_mapping`)."""
    family = FAMILY_OF_MODULE.get(str(identity.get("model._target_", module)))
    if family is None or any(k.startswith("model.net.") for k in identity):
        return identity
    flat = {k: identity[f"model.{k}"] for k in FLAT_NET_KEYS[family] if f"model.{k}" in identity}
    if not flat:
        return identity
    out = {k: v for k, v in identity.items() if not (k.startswith("model.") and k[len("model."):] in flat)}
    for key, value in upgrade_net_mapping(flat, family)["net"].items():
        out[f"model.net.{key}"] = value
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


FLAT_KEY = re.compile(r"^model\.(\w+)$")


def old_net_override(key: str, value: Any, family: str | None, text: str | None = None) -> tuple[str, Any] | None:
    """Today's ``(key, value)`` of an override of a flat network key of ``family`` (the model the command composes):
    ``model.<size>`` as ``model.net.<size>``, NCSN's ``model.arch`` as the ``model/net`` group choice (``deq`` ->
    ``twores``); None for any other key. An NCSN key that some choices' configs do not hold (``model.scales``: only
    ``mdeq``'s) is force-added (key ``++model.net.<k>``), as the flat key was accepted, and unused, by every arch."""
    match = FLAT_KEY.match(str(key))
    if family not in FLAT_NET_KEYS or not match or match.group(1) not in FLAT_NET_KEYS[family]:
        return None
    if family == "ncsn" and match.group(1) in NCSN_OPTIONAL:  # held by some choices only: set as before (``++``)
        return f"++model.net.{match.group(1)}", value
    if family != "ncsn" or match.group(1) != "arch":
        return f"model.net.{match.group(1)}", value
    if not (isinstance(value, str) and value in NCSN_NETS):
        raise ValueError(f"{text or f'{key}={value}'}: NCSN's network is the model/net group now (conf/model/net/): "
                         f"write model/net=twores (what model.arch=deq was), refinenet or mdeq")
    return "model/net", NCSN_NETS[value][0]


def upgrade_run_overrides(overrides: list[str], module: str | None) -> list[str]:
    """Overrides of a finished run's config (``src.evaluate``, ``src.sample``: ``key=value``) with the flat network keys
    of its family (``module``: its ``model._target_``) as today's ``model.net.*``; ``model.arch`` is refused in one
    line (a checkpoint is evaluated with the network it was trained with)."""
    family = FAMILY_OF_MODULE.get(str(module))
    out = []
    for override in overrides:
        key, _, value = override.partition("=")
        today = old_net_override(key.lstrip("+"), value, family, override)
        if today is not None and today[0] == "model/net":
            raise ValueError(f"{override}: a checkpoint is evaluated with the network it was trained with (its run's "
                             "model.net); leave the architecture out")
        out.append(override if today is None else f"{today[0].lstrip('+')}={value}")
    return out


def old_override(key: str, value: Any, sweep: bool = False, text: str | None = None,
                 family: str | None = None) -> tuple[str, Any] | None:
    """Today's ``(key, value)`` of a command-line override in an older spelling that still works (``sweep``: a
    sweep's value list cannot be translated, it is refused); None for any other override; a ``ValueError`` in one
    line for an old spelling that no longer works, naming today's (``text``: the override as typed). ``family``:
    the model the command composes (``ncsn``, ``dkef``, …; None: unknown), for the flat network keys
    (:func:`old_net_override`; a sweep over one is left to each of its jobs, which Hydra composes one by one)."""
    if sweep and FLAT_KEY.match(str(key)):
        return None
    net = old_net_override(key, value, family, text)
    if net is not None:
        return net
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
