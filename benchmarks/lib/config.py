"""The training config a study builds its modules from, composed as ``python -m src.train`` composes it."""

from __future__ import annotations

from hydra import compose, initialize_config_dir
from hydra.core.global_hydra import GlobalHydra
from omegaconf import DictConfig

from benchmarks.lib.results import ROOT


def train_config(overrides: list[str], conf_dir: str | None = None) -> DictConfig:
    """``conf/train.yaml`` with ``overrides`` (no Hydra run: nothing is written); clears a Hydra left initialised
    by an earlier call, so a study can compose several configs in one process. ``conf_dir``: another tree's
    ``conf`` (a revision's, :func:`benchmarks.lib.step_cases.snapshot`), this repository's by default."""
    GlobalHydra.instance().clear()
    with initialize_config_dir(config_dir=str(conf_dir or ROOT / "conf"), version_base="1.3"):
        return compose(config_name="train", overrides=list(overrides))
