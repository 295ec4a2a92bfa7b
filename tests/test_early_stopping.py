"""``callbacks=early_stopping``: the default callbacks plus Lightning's EarlyStopping (resumed exactly:
src/callbacks/early_stopping.py) on the metric the best checkpoint is chosen by (Table 3's runs)."""

from __future__ import annotations

import json
import os
import signal
from pathlib import Path

import lightning.pytorch as L
import pytest
from lightning.pytorch.callbacks import EarlyStopping, ModelCheckpoint

from src.runs.training import _instantiate_group
from src.runtime.checkpoints import load_checked
from tests.conftest import FAST, compose_train
from tests.test_resume_kill import assert_equal_tree, finish, start


def test_early_stopping_watches_the_checkpoint_metric_with_patience_20(tmp_path):
    cfg = compose_train(["callbacks=early_stopping", "logger=none"], tmp_path)
    callbacks = _instantiate_group(cfg.callbacks)
    stop = [cb for cb in callbacks if isinstance(cb, EarlyStopping)]
    ckpt = [cb for cb in callbacks if isinstance(cb, ModelCheckpoint)]
    assert len(stop) == 1 and len(ckpt) == 1  # the default callbacks are all still there
    assert stop[0].monitor == ckpt[0].monitor == "val/sm_loss"
    assert stop[0].mode == ckpt[0].mode == "min"
    assert stop[0].patience == 20


def test_early_stopping_follows_a_family_monitor_and_a_new_patience(tmp_path):
    cfg = compose_train(["callbacks=early_stopping", "callbacks.early_stopping.patience=3", "model=ncsn",
                         "data=mnist_images", "logger=none"], tmp_path)
    (stop,) = [cb for cb in _instantiate_group(cfg.callbacks) if isinstance(cb, EarlyStopping)]
    assert stop.patience == 3
    assert stop.monitor == "val/dsm_loss" and stop.mode == "min"  # the NCSN's own (model.monitor)


def test_default_callbacks_do_not_stop_early(tmp_path):
    cfg = compose_train(["logger=none"], tmp_path)
    assert not any(isinstance(cb, EarlyStopping) for cb in _instantiate_group(cfg.callbacks))


# ---------------------------------------------------------------------------------------------------------------
# Exact resume (src/callbacks/early_stopping.py): runs killed (SIGKILL from inside, tests/test_resume_kill.py) where
# Lightning's EarlyStopping loses its state, resumed from last.ckpt, against an uninterrupted run. With min_delta
# 1e9 no validation after the first improves and patience 1 stops the run at its second check.

STOP = [*FAST, "data.n_train=64", "trainer.max_epochs=4", "deq=true", "loss=ssm_vr", "logger=none",
        "callbacks=early_stopping", "callbacks.early_stopping.patience=1", "callbacks.early_stopping.min_delta=1e9",
        "callbacks.progress_bar=null", "callbacks.profiling.saved_tensors=false", "trainer.enable_progress_bar=false",
        "trainer.precision=64-true"]
MID_EPOCH_CHECKS = ["trainer.val_check_interval=2"]  # validation every 2 of an epoch's 4 steps: checked after each


class KillAtTest(L.Callback):
    """SIGKILL this process as its test phase starts (training is over, last.ckpt written)."""

    def on_test_start(self, trainer, pl_module):
        os.kill(os.getpid(), signal.SIGKILL)


KILL_AT_TEST = [f"+callbacks.kill._target_={__name__}.KillAtTest"]


def kill_after_step(step: int) -> list[str]:
    return ["+callbacks.kill._target_=tests.test_resume_kill.KillAfterStep", f"+callbacks.kill.step={step}"]


def _reference_and_killed(overrides: list[str], kill: list[str], tmp_path: Path):
    """The uninterrupted run and the run to kill side by side (one thread each), then the killed one resumed from
    its last.ckpt: ((ref checkpoint, ref metrics), (resumed checkpoint, resumed metrics), resumed run dir)."""
    ref_dir, run_dir = tmp_path / "ref", tmp_path / "killed"
    ref, victim = start(overrides, ref_dir), start([*overrides, *kill], run_dir)
    rc, err = finish(ref)
    assert rc == 0, err[-3000:]
    rc, err = finish(victim)
    assert rc == -signal.SIGKILL, f"not killed (rc {rc}): {err[-3000:]}"
    rc, err = finish(start([*overrides, f"ckpt_path={run_dir / 'checkpoints' / 'last.ckpt'}"], run_dir))
    assert rc == 0, err[-3000:]
    runs = [(load_checked(d / "checkpoints" / "last.ckpt"), json.loads((d / "metrics.json").read_text()))
            for d in (ref_dir, run_dir)]
    return runs[0], runs[1], run_dir


def _assert_same_run(ref: tuple[dict, dict], resumed: tuple[dict, dict]) -> None:
    (a, ma), (b, mb) = ref, resumed
    assert a["global_step"] == b["global_step"]
    for key in ["state_dict", "optimizer_states", "deqsm_rng_states"]:
        assert_equal_tree(a[key], b[key], key)
    assert ma["tested_checkpoint"].rsplit("/", 1)[-1] == mb["tested_checkpoint"].rsplit("/", 1)[-1]
    tests = {k: v for k, v in ma.items() if k.startswith("test/")}
    assert tests and tests == {k: v for k, v in mb.items() if k.startswith("test/")}


def test_a_run_killed_in_its_test_after_stopping_early_resumes_to_the_same_test(tmp_path):
    """4 steps an epoch, checks at epoch ends: the uninterrupted run stops after epoch 2 (step 8 of 16). Killed
    after the stop (last.ckpt: after epoch 2's validation, before its check), the resumed check reads the kept
    value, stops at once and tests the same checkpoint (Lightning's raised: the metric was gone)."""
    ref, resumed, _ = _reference_and_killed(STOP, KILL_AT_TEST, tmp_path)
    assert ref[0]["global_step"] == 8, ref[0]["global_step"]
    _assert_same_run(ref, resumed)


@pytest.mark.slow
def test_a_run_killed_between_a_validation_and_its_check_trains_on_as_uninterrupted(tmp_path):
    """Killed at the first step of epoch 2 (last.ckpt: after epoch 1's validation, before its check): the resumed
    run checks epoch 1 with the kept value, trains epoch 2 and stops there."""
    ref, resumed, _ = _reference_and_killed(STOP, kill_after_step(4), tmp_path)
    assert ref[0]["global_step"] == 8
    _assert_same_run(ref, resumed)


@pytest.mark.slow
def test_a_run_stopped_by_a_check_inside_an_epoch_stays_stopped_when_resumed(tmp_path):
    """Checks after each validation (inside epochs): last.ckpt holds the stop; the resumed run does not train on
    (Lightning's would: ``trainer.should_stop`` is not in its checkpoint)."""
    ref, resumed, run_dir = _reference_and_killed([*STOP, *MID_EPOCH_CHECKS], KILL_AT_TEST, tmp_path)
    assert ref[0]["global_step"] == 4
    assert "the resumed run trains no further" in (run_dir / "train.log").read_text()
    _assert_same_run(ref, resumed)
