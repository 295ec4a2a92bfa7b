"""Load a trained run: the one home of checkpoint → run config → module.

A run directory (``src.train``'s) holds ``.hydra/config.yaml`` and ``checkpoints/``. :func:`run_of_checkpoint`
checks the checkpoint file (:mod:`src.runtime.checkpoints`), finds and reads the run's composed config (an older
run's read back as today's, :mod:`src.config.old_runs`), merges command-line overrides and applies the trust policy
(:func:`check_targets`: only deqsm classes are built from a run's config unless the user trusts it);
:func:`load_module` builds the LightningModule and its data module and loads the weights, weights-only unless
trusted (:func:`parse_trust` reads ``trust_checkpoint=true|false``). ``src.evaluate``, ``src.sample`` and the
benchmarks all load runs through here.
"""

from __future__ import annotations

from pathlib import Path

import lightning.pytorch as L
from hydra.utils import instantiate
from omegaconf import DictConfig, OmegaConf

from src.config.old_runs import (
    clear_stale_norm_of_normalized_block,
    upgrade_net_config,
    upgrade_optimizer_config,
    upgrade_run_overrides,
)
from src.runtime.checkpoints import (
    TRUST_HINT,
    UnsafeCheckpointError,
    check_checkpoint_file,
    check_matches_model,
    load_checked,
)
from src.runtime.environment import set_float_environment


def find_run_config(ckpt: Path) -> Path:
    for parent in [ckpt.parent, *ckpt.parents]:
        cand = parent / ".hydra" / "config.yaml"
        if cand.is_file():
            return cand
    raise FileNotFoundError(
        f"no run config (.hydra/config.yaml) found above checkpoint {ckpt}; src.evaluate needs the run directory "
        "that src.train created (checkpoints/ and .hydra/ side by side)"
    )


# what a run's config may build without trust: deqsm classes, and torch's optimisers and schedulers (built partial,
# on the module's parameters: no file read, no code run)
SAFE_TARGETS = ("src.", "torch.optim.")


def check_targets(cfg: DictConfig, cfg_path: Path, trust: bool = False) -> None:
    """A run's config is a file too: the ``_target_`` s under ``model`` and ``data`` (what src.evaluate and
    src.sample instantiate) must be deqsm classes (``src.…``) or ``torch.optim`` ones (:data:`SAFE_TARGETS`), unless the user trusts the run directory: a
    shared run's config naming ``torch.load`` of a file in the run (unpickling runs code) or
    ``pathlib.Path.unlink`` would otherwise be called (Hydra's blocklist stops ``os.system``, ``subprocess``,
    ``shutil.rmtree``…, not these: measured)."""
    if trust:
        return
    for section in ("model", "data"):
        node = OmegaConf.to_container(cfg.get(section) or {}, resolve=False)
        stack = [(section, node)]
        while stack:
            where, value = stack.pop()
            if isinstance(value, dict):
                target = value.get("_target_")
                if target is not None and not str(target).startswith(SAFE_TARGETS):
                    raise UnsafeCheckpointError(
                        f"run config {cfg_path} has {where}._target_={target}: src.evaluate and src.sample build only "
                        f"deqsm classes (src.…) from a run's config; if you trust this run directory, add {TRUST_HINT}")
                stack += [(f"{where}.{k}", v) for k, v in value.items()]
            elif isinstance(value, list):
                stack += [(f"{where}[{i}]", v) for i, v in enumerate(value)]


def run_of_checkpoint(ckpt_path: str | Path, overrides: list[str] | None = None,
                      trust: bool = False) -> tuple[Path, DictConfig, Path]:
    """The checkpoint (its file checked), its run's composed config with ``overrides`` merged (its targets
    checked, :func:`check_targets`), and the run directory (the parent of ``.hydra/``, whichever sub-folder of it
    holds the checkpoint)."""
    ckpt = check_checkpoint_file(ckpt_path)
    cfg_path = find_run_config(ckpt)
    cfg = OmegaConf.load(cfg_path)
    run_dir = cfg_path.parent.parent
    # paths.output_dir holds a ${hydra:...} interpolation when composed by Hydra: pin it to the run dir
    cfg.paths.output_dir = str(run_dir)
    clear_stale_norm_of_normalized_block(cfg)  # a run of an older deqsm (src.config.old_runs)
    upgrade_optimizer_config(cfg)
    upgrade_net_config(cfg)
    if overrides:
        extra = OmegaConf.from_dotlist(upgrade_run_overrides(list(overrides), cfg.model.get("_target_")))
        for key in extra:
            if isinstance(cfg.get(key), DictConfig) and not isinstance(extra[key], DictConfig):
                family = cfg[key].get("_target_", "") if key == "model" else ""
                raise ValueError(  # noqa: TRY004  a bad command-line value
                    f"{key}={extra[key]} would replace the run's whole {key} config with a string: the checkpoint "
                    f"is evaluated with the config it was trained with{f' ({family})' if family else ''}; "
                    f"override single keys instead (e.g. {key}.<name>=<value>)")
        cfg = OmegaConf.merge(cfg, extra)
    check_targets(cfg, cfg_path, trust)
    return ckpt, cfg, run_dir


def load_module(ckpt_path: str | Path, overrides: list[str] | None = None, trust: bool = False):
    """The LightningModule of ``ckpt_path`` with its weights loaded (EMA-averaged for ``ema=true`` runs), in
    eval mode and the run's precision, with its data module set up for testing: ``(module, datamodule,
    config, run directory)``."""
    ckpt, cfg, run_dir = run_of_checkpoint(ckpt_path, overrides, trust)
    set_float_environment(cfg)
    L.seed_everything(int(cfg.seed), workers=True)
    datamodule = instantiate(cfg.data)
    model = instantiate(cfg.model)
    state = load_checked(ckpt, trust=trust)
    check_matches_model(state, model, ckpt)
    model.load_state_dict(state["state_dict"])
    precision = str(cfg.trainer.get("precision", "32-true"))
    if precision.startswith("64"):
        model = model.double()
    datamodule.prepare_data()
    datamodule.setup("test")
    model.attach_datamodule(datamodule)
    model.eval()
    return model, datamodule, cfg, run_dir


def split_arguments(argv: list[str], own_keys: tuple[str, ...]) -> tuple[dict[str, str], list[str]]:
    """An entry point's ``key=value`` arguments: ``({key: value} of its own keys, the run-config overrides)``
    (``src.evaluate``: ``ckpt_path``, ``trust_checkpoint``; ``src.sample`` adds ``n``, ``seed``, ``out``)."""
    own = {a.split("=", 1)[0]: a.split("=", 1)[1] for a in argv if a.split("=", 1)[0] in own_keys and "=" in a}
    return own, [a for a in argv if a.split("=", 1)[0] not in own_keys]


def parse_trust(value: str) -> bool:
    """``trust_checkpoint=true|false`` of the command line."""
    if str(value).lower() not in ("true", "false"):
        raise SystemExit(f"trust_checkpoint={value}: true or false")
    return str(value).lower() == "true"
