"""End-to-end: configs compose, instantiate, and train through `fast_dev_run` for every combination."""

from __future__ import annotations

import json
import math

import pytest
from hydra.errors import ConfigCompositionException, InstantiationException
from hydra.utils import instantiate
from omegaconf.errors import ConfigAttributeError, ConfigKeyError

from src.runs.training import train
from tests.conftest import FAST, FAST_MODEL, compose_train

LOSSES = ["sm", "ssm", "ssm_vr", "dsm", "cp"]


@pytest.mark.parametrize("loss, deq", [
    *((loss, "true") for loss in LOSSES), ("sm", "false"),
    # slow: every loss trains through the DEQ above, and sm-false covers the explicit net's path
    *(pytest.param(loss, "false", marks=pytest.mark.slow) for loss in LOSSES if loss != "sm"),
])
def test_fast_dev_run_every_loss_and_deq(tmp_path, loss, deq):
    cfg = compose_train([*FAST, "model=dkef", f"loss={loss}", f"deq={deq}", "trainer.fast_dev_run=true"], tmp_path)
    metrics = train(cfg)
    saved = json.loads((tmp_path / "metrics.json").read_text())
    for key in ("test/sm_loss", "test/log_likelihood", "test/fisher_divergence", "n_params"):
        assert key in saved and math.isfinite(saved[key]), key
    assert saved["profile/saved_bytes_mean"] > 0
    if deq == "true":
        assert saved["profile/deq_iterations_mean"] >= 1
        assert 0 < saved["val/deq_contraction_rate"] < 1  # at the training input's fixed point (src.lit.base)
    else:
        assert "val/deq_contraction_rate" not in saved
    # ground truth of N(0, I_10): mean log-density of the test points is about -D/2 (1 + log 2π) = -14.19
    assert -20 < saved["test/true_log_likelihood"] < -9
    assert metrics["n_params"] == saved["n_params"]


@pytest.mark.parametrize("backward", ["implicit", "phantom"])
def test_the_adjoint_solves_iterations_are_profiled_where_there_are_some(tmp_path, backward):
    """profile/deq_adjoint_iterations_*: the implicit backward's adjoint solves per step (deq.backward_tol's lever);
    the phantom backward solves none."""
    cfg = compose_train([*FAST, "model=dkef", "loss=sm", "deq=true", f"deq.backward={backward}",
                         "trainer.fast_dev_run=true"], tmp_path)
    train(cfg)
    saved = json.loads((tmp_path / "metrics.json").read_text())
    if backward == "implicit":
        assert saved["profile/deq_adjoint_iterations_mean"] >= 1 and saved["profile/deq_adjoint_hit_cap_max"] == 0
    else:
        assert "profile/deq_adjoint_iterations_mean" not in saved


NICE_FAST = ["logger=none", "callbacks=minimal", "model=nice", "data=mnist", "data.limit=400", "model.hidden=32",
             "model.deq_width=32", "model.metrics.exact_sm.test_points=8", "model.metrics.exact_sm.val_points=4",
             "model.n_samples_grid=4", "trainer.fast_dev_run=true",
             # one batch of 16, not the default 128: exact SM through 784 inputs kept 5-6 GB resident at 128
             "data.batch_size=16", "data.eval_batch_size=64"]


@pytest.mark.parametrize("loss, deq", [
    ("mle", "true"), ("mle", "false"), ("dsm", "true"),
    # slow: NICE runs each objective's generic path (every loss: test_fast_dev_run_every_loss_and_deq) as dsm does
    *(pytest.param(loss, deq, marks=pytest.mark.slow) for loss in LOSSES for deq in ("true", "false")
      if (loss, deq) != ("dsm", "true")),
])
def test_fast_dev_run_nice(tmp_path, mnist_root, loss, deq):
    cfg = compose_train([*NICE_FAST, f"data.root={mnist_root}", f"loss={loss}", f"deq={deq}"], tmp_path)
    train(cfg)
    saved = json.loads((tmp_path / "metrics.json").read_text())
    for key in ("test/sm_loss", "test/log_likelihood", "test/bits_per_dim"):
        assert math.isfinite(saved[key]), key
    # an untrained flow is far from the data, but bits/dim in pixel space must be positive and finite
    assert saved["test/bits_per_dim"] > 0
    assert (tmp_path / "samples.png").stat().st_size > 500
    rates = {k: v for k, v in saved.items() if k.startswith("val/deq_contraction_rate/")}
    if deq == "true":  # one DEQ block per coupling: each one's rate, and the largest
        assert len(rates) >= 2 and all(0 < r < 1 for r in rates.values())
        assert saved["val/deq_contraction_rate"] == max(rates.values())
    else:
        assert not rates and "val/deq_contraction_rate" not in saved


def test_instantiate_gives_lightning_objects(tmp_path):
    import lightning.pytorch as L

    cfg = compose_train([*FAST, "deq=false", "depth=16"], tmp_path)
    model = instantiate(cfg.model)
    dm = instantiate(cfg.data)
    assert isinstance(model, L.LightningModule) and isinstance(dm, L.LightningDataModule)
    # 16 dense layers per kernel feature net (3 kernels): 15 hidden Linear + readout + skip each
    n_linear = sum(1 for m in model.modules() if m.__class__.__name__ == "Linear")
    assert n_linear == 3 * 17


def test_depth_means_layers_inside_f_when_deq(tmp_path):
    cfg = compose_train([*FAST, "deq=true", "depth=2"], tmp_path)
    model = instantiate(cfg.model)
    blocks = [m for m in model.modules() if m.__class__.__name__ == "DenseDEQBlock"]
    assert len(blocks) == 3 and all(b.n_layers == 2 for b in blocks)


@pytest.mark.parametrize(
    "override, exc",
    [
        (["not_a_key=1"], ConfigCompositionException),
        (["model=not_a_model"], ConfigCompositionException),
        (["deq.not_a_key=1"], (ConfigCompositionException, ConfigKeyError, ConfigAttributeError)),
    ],
)
def test_bad_overrides_are_rejected(tmp_path, override, exc):
    with pytest.raises(exc):
        compose_train([*FAST, *override], tmp_path)


@pytest.mark.parametrize(
    "override, message",
    [
        ("depth=0", "depth=0 is invalid"),
        ("deq.norm_lambda=1.0", "deq.norm_lambda=1.0 is invalid"),
        ("deq.norm_lambda=0.5", "must be > 1"),
        ("loss=cp deq.backward=implicit", "loss=cp cannot run with deq.backward=implicit"),
    ],
)
def test_invalid_values_fail_at_start_up(tmp_path, override, message):
    cfg = compose_train([*FAST, *override.split(), "trainer.fast_dev_run=true"], tmp_path)
    with pytest.raises(ValueError, match=message):
        train(cfg)
    assert not (tmp_path / "metrics.json").exists()


def test_mle_with_dkef_fails_clearly(tmp_path):
    cfg = compose_train([*FAST, "loss=mle", "trainer.fast_dev_run=true"], tmp_path)
    with pytest.raises(ValueError, match="tractable likelihood"):
        train(cfg)


def test_missing_data_file_error_names_file(tmp_path):
    cfg = compose_train(
        [*FAST_MODEL, "data=redwine", f"data.root={tmp_path}/nowhere", "data.download=false", "trainer.fast_dev_run=true"],
        tmp_path,
    )
    with pytest.raises(FileNotFoundError, match="winequality-red.csv"):
        train(cfg)


@pytest.mark.parametrize("flush", [True, False])
def test_flush_denormal_setting_reaches_torch(tmp_path, flush):
    """``flush_denormal`` (default true) makes float32 subnormals zero, false keeps gradual underflow."""
    import torch

    from src.runtime.environment import set_float_environment

    cfg = compose_train([*FAST, "model=dkef"] + ([] if flush else ["flush_denormal=false"]), tmp_path)
    assert cfg.flush_denormal is flush
    try:
        set_float_environment(cfg)
        tiny = torch.tensor([1e-39], dtype=torch.float32) * 1.0  # a subnormal float32
        assert (tiny.item() == 0.0) is flush
    finally:
        torch.set_flush_denormal(False)


def test_dkef_final_refit_runs_in_the_test_and_reports_its_lambda(tmp_path):
    """model.final_refit (the reference's final stage) from the command line: the test refits λ on validation
    (reported, and the validation loss does not rise) and then tests with that α."""
    cfg = compose_train([*FAST, "model=dkef", "loss=sm", "deq=false", "trainer.fast_dev_run=true",
                         "model.final_refit={lambda_steps:50,lr:0.05}"], tmp_path)
    train(cfg)
    saved = json.loads((tmp_path / "metrics.json").read_text())
    assert saved["test/final_refit/log10_lambda_trained"] != saved["test/final_refit/log10_lambda"]
    assert saved["test/final_refit/val_sm_loss"] <= saved["test/final_refit/val_sm_loss_before"]
    assert math.isfinite(saved["test/sm_loss"])


@pytest.mark.parametrize("spec, needle", [("{lambda_steps:10}", "missing: ['lr']"),
                                          ("{lambda_steps:10,lr:0.1,alpha:1}", "unknown: ['alpha']"),
                                          ("{lambda_steps:-1,lr:0.1}", "lambda_steps >= 0")])
def test_dkef_bad_final_refit_is_a_clear_error(tmp_path, spec, needle):
    cfg = compose_train([*FAST, "model=dkef", f"model.final_refit={spec}"], tmp_path)
    with pytest.raises((ValueError, InstantiationException), match="model.final_refit") as err:
        instantiate(cfg.model)
    assert needle in str(err.value)


def test_dkef_trains_when_the_last_batch_would_hold_one_row(tmp_path):
    """97 training rows at batch 16 (6·16 + 1, like WhiteWine's reference split at batch 128: 31·128 + 1): the
    epoch's single-row remainder is dropped instead of failing the α-fit/loss split of the step."""
    cfg = compose_train([*FAST, "model=dkef", "loss=sm", "deq=false", "data.n_train=97", "trainer.max_epochs=2",
                         "trainer.max_steps=-1", "trainer.limit_val_batches=1", "trainer.limit_test_batches=1"],
                        tmp_path)
    train(cfg)
    saved = json.loads((tmp_path / "metrics.json").read_text())
    assert saved["global_step"] == 12 and math.isfinite(saved["test/sm_loss"])
