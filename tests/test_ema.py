"""EMA of the weights (``ema=true``): the weights validated, checkpointed, tested and resumed."""

from __future__ import annotations

from pathlib import Path

import lightning.pytorch as L
import pytest
import torch
from omegaconf import OmegaConf

from src.runs.training import train
from tests.conftest import FAST, compose_train

DECAY = 0.9  # far from 1, so that the average of a dozen steps differs clearly from the last weights
# Two epochs of 6 steps, a checkpoint (the best by validation SM loss, and last.ckpt) after each epoch.
RUN = [*FAST, "callbacks=default", "trainer.enable_progress_bar=false", "trainer.max_epochs=2"]

RECORDERS: list[Recorder] = []


class Recorder(L.Callback):
    """The parameters after every optimizer step (by global step) and the ones in place when the test ends."""

    def __init__(self):
        self.steps: dict[int, dict[str, torch.Tensor]] = {}
        self.validation_end: dict[int, dict[str, torch.Tensor]] = {}
        self.after_validation: dict[int, dict[str, torch.Tensor]] = {}
        self.tested: dict[str, torch.Tensor] | None = None
        self.tested_buffers: dict[str, torch.Tensor] | None = None
        RECORDERS.append(self)

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        self.steps[trainer.global_step] = {k: v.detach().clone() for k, v in pl_module.named_parameters()}

    def on_validation_epoch_end(self, trainer, pl_module):  # as the module's own epoch end sees them
        self.validation_end[trainer.global_step] = {k: v.detach().clone() for k, v in pl_module.named_parameters()}

    def on_validation_end(self, trainer, pl_module):  # after validation, as a checkpoint sees them
        self.after_validation[trainer.global_step] = {k: v.detach().clone() for k, v in pl_module.named_parameters()}

    def on_test_end(self, trainer, pl_module):  # where a model or a callback draws samples
        self.tested = {k: v.detach().clone() for k, v in pl_module.named_parameters()}
        self.tested_buffers = {k: v.detach().clone() for k, v in pl_module.named_buffers()}


def run(overrides: list[str], out: Path, base: list[str] = RUN) -> tuple[dict, Recorder]:
    RECORDERS.clear()
    cfg = compose_train([*base, *overrides, f"+callbacks.recorder._target_={__name__}.Recorder"], out)
    (out / ".hydra").mkdir(parents=True, exist_ok=True)  # as a Hydra run leaves it (src.evaluate reads it)
    OmegaConf.save(cfg, out / ".hydra" / "config.yaml")
    metrics = train(cfg)
    assert len(RECORDERS) == 1
    return metrics, RECORDERS[0]


def ema_by_hand(steps: dict[int, dict[str, torch.Tensor]], upto: int, decay: float) -> dict[str, torch.Tensor]:
    """W_ema(1) = W(1); W_ema(t) = decay W_ema(t-1) + (1 - decay) W(t), in float64."""
    ema = None
    for step in range(1, upto + 1):
        w = {k: v.double() for k, v in steps[step].items()}
        ema = w if ema is None else {k: decay * ema[k] + (1 - decay) * w[k] for k in w}
    return ema


def assert_same(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor], atol: float = 1e-6) -> None:
    assert a.keys() == b.keys()
    for k, v in a.items():
        torch.testing.assert_close(v.double(), b[k].double(), rtol=1e-5, atol=atol, msg=f"{k} differs")


def max_diff(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    return max((a[k].double() - b[k].double()).abs().max().item() for k in a)


def test_ema_off_tests_the_trained_weights(tmp_path, one_thread):
    metrics, rec = run(["ema=false"], tmp_path)
    ckpt = torch.load(metrics["tested_checkpoint"], map_location="cpu", weights_only=True)
    assert "current_model_state" not in ckpt and "averaging_state" not in ckpt
    best_step = ckpt["global_step"]
    assert sorted(rec.steps) == list(range(1, 13)) and best_step in (6, 12)
    assert_same(rec.tested, rec.steps[best_step], atol=0)


@pytest.mark.parametrize("checkpoints", [True, False])
def test_ema_on_tests_the_average_of_the_steps(tmp_path, one_thread, checkpoints):
    no_ckpt = ["callbacks=minimal", "+trainer.enable_checkpointing=false"]
    metrics, rec = run(["ema=true", f"callbacks.ema.decay={DECAY}", *([] if checkpoints else no_ckpt)], tmp_path)
    assert sorted(rec.steps) == list(range(1, 13))
    if not checkpoints:  # the final weights are tested: the average after 12 steps, copied in at the end of fit
        assert metrics["tested_checkpoint"] == "final weights"
        step = 12
    else:  # the best checkpoint (by the averaged weights' validation loss) is tested
        ckpt = torch.load(metrics["tested_checkpoint"], map_location="cpu", weights_only=True)
        step = ckpt["global_step"]
        assert step in (6, 12)
        # the checkpoint: averaged weights in state_dict, trained ones beside them, and the averaging state
        assert_same({k: ckpt["state_dict"][k] for k in rec.steps[step]}, ema_by_hand(rec.steps, step, DECAY))
        assert_same({k: ckpt["current_model_state"][k] for k in rec.steps[step]}, rec.steps[step], atol=0)
        assert int(ckpt["averaging_state"]["n_averaged"]) == step
        # the whole validation runs on the average, its end included (the module's metrics' compute and the DEQ
        # diagnostics run there), and the trained weights are back before the checkpoint is written
        for s in (6, 12):
            assert_same(rec.validation_end[s], ema_by_hand(rec.steps, s, DECAY))
            assert_same(rec.after_validation[s], rec.steps[s], atol=0)
        ema_state = [v for k, v in ckpt["callbacks"].items() if k.startswith("EMA")]
        assert ema_state == [{"latest_update_step": step}]
        # re-evaluating the checkpoint (a fresh Trainer, no callbacks) sees the same averaged weights
        from src.runs.evaluation import evaluate

        ev = evaluate(metrics["tested_checkpoint"])
        for key in ("test/sm_loss", "test/log_likelihood"):
            assert ev[key] == pytest.approx(metrics[key], rel=1e-6, abs=1e-6), key
    expected = ema_by_hand(rec.steps, step, DECAY)
    assert_same(rec.tested, expected)
    # the average is not the last trained weights: the comparison above could tell them apart
    assert max_diff(rec.steps[step], expected) > 1e-3
    assert max_diff(rec.tested, rec.steps[step]) > 1e-3
    for key in ("test/sm_loss", "test/log_likelihood", "test/fisher_divergence"):
        assert torch.isfinite(torch.tensor(metrics[key])), key


def test_ema_nice_keeps_integer_buffers_and_samples_from_the_average(tmp_path, one_thread, mnist_root):
    """NICE: permutation buffers (int64) are copied, not averaged (Lightning's default use_buffers=True writes an
    EMA with decay 0.9 back into them truncated: this test then fails on net.perm); spectral-norm vectors ride
    along; samples are drawn at test end, from the averaged weights."""
    from tests.test_train import NICE_FAST

    nice = [o for o in NICE_FAST if o != "trainer.fast_dev_run=true"]
    metrics, rec = run([f"data.root={mnist_root}", "loss=ssm", "deq=true", "deq.norm=spectral", "ema=true",
                        f"callbacks.ema.decay={DECAY}", "trainer.max_epochs=1", "trainer.limit_train_batches=2",
                        "trainer.limit_val_batches=0", "trainer.limit_test_batches=1",
                        "model.metrics.exact_sm.test_points=2",
                        "trainer.enable_progress_bar=false"], tmp_path, base=nice)
    assert sorted(rec.steps) == [1, 2]
    ints = {k: v for k, v in rec.tested_buffers.items() if not v.is_floating_point()}
    assert {k.rsplit(".", 1)[-1] for k in ints} == {"perm", "inv_perm"}
    perm = torch.cat([torch.arange(0, 784, 2), torch.arange(1, 784, 2)])
    for k, v in ints.items():
        assert torch.equal(v, perm if k.endswith(".perm") else torch.argsort(perm)), k
    assert_same(rec.tested, ema_by_hand(rec.steps, 2, DECAY))
    assert max_diff(rec.tested, rec.steps[2]) > 1e-4
    assert (tmp_path / "samples.png").stat().st_size > 500
    assert torch.isfinite(torch.tensor(metrics["test/bits_per_dim"]))


def test_resume_continues_the_average_exactly(tmp_path, one_thread):
    ema = ["ema=true", f"callbacks.ema.decay={DECAY}", "trainer.max_epochs=4"]
    run(ema, tmp_path / "straight")
    run([*ema, "trainer.max_epochs=2"], tmp_path / "halves")
    half = tmp_path / "halves" / "checkpoints" / "last.ckpt"
    assert torch.load(half, map_location="cpu", weights_only=True)["global_step"] == 12
    run([*ema, f"ckpt_path={half}"], tmp_path / "halves")
    a, b = (torch.load(tmp_path / d / "checkpoints" / "last.ckpt", map_location="cpu", weights_only=True)
            for d in ("straight", "halves"))
    assert a["global_step"] == b["global_step"] == 24
    assert int(a["averaging_state"]["n_averaged"]) == int(b["averaging_state"]["n_averaged"]) == 24
    assert_same(a["state_dict"], b["state_dict"])
    assert_same(a["current_model_state"], b["current_model_state"])
    assert max_diff(a["state_dict"], a["current_model_state"]) > 1e-3


def test_ema_checkpoint_needs_ema_to_resume(tmp_path, one_thread):
    run(["ema=true", "trainer.max_epochs=1"], tmp_path / "ema")
    last = tmp_path / "ema" / "checkpoints" / "last.ckpt"
    cfg = compose_train([*RUN, "ema=false", "trainer.max_epochs=2", f"ckpt_path={last}"], tmp_path / "off")
    with pytest.raises(ValueError, match="resume it with ema=true"):
        train(cfg)


def test_ema_decay_is_checked(tmp_path):
    cfg = compose_train([*RUN, "ema=true", "callbacks.ema.decay=1.5"], tmp_path)
    with pytest.raises(ValueError, match="decay=1.5"):
        train(cfg)
