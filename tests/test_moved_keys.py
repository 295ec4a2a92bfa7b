"""One ``model.metrics`` tree for every evaluation setting (issue 24): the old ``model.evaluation.*`` keys are
refused in one line naming the new key — on the command line, in an experiment file, in an old run's saved
config — and the new keys reach the modules with the values the old ones had."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch
from hydra.errors import ConfigCompositionException
from omegaconf import OmegaConf, open_dict

import src  # noqa: F401  (installs src.config.hydra_patch, as every entry point does)
from src.runs.build import build
from src.runs.load import run_of_checkpoint
from tests.conftest import FAST, REPO_ROOT, compose_train


@pytest.mark.parametrize("override, new", [
    ("model.evaluation.ll_samples=10", "model.metrics.log_likelihood.samples"),
    ("+model.evaluation.ll_samples=10", "model.metrics.log_likelihood.samples"),
    ("model.evaluation.ll_proposal_std=1.5", "model.metrics.log_likelihood.proposal_std"),
    ("model.evaluation.alpha_fit_points=48", "model.alpha_refit_points"),
    ("model.evaluation.ais.n_steps=5", "model.metrics.log_likelihood.ais.n_steps"),
    ("++model.evaluation.ais.schedule=linear", "model.metrics.log_likelihood.ais.schedule"),
    ("model.evaluation.ais.test_points=8", "model.metrics.log_likelihood.test_points"),
    ("model.evaluation.ais.seed=3", "model.metrics.log_likelihood.seed"),
    ("model.evaluation.val_sm_points=4", "model.metrics.exact_sm.val_points"),
])
def test_old_override_is_refused_naming_the_new_key(override, new):
    old = override.split("=", 1)[0].lstrip("+")
    with pytest.raises(ConfigCompositionException) as info:
        compose_train(["experiment=vae_mnist" if ".ais." in override else "model=dkef", override])
    assert str(info.value) == f"{old} is now {new} (model.evaluation was removed)"


def test_unknown_old_key_lists_where_every_setting_went():
    with pytest.raises(ConfigCompositionException) as info:
        compose_train(["+model.evaluation.n_points=3"])
    message = str(info.value)
    assert "\n" not in message
    assert message.startswith("model.evaluation.n_points is not a key: model.evaluation was removed")
    assert "ll_samples -> model.metrics.log_likelihood.samples" in message
    assert "alpha_fit_points -> model.alpha_refit_points" in message


def test_old_key_in_an_experiment_file_is_refused(tmp_path):
    (tmp_path / "experiment").mkdir()
    (tmp_path / "experiment" / "mine.yaml").write_text(
        "# @package _global_\ndefaults:\n  - override /model: dkef\nmodel:\n  evaluation:\n    ll_samples: 5\n")
    with pytest.raises(ConfigCompositionException) as info:
        compose_train([f"hydra.searchpath=[file://{tmp_path}]", "experiment=mine"])
    assert str(info.value) == ("a config file: model.evaluation.ll_samples is now "
                               "model.metrics.log_likelihood.samples (model.evaluation was removed)")


def test_old_key_on_the_command_line_is_one_line_before_training(tmp_path):
    cmd = [sys.executable, "-m", "src.train", *FAST, "model.evaluation.ll_samples=2000", f"hydra.run.dir={tmp_path}"]
    done = subprocess.run(cmd, check=False, cwd=REPO_ROOT, capture_output=True, text=True, timeout=300,
                          env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert done.returncode != 0
    assert ("model.evaluation.ll_samples is now model.metrics.log_likelihood.samples (model.evaluation was "
            "removed)") in done.stderr
    assert "Traceback" not in done.stderr and "Epoch" not in done.stdout + done.stderr


def test_old_run_config_is_refused_by_evaluate(tmp_path):
    """A run directory written before the move: src.evaluate / src.sample name the file and the new key."""
    cfg = compose_train(["model=dkef"], tmp_path)
    with open_dict(cfg):
        cfg.model.evaluation = {"alpha_fit_points": 500}
    (tmp_path / ".hydra").mkdir()
    OmegaConf.save(cfg, tmp_path / ".hydra" / "config.yaml")
    (tmp_path / "checkpoints").mkdir()
    torch.save({}, tmp_path / "checkpoints" / "last.ckpt")
    with pytest.raises(ValueError) as info:
        run_of_checkpoint(tmp_path / "checkpoints" / "last.ckpt")
    assert str(info.value) == (f"run config {tmp_path / '.hydra' / 'config.yaml'} (of an older version: rename the "
                               "key there): model.evaluation.alpha_fit_points is now model.alpha_refit_points "
                               "(model.evaluation was removed)")
    with open_dict(cfg):
        del cfg.model["evaluation"]
    OmegaConf.save(cfg, tmp_path / ".hydra" / "config.yaml")
    with pytest.raises(ValueError, match=r"^model\.evaluation\.ais\.n_steps is now model\.metrics\.log_likelihood"
                                         r"\.ais\.n_steps \(model\.evaluation was removed\)$"):
        run_of_checkpoint(tmp_path / "checkpoints" / "last.ckpt", ["model.evaluation.ais.n_steps=5"])


def test_new_keys_reach_the_modules_with_the_old_defaults():
    dkef = build(compose_train(["model=dkef", "data.dim=2"]).model)
    assert dkef.alpha_refit_points == 1000
    assert dkef.log_likelihood_options == {"samples": 100_000, "proposal_std": 2.0}
    dkef = build(compose_train(["experiment=dkef_gaussian", "data.dim=2", "model.n_inducing=4"]).model)
    assert dkef.alpha_refit_points == 500 and dkef.log_likelihood_options["samples"] == 1_000_000
    dkef = build(compose_train(["model=dkef", "data.dim=2", "model.metrics.log_likelihood=null"]).model)
    assert dkef.log_likelihood_options is None  # switched off: no log Z is estimated
    vae = build(compose_train(["experiment=vae_mnist", "model.hidden=8", "model.channels=4"]).model)
    assert (vae.ais_points, vae.ais_seed) == (100, 0)  # the experiment's 100 test images
    assert vae.ais_cfg == {"n_steps": 1000, "n_chains": 16, "leapfrog": 10, "step_size": 0.05,
                           "target_accept": 0.65, "schedule": "sigmoid"}


@pytest.mark.parametrize("overrides, expected", [
    (["model=dkef", "++model.metrics.log_likelihood.sample=5"],
     "model.metrics.log_likelihood: unknown key(s) ['sample']; valid: samples, proposal_std"),
    (["experiment=vae_mnist", "++model.metrics.log_likelihood.ais.steps=5"],
     ("model.metrics.log_likelihood.ais: unknown key(s) ['steps']; valid: n_steps, n_chains, leapfrog, step_size, "
      "target_accept, schedule")),
    (["model=nice", "data=mnist", "++model.metrics.log_likelihood.samples=5"],
     "model.metrics.log_likelihood: unknown key(s) ['samples']; valid: none"),
])
def test_unknown_log_likelihood_option_is_one_line(overrides, expected):
    with pytest.raises(ValueError) as info:
        build(compose_train(overrides).model)
    assert str(info.value) == expected
