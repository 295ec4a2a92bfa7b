"""The LightningModule base: float64 end to end, optimisers from config, manual optimisation with clipping,
pluggable metrics (exact SM guard, noise-conditional losses against closed forms)."""

from __future__ import annotations

import json
import math

import lightning.pytorch as L
import pytest
import torch

from src.data.datamodules import GaussianDataModule
from src.runs.training import train
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
def test_nice_float64_end_to_end(tmp_path, mnist_root, deq):
    cfg = compose_train(["logger=none", "callbacks=minimal", "model=nice", "data=mnist", "data.limit=300",
                         f"data.root={mnist_root}", "model.hidden=16", "model.deq_width=16",
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
    from src.runs.evaluation import evaluate

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
    from src.metrics.exact_sm import ExactSMLoss

    class Images:
        data_dim = 3072

    with pytest.raises(ValueError, match="D=3072 costs 3072 backward passes"):
        ExactSMLoss().setup(None, Images())
    ExactSMLoss(max_dim=4096).setup(None, Images())  # raised knowingly: allowed


def test_unknown_metric_and_bad_options_are_named():
    from src.metrics.registry import build_metrics

    with pytest.raises(ValueError, match="model.metrics.bogus is not a metric"):
        build_metrics({"bogus": {}})
    with pytest.raises(ValueError, match="model.metrics.exact_sm"):
        build_metrics({"exact_sm": {"points": 3}})
    assert list(build_metrics({"exact_sm": None, "log_likelihood": {}})) == ["log_likelihood"]


def _toy(optimizer, **kw):
    return TwoOptimiserToy((1, 4, 4), optimizer, **kw)


ADAM = {"_target_": "torch.optim.Adam", "_partial_": True}


def test_optimisers_are_partial_torch_optim_classes_one_per_named_module_group():
    both = {"score": {**ADAM, "lr": 1e-2}, "generator": {"_target_": "torch.optim.SGD", "lr": 0.5, "momentum": 0.9}}
    toy = _toy(both)
    score, generator = toy.configure_optimizers()
    assert isinstance(score, torch.optim.Adam) and score.defaults["lr"] == 1e-2
    assert isinstance(generator, torch.optim.SGD) and generator.defaults["momentum"] == 0.9
    assert {id(p) for g in score.param_groups for p in g["params"]} == {id(p) for p in toy.score_net.parameters()}
    with pytest.raises(ValueError, match="needs one optimiser for each of score, generator, got score"):
        _toy({"score": {**ADAM, "lr": 1e-2}}).configure_optimizers()
    with pytest.raises(ValueError, match="model.optimizer.score.lr=-1 must be > 0"):
        _toy({"score": {**ADAM, "lr": -1}, "generator": ADAM})
    with pytest.raises(ValueError, match="model.optimizer.generator: SGD takes no argument betas"):
        _toy({"score": ADAM, "generator": {"_target_": "torch.optim.SGD", "lr": 0.1, "betas": [0.9, 0.99]}})
    with pytest.raises(ValueError, match="is the old spelling: give a partial torch.optim class"):
        _toy({"name": "sgd", "lr": 0.5})
    with pytest.raises(ValueError, match="model.scheduler._target_=.*is not a torch.optim.lr_scheduler class"):
        _toy({"score": ADAM, "generator": ADAM}, scheduler={"_target_": "torch.optim.SGD"})


TOY_OPT = {"score": {**ADAM, "lr": 0.05}, "generator": {**ADAM, "lr": 0.05}}


class GradNormRecorder(L.Callback):
    """The gradient norm each optimiser sees at its step (after any clipping)."""

    def __init__(self):
        self.norms: dict[int, list[float]] = {}

    def on_train_start(self, trainer, pl_module):
        for i, opt in enumerate(trainer.optimizers):
            def hook(optimizer, args, kwargs, i=i):
                grads = [p.grad for g in optimizer.param_groups for p in g["params"] if p.grad is not None]
                self.norms.setdefault(i, []).append(
                    torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g) for g in grads])).item())
            opt.register_step_pre_hook(hook)


def test_two_optimiser_toy_alternates_clips_writes_grid_and_fid(tmp_path, mnist_root):
    """A manual-optimisation family through the base: 2 score updates per generator update, trainer-level
    clipping applied to each manual update, a sample grid, and FID (MNIST features) that falls as the
    generator learns the data's pixel means and spreads."""
    from omegaconf import OmegaConf

    from src.callbacks.samples import SampleGridCallback
    from src.data.mnist_images import MNISTImageDataModule
    from src.runs.training import follow_optimization_mode

    dm = MNISTImageDataModule(root=str(mnist_root), limit=1200, batch_size=100, eval_batch_size=300)
    metrics = {"fid": {"kind": "mnist", "n_samples": 150}}

    def fid_of(module):
        tester = L.Trainer(logger=False, enable_progress_bar=False, inference_mode=False, enable_model_summary=False,
                           default_root_dir=str(tmp_path))
        tester.test(module, datamodule=dm, verbose=False)
        return module.test_results["test/fid"]

    fid_before = fid_of(TwoOptimiserToy((1, 28, 28), TOY_OPT, metrics=metrics))

    model = TwoOptimiserToy((1, 28, 28), TOY_OPT, metrics=metrics)
    trainer_cfg = follow_optimization_mode(OmegaConf.create({"gradient_clip_val": 0.5, "max_steps": 180}), model)
    assert "gradient_clip_val" not in trainer_cfg and model.manual_clip["gradient_clip_val"] == 0.5
    recorder = GradNormRecorder()
    trainer = L.Trainer(max_steps=trainer_cfg.max_steps, logger=False, enable_progress_bar=False,
                        inference_mode=False, enable_model_summary=False, enable_checkpointing=False,
                        default_root_dir=str(tmp_path), limit_val_batches=0,
                        callbacks=[SampleGridCallback(every_n_steps=None, n=16), recorder])
    trainer.fit(model, datamodule=dm)

    opt_score, opt_gen = trainer.optimizers
    n_score = int(next(iter(opt_score.state.values()))["step"])
    n_gen = int(next(iter(opt_gen.state.values()))["step"])
    assert n_score == 2 * n_gen and n_gen > 0
    assert trainer.global_step == n_score + n_gen  # Lightning counts every optimiser step
    # unclipped, the score net's DSM gradient is far above 0.5; every manual update was clipped to norm 0.5
    fresh = TwoOptimiserToy((1, 28, 28), TOY_OPT)
    dm.setup("fit")
    from src.objectives.dsm import dsm

    grads = torch.autograd.grad(dsm(fresh.score_net, dm.split_tensor("train", 100), sigma=0.1).loss,
                                list(fresh.score_net.parameters()))
    assert torch.linalg.vector_norm(torch.stack([g.norm() for g in grads])) > 5.0
    assert max(recorder.norms[0]) <= 0.5 + 1e-5 and len(recorder.norms[0]) == n_score
    assert (tmp_path / "samples.png").stat().st_size > 500
    fid_after = fid_of(model)
    assert math.isfinite(fid_before) and math.isfinite(fid_after)
    assert fid_after < 0.7 * fid_before, (fid_before, fid_after)  # measured: 3104 -> 1786


def test_optimized_metric_defaults_to_the_familys_monitor():
    assert compose_train(["model=dkef"]).optimized_metric == "val/sm_loss"
    cfg = compose_train(["model=dkef", "+model.monitor=val/dsm_loss", "+model.monitor_mode=max"])
    assert (cfg.optimized_metric, cfg.optimized_metric_mode) == ("val/dsm_loss", "max")
    cfg = compose_train(["model=dkef", "+model.monitor=val/dsm_loss", "optimized_metric=test/fid"])
    assert cfg.optimized_metric == "test/fid" and cfg.callbacks.model_checkpoint.monitor == "test/fid"


def test_log_likelihood_metric_reports_mean_and_stderr_over_test_points():
    """``test/<name>_stderr`` is the standard error over test points, accumulated over batches: the unbiased
    standard deviation of all per-point values / √n (what a paired or unpaired comparison of runs needs)."""
    from src.metrics.log_likelihood import LogLikelihood

    values = torch.tensor([-3.0, -1.0, -4.0, -1.5, -9.0, -2.5, -6.0], dtype=torch.float64)

    class Family:
        def log_likelihood_metrics(self, x):
            return {"log_likelihood": values[x.long()]}

        def log_likelihood_constants(self):
            return {}

    metric = LogLikelihood()
    for idx in (torch.arange(0, 3), torch.arange(3, 7)):
        metric.update(Family(), idx.float(), "test")
    out = metric.compute(Family(), "test")
    assert abs(out["test/log_likelihood"] - values.mean().item()) < 1e-12
    assert abs(out["test/log_likelihood_stderr"] - (values.std() / 7 ** 0.5).item()) < 1e-12
