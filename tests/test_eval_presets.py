"""Evaluation presets (conf/eval/, src/metrics/presets.py): which preset a run gets, what each one sets, and that
the preset and its sample counts reach metrics.json."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
from omegaconf import OmegaConf, open_dict

from src.metrics import presets
from src.metrics.presets import apply_eval_preset, choose_preset
from src.runs.evaluation import evaluate
from src.runs.training import train
from tests.conftest import FAST, REPO_ROOT, compose_train

NCSN = ["model=ncsn", "data=mnist_images", "loss=ssm_vr"]


@pytest.mark.parametrize("overrides, expected", [
    (["trainer.max_steps=50"], "quick"),                       # a short CPU run
    (["trainer.max_steps=2000"], "quick"),                     # the bound itself
    (["trainer.max_steps=2001"], "standard"),
    (["trainer.max_epochs=3"], "standard"),                    # epoch-based: the configuration's own settings
    (["trainer.fast_dev_run=true"], "quick"),
    (["trainer=gpu", "trainer.max_steps=50"], "standard"),     # a GPU run is never cut short automatically
    (["eval=paper", "trainer.max_steps=50"], "paper"),
    (["eval=standard", "trainer.max_steps=50"], "standard"),
    (["eval.quick_max_steps=10", "trainer.max_steps=50"], "standard"),
])
def test_auto_choice_follows_accelerator_and_run_length(overrides, expected):
    name, reason = choose_preset(compose_train(overrides))
    assert name == expected, reason


def test_unknown_preset_is_one_clear_error():
    cfg = compose_train([])
    cfg.eval.name = "fast"
    with pytest.raises(ValueError, match=r"^eval='fast' is not an evaluation preset; valid: auto, quick, standard, paper$"):
        choose_preset(cfg)


def test_quick_caps_existing_keys_only():
    cfg = compose_train([*NCSN, "trainer.max_steps=50"])
    assert cfg.model.metrics.fid.n_samples == 1000 and cfg.model.sampling.n_steps_each == 100
    record = apply_eval_preset(cfg, explicit=[])
    assert record["eval/preset"] == "quick" and cfg.eval.preset == "quick"
    assert cfg.model.metrics.fid.n_samples == 128
    # the sampler is shortened as a unit: T = 4 at eps 1e-4 (one step reaches the widest level's mean)
    assert cfg.model.sampling.n_steps_each == 4 and cfg.model.sampling.step_lr == pytest.approx(1e-4)
    assert cfg.model.sampling.denoise is False  # a key of the unit the preset does not name stays
    assert cfg.model.metrics.noise_conditional.test_points == 64
    assert cfg.model.n_samples_grid == 36
    assert cfg.model.metrics.exact_sm is None  # switched off by the family: stays off
    assert "log_likelihood" not in cfg.model.metrics  # NCSN has no likelihood: quick's AIS/IS caps skipped
    assert not any(key.startswith("eval/model.metrics.log_likelihood") for key in record)
    assert record["eval/model.metrics.fid.n_samples"] == 128
    assert record["eval/model.sampling.n_steps_each"] == 4
    assert "eval/model.metrics.exact_sm.test_points" not in record


def test_quick_keeps_smaller_values_and_command_line_keys():
    cfg = compose_train([*NCSN, "trainer.max_steps=50", "model.metrics.fid.n_samples=8",
                         "model.sampling.n_steps_each=3", "model.metrics.noise_conditional.test_points=999"])
    apply_eval_preset(cfg, explicit=["model.metrics.noise_conditional.test_points"])
    assert cfg.model.metrics.fid.n_samples == 8                           # already below the cap
    assert cfg.model.sampling.n_steps_each == 3                           # T = 3 < 4: the unit is not applied
    assert cfg.model.sampling.step_lr == pytest.approx(2e-5)
    assert cfg.model.metrics.noise_conditional.test_points == 999         # given on the command line
    cfg = compose_train([*NCSN, "trainer.max_steps=50", "model.metrics.fid=null"])
    apply_eval_preset(cfg, explicit=[])
    assert cfg.model.metrics.fid is None                                  # switched off: stays off


def test_paper_sets_the_paper_protocol():
    cfg = compose_train(["experiment=vae_mnist", "eval=paper"])
    record = apply_eval_preset(cfg, explicit=[])
    ll = cfg.model.metrics.log_likelihood
    assert (ll.ais.n_steps, ll.ais.n_chains, ll.ais.leapfrog, ll.test_points) == (1000, 16, 10, 10000)
    assert cfg.model.metrics.fid.n_samples == 10000 and cfg.model.metrics.vae.test_points is None
    assert record["eval/model.metrics.log_likelihood.ais.n_steps"] == 1000
    assert "eval/model.metrics.log_likelihood.samples" not in record  # DKEF's key: the VAE has none
    cfg = compose_train(["experiment=ncsn_mnist", "eval=paper"])
    apply_eval_preset(cfg, explicit=[])
    assert cfg.model.sampling.n_steps_each == 100 and cfg.model.sampling.step_lr == pytest.approx(2e-5)
    assert cfg.trainer.limit_test_batches is None  # the whole test set (the experiment tests 2 batches)
    cfg = compose_train(["experiment=dkef_uci", "data=redwine", "eval=paper",
                         "model.metrics.log_likelihood.samples=10"])
    apply_eval_preset(cfg, explicit=["model.metrics.log_likelihood.samples"])
    assert cfg.model.metrics.log_likelihood.samples == 10 and "fid" not in cfg.model.metrics
    cfg = compose_train(["experiment=dkef_uci", "data=redwine", "eval=paper"])
    assert cfg.model.metrics.log_likelihood.samples == 1000000  # the experiment's (model default 1e5)
    assert cfg.model.metrics.log_likelihood.proposal_std == 2.0


def test_standard_changes_nothing():
    cfg = compose_train(["experiment=ncsn_mnist", "eval=standard"])
    before = cfg.copy()
    apply_eval_preset(cfg, explicit=[])
    assert cfg.eval.preset == "standard"
    with open_dict(cfg):
        del cfg.eval["preset"]
    assert cfg == before


def test_preset_and_its_counts_reach_metrics_json(tmp_path):
    cfg = compose_train([*FAST, "trainer.max_steps=3", "trainer.enable_progress_bar=false",
                         "model.metrics.exact_sm.test_points=300"], tmp_path)
    train(cfg)
    saved = json.loads((tmp_path / "metrics.json").read_text())
    assert saved["eval/preset"] == "quick"
    assert saved["eval/model.metrics.exact_sm.test_points"] == 256       # the cap of quick, not the 300 asked
    assert saved["eval/model.metrics.log_likelihood.samples"] == 2000    # FAST's smaller value stays
    assert saved["test/sm_loss_n_points"] == 32                          # the whole (32-point) test set
    assert saved["config"]["eval"]["preset"] == "quick"


def test_command_line_run_states_its_preset(tmp_path):
    """Through Hydra: the start-up log names the preset, why, and what it changed; a config-group choice on the
    command line (model=dkef) is not mistaken for a key the user set, a plain key is."""
    cmd = [sys.executable, "-m", "src.train", "model=dkef", *FAST, "trainer.max_steps=3",
           "trainer.enable_progress_bar=false", "model.metrics.log_likelihood.samples=200000", f"hydra.run.dir={tmp_path}"]
    done = subprocess.run(cmd, check=False, cwd=REPO_ROOT, capture_output=True, text=True, timeout=300,
                          env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert done.returncode == 0, done.stderr[-3000:]
    log = done.stdout + done.stderr
    assert ("evaluation preset: quick (eval=auto: a CPU run of 3 steps (<= eval.quick_max_steps=2000)); "
            "model.metrics.exact_sm.test_points=256 (was None)") in log
    saved = json.loads((tmp_path / "metrics.json").read_text())
    assert saved["eval/model.metrics.log_likelihood.samples"] == 200000  # on the command line: above quick's cap
    assert saved["eval/model.metrics.exact_sm.test_points"] == 256
    # the run's saved config is the one that ran: the preset resolved into it before the run started
    ran = OmegaConf.load(tmp_path / ".hydra" / "config.yaml")
    assert ran.eval.preset == "quick" and ran.model.metrics.exact_sm.test_points == 256
    assert ran.model.metrics.exact_sm.backward_budget == 4096 and ran.model.metrics.log_likelihood.samples == 200000


def test_auto_composes_the_presets_it_may_choose(monkeypatch):
    """eval=auto holds quick and standard as Hydra composed them (conf/eval/auto.yaml's defaults list): applying
    one reads no file and composes nothing at run time."""
    cfg = compose_train([*NCSN, "trainer.max_steps=50"])
    assert cfg.eval.name == "auto" and set(cfg.eval.presets) == {"quick", "standard"}
    assert cfg.eval.presets.quick.mode == "cap" and cfg.eval.presets.quick.settings["model.metrics.fid.n_samples"] == 128
    assert compose_train(["eval=paper"]).eval.get("presets") is None  # a named preset is cfg.eval itself

    def refuse(name):
        raise AssertionError(f"composed {name} at run time")

    monkeypatch.setattr(presets, "composed_preset", refuse)
    assert apply_eval_preset(cfg, explicit=[])["eval/model.metrics.fid.n_samples"] == 128
    assert apply_eval_preset(compose_train(["trainer.max_steps=5000"]), explicit=[])["eval/preset"] == "standard"


def test_run_config_written_before_composed_presets_still_evaluates(tmp_path, caplog):
    """A run directory whose .hydra/config.yaml has the eval node of an older version (``{name: auto,
    quick_max_steps: 2000}``, no presets): src.evaluate composes the preset auto picks, says so, and records it."""
    cfg = compose_train([*FAST, "trainer.max_steps=3", "trainer.enable_progress_bar=false",
                         "callbacks=default", "callbacks.progress_bar=null"], tmp_path)
    train(cfg)
    with open_dict(cfg):
        cfg.eval = OmegaConf.create({"name": "auto", "quick_max_steps": 2000})  # as older versions saved it
    (tmp_path / ".hydra").mkdir()
    OmegaConf.save(cfg, tmp_path / ".hydra" / "config.yaml")
    with caplog.at_level("INFO", logger=presets.__name__):
        saved = evaluate(tmp_path / "checkpoints" / "last.ckpt")
    assert saved["eval/preset"] == "quick"
    assert saved["eval/model.metrics.exact_sm.test_points"] == 256       # quick's cap, composed from conf/eval
    assert saved["eval/model.metrics.log_likelihood.samples"] == 2000    # FAST's smaller value stays
    assert "composed from this version's conf/eval" in caplog.text
    assert json.loads((tmp_path / "eval_metrics.json").read_text())["eval/preset"] == "quick"


def test_exact_sm_backward_budget_sizes_points_by_dimension():
    from src.metrics.exact_sm import ExactSMLoss

    m = ExactSMLoss(val_points=32, test_points=256, backward_budget=4096)
    assert (m.points("val", 784), m.points("test", 784)) == (5, 5)       # NICE on MNIST: 4096 // 784
    assert (m.points("val", 11), m.points("test", 11)) == (32, 256)      # DKEF on RedWine: the point caps
    assert ExactSMLoss(backward_budget=10).points("test", 784) == 1      # never zero points
    assert ExactSMLoss().points("test", 784) is None                     # no cap at all
    with pytest.raises(ValueError, match=r"^model.metrics.exact_sm.backward_budget=0: give >= 1, or null$"):
        ExactSMLoss(backward_budget=0)
