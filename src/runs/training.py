"""Training as a library: compose -> instantiate -> fit -> test -> ``<run dir>/metrics.json``.

:func:`train` runs one composed config (what ``python -m src.train`` does inside its run directory, and what the
tests call in-process); :func:`optimized_value` is the value a sweeper reads. The command line is the thin
entry point :mod:`src.train`.
"""

from __future__ import annotations

import functools
import logging
import time
from pathlib import Path
from typing import Any

import lightning.pytorch as L
import torch
from hydra.core.hydra_config import HydraConfig
from hydra.utils import instantiate
from lightning.pytorch.callbacks import ModelCheckpoint, ProgressBar
from omegaconf import DictConfig, OmegaConf, open_dict

from src.callbacks.checkpoint import LastCheckpoint
from src.callbacks.ema import check_resume
from src.callbacks.profiling import ProfilingCallback
from src.config.family_data import check_family_data
from src.metrics.presets import apply_eval_preset
from src.runs.build import build
from src.runs.identity import ALLOW_KEY, check_same_run, run_identity
from src.runs.identity import CHECKPOINT_KEY as IDENTITY_KEY
from src.runtime.atomic import atomic_file, write_json_atomic
from src.runtime.checkpoints import (
    AtomicCheckpointIO,
    check_matches_model,
    load_checked,
    remove_stale_temporaries,
)
from src.runtime.environment import print_metrics, set_float_environment

log = logging.getLogger(__name__)


def _instantiate_group(group: DictConfig | None) -> list:
    if not group:
        return []
    return [build(conf) for conf in group.values() if isinstance(conf, DictConfig) and "_target_" in conf]


def validate_config(cfg: DictConfig) -> None:
    """Start-up checks that turn an impossible combination into one clear message, before anything is built."""
    # Single-group values (depth, deq.*, data and model keys) are checked where they are used, once: the deq group
    # where the module is built (src.lit.base.DeqsmModule parses it with src.deq.config, which refuses every DEQ
    # combination a family cannot run, loss=cp with the implicit backward included). Here only what must be
    # refused before the data are built.
    check_family_data(cfg)  # model=ncsn / model=vae on the default (non-image) data: one line naming the data


def follow_optimization_mode(trainer_cfg: DictConfig, model: L.LightningModule) -> DictConfig:
    """The trainer config for ``model``'s optimisation mode. Lightning refuses ``gradient_clip_val`` with
    manual optimisation (a family with alternating updates); then the clipping moves into the model, whose
    ``manual_update`` applies it, so ``trainer.gradient_clip_val`` means the same in both modes."""
    if model.automatic_optimization or not trainer_cfg.get("gradient_clip_val"):
        return trainer_cfg
    trainer_cfg = trainer_cfg.copy()
    with open_dict(trainer_cfg):
        model.manual_clip = {"gradient_clip_val": float(trainer_cfg.pop("gradient_clip_val")),
                             "gradient_clip_algorithm": trainer_cfg.pop("gradient_clip_algorithm", None) or "norm"}
    return trainer_cfg


def follow_ddp_needs(trainer_cfg: DictConfig, model: L.LightningModule) -> DictConfig:
    """``trainer.strategy=ddp`` for a module whose backward passes each reach only part of it (the VAE's two
    manual optimisers: ``ddp_find_unused_parameters = True``, which says why) becomes Lightning's
    ``ddp_find_unused_parameters_true``. Any other strategy the user names is kept as given."""
    if not getattr(model, "ddp_find_unused_parameters", False) or trainer_cfg.get("strategy") != "ddp":
        return trainer_cfg
    trainer_cfg = trainer_cfg.copy()
    with open_dict(trainer_cfg):
        trainer_cfg.strategy = "ddp_find_unused_parameters_true"
    return trainer_cfg


def one_last_checkpoint(callbacks: list) -> None:
    """``last.ckpt`` has one writer, :class:`~src.callbacks.checkpoint.LastCheckpoint` (which writes every
    checkpoint as it first): a ``ModelCheckpoint`` asked for ``save_last`` beside it would add ``last-v1.ckpt``,
    so its ``save_last`` is switched off (last.ckpt is there all the same)."""
    if not any(isinstance(cb, LastCheckpoint) for cb in callbacks):
        return
    for cb in callbacks:
        if isinstance(cb, ModelCheckpoint) and cb.save_last:
            log.info("ModelCheckpoint(save_last=%s) -> false: last.ckpt is written by callbacks.last_checkpoint",
                     cb.save_last)
            cb.save_last = False


def output_dir(cfg: DictConfig) -> Path:
    try:
        return Path(cfg.paths.output_dir)
    except Exception:  # noqa: BLE001  composed without a Hydra run (tests): fall back to the trainer's root dir
        return Path(cfg.trainer.get("default_root_dir") or ".")


def _wandb_group(cfg: DictConfig) -> str | None:
    try:
        hc = HydraConfig.get()
    except ValueError:
        return None
    if hc.mode is not None and hc.mode.name == "MULTIRUN":
        return Path(hc.sweep.dir).name
    return None


def save_run_config(cfg: DictConfig) -> Path | None:
    """Rewrite ``<run dir>/.hydra/config.yaml`` with ``cfg`` as it runs: Hydra saves the composed config before the
    task starts, and the evaluation preset (and a sweep's W&B group) is resolved into the config after that, so
    without this the saved config would not be the one that ran (``src.evaluate`` and ``src.sample`` read it).
    Written atomically, on global rank 0 of a Hydra run that saves its config; the path, or None."""
    from lightning.fabric.utilities.rank_zero import rank_zero_only

    try:
        hc = HydraConfig.get()
    except ValueError:  # composed without a Hydra run (tests, tools): nothing was saved
        return None
    if hc.output_subdir is None or getattr(rank_zero_only, "rank", 0) != 0:
        return None
    path = Path(hc.runtime.output_dir) / hc.output_subdir / "config.yaml"
    with atomic_file(path, "w") as fh:
        fh.write(OmegaConf.to_yaml(cfg))
    return path


def train(cfg: DictConfig) -> dict[str, Any]:
    """Train and test one configuration; return the metrics written to ``metrics.json``."""
    validate_config(cfg)
    # the config is settled before anything is built, and saved as it will run (save_run_config)
    eval_record = apply_eval_preset(cfg)  # eval=quick|standard|paper|auto: the test phase's cost, logged
    group = _wandb_group(cfg)
    if group and cfg.get("logger") and "wandb" in cfg.logger:
        with open_dict(cfg):
            cfg.logger.wandb.group = group  # multirun jobs: one W&B run each, grouped by sweep
    save_run_config(cfg)
    set_float_environment(cfg)
    L.seed_everything(cfg.seed, workers=True)
    out_dir = output_dir(cfg)

    datamodule: L.LightningDataModule = build(cfg.data)
    model: L.LightningModule = build(cfg.model)
    callbacks = _instantiate_group(cfg.get("callbacks"))  # every callback from the callbacks group
    if not cfg.trainer.get("enable_progress_bar", True):  # a progress-bar callback would contradict it
        callbacks = [cb for cb in callbacks if not isinstance(cb, ProgressBar)]
    # A resume's checkpoint is checked before anything starts (loggers, W&B, the trainer): weights-only unless
    # trust_checkpoint=true, of this model's family and shapes (no override can allow another), of this run's
    # objective, sizes, DEQ settings and data unless resume_allow names the key (src.runs.identity), and an EMA
    # checkpoint is refused without ema=true; read memory-mapped here, and checked again as Lightning loads it.
    # Every checkpoint written holds this run's identity for that check.
    trust = bool(cfg.get("trust_checkpoint", False))
    identity = run_identity(cfg)
    validators = [functools.partial(check_matches_model, model=model),
                  functools.partial(check_same_run, identity=identity, allow=cfg.get(ALLOW_KEY) or ()),
                  functools.partial(check_resume, callbacks=callbacks)]
    if cfg.get("ckpt_path"):
        saved = load_checked(cfg.ckpt_path, trust=trust, mmap=True)
        for check in validators:
            check(saved, path=cfg.ckpt_path)
        del saved
        remove_stale_temporaries(Path(cfg.ckpt_path).parent)  # a killed save's leftovers
    loggers = _instantiate_group(cfg.get("logger"))
    trainer_cfg = follow_optimization_mode(cfg.trainer, model)
    trainer_cfg = follow_ddp_needs(trainer_cfg, model)
    if cfg.get("ckpt_path"):
        # No sanity validation when resuming: run mid-training it has side effects an uninterrupted run does
        # not have at that point (it draws from the global RNG as its loader starts, refits evaluation state),
        # and the resumed run would drift from the uninterrupted one. The checkpoint was validated already.
        trainer_cfg = trainer_cfg.copy()
        with open_dict(trainer_cfg):
            trainer_cfg.num_sanity_val_steps = 0
    one_last_checkpoint(callbacks)
    checkpoint_io = AtomicCheckpointIO(validators=validators, trust=trust, stamp={IDENTITY_KEY: identity})
    trainer: L.Trainer = instantiate(trainer_cfg, callbacks=callbacks, logger=loggers or False,
                                     plugins=[checkpoint_io])
    for lg in loggers:
        lg.log_hyperparams(OmegaConf.to_container(cfg, resolve=True))

    n_params = sum(p.numel() for p in model.parameters())
    log.info("model: %s, %d parameters; output dir: %s", type(model).__name__, n_params, out_dir)
    t_fit, c_fit = time.perf_counter(), time.process_time()
    trainer.fit(model, datamodule=datamodule, ckpt_path=cfg.get("ckpt_path"), weights_only=not trust)

    metrics: dict[str, Any] = {
        "n_params": n_params,
        "global_step": trainer.global_step,
        "epochs": trainer.current_epoch,
        "time/fit_s": time.perf_counter() - t_fit,  # wall time of fit: start-up probes, validation, training
        "time/fit_cpu_s": time.process_time() - c_fit,  # its CPU time, all threads (the figure on a busy machine)
    }
    for key, value in trainer.callback_metrics.items():
        if key.startswith(("val/", "train/")) and torch.is_tensor(value) and value.numel() == 1:
            metrics[key] = value.item()
    for cb in callbacks:
        if isinstance(cb, ProfilingCallback):
            metrics.update(cb.summary)
    # the best-checkpoint callback (trainer.checkpoint_callback is the first Checkpoint, maybe last_checkpoint)
    ckpt_cb = next((cb for cb in trainer.checkpoint_callbacks if isinstance(cb, ModelCheckpoint)), None)
    best = getattr(ckpt_cb, "best_model_path", "") if ckpt_cb is not None else ""
    if best and getattr(ckpt_cb, "monitor", None) and ckpt_cb.best_model_score is not None:
        metrics[f"best/{ckpt_cb.monitor}"] = float(ckpt_cb.best_model_score)

    if trainer.world_size > 1:
        metrics.update(ddp_consistency(trainer, model))
    if cfg.get("test", True):
        # every rank tests its shard of the test set; the metrics are reduced across ranks (torchmetrics)
        t_test, c_test = time.perf_counter(), time.process_time()
        trainer.test(model, datamodule=datamodule, ckpt_path=best or None, weights_only=True)
        metrics["time/test_s"] = time.perf_counter() - t_test  # the test phase's wall time (eval preset's cost)
        metrics["time/test_cpu_s"] = time.process_time() - c_test
        log.info("test phase (eval=%s): %.1f s wall / %.1f s CPU, after fit %.1f s wall / %.1f s CPU",
                 eval_record["eval/preset"], metrics["time/test_s"], metrics["time/test_cpu_s"],
                 metrics["time/fit_s"], metrics["time/fit_cpu_s"])
        metrics.update(model.test_results)
        metrics.update(eval_record)  # the preset and the sample counts behind the test figures
        metrics["tested_checkpoint"] = best or "final weights"
    if not trainer.is_global_zero:
        return metrics

    metrics["config"] = OmegaConf.to_container(cfg, resolve=True)
    write_json_atomic(out_dir / "metrics.json", metrics)
    for lg in loggers:
        if hasattr(lg, "log_metrics"):
            lg.log_metrics({k: v for k, v in metrics.items() if isinstance(v, (int, float))})
    print_metrics(metrics, out_dir / "metrics.json")
    return metrics


def parameter_fingerprint(model: torch.nn.Module) -> float:
    """A float64 fingerprint of all parameters (sum of |p| weighted by position), for cross-rank checks."""
    total = torch.zeros((), dtype=torch.float64)
    for i, p in enumerate(model.parameters()):
        flat = p.detach().double().flatten().cpu()
        total += (flat.abs() * torch.arange(1, flat.numel() + 1, dtype=torch.float64)).sum() * (i + 1)
    return total.item()


def ddp_consistency(trainer: L.Trainer, model: L.LightningModule) -> dict[str, Any]:
    """Gather every rank's parameter fingerprint: DDP must leave identical parameters on all ranks."""
    fp = torch.tensor([parameter_fingerprint(model)], dtype=torch.float64, device=model.device)
    gathered = trainer.strategy.all_gather(fp).flatten().tolist()
    return {"ddp/world_size": trainer.world_size, "ddp/param_fingerprints": gathered,
            "ddp/ranks_identical": len(set(gathered)) == 1}


class OptimizedMetricNotLogged(RuntimeError):
    """A sweep trial never logged the ``optimized_metric`` the sweeper optimises: the trial fails."""


def sweeper_needs_value() -> bool:
    """Whether this job is a trial of a sweeper that optimises its return value (Optuna), not a plain sweep."""
    try:
        hc = HydraConfig.get()
    except ValueError:
        return False
    target = str(OmegaConf.select(hc, "sweeper._target_") or "")
    return hc.mode is not None and hc.mode.name == "MULTIRUN" and "optuna" in target.lower()


def optimized_value(metrics: dict[str, Any], cfg: DictConfig, required: bool = False) -> float | None:
    """The value of ``cfg.optimized_metric`` for a sweeper: the best checkpoint's score when checkpoints
    monitor it, else the metric's last logged value. When the run never logged it: a warning and None, or with
    ``required`` (a trial of an optimising sweeper) :class:`OptimizedMetricNotLogged`, one sentence that the
    sweep reports as the trial's failure (src.reports.optuna_sweep) before it goes on."""
    key = cfg.get("optimized_metric")
    if not key:
        return None
    value = metrics.get(f"best/{key}", metrics.get(key))
    if value is None:
        stage = key.split("/", 1)[0] + "/"
        logged = sorted(k for k in metrics if k.startswith(stage) and not k.startswith(f"{stage}deq_"))
        steps = OmegaConf.select(cfg, "trainer.max_steps")
        where = (f"logged {stage} keys: {', '.join(logged)}" if logged else
                 f"no {stage} key at all: the run ended at global step {metrics.get('global_step')} "
                 f"(trainer.max_steps={steps}) before its first validation")
        message = (f"optimized_metric={key} was never logged by this run ({where}); validate before the run "
                   "ends (more steps, trainer.val_check_interval) or optimise a logged key")
        if required:
            raise OptimizedMetricNotLogged(message)
        log.warning(message)
        return None
    return float(value)
