"""Recompute the test metrics of a finished run from a checkpoint.

    python -m src.evaluate ckpt_path=outputs/train/runs/<time>/checkpoints/last.ckpt

The run's composed config is read from ``<run dir>/.hydra/config.yaml`` (the checkpoint's run directory);
any further ``key=value`` arguments override it (e.g. ``data.root=...``). The metrics are printed and
written to ``<run dir>/eval_metrics.json`` (the run's own metrics.json is never touched).
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import lightning.pytorch as L
from hydra.utils import instantiate
from omegaconf import DictConfig, OmegaConf

from src.checkpoints import AtomicCheckpointIO, check_checkpoint_file
from src.train import _print_metrics, set_float_environment, write_json_atomic


def find_run_config(ckpt: Path) -> Path:
    for parent in [ckpt.parent, *ckpt.parents]:
        cand = parent / ".hydra" / "config.yaml"
        if cand.is_file():
            return cand
    raise FileNotFoundError(
        f"no run config (.hydra/config.yaml) found above checkpoint {ckpt}; src.evaluate needs the run directory "
        "that src.train created (checkpoints/ and .hydra/ side by side)"
    )


def run_of_checkpoint(ckpt_path: str | Path, overrides: list[str] | None = None) -> tuple[Path, DictConfig, Path]:
    """The checkpoint (its file checked), its run's composed config with ``overrides`` merged, and the run
    directory (the parent of ``.hydra/``, whichever sub-folder of it holds the checkpoint)."""
    ckpt = check_checkpoint_file(ckpt_path)
    cfg_path = find_run_config(ckpt)
    cfg = OmegaConf.load(cfg_path)
    run_dir = cfg_path.parent.parent
    # paths.output_dir holds a ${hydra:...} interpolation when composed by Hydra: pin it to the run dir
    cfg.paths.output_dir = str(run_dir)
    if overrides:
        cfg = OmegaConf.merge(cfg, OmegaConf.from_dotlist(overrides))
    return ckpt, cfg, run_dir


def evaluate(ckpt_path: str | Path, overrides: list[str] | None = None) -> dict[str, Any]:
    ckpt, cfg, run_dir = run_of_checkpoint(ckpt_path, overrides)  # content checked once, as Lightning loads it
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
        plugins=[AtomicCheckpointIO()],
    )
    trainer.test(model, datamodule=datamodule, ckpt_path=str(ckpt), weights_only=False, verbose=False)
    metrics = dict(model.test_results)
    metrics["precision"] = str(trainer.precision)
    metrics["checkpoint"] = str(ckpt)
    write_json_atomic(run_dir / "eval_metrics.json", metrics)
    _print_metrics(metrics, run_dir / "eval_metrics.json")
    return metrics


def main(argv: list[str] | None = None) -> None:
    argv = list(sys.argv[1:] if argv is None else argv)
    ckpt = [a.split("=", 1)[1] for a in argv if a.startswith("ckpt_path=")]
    if not ckpt:
        raise SystemExit("usage: python -m src.evaluate ckpt_path=<run dir>/checkpoints/last.ckpt [key=value ...]")
    evaluate(ckpt[0], [a for a in argv if not a.startswith("ckpt_path=")])


if __name__ == "__main__":
    main()
