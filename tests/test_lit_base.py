"""The LightningModule base: float64 end to end, optimisers from config, manual optimisation with clipping,
pluggable metrics (exact SM guard, noise-conditional losses against closed forms)."""

from __future__ import annotations

import json
import math

import lightning.pytorch as L
import pytest
import torch

from src.data.datamodules import GaussianDataModule
from src.train import train
from tests.conftest import FAST, compose_train
from tests.toy_modules import NoiseConditionalGaussian, TwoOptimiserToy

PROBE = "+callbacks.dtype_probe._target_=tests.toy_modules.DtypeProbe"


def _finite_metrics(path):
    saved = json.loads(path.read_text())
    return saved, {k: v for k, v in saved.items() if k.startswith("test/")}


@pytest.mark.parametrize("deq", ["true", "false"])
def test_dkef_float64_end_to_end(tmp_path, deq):
    cfg = compose_train([*FAST, "model=dkef", f"deq={deq}", "++trainer.precision=64-true",
                         "trainer.fast_dev_run=true", PROBE], tmp_path)
    train(cfg)
    _, test = _finite_metrics(tmp_path / "metrics.json")
    for key in ("test/sm_loss", "test/log_likelihood", "test/fisher_divergence", "test/true_log_likelihood"):
        assert math.isfinite(test[key]), key
    dtypes = {d for _, d in json.loads((tmp_path / "dtype_probe.json").read_text())}
    assert dtypes == {"torch.float64"}, f"a float32 tensor reached the model: {dtypes}"


@pytest.mark.parametrize("deq", ["true", "false"])
def test_nice_float64_end_to_end(tmp_path, shared_data, deq):
    cfg = compose_train(["logger=none", "callbacks=minimal", "model=nice", "data=mnist", "data.limit=300",
                         f"data.root={shared_data}", "model.hidden=16", "model.deq_width=16",
                         "model.metrics.exact_sm.test_points=4", "model.metrics.exact_sm.val_points=2",
                         "model.n_samples_grid=4", f"deq={deq}", "loss=ssm", "++trainer.precision=64-true",
                         "trainer.fast_dev_run=true", PROBE], tmp_path)
    train(cfg)
    _, test = _finite_metrics(tmp_path / "metrics.json")
    for key in ("test/sm_loss", "test/log_likelihood", "test/bits_per_dim"):
        assert math.isfinite(test[key]), key
    dtypes = {d for _, d in json.loads((tmp_path / "dtype_probe.json").read_text())}
    assert dtypes == {"torch.float64"}, f"a float32 tensor reached the model: {dtypes}"


def test_evaluate_keeps_the_runs_precision(tmp_path):
    from src.evaluate import evaluate

    cfg = compose_train([*FAST, "deq=false", "depth=2", "++trainer.precision=64-true", "trainer.max_epochs=1",
                         "callbacks=default", "callbacks.progress_bar=null", "trainer.enable_progress_bar=false"],
                        tmp_path)
    cfg.trainer.default_root_dir = str(tmp_path)
    metrics = train(cfg)
    (tmp_path / ".hydra").mkdir()
    from omegaconf import OmegaConf

    OmegaConf.save(cfg, tmp_path / ".hydra" / "config.yaml")
    ev = evaluate(metrics["tested_checkpoint"])
    assert ev["precision"] == "64-true"
    for key in ("test/sm_loss", "test/log_likelihood"):
        assert ev[key] == pytest.approx(metrics[key], rel=1e-7), key


def test_noise_conditional_losses_match_closed_forms():
    """True score of N(0, I) perturbed by σ: σ²-weighted DSM = D/(2(1+σ²)), SSM-VR = −Dσ²/(2(1+σ²))."""
    d, sigmas = 6, [1.0, 0.3, 0.05]
    dm = GaussianDataModule(dim=d, n_train=64, n_val=64, n_test=4096, eval_batch_size=1024, seed=1)
    module = NoiseConditionalGaussian(sigmas, metrics={"noise_conditional": {"losses": ["dsm", "ssm_vr"]}})
    trainer = L.Trainer(logger=False, enable_progress_bar=False, inference_mode=False, enable_model_summary=False)
    trainer.test(module, datamodule=dm, verbose=False)
    r = module.test_results
    for i, s in enumerate(sigmas):
        # sample means of 4096 points: standard errors ≈ 1.5 % of the DSM value and ≈ 0 for SSM-VR (Rademacher)
        assert r[f"test/dsm_loss/sigma_{i}"] == pytest.approx(d / (2 * (1 + s * s)), rel=0.05)
        assert r[f"test/ssm_vr_loss/sigma_{i}"] == pytest.approx(-d * s * s / (2 * (1 + s * s)), rel=0.05, abs=1e-3)
    assert r["test/dsm_loss"] == pytest.approx(sum(r[f"test/dsm_loss/sigma_{i}"] for i in range(3)) / 3)
    again = NoiseConditionalGaussian(sigmas, metrics={"noise_conditional": {"losses": ["dsm"]}})
    trainer.test(again, datamodule=dm, verbose=False)
    assert again.test_results["test/dsm_loss"] == r["test/dsm_loss"]  # seeded: re-evaluation repeats exactly


def test_exact_sm_refuses_high_dimensions():
    from src.metrics.evaluation import ExactSMLoss

    class Images:
        data_dim = 3072

    with pytest.raises(ValueError, match="D=3072 costs 3072 backward passes"):
        ExactSMLoss().setup(None, Images())
    ExactSMLoss(max_dim=4096).setup(None, Images())  # raised knowingly: allowed


def test_unknown_metric_and_bad_options_are_named():
    from src.metrics.evaluation import build_metrics

    with pytest.raises(ValueError, match="model.metrics.bogus is not a metric"):
        build_metrics({"bogus": {}})
    with pytest.raises(ValueError, match="model.metrics.exact_sm"):
        build_metrics({"exact_sm": {"points": 3}})
    assert list(build_metrics({"exact_sm": None, "log_likelihood": {}})) == ["log_likelihood"]


def _toy(optimizer, **kw):
    return TwoOptimiserToy((1, 4, 4), optimizer, **kw)


def test_optimiser_specs_must_cover_every_parameter_once():
    both = {"score": {"lr": 1e-2, "params": ["score_net"]}, "generator": {"lr": 1e-2, "params": ["generator"]}}
    assert len(_toy(both).configure_optimizers()) == 2
    with pytest.raises(ValueError, match="parameters in no optimiser: generator"):
        _toy({"score": {"lr": 1e-2, "params": ["score_net"]}}).configure_optimizers()
    with pytest.raises(ValueError, match="belongs to two optimisers"):
        _toy({"score": {"params": ["score_net"]}, "all": {"params": [""]}}).configure_optimizers()
    with pytest.raises(ValueError, match="has no sub-module 'decoder'"):
        _toy({"score": {"params": ["score_net", "decoder"]}, "g": {"params": ["generator"]}}).configure_optimizers()
    opt = _toy({"name": "sgd", "lr": 0.5, "momentum": 0.9}).configure_optimizers()
    assert isinstance(opt, torch.optim.SGD) and opt.defaults["momentum"] == 0.9
