"""Recompute the test metrics of a finished run from a checkpoint.

    python -m src.evaluate ckpt_path=outputs/train/runs/<time>/checkpoints/last.ckpt [trust_checkpoint=true]

The run's composed config is read from ``<run dir>/.hydra/config.yaml`` (the checkpoint's run directory);
any further ``key=value`` arguments override it (e.g. ``data.root=...``). The metrics are printed and
written to ``<run dir>/eval_metrics.json`` (the run's own metrics.json is never touched). The checkpoint loads
weights-only (:mod:`src.checkpoints`); ``trust_checkpoint=true`` loads one holding other pickled objects (only
a file you trust). A checkpoint of another family or other sizes is refused in one line naming both.
"""

from __future__ import annotations

import functools
import sys
from pathlib import Path
from typing import Any

import lightning.pytorch as L
from hydra.utils import instantiate
from omegaconf import DictConfig, OmegaConf

from src.checkpoints import (
    TRUST_HINT,
    AtomicCheckpointIO,
    UnsafeCheckpointError,
    check_checkpoint_file,
    check_matches_model,
)
from src.configs import moved_override_message, refuse_moved_keys
from src.metrics.presets import apply_eval_preset
from src.runtime import print_metrics, set_float_environment, write_json_atomic

_OWN_KEYS = ("ckpt_path", "trust_checkpoint")


def find_run_config(ckpt: Path) -> Path:
    for parent in [ckpt.parent, *ckpt.parents]:
        cand = parent / ".hydra" / "config.yaml"
        if cand.is_file():
            return cand
    raise FileNotFoundError(
        f"no run config (.hydra/config.yaml) found above checkpoint {ckpt}; src.evaluate needs the run directory "
        "that src.train created (checkpoints/ and .hydra/ side by side)"
    )


def check_targets(cfg: DictConfig, cfg_path: Path, trust: bool = False) -> None:
    """A run's config is a file too: the ``_target_`` s under ``model`` and ``data`` (what src.evaluate and
    src.sample instantiate) must be deqsm classes (``src.…``), unless the user trusts the run directory: a
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
                if target is not None and not str(target).startswith("src."):
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
    refuse_moved_keys(cfg, f"run config {cfg_path} (of an older version: rename the key there)")
    if overrides:
        message = moved_override_message(o.split("=", 1)[0] for o in overrides)
        if message is not None:
            raise ValueError(message)
        extra = OmegaConf.from_dotlist(overrides)
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


def evaluate(ckpt_path: str | Path, overrides: list[str] | None = None, trust: bool = False) -> dict[str, Any]:
    """Test metrics of ``ckpt_path`` (its run's config, ``overrides`` merged); ``trust``: load a checkpoint
    holding pickled objects other than tensors and plain values (module docstring)."""
    ckpt, cfg, run_dir = run_of_checkpoint(ckpt_path, overrides, trust)  # content checked as Lightning loads it
    # the run's evaluation preset, chosen as src.train chose it (keys given here win): the same test again
    eval_record = apply_eval_preset(cfg, explicit=[o.split("=", 1)[0].lstrip("+") for o in overrides or []])
    set_float_environment(cfg)
    L.seed_everything(cfg.seed, workers=True)
    datamodule = instantiate(cfg.data)
    model = instantiate(cfg.model)
    test_share = cfg.trainer.get("limit_test_batches")
    trainer = L.Trainer(
        accelerator=cfg.trainer.get("accelerator", "cpu"), devices=1, logger=False, inference_mode=False,
        precision=cfg.trainer.get("precision", "32-true"),  # the run's precision: float64 runs stay float64
        # the run's share of the test set (e.g. experiment=ncsn_mnist tests 2 batches): the same metrics as its
        # own test, and not the whole test set at 10 noise levels x (DSM + SSM-VR) each
        limit_test_batches=1.0 if test_share is None else test_share,
        enable_progress_bar=False, enable_model_summary=False, default_root_dir=str(run_dir),
        plugins=[AtomicCheckpointIO(validators=[functools.partial(check_matches_model, model=model)], trust=trust)],
    )
    trainer.test(model, datamodule=datamodule, ckpt_path=str(ckpt), weights_only=not trust, verbose=False)
    metrics = {**eval_record, **model.test_results}
    metrics["precision"] = str(trainer.precision)
    metrics["checkpoint"] = str(ckpt)
    write_json_atomic(run_dir / "eval_metrics.json", metrics)
    print_metrics(metrics, run_dir / "eval_metrics.json")
    return metrics


def main(argv: list[str] | None = None) -> None:
    argv = list(sys.argv[1:] if argv is None else argv)
    own = {a.split("=", 1)[0]: a.split("=", 1)[1] for a in argv if a.split("=", 1)[0] in _OWN_KEYS and "=" in a}
    if "ckpt_path" not in own:
        raise SystemExit("usage: python -m src.evaluate ckpt_path=<run dir>/checkpoints/last.ckpt "
                         "[trust_checkpoint=true] [key=value ...]")
    evaluate(own["ckpt_path"], [a for a in argv if a.split("=", 1)[0] not in _OWN_KEYS],
             trust=parse_trust(own.get("trust_checkpoint", "false")))


def parse_trust(value: str) -> bool:
    """``trust_checkpoint=true|false`` of the command line."""
    if str(value).lower() not in ("true", "false"):
        raise SystemExit(f"trust_checkpoint={value}: true or false")
    return str(value).lower() == "true"


if __name__ == "__main__":
    main()
