"""Checkpoints that cannot hurt: a crafted checkpoint is refused by every load path without its payload running
(trusted old checkpoints still load with the opt-in), nothing non-finite is ever written, a checkpoint of another
family or other sizes is refused in one line."""

from __future__ import annotations

import os
from collections import OrderedDict
from pathlib import Path

import numpy as np
import pytest
import torch
from omegaconf import OmegaConf

from src.runs.training import train
from src.runtime.checkpoints import (
    CheckpointError,
    NonFiniteCheckpointError,
    UnsafeCheckpointError,
    check_matches_model,
    load_checked,
    nonfinite_entries,
    safe_contents,
)
from tests.conftest import FAST, compose_train
from tests.test_data_mnist import fake_mnist

pytestmark = pytest.mark.usefixtures("one_thread")

RUN = [*FAST, "callbacks=default", "callbacks.progress_bar=null", "trainer.enable_progress_bar=false",
       "trainer.max_epochs=1", "data.n_train=32"]


def run(overrides: list[str], out: Path) -> dict:
    cfg = compose_train([*RUN, *overrides], out)
    (out / ".hydra").mkdir(parents=True, exist_ok=True)  # as a Hydra run leaves it (src.evaluate reads it)
    OmegaConf.save(cfg, out / ".hydra" / "config.yaml")
    return train(cfg)


class Payload:
    """Unpickling it runs a shell command that writes ``marker`` (what a malicious checkpoint would do)."""

    def __init__(self, marker: Path):
        self.marker = marker

    def __reduce__(self):
        return os.system, (f"echo pwned > {self.marker}",)


@pytest.fixture(scope="module")
def dkef_run(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("dkef_run")
    run([], out)
    return out


def crafted(run_dir: Path, tmp_path: Path) -> tuple[Path, Path]:
    """A copy of a real checkpoint of ``run_dir`` carrying a :class:`Payload`, inside the run (for its config)."""
    marker = tmp_path / "marker.txt"
    ckpt = torch.load(run_dir / "checkpoints" / "last.ckpt", map_location="cpu", weights_only=True)
    ckpt["callbacks"]["Evil"] = Payload(marker)
    path = run_dir / "checkpoints" / f"crafted_{tmp_path.name}.ckpt"
    torch.save(ckpt, path)
    return path, marker


def test_checkpoints_load_weights_only_and_hold_plain_values(dkef_run):
    ckpt = torch.load(dkef_run / "checkpoints" / "last.ckpt", map_location="cpu", weights_only=True)
    rng = ckpt["deqsm_rng_states"]["numpy"]
    assert rng["bit_generator"] == "MT19937" and rng["key"].dtype == torch.int64 and rng["key"].numel() == 624
    assert ckpt["deqsm_family"] == "DKEFLitModule" and isinstance(ckpt["hyper_parameters"], dict)


def test_crafted_checkpoint_is_refused_by_every_load_path(dkef_run, tmp_path):
    from src.runs.evaluation import evaluate
    from src.runs.sampling import sample_from_checkpoint

    path, marker = crafted(dkef_run, tmp_path)
    refused = r"holds a pickled posix\.system, which a safe load refuses .* trust_checkpoint=true"
    with pytest.raises(UnsafeCheckpointError, match=refused):  # train resume
        train(compose_train([*RUN, "trainer.max_epochs=2", f"ckpt_path={path}"], tmp_path / "resumed"))
    with pytest.raises(UnsafeCheckpointError, match=refused):
        evaluate(path)
    with pytest.raises(UnsafeCheckpointError, match=refused):
        sample_from_checkpoint(path, n=2)
    with pytest.raises(UnsafeCheckpointError, match=refused):
        load_checked(path)
    assert not marker.exists()
    # control: the payload is live — trusting the file runs it (what every load did before)
    with pytest.raises(ValueError, match="does not generate"):
        sample_from_checkpoint(path, n=2, trust=True)
    assert marker.read_text().strip() == "pwned"


def test_old_format_checkpoint_loads_only_with_the_opt_in(dkef_run, tmp_path):
    """A checkpoint as deqsm wrote it before (numpy RNG state, OmegaConf hyper-parameters) is refused with a
    line naming the numpy object, and resumes with trust_checkpoint=true."""
    ckpt = torch.load(dkef_run / "checkpoints" / "last.ckpt", map_location="cpu", weights_only=True)
    ckpt["deqsm_rng_states"]["numpy"] = np.random.get_state()  # the legacy tuple with an ndarray
    ckpt["hyper_parameters"] = OmegaConf.create(ckpt["hyper_parameters"])
    old = tmp_path / "old.ckpt"
    torch.save(ckpt, old)
    with pytest.raises(UnsafeCheckpointError, match=r"old\.ckpt holds a pickled (numpy|omegaconf)\.\S+, which a safe load"):
        train(compose_train([*RUN, "trainer.max_epochs=2", f"ckpt_path={old}"], tmp_path / "refused"))
    metrics = train(compose_train([*RUN, "trainer.max_epochs=2", f"ckpt_path={old}", "trust_checkpoint=true"],
                                  tmp_path / "trusted"))
    assert metrics["global_step"] == 2 * ckpt["global_step"] > 0


def test_save_time_conversion_and_refusal():
    cfg = OmegaConf.create({"a": [1, {"b": 2.0}]})
    out = safe_contents({"hp": cfg, "od": OrderedDict(w=torch.ones(1)), "p": Path("/x")})
    assert out["hp"] == {"a": [1, {"b": 2.0}]} and type(out["hp"]) is dict
    assert isinstance(out["od"], OrderedDict) and out["p"] == "/x"
    with pytest.raises(TypeError, match=r"checkpoint/callbacks/Foo/state holds a numpy\.ndarray"):
        safe_contents({"callbacks": {"Foo": {"state": np.zeros(2)}}})


def test_diverging_run_writes_no_nonfinite_checkpoint(tmp_path):
    """The issue's run: DEQ-DKEF, exact SM, lr 5, a checkpoint every step. Step 6's update is made with a finite
    loss but leaves NaN weights and Adam moments: that state is not saved, the run stops naming the newest
    (finite) checkpoint, and every file on disk is finite."""
    cfg = compose_train(["logger=none", "callbacks.progress_bar=null", "trainer.enable_progress_bar=false",
                         "model=dkef", "loss=sm", "deq=true", "model.optimizer.lr=5", "trainer.max_steps=12",
                         "test=false", "callbacks.last_checkpoint.every_n_train_steps=1",
                         "callbacks.last_checkpoint.keep_steps=true",
                         # the step at which an lr-5 run diverges is set by round-off: pin the route it was found on
                         "model.exact_route=autograd"], tmp_path)
    with pytest.raises(NonFiniteCheckpointError, match=r"state at global step 6 is not finite \(state_dict/") as info:
        train(cfg)
    newest = tmp_path / "checkpoints" / "last.ckpt"
    assert f"the newest finite checkpoint is {newest} (resume with ckpt_path={newest})" in str(info.value)
    steps = []
    for p in sorted((tmp_path / "checkpoints").glob("*.ckpt")):
        ckpt = load_checked(p)
        assert nonfinite_entries(ckpt) == [], p
        steps.append(ckpt["global_step"])
    assert load_checked(newest)["global_step"] == max(steps) == 5
    assert not (tmp_path / "checkpoints" / "step_0000006.ckpt").exists()
    assert not list((tmp_path / "checkpoints").glob(".*.tmp"))


def test_checkpoint_of_another_family_or_shape_is_named(dkef_run, tmp_path):
    from src.runs.evaluation import evaluate
    from src.runs.sampling import sample_from_checkpoint

    last = dkef_run / "checkpoints" / "last.ckpt"
    for size in ("model.net.n_inducing=8", "model.n_inducing=8"):  # today's spelling and the flat one of old
        with pytest.raises(CheckpointError, match=r"does not fit this DKEFLitModule: shapes differ: .*\[16, "):
            evaluate(last, [size])
    with pytest.raises(ValueError, match=r"model=nice would replace the run's whole model config"):
        evaluate(last, ["model=nice"])
    with pytest.raises(ValueError, match=r"model=nice would replace"):
        sample_from_checkpoint(last, n=2, overrides=["model=nice"])
    nice = compose_train(["model=nice", "data=mnist", "model.hidden=8"], tmp_path)
    from hydra.utils import instantiate

    model = instantiate(nice.model)
    with pytest.raises(CheckpointError, match=r"is a DKEFLitModule checkpoint, but this run builds a NICE"):
        check_matches_model(load_checked(last), model, last)
    fake_mnist(tmp_path / "data" / "mnist", n_train=60, n_test=40)  # small files in MNIST's format: no data set
    with pytest.raises(CheckpointError, match=r"is a DKEFLitModule checkpoint"):  # train resume, same check
        train(compose_train(["model=nice", "data=mnist", f"data.root={tmp_path / 'data'}", "model.hidden=8", "logger=none",
                             "callbacks=minimal", f"ckpt_path={last}", "data.limit=100", "trainer.max_epochs=1"],
                            tmp_path / "nice"))


def test_run_config_may_only_build_deqsm_classes(dkef_run, tmp_path):
    """src.evaluate / src.sample instantiate the model and data of the checkpoint's run config: a shared run
    directory whose config names another callable is refused (unless trusted) before anything is built. Hydra
    blocks os.system-like targets but not ``torch.load`` (measured), which unpickles a file of the run."""
    import shutil

    from src.runs.evaluation import evaluate
    from src.runs.sampling import sample_from_checkpoint

    run = tmp_path / "shared_run"
    shutil.copytree(dkef_run / ".hydra", run / ".hydra")
    (run / "checkpoints").mkdir()
    shutil.copyfile(dkef_run / "checkpoints" / "last.ckpt", run / "checkpoints" / "last.ckpt")
    marker = tmp_path / "marker.txt"
    torch.save({"x": Payload(marker)}, run / "data.pt")
    cfg = OmegaConf.load(run / ".hydra" / "config.yaml")
    cfg.data = {"_target_": "torch.load", "f": str(run / "data.pt"), "weights_only": False}
    OmegaConf.save(cfg, run / ".hydra" / "config.yaml")
    for load in (lambda p: evaluate(p), lambda p: sample_from_checkpoint(p, n=2)):
        with pytest.raises(UnsafeCheckpointError, match=r"has data\._target_=torch\.load: .* trust_checkpoint=true"):
            load(run / "checkpoints" / "last.ckpt")
    assert not marker.exists()
    with pytest.raises(Exception):  # noqa: B017  control: trusted, the config's target runs (and fails after)
        evaluate(run / "checkpoints" / "last.ckpt", trust=True)
    assert marker.read_text().strip() == "pwned"
