"""``callbacks=early_stopping``: the default callbacks plus Lightning's EarlyStopping on the metric the best
checkpoint is chosen by (Table 3's runs)."""

from __future__ import annotations

from lightning.pytorch.callbacks import EarlyStopping, ModelCheckpoint

from src.runs.training import _instantiate_group
from tests.conftest import compose_train


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
