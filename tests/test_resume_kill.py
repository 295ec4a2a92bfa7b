"""Exact resume after a real SIGKILL mid-epoch, for every family (DKEF, NICE, NCSN with EMA, the two-optimiser
VAE, a supervised study): ``python -m src.train`` is killed (SIGKILL: no clean-up runs) right after a step
checkpoint, resumed from ``checkpoints/last.ckpt``, and its final parameters, optimiser states, EMA state, RNG
and DEQ warm-start states and test metrics are bit-equal to an uninterrupted run's, in float64.

The kill comes from inside the run (:class:`KillAfterStep`, a callback sending SIGKILL to its own process at
the start of the first batch after global step ``step``), so that it lands mid-epoch at a known step on a
busy machine; for the process it is the same signal as a ``kill -9`` from outside.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import lightning.pytorch as L
import pytest
import torch

from src.runtime.checkpoints import load_checked
from tests.conftest import FAST, REPO_ROOT, SHARED_DATA, require_mnist


class KillAfterStep(L.Callback):
    """SIGKILL this process at the start of the first batch after global step ``step`` (a checkpoint of that
    step is on disk by then: ``last_checkpoint`` saves at the end of the batch that reached it)."""

    def __init__(self, step: int):
        self.step = int(step)

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        if trainer.global_step >= self.step:
            os.kill(os.getpid(), signal.SIGKILL)


COMMON = ["logger=none", "callbacks=default", "callbacks.progress_bar=null", "callbacks.profiling.saved_tensors=false",
          "trainer.enable_progress_bar=false", "trainer.precision=64-true",
          "callbacks.last_checkpoint.every_n_train_steps=1", "callbacks.last_checkpoint.keep_steps=true"]
DATA = f"data.root={SHARED_DATA}"

# family: (overrides, global step to kill after, optimiser steps per epoch); 2 epochs each, the kill mid-epoch 2
FAMILIES = {
    "dkef": ([*FAST, "data.n_train=64", "trainer.max_epochs=2", "deq=true", "loss=ssm_vr"], 6, 4),
    # a validation (and a best-checkpoint update) right after the last step saved before the kill
    "dkef_midval": ([*FAST, "data.n_train=64", "trainer.max_epochs=2", "deq=true", "loss=ssm_vr",
                     "trainer.val_check_interval=2"], 6, 4),
    "nice": (["model=nice", "data=mnist", DATA, "data.limit=200", "data.batch_size=35", "model.hidden=16",
              "model.deq_width=16", "deq=true", "loss=ssm", "model.metrics.exact_sm.test_points=4",
              "model.metrics.exact_sm.val_points=4", "model.n_samples_grid=0", "trainer.max_epochs=2"], 6, 4),
    "ncsn_ema": (["model=ncsn", "data=mnist_images", DATA, "data.limit=48", "data.batch_size=8",
                  "data.eval_batch_size=16", "model.ngf=4", "model.noise.num_classes=3", "model.metrics.fid=null",
                  "model.n_samples_grid=0", "deq=true", "loss=ssm_vr", "ema=true", "callbacks.ema.decay=0.8",
                  "trainer.limit_val_batches=1", "trainer.limit_test_batches=1", "trainer.max_epochs=2"], 6, 4),
    "vae": (["experiment=vae_mnist", DATA, "data.limit=96", "data.batch_size=16", "data.eval_batch_size=32",
             "model.latent_dim=4", "model.hidden=16", "model.channels=8", "model.metrics.log_likelihood=null",
             "model.metrics.fid=null", "model.metrics.vae.val_points=16", "deq=true", "trainer.max_steps=-1",
             "trainer.max_epochs=2", "trainer.val_check_interval=null", "trainer.check_val_every_n_epoch=1",
             "trainer.limit_val_batches=1", "trainer.limit_test_batches=1"], 10, 8),
    "steep": (["experiment=steep", "callbacks=default", "data.dim=3", "data.task_kwargs.n_train=64",
               "data.batch_size=16", "deq=true", "trainer.max_epochs=2", "trainer.check_val_every_n_epoch=1"], 6, 4),
}


def train_cmd(overrides: list[str], run_dir: Path) -> list[str]:
    return [sys.executable, "-m", "src.train", *overrides, f"hydra.run.dir={run_dir}"]


def start(overrides: list[str], run_dir: Path) -> subprocess.Popen:
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "WANDB_MODE": "offline", "OMP_NUM_THREADS": "1"}
    return subprocess.Popen(train_cmd(overrides, run_dir), cwd=REPO_ROOT, env=env, stdout=subprocess.DEVNULL,
                            stderr=subprocess.PIPE, text=True)


def finish(proc: subprocess.Popen, timeout: int = 300) -> tuple[int, str]:
    _, err = proc.communicate(timeout=timeout)
    return proc.returncode, err


def assert_equal_tree(a, b, where: str) -> None:
    """Bit-equal nested checkpoint contents (tensors with torch.equal, numbers and strings with ==)."""
    if torch.is_tensor(a):
        assert torch.is_tensor(b) and a.dtype == b.dtype and a.shape == b.shape, where
        assert torch.equal(a, b), f"{where} differs (max |diff| {(a.double() - b.double()).abs().max().item():.3g})"
    elif isinstance(a, dict):
        assert set(a) == set(b), f"{where}: keys {sorted(set(a) ^ set(b))}"
        for k in a:
            assert_equal_tree(a[k], b[k], f"{where}/{k}")
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b), where
        for i, (x, y) in enumerate(zip(a, b)):
            assert_equal_tree(x, y, f"{where}[{i}]")
    else:
        assert a == b, f"{where}: {a} != {b}"


@pytest.fixture(scope="module")
def runs_root(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("resume_kill")


# the default suite kills one run (~21 s CPU): DKEF with a validation mid-epoch (the RNG that validation must leave
# alone); the other families run with `make test-all` (slow: the VAE's two optimisers resume exactly in the default
# suite's tests/test_lit_vae.py, at an epoch end)
DEFAULT_SUITE = {"dkef_midval"}


@pytest.mark.parametrize("family", [f if f in DEFAULT_SUITE else pytest.param(f, marks=pytest.mark.slow)
                                    for f in FAMILIES])
def test_sigkill_mid_epoch_then_resume_is_bit_equal(runs_root, family):
    overrides, kill_step, steps_per_epoch = FAMILIES[family]
    if DATA in overrides:  # the image families read MNIST
        require_mnist()
    overrides = [*overrides, *COMMON]
    full, killed = runs_root / family / "full", runs_root / family / "killed"
    kill = [f"+callbacks.kill._target_={__name__}.KillAfterStep", f"+callbacks.kill.step={kill_step}"]
    # the uninterrupted reference and the run to kill side by side (one thread each)
    ref, victim = start(overrides, full), start([*overrides, *kill], killed)
    rc_ref, err_ref = finish(ref)
    rc_killed, err_killed = finish(victim)
    assert rc_ref == 0, err_ref[-3000:]
    assert rc_killed == -signal.SIGKILL, f"not killed (rc {rc_killed}): {err_killed[-3000:]}"

    ckpts = killed / "checkpoints"
    last = load_checked(ckpts / "last.ckpt")  # weights-only: every family's checkpoint loads safely
    assert last["global_step"] >= kill_step
    assert (ckpts / f"step_{last['global_step']:07d}.ckpt").is_file()  # last.ckpt is the newest step
    (loader,) = last["loops"]["fit_loop"]["state_dict"]["combined_loader"]
    assert loader["epoch"] == 1 and 0 < loader["batches"] < (steps_per_epoch or 10**9), loader  # mid-epoch 2
    if steps_per_epoch:
        assert last["global_step"] % steps_per_epoch != 0
    stale = ckpts / ".last.ckpt.killedsave.tmp"  # what a SIGKILL during a save leaves
    stale.write_bytes(b"partial")

    rc, err = finish(start([*overrides, f"ckpt_path={ckpts / 'last.ckpt'}"], killed))
    assert rc == 0, err[-3000:]
    assert "dataloader is not resumable" not in err
    assert not stale.exists()
    assert not list(ckpts.glob("last-v*.ckpt"))

    a, b = load_checked(full / "checkpoints" / "last.ckpt"), load_checked(ckpts / "last.ckpt")
    assert a["global_step"] == b["global_step"] > kill_step
    keys = ["state_dict", "optimizer_states", "deqsm_rng_states", "deqsm_warm_start", "lr_schedulers"]
    if family == "ncsn_ema":
        keys += ["current_model_state", "averaging_state"]
        assert int(a["averaging_state"]["n_averaged"]) == a["global_step"]
    if family == "vae":
        assert len(a["optimizer_states"]) == 2
    for key in keys:
        assert_equal_tree(a[key], b[key], key)
    assert next(iter(a["state_dict"].values())).dtype == torch.float64
    ma, mb = (json.loads((d / "metrics.json").read_text()) for d in (full, killed))
    tests = {k: v for k, v in ma.items() if k.startswith("test/")}
    assert tests and tests == {k: v for k, v in mb.items() if k.startswith("test/")}



def test_validation_leaves_the_training_rng_untouched(tmp_path, one_thread):
    """A DEQ-NCSN validated after every epoch ends with the same weights and RNG state as one never validated:
    validation (its loaders, the seeded contraction check through split_tensor, any metric's draws) leaves the
    training RNG where it found it (src.runtime.rng, the loaders' own generators)."""
    require_mnist()
    from src.runs.training import train
    from tests.conftest import compose_train

    base = ["logger=none", "callbacks=default", "callbacks.progress_bar=null", "trainer.enable_progress_bar=false",
            "model=ncsn", "data=mnist_images", DATA, "data.limit=32", "data.batch_size=8", "data.eval_batch_size=8",
            "model.ngf=4", "model.noise.num_classes=3", "model.metrics.fid=null", "model.n_samples_grid=0",
            "deq=true", "loss=ssm_vr", "trainer.max_epochs=2", "test=false", "trainer.precision=64-true"]
    validated = ["trainer.val_check_interval=null", "trainer.check_val_every_n_epoch=1", "trainer.limit_val_batches=1"]
    for name, val in (("validated", validated), ("never", ["trainer.limit_val_batches=0"])):
        train(compose_train([*base, *val], tmp_path / name))
    a, b = (load_checked(tmp_path / name / "checkpoints" / "last.ckpt") for name in ("validated", "never"))
    assert a["global_step"] == b["global_step"] > 0
    for key in ("state_dict", "deqsm_rng_states"):
        assert_equal_tree(a[key], b[key], key)
