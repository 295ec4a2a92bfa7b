"""Recompute the test metrics of a finished run from a checkpoint (what ``python -m src.evaluate`` runs).

The run's composed config is read back (:mod:`src.runs.load`), its evaluation preset chosen as ``src.train``
chose it, and the metrics written to ``<run dir>/eval_metrics.json`` (the run's own metrics.json is never
touched).
"""

from __future__ import annotations

import functools
from pathlib import Path
from typing import Any

import lightning.pytorch as L
from hydra.utils import instantiate

from src.metrics.presets import apply_eval_preset
from src.runs.load import run_of_checkpoint
from src.runtime import progress
from src.runtime.atomic import write_json_atomic
from src.runtime.checkpoints import AtomicCheckpointIO, check_matches_model
from src.runtime.environment import print_metrics, set_float_environment


def evaluate(ckpt_path: str | Path, overrides: list[str] | None = None, trust: bool = False) -> dict[str, Any]:
    """Test metrics of ``ckpt_path`` (its run's config, ``overrides`` merged); ``trust``: load a checkpoint
    holding pickled objects other than tensors and plain values (module docstring)."""
    progress.ensure_log_lines()
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
        # the long phases (Langevin sampling, AIS, FID) show progress: a bar, or log lines in a log file
        callbacks=[progress.test_progress_bar()], enable_model_summary=False, default_root_dir=str(run_dir),
        plugins=[AtomicCheckpointIO(validators=[functools.partial(check_matches_model, model=model)], trust=trust)],
    )
    trainer.test(model, datamodule=datamodule, ckpt_path=str(ckpt), weights_only=not trust, verbose=False)
    metrics = {**eval_record, **model.test_results}
    metrics["precision"] = str(trainer.precision)
    metrics["checkpoint"] = str(ckpt)
    write_json_atomic(run_dir / "eval_metrics.json", metrics)
    print_metrics(metrics, run_dir / "eval_metrics.json")
    return metrics
