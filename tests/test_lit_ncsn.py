"""NCSN through Lightning and the command line (paper §4.4): every architecture × loss × deq trains through
``fast_dev_run`` and is tested (noise-conditional losses, FID, DEQ diagnostics); the loss plumbing against
closed forms; ``python -m src.train model=ncsn … `` then ``python -m src.sample`` on its checkpoint."""

from __future__ import annotations

import json
import logging
import math
import os
import shutil
import subprocess
import sys
import warnings

import pytest
import torch

from src.deq.block import phantom_truncation
from src.deq.config import deq_setting
from src.runs.build import build
from src.runs.training import train
from tests.conftest import REPO_ROOT, compose_train

pytestmark = pytest.mark.usefixtures("one_thread")

TINY = ["logger=none", "callbacks=minimal", "model=ncsn", "data=mnist_images", "data.limit=200",
        "data.batch_size=8", "data.eval_batch_size=16", "model.ngf=4", "model.noise.num_classes=3",
        "model.sampling.n_steps_each=2", "model.metrics.fid.n_samples=8", "model.n_samples_grid=4",
        "trainer.fast_dev_run=true"]


@pytest.mark.parametrize("arch, loss", [
    ("refinenet", "dsm"), ("deq-true", "dsm"), ("deq-true", "ssm_vr"), ("deq-false", "dsm"),
    # slow: ssm_vr trains through deq-true above, and each explicit arch's training path runs with dsm
    pytest.param("refinenet", "ssm_vr", marks=pytest.mark.slow),
    pytest.param("deq-false", "ssm_vr", marks=pytest.mark.slow),
])
def test_fast_dev_run_every_arch_loss_and_deq(tmp_path, mnist_root, arch, loss):
    name, _, deq = arch.partition("-")
    extra = [f"deq={deq or 'false'}"] + (["depth=1"] if deq == "false" else [])
    cfg = compose_train([*TINY, f"data.root={mnist_root}", f"model.arch={name}", f"loss={loss}", *extra], tmp_path)
    train(cfg)
    saved = json.loads((tmp_path / "metrics.json").read_text())
    for key in ("test/dsm_loss", "test/ssm_vr_loss", "test/dsm_loss/sigma_2", "test/fid", "train/loss"):
        assert math.isfinite(saved[key]), key
    # σ²-weighted DSM of an untrained net: about D/2 = 392 per sample at every level (s ≈ 0) and more
    assert 100 < saved["test/dsm_loss"] < 1e5
    assert saved["test/fid"] > 0
    assert (tmp_path / "samples.png").stat().st_size > 100
    if arch == "deq-true":
        assert saved["profile/deq_iterations_mean"] >= 1
        lam = deq_setting(cfg.deq).norm_lambda  # unset in the config: the paper's 2
        assert 0 < saved["test/deq_contraction_rate"] < 2 / lam**2  # the map's bound
        assert saved["test/deq_forward_iterations"] >= 1
        assert 0 < saved["val/deq_contraction_rate"] < 2 / lam**2
    else:
        assert "test/deq_contraction_rate" not in saved


def lit_module(tmp_path, overrides):
    """The NCSN module of the config (built only: no data set is read)."""
    cfg = compose_train([*TINY, *overrides], tmp_path)
    return build(cfg.model)  # a user error in the module's arguments is raised as itself


def test_phantom_truncation_bound_and_warning(tmp_path):
    """ρᴷ/(1 − ρ) bounds the phantom Jacobian's missing Neumann tail; validation warns when a loss that
    differentiates through the DEQ (SSM-VR) is truncated by more than 5 %: the measured failure (ρ = 0.383 after
    600 steps with K = 2, exact SSM-VR +417 where the truncated one read −728) warns, the implicit-trained
    map (ρ = 0.087) does not, nor K = 8, DSM (no divergence through the DEQ) or the implicit backward."""
    assert phantom_truncation(0.383, 2) == pytest.approx(0.383**2 / 0.617)
    assert phantom_truncation(0.5, 1) == pytest.approx(1.0) and phantom_truncation(1.0, 8) == math.inf
    module = lit_module(tmp_path, ["loss=ssm_vr", "deq=true", "deq.phantom_steps=2"])
    with pytest.warns(RuntimeWarning, match="deq.backward=implicit"):
        assert module.check_phantom_truncation(0.383) == pytest.approx(0.2377, abs=1e-4)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert module.check_phantom_truncation(0.087) < 0.01
        module.net.deq_block().config.phantom_steps = 8
        assert module.check_phantom_truncation(0.383) < 1e-3
        module.net.deq_block().config.backward = "implicit"
        assert module.check_phantom_truncation(0.383) is None
        dsm = lit_module(tmp_path, ["loss=dsm", "deq=true"])
        assert dsm.check_phantom_truncation(0.9) is None


def test_noise_conditional_training_loss_closed_forms(tmp_path):
    """With the last conv zeroed, s ≡ 0: the σ²-weighted DSM loss is ½‖ε‖² per sample (mean D/2 = 392,
    std √(D/2) = 19.8 per sample, so within 25 of 392 for 64 samples at 8 standard errors) and SSM-VR is 0."""
    torch.manual_seed(0)
    x = torch.rand(64, 1, 28, 28)
    for loss, lo, hi in (("dsm", 392 - 25, 392 + 25), ("ssm_vr", -1e-12, 1e-12)):
        module = lit_module(tmp_path, [f"loss={loss}", "deq=true"])
        with torch.no_grad():
            module.net.end.weight.zero_()
            module.net.end.bias.zero_()
        value = module.training_step(x, 0).item()
        assert lo <= value <= hi, (loss, value)
    assert module.noise_levels.shape == (3,)
    assert module.noise_levels[0].item() == pytest.approx(1.0) and module.noise_levels[-1].item() == pytest.approx(0.01)


def test_sample_is_seeded_and_shaped(tmp_path):
    module = lit_module(tmp_path, ["deq=true", "loss=dsm"])
    a = module.sample(3, torch.Generator().manual_seed(1))
    b = module.sample(3, torch.Generator().manual_seed(1))
    assert a.shape == (3, 1, 28, 28) and torch.isfinite(a).all()
    assert torch.allclose(a, b, atol=1e-5)
    with pytest.raises(ValueError, match="loss=dsm"):
        lit_module(tmp_path, ["loss=sm"])


TABLE5 = ["model.net.conditioning=cond_norm", "model.noise.sigma_begin=1", "model.noise.num_classes=10"]


@pytest.mark.parametrize("deq,depth,net,params,table5", [("true", "null", "twores", 8_611_075, 8_762_243),
                                                         ("false", "1", "twores", 8_464_387, 8_619_907),
                                                         ("false", "null", "refinenet", 28_546_947, 28_937_475)])
def test_cifar10_experiment_is_the_papers_setting(tmp_path, deq, depth, net, params, table5):
    """The authors' code's settings (232 levels 50 -> 0.01, σ-scaled conditioning, T = 5 at 6.2e-6); with the
    documented overrides, the NCSN-v1 network at 10 levels whose counts are Table 5's 9M / 9M / 28M."""
    base = ["experiment=ncsn_cifar10", f"deq={deq}", f"depth={depth}", f"model/net={net}", "logger=none"]
    cfg = compose_train(base, tmp_path)
    assert (cfg.model.net.ngf, cfg.data.batch_size, cfg.trainer.max_steps) == (128, 128, 200_000)
    assert (cfg.model.optimizer.lr, cfg.model.optimizer.weight_decay, cfg.loss.name) == (1e-4, 1e-12, "ssm_vr")
    assert cfg.model.sampling.step_lr == 6.2e-6 and cfg.model.sampling.n_steps_each == 5
    assert cfg.model.net.conditioning == "sigma"
    assert cfg.optimized_metric == "val/dsm_loss"
    module = build(cfg.model)
    assert sum(p.numel() for p in module.parameters()) == params
    sig = module.net.sigmas
    assert sig.numel() == 232 and sig[0].item() == pytest.approx(50.0) and sig[-1].item() == pytest.approx(0.01)
    module = build(compose_train([*base, *TABLE5], tmp_path).model)
    assert sum(p.numel() for p in module.parameters()) == table5
    assert module.net.sigmas.numel() == 10


@pytest.mark.parametrize("conditioning", ["cond_norm", "sigma"])
def test_both_conditionings_train(tmp_path, conditioning):
    """A few SSM-VR steps of the TwoRes network lower the σ²-weighted DSM loss on the training batches."""
    cfg = compose_train([*TINY, "deq=false", "depth=1", "loss=ssm_vr",
                         f"model.conditioning={conditioning}", "model.optimizer.lr=3e-3"], tmp_path)
    module = build(cfg.model)
    assert module.net.conditioning == conditioning
    torch.manual_seed(0)
    x = torch.rand(16, 1, 28, 28)
    opt = torch.optim.Adam(module.parameters(), lr=3e-3)

    def dsm():
        from src.objectives.conditional import noise_conditional
        from src.objectives.registry import get_objective

        g = torch.Generator().manual_seed(1)
        return noise_conditional(get_objective("dsm"), module.net, x, module.net.sigmas, generator=g,
                                 create_graph=False).loss.item()

    before = dsm()
    for _ in range(25):
        opt.zero_grad()
        module.training_objective(x).loss.backward()
        opt.step()
    assert dsm() < 0.8 * before


def test_unknown_conditioning_is_refused(tmp_path):
    with pytest.raises(ValueError, match="model.net.conditioning='film' is unknown; valid: cond_norm, sigma"):
        lit_module(tmp_path, ["loss=ssm_vr", "model.conditioning=film"])


def test_train_command_writes_fid_and_sample_command_reads_its_checkpoint(tmp_path, mnist_root, caplog):
    run = tmp_path / "run"
    cmd = [sys.executable, "-m", "src.train", "model=ncsn", "data=mnist_images", "deq=true", "loss=ssm_vr",
           f"data.root={mnist_root}", "data.limit=200", "data.batch_size=8", "data.eval_batch_size=16",
           "model.ngf=4", "model.noise.num_classes=3", "model.sampling.n_steps_each=2",
           "model.metrics.fid.n_samples=8", "model.n_samples_grid=0", "trainer.max_steps=2",
           "trainer.val_check_interval=2", "trainer.limit_val_batches=1", "trainer.limit_test_batches=1",
           "trainer.enable_progress_bar=false", "logger=none", "ema=true", f"hydra.run.dir={run}"]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    done = subprocess.run(cmd, check=False, cwd=REPO_ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    saved = json.loads((run / "metrics.json").read_text())
    assert saved["test/fid"] > 0 and math.isfinite(saved["test/ssm_vr_loss"])
    assert math.isfinite(saved["best/val/dsm_loss"])

    # src.evaluate re-tests the same share of the test set (the run's limit_test_batches): the same losses
    from src.runs.evaluation import evaluate

    # (a checkpoint kept in another sub-folder of the run, as benchmarks/tools/training_curves.py keeps them: the
    # results still go to the run directory)
    (run / "kept").mkdir()
    kept = run / "kept" / "step.ckpt"
    shutil.copyfile(saved["tested_checkpoint"], kept)
    with caplog.at_level(logging.INFO, logger="src.runtime.progress"):
        again_metrics = evaluate(kept, [f"data.root={mnist_root}"])
    # its long phases show progress although the run was trained with trainer.enable_progress_bar=false
    started = [r.getMessage() for r in caplog.records if r.getMessage().endswith("in all)")]
    assert any(m.startswith("Langevin sampling of 8 images") for m in started), started
    for key in ("test/dsm_loss", "test/ssm_vr_loss"):
        assert again_metrics[key] == pytest.approx(saved[key], rel=1e-5), key
    assert (run / "eval_metrics.json").is_file() and not (run / "kept" / "eval_metrics.json").exists()

    from src.runs.sampling import sample_from_checkpoint

    out = sample_from_checkpoint(run / "checkpoints" / "last.ckpt", n=5, seed=3, out=tmp_path / "s.png",
                                 overrides=[f"data.root={mnist_root}"])
    images = torch.load(out.with_suffix(".pt"))
    assert images.shape == (5, 1, 28, 28) and 0 <= images.min() and images.max() <= 1
    again = torch.load(sample_from_checkpoint(run / "checkpoints" / "last.ckpt", n=5, seed=3,
                                              out=tmp_path / "t.png", overrides=[f"data.root={mnist_root}"])
                       .with_suffix(".pt"))
    assert torch.equal(images, again)


def test_resume_with_ema_matches_an_uninterrupted_run(tmp_path, mnist_root):
    """A DEQ-NCSN with EMA, 2 epochs straight vs 1 epoch, then resumed from its last.ckpt: the same
    trained and averaged weights (noise levels and projections drawn from the restored RNG, the DEQ warm start
    restored)."""
    base = ["logger=none", "callbacks=default", "callbacks.progress_bar=null", "trainer.enable_progress_bar=false",
            "model=ncsn", "data=mnist_images", f"data.root={mnist_root}", "data.limit=24", "data.batch_size=8",
            "data.eval_batch_size=16", "model.ngf=4", "model.noise.num_classes=3", "model.metrics.fid=null",
            "model.n_samples_grid=0", "deq=true", "loss=ssm_vr", "ema=true", "callbacks.ema.decay=0.8",
            "trainer.limit_val_batches=1", "test=false"]

    def last(run_dir):
        return torch.load(run_dir / "checkpoints" / "last.ckpt", map_location="cpu", weights_only=True)

    train(compose_train([*base, "trainer.max_epochs=2"], tmp_path / "straight"))
    train(compose_train([*base, "trainer.max_epochs=1"], tmp_path / "halves"))
    half = tmp_path / "halves" / "checkpoints" / "last.ckpt"
    steps = last(tmp_path / "halves")["global_step"]
    assert steps >= 2
    train(compose_train([*base, "trainer.max_epochs=2", f"ckpt_path={half}"], tmp_path / "halves"))
    a, b = last(tmp_path / "straight"), last(tmp_path / "halves")
    assert a["global_step"] == b["global_step"] == 2 * steps
    for key in ("state_dict", "current_model_state"):  # the EMA weights and the trained ones
        for name, value in a[key].items():
            torch.testing.assert_close(b[key][name], value, rtol=0, atol=1e-6, msg=f"{key}: {name}")
    moved = max((a["state_dict"][k] - a["current_model_state"][k]).abs().max().item() for k in a["state_dict"]
                if a["state_dict"][k].is_floating_point())
    assert moved > 1e-4  # the average differs from the last weights: the check above compares both


def test_sampling_update_is_composed_and_reaches_the_sampler(tmp_path):
    """model.sampling.update: euler by default; authors changes the samples only from a level's second step on
    (T = 1: the same samples); an unknown rule is refused with the allowed ones."""
    base = ["experiment=ncsn_mnist", "logger=none", "model.ngf=4", "model.noise.num_classes=3"]
    assert compose_train(base, tmp_path).model.sampling["update"] == "euler"  # .update: the dict method

    def samples(update, t):
        cfg = compose_train([*base, f"model.sampling.update={update}", f"model.sampling.n_steps_each={t}"], tmp_path)
        torch.manual_seed(0)
        module = build(cfg.model)
        assert module.sampling["update"] == update
        return module.sample(2, torch.Generator().manual_seed(1))

    assert torch.equal(samples("authors", 1), samples("euler", 1))
    assert not torch.allclose(samples("authors", 2), samples("euler", 2))
    with pytest.raises(ValueError, match="model.sampling.update='bdf': choose one of euler, authors"):
        build(compose_train([*base, "model.sampling.update=bdf"], tmp_path).model)
