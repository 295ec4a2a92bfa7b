"""Exact resume under DDP (issue 40): a ``trainer=ddp_cpu`` run (2 processes) killed by SIGKILL mid-epoch and
resumed from ``last.ckpt`` ends bit-equal — parameters, optimiser state, every rank's RNG states, test metrics,
in float64 — to the uninterrupted run, for DKEF and NICE (an image family).

Each rank's RNG streams and loader position are saved (gathered to rank 0) and each rank gets its own back
(:func:`src.lit.resume.gather_rank_states`). :class:`RankDependentDraws` makes the ranks' global RNG streams
differ (rank r draws r + 1 numbers per step, as a rank-dependent data or noise path would), so restoring rank 0's
state on every rank — what a checkpoint held before — would give rank 1 other SSM projections after the resume.

    python -m pytest -q -m slow tests/test_ddp_resume.py     # the kill-and-resume runs (about 5 min)
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

from src.lit.resume import restore_rank_state
from src.runtime.checkpoints import load_checked
from src.runtime.rng import capture_rng_states
from tests.conftest import FAST, REPO_ROOT, SHARED_DATA, require_mnist
from tests.test_resume_kill import COMMON, assert_equal_tree


class RankDependentDraws(L.Callback):
    """Rank r draws r + 1 numbers from the global torch RNG before each training batch."""

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        torch.rand(trainer.global_rank + 1)


class KillAllRanksAfterStep(L.Callback):
    """Rank 0 SIGKILLs its whole process group (both ranks: a node lost) at the first batch after ``step``,
    when that step's checkpoint is on disk (rank 0 wrote it at the end of the batch that reached it)."""

    def __init__(self, step: int):
        self.step = int(step)

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        if trainer.global_step >= self.step and trainer.global_rank == 0:
            os.killpg(os.getpgid(0), signal.SIGKILL)


DDP = ["trainer=ddp_cpu", "+callbacks.rank_draws._target_=tests.test_ddp_resume.RankDependentDraws"]
FAMILIES = {
    # 64 points, batch 16 per rank: 2 steps per epoch, 3 epochs; killed after step 3 (mid-epoch 2)
    "dkef": ([*FAST, "data.n_train=64", "trainer.max_epochs=3", "deq=true", "loss=ssm_vr"], 3),
    "nice": (["model=nice", "data=mnist", f"data.root={SHARED_DATA}", "data.limit=120", "data.batch_size=15",
              "model.hidden=16", "model.deq_width=16", "deq=true", "loss=ssm", "model.metrics.exact_sm.test_points=4",
              "model.metrics.exact_sm.val_points=4", "model.n_samples_grid=0", "trainer.max_epochs=2"], 3),
}


def start(overrides: list[str], run_dir: Path) -> subprocess.Popen:
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1"}
    for k in ("LOCAL_RANK", "NODE_RANK", "RANK", "WORLD_SIZE", "MASTER_PORT"):
        env.pop(k, None)
    cmd = [sys.executable, "-m", "src.train", *overrides, f"hydra.run.dir={run_dir}"]
    return subprocess.Popen(cmd, cwd=REPO_ROOT, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                            text=True, start_new_session=True)


def finish(proc: subprocess.Popen, timeout: int = 600) -> tuple[int, str]:
    _, err = proc.communicate(timeout=timeout)
    return proc.returncode, err


@pytest.mark.slow
@pytest.mark.parametrize("family", list(FAMILIES))
def test_ddp_sigkill_mid_epoch_then_resume_is_bit_equal(tmp_path, family):
    overrides, kill_step = FAMILIES[family]
    if family != "dkef":
        require_mnist()
    overrides = [*overrides, *COMMON, *DDP]
    full, killed = tmp_path / "full", tmp_path / "killed"
    kill = [f"+callbacks.kill._target_={__name__}.KillAllRanksAfterStep", f"+callbacks.kill.step={kill_step}"]
    rc_ref, err_ref = finish(start(overrides, full))
    assert rc_ref == 0, err_ref[-3000:]
    rc_killed, err_killed = finish(start([*overrides, *kill], killed))
    assert rc_killed == -signal.SIGKILL, f"not killed (rc {rc_killed}): {err_killed[-3000:]}"

    ckpts = killed / "checkpoints"
    last = load_checked(ckpts / "last.ckpt")
    assert last["global_step"] == kill_step
    (loader,) = last["loops"]["fit_loop"]["state_dict"]["combined_loader"]
    assert 0 < loader["batches"], loader  # mid-epoch
    ranks = last["deqsm_rank_states"]
    assert [r["rank"] for r in ranks] == [0, 1]  # every rank's RNG streams and loader position
    assert not torch.equal(ranks[0]["rng"]["torch"], ranks[1]["rng"]["torch"])  # the streams differ

    rc, err = finish(start([*overrides, f"ckpt_path={ckpts / 'last.ckpt'}"], killed))
    assert rc == 0, err[-3000:]
    assert "world size" not in err

    a, b = load_checked(full / "checkpoints" / "last.ckpt"), load_checked(ckpts / "last.ckpt")
    assert a["global_step"] == b["global_step"] > kill_step
    for key in ["state_dict", "optimizer_states", "deqsm_rng_states", "deqsm_rank_states", "deqsm_warm_start"]:
        assert_equal_tree(a[key], b[key], key)
    assert next(iter(a["state_dict"].values())).dtype == torch.float64
    ma, mb = (json.loads((d / "metrics.json").read_text()) for d in (full, killed))
    assert ma["ddp/ranks_identical"] and mb["ddp/ranks_identical"]
    tests = {k: v for k, v in ma.items() if k.startswith("test/")}
    assert tests and tests == {k: v for k, v in mb.items() if k.startswith("test/")}


def fake_trainer(rank: int, world: int):
    from types import SimpleNamespace

    return SimpleNamespace(global_rank=rank, world_size=world, is_global_zero=rank == 0)


def two_rank_checkpoint() -> dict:
    states = []
    for rank in (0, 1):
        torch.manual_seed(100 + rank)
        states.append({"rank": rank, "rng": capture_rng_states(), "warm_start": {"b": {"4x2": torch.full((4, 2), rank)}},
                       "loaders": [{"seed": 0, "epoch": 1, "batches": 3 + rank}]})
    return {"deqsm_rank_states": states,
            "loops": {"fit_loop": {"state_dict": {"combined_loader": [{"seed": 0, "epoch": 1, "batches": 3}]}}}}


def test_each_rank_gets_its_own_streams_and_loader_position():
    ckpt = two_rank_checkpoint()
    torch.manual_seed(0)
    mine = restore_rank_state(ckpt, fake_trainer(1, 2))
    torch.manual_seed(101)
    expected = torch.rand(3)
    restore_rank_state(ckpt, fake_trainer(1, 2))
    assert torch.equal(torch.rand(3), expected)  # rank 1's stream, not rank 0's
    assert torch.equal(mine["warm_start"]["b"]["4x2"], torch.ones(4, 2))
    assert ckpt["loops"]["fit_loop"]["state_dict"]["combined_loader"] == [{"seed": 0, "epoch": 1, "batches": 4}]


def test_a_world_size_change_is_one_line_and_goes_on(caplog):
    ckpt = two_rank_checkpoint()
    torch.manual_seed(7)
    before = torch.get_rng_state()
    assert restore_rank_state(ckpt, fake_trainer(0, 1)) is None
    assert torch.equal(torch.get_rng_state(), before)  # left as the checkpoint's rank-0 state put it
    (record,) = [r for r in caplog.records if r.name == "src.lit.resume"]
    assert record.getMessage().startswith("resuming a checkpoint of world size 2 with world size 1: ")
    assert "\n" not in record.getMessage()
    assert ckpt["loops"]["fit_loop"]["state_dict"]["combined_loader"] == [{"seed": 0, "epoch": 1, "batches": 3}]
