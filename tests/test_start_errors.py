"""Bad input is refused at start-up with one clear line (issue 23): optimiser settings, and a sweep trial that
never logged its optimized_metric (the trial fails with that sentence; the sweep goes on and lists it)."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys

import pytest
import yaml

from src.runs.build import build
from src.runs.training import OptimizedMetricNotLogged, optimized_value
from tests.conftest import FAST, REPO_ROOT, compose_train


def _refused(overrides: list[str]) -> str:
    cfg = compose_train(overrides)
    with pytest.raises(ValueError) as info:
        build(cfg.model)
    message = str(info.value)
    assert "\n" not in message
    return message


@pytest.mark.parametrize("overrides, expected", [
    (["model.optimizer.lr=-1e-3"], "model.optimizer.lr=-0.001 must be > 0 (e.g. 1e-3)"),
    (["model.optimizer.lr=0"], "model.optimizer.lr=0 must be > 0 (e.g. 1e-3)"),
    (["model.optimizer.weight_decay=-1"], "model.optimizer.weight_decay=-1 must be >= 0"),
    (["model.optimizer.lr=fast"], "model.optimizer.lr='fast' is not a number"),
    (["experiment=vae_mnist", "model.optimizer.score.lr=-1e-4"], "model.optimizer.score.lr=-0.0001 must be > 0"),
])
def test_bad_learning_rate_is_one_line_at_start_up(overrides, expected):
    assert _refused(overrides).startswith(expected)


def test_unknown_optimiser_and_argument_are_one_line():
    message = _refused(["model.optimizer._target_=torch.optim.Adamm"])
    assert message.startswith("model.optimizer._target_: Error locating target 'torch.optim.Adamm'")
    message = _refused(["model.optimizer._target_=torch.nn.Linear"])
    assert message.startswith("model.optimizer._target_=Linear is not a torch.optim optimiser")
    message = _refused(["model.scheduler={_target_: torch.optim.SGD, _partial_: true}"])
    assert message.startswith("model.scheduler._target_=SGD is not a torch.optim.lr_scheduler class")
    message = _refused(["model.scheduler={_target_: torch.optim.lr_scheduler.StepLR, step_size: 10}"])
    assert message.startswith("model.scheduler: StepLR.__init__() missing 1 required positional argument")
    assert message.endswith("needs model.scheduler._partial_=true")
    message = _refused(["++model.optimizer.betaz=[0.9,0.99]"])
    assert message.startswith("model.optimizer: Adam takes no argument betaz; its arguments: ")
    assert "betas" in message


def test_the_old_optimiser_name_still_works():
    """model.optimizer[.<name>].name=<optimiser> (recorded commands, e.g. benchmarks/results/separation.md) is read as
    today's model.optimizer[.<name>]._target_=torch.optim.<Class>."""
    cfg = compose_train(["experiment=gotu", "model.optimizer.name=adam", "model.optimizer.lr=1e-3"])
    assert cfg.model.optimizer._target_ == "torch.optim.Adam" and cfg.model.optimizer.lr == 1e-3
    assert "name" not in cfg.model.optimizer
    cfg = compose_train(["experiment=vae_mnist", "model.optimizer.vae.name=sgd"])
    assert (cfg.model.optimizer.vae._target_, cfg.model.optimizer.score._target_) == (
        "torch.optim.SGD", "torch.optim.RMSprop")


@pytest.mark.parametrize("override, today", [
    ("model.optimizer.name=adamm", "write model.optimizer._target_=torch.optim.<Class> (e.g. torch.optim.SGD)"),
    ("model.optimizer.scheduler=cosine", "write model.scheduler='{_target_: torch.optim.lr_scheduler.CosineAnnealingLR"),
    ("model.optimizer.score.params=[score_net]", "write nothing: the family fixes which sub-modules"),
])
def test_old_optimiser_spellings_are_refused_naming_todays(override, today):
    from hydra.errors import ConfigCompositionException

    with pytest.raises(ConfigCompositionException) as info:
        compose_train([override])
    assert str(info.value).startswith(f"{override} is an old spelling") and today in str(info.value)
    assert "\n" not in str(info.value)


def test_old_optimiser_spelling_on_the_command_line(tmp_path):
    cmd = [sys.executable, "-m", "src.train", *FAST, "model.optimizer.scheduler=cosine", f"hydra.run.dir={tmp_path}"]
    done = subprocess.run(cmd, check=False, cwd=REPO_ROOT, capture_output=True, text=True, timeout=300,
                          env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert done.returncode != 0
    lines = [x for x in done.stderr.splitlines() if x.strip()]
    assert lines[0] == ("model.optimizer.scheduler=cosine is an old spelling (model.optimizer is a partial torch.optim "
                        "class now, src/lit/optimizers.py): write model.scheduler='{_target_: "
                        "torch.optim.lr_scheduler.CosineAnnealingLR, _partial_: true, eta_min: <1 % of lr>}'"), lines
    assert "Traceback" not in done.stderr and len(lines) == 2  # and Hydra's HYDRA_FULL_ERROR=1 hint


# slow: covered by test_bad_learning_rate_is_one_line_at_start_up + test_one_line_errors.py's command line
@pytest.mark.slow
def test_bad_learning_rate_on_the_command_line(tmp_path):
    """The user's view: the message itself, no torch traceback, before any training step."""
    cmd = [sys.executable, "-m", "src.train", *FAST, "model.optimizer.lr=-1e-3", f"hydra.run.dir={tmp_path}"]
    done = subprocess.run(cmd, check=False, cwd=REPO_ROOT, capture_output=True, text=True, timeout=300,
                          env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert done.returncode != 0
    assert "ValueError: model.optimizer.lr=-0.001 must be > 0 (e.g. 1e-3)" in done.stderr
    assert "torch/optim" not in done.stderr and "Epoch 0" not in done.stdout + done.stderr


def test_missing_optimized_metric_fails_a_trial_and_warns_a_single_run(caplog):
    cfg = compose_train(["optimized_metric=val/sm_loss", "trainer.max_steps=2"])
    metrics = {"global_step": 2, "test/sm_loss": 1.0}
    assert optimized_value(metrics, cfg) is None  # a single run: a warning, nothing else
    assert "optimized_metric=val/sm_loss was never logged by this run" in caplog.text
    with pytest.raises(OptimizedMetricNotLogged) as info:
        optimized_value(metrics, cfg, required=True)
    assert str(info.value) == (
        "optimized_metric=val/sm_loss was never logged by this run (no val/ key at all: the run ended at global "
        "step 2 (trainer.max_steps=2) before its first validation); validate before the run ends (more steps, "
        "trainer.val_check_interval) or optimise a logged key")
    with pytest.raises(OptimizedMetricNotLogged, match=r"\(logged val/ keys: val/dsm_loss\)"):  # e.g. a typo
        optimized_value({"val/dsm_loss": 2.0}, cfg, required=True)
    assert optimized_value({"best/val/sm_loss": 3.5, "val/sm_loss": 4.0}, cfg, required=True) == 3.5


@pytest.mark.skipif(importlib.util.find_spec("hydra_plugins.hydra_optuna_sweeper") is None,
                    reason="the Optuna sweeper plugin is not installed (pip install -e '.[optuna]')")
def test_optuna_sweep_goes_on_past_trials_that_never_validated(tmp_path):
    """hparams_search=dkef_optuna ++trainer.max_steps=2: no trial reaches a validation, so each one fails with
    the sentence; every trial still runs, and the end lists them instead of Optuna's 'No trials are completed'."""
    cmd = [sys.executable, "-m", "src.train", "-m", "hparams_search=dkef_optuna", "++trainer.max_steps=2",
           "hydra.sweeper.n_trials=2", *FAST, "callbacks=default", "trainer.enable_progress_bar=false",
           f"hydra.sweep.dir={tmp_path}"]
    done = subprocess.run(cmd, check=False, cwd=REPO_ROOT, capture_output=True, text=True, timeout=600,
                          env={**os.environ, "OMP_NUM_THREADS": "1"})
    out = done.stdout + done.stderr
    assert "No trials are completed yet" not in out
    assert done.returncode == 1 and "no trial of the sweep completed: all 2 failed" in done.stderr
    assert "Traceback" not in done.stderr.split("2 of 2 trials failed")[-1]  # the end is a report, not a crash
    failed = yaml.safe_load((tmp_path / "failed_trials.yaml").read_text())
    assert failed["n_trials"] == 2 and [f["job"] for f in failed["failed"]] == [0, 1]
    for f in failed["failed"]:
        assert f["reason"].startswith("OptimizedMetricNotLogged: optimized_metric=val/sm_loss was never logged")
        assert f["reason"].endswith("before its first validation); validate before the run ends (more steps, "
                                    "trainer.val_check_interval) or optimise a logged key")
        assert {o.split("=")[0] for o in f["overrides"]} == {"model.optimizer.lr", "deq.norm_lambda",
                                                             "model.net.deq_width", "loss"}  # the sampled ones
    assert (tmp_path / "0" / "metrics.json").is_file() and (tmp_path / "1" / "metrics.json").is_file()
    assert yaml.safe_load((tmp_path / "optimization_results.yaml").read_text())["best_params"] is None


DKEF_NORMALIZED = "deq.block=normalized_residual is a block of model=ncsn only: model=dkef has its own DEQ block, " \
                  "so drop deq.block (or set deq.block=null)"
ONE_PASS_OFF = "deq.one_pass=true needs deq=true: the one-pass control replaces the DEQ's fixed point by one " \
               "explicit pass, and deq=false has no DEQ; drop deq.one_pass or use deq=true"


@pytest.mark.parametrize("overrides, expected", [
    (["model=dkef", "loss=sm", "deq=true", "deq.block=normalized_residual"], DKEF_NORMALIZED),
    (["deq=false", "deq.one_pass=true"], ONE_PASS_OFF),
    (["model=nice", "data=mnist", "deq=true", "deq.block=normalized_residual"],
     DKEF_NORMALIZED.replace("model=dkef", "model=nice")),
])
def test_impossible_deq_combinations_are_one_line_at_build(overrides, expected):
    """Issue 49: a DEQ block of another family (a TypeError inside the block before) and the one-pass control
    without a DEQ (silently ignored before) are refused where the module is built."""
    assert _refused(overrides) == expected


# slow: covered by test_impossible_deq_combinations_are_one_line_at_build + test_one_line_errors.py's command line
@pytest.mark.slow
def test_impossible_deq_combinations_on_the_command_line(tmp_path):
    """The user's view of both refusals: the message, before any training step."""
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    for overrides, expected in ((["model=dkef", "loss=sm", "deq=true", "deq.block=normalized_residual"],
                                 DKEF_NORMALIZED), (["deq=false", "deq.one_pass=true"], ONE_PASS_OFF)):
        run_dir = tmp_path / overrides[-1].replace("=", "_")
        cmd = [sys.executable, "-m", "src.train", *FAST, *overrides, f"hydra.run.dir={run_dir}"]
        done = subprocess.run(cmd, check=False, cwd=REPO_ROOT, capture_output=True, text=True, timeout=300, env=env)
        assert done.returncode != 0
        assert f"ValueError: {expected}\n" in done.stderr, done.stderr[-2000:]
        assert "TypeError" not in done.stderr and "Epoch 0" not in done.stdout + done.stderr
