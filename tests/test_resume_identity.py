"""A resume continues the run it was trained as (src/runs/identity.py): per family, a tiny run of 2 steps is resumed
with a changed objective / network / DEQ / data key (refused in one line naming each key and the override), with
that override (it goes on), and with what may change (max_steps, logging, evaluation settings: silent)."""

from __future__ import annotations

import logging

import pytest
import torch

from src.runs.identity import CHECKPOINT_KEY, ResumeMismatchError, check_same_run, differences
from src.runs.training import train
from tests.conftest import FAST, compose_train

pytestmark = pytest.mark.usefixtures("one_thread")

# last.ckpt only (no best checkpoint, no profiling, no progress bar): the state a resume reads
CKPT = ["logger=none", "callbacks=none", "+callbacks.last_checkpoint._target_=src.callbacks.checkpoint.LastCheckpoint",
        "+callbacks.last_checkpoint.dirpath=${paths.output_dir}/checkpoints", "trainer.enable_progress_bar=false",
        "trainer.max_steps=2", "trainer.max_epochs=-1", "test=false"]

FAMILIES = {
    "dkef": [*FAST, "model=dkef", "loss=sm", "deq=true"],
    "nice": ["model=nice", "data=mnist", "data.limit=100", "data.batch_size=16", "model.net.hidden=16",
             "model.net.deq_width=16", "model.net.n_couplings=2", "loss=ssm", "deq=true"],
    "vae": ["experiment=vae_mnist", "data.limit=64", "data.batch_size=16", "model.net.latent_dim=4",
            "model.net.hidden=16", "model.net.channels=8", "deq=true"],
    "ncsn": ["model=ncsn", "data=mnist_images", "data.limit=48", "data.batch_size=8", "model.net.ngf=4",
             "model.noise.num_classes=3", "loss=ssm_vr", "deq=true"],
}
# per family: a changed run (overrides) -> the keys the refusal must name
CHANGED = {
    "dkef": (["loss=ssm_vr"], ["loss.name: sm in the checkpoint, ssm_vr here", "resume_allow=[loss]"]),
    "nice": (["deq.max_iter=7"], ["deq.max_iter: ", "resume_allow=[deq.max_iter]"]),
    "vae": (["model.score_steps=2", "data.binarize=false"],
            ["model.score_steps: 1 in the checkpoint, 2 here", "data.binarize: True in the checkpoint, False here",
             "resume_allow=[data.binarize,model.score_steps]"]),
    "ncsn": (["model.noise.sigma_end=0.02", "model.optimizer.lr=3e-4"],
             ["model.noise.sigma_end: 0.01 in the checkpoint, 0.02 here",
              "model.optimizer.lr: 0.0001 in the checkpoint, 0.0003 here"]),
}
# what may change, per family (besides trainer.max_steps and the logger)
MAY_CHANGE = {
    "dkef": ["model.metrics.log_likelihood.samples=1000", "model.alpha_refit_points=32"],
    "nice": ["model.metrics.exact_sm.test_points=4", "data.eval_batch_size=32"],
    "vae": ["model.metrics.fid.n_samples=8", "model.n_samples_grid=4"],
    "ncsn": ["model.sampling.n_steps_each=2", "eval=quick"],
}


def _family(name: str, request) -> list[str]:
    if name == "dkef":
        return FAMILIES[name]
    return [*FAMILIES[name], f"data.root={request.getfixturevalue('mnist_root')}"]


@pytest.mark.parametrize("family", list(FAMILIES))
def test_a_resume_refuses_another_run_and_allows_what_may_change(tmp_path, request, caplog, family):
    base = [*_family(family, request), *CKPT]
    train(compose_train(base, tmp_path / "first"))
    ckpt = tmp_path / "first" / "checkpoints" / "last.ckpt"
    saved = torch.load(ckpt, map_location="cpu", weights_only=True)[CHECKPOINT_KEY]
    assert saved["model._target_"].startswith("src.lit.") and saved["deq.enabled"] is True

    changed, needles = CHANGED[family]
    resume = [f"ckpt_path={ckpt}"]
    cfg = compose_train([*base, *changed, *resume, "trainer.max_steps=4"], tmp_path / "changed")
    with pytest.raises(ResumeMismatchError) as info:
        train(cfg)
    message = str(info.value)
    assert "\n" not in message and message.startswith(f"ckpt_path={ckpt} was trained as another run — ")
    for needle in needles:
        assert needle in message, message
    assert not (tmp_path / "changed" / "checkpoints").exists()  # refused before a step was taken

    # on purpose: the override the message names lets it go on
    allow = message.rsplit("resume_allow=", 1)[1]
    caplog.clear()
    metrics = train(compose_train([*base, *changed, *resume, f"resume_allow={allow}", "trainer.max_steps=3"],
                                  tmp_path / "allowed"))
    assert metrics["global_step"] >= 3 and f"Restored all states from the checkpoint at {ckpt}" in caplog.text

    # what may change passes silently: more steps, another logger, evaluation settings
    metrics = train(compose_train([*base, *MAY_CHANGE[family], *resume, "trainer.max_steps=3", "logger=csv"],
                                  tmp_path / "more"))
    assert metrics["global_step"] >= 3 and caplog.text.count("Restored all states from the checkpoint") == 2


def test_a_checkpoint_of_an_older_version_is_checked_through_its_hyper_parameters(caplog):
    """A checkpoint without deqsm_run: its model's saved hyper-parameters stand for its run (data unchecked)."""
    here = {"model._target_": "src.lit.dkef.DKEFLitModule", "loss.name": "ssm_vr", "loss.n_projections": 1,
            "deq.max_iter": 30, "model.net.n_kernels": 3, "data.dim": 10, "data.n_train": 96}
    old = {"hyper_parameters": {"input_dim": 10, "loss": {"name": "sm", "trace_route": "auto"},
                                "deq": {"max_iter": 30}, "n_kernels": 3, "metrics": {"exact_sm": {}}}}
    with caplog.at_level(logging.INFO, logger="src.runs.identity"), \
            pytest.raises(ResumeMismatchError, match=r"loss\.name: sm in the checkpoint, ssm_vr here: .*"
                                                     r"resume_allow=\[loss\.name\]$"):
        check_same_run(old, "old.ckpt", identity=here)
    assert "written before checkpoints recorded their run" in caplog.text
    check_same_run(old, "old.ckpt", identity=here, allow=["loss"])
    old["hyper_parameters"]["input_dim"] = 11
    with pytest.raises(ResumeMismatchError, match=r"data\.dim: 11 in the checkpoint, 10 here"):
        check_same_run(old, "old.ckpt", identity=here, allow=["loss"])


def test_differences_name_each_key_and_cover_groups():
    saved = {"loss.name": "sm", "deq.max_iter": 30, "deq.tol": 1e-4, "model.ngf": 4}
    here = {"loss.name": "sm", "deq.max_iter": 10, "deq.tol": 1e-3, "model.ngf": 4, "model.new": 1}
    assert differences(saved, here) == ["deq.max_iter: 30 in the checkpoint, 10 here",
                                        "deq.tol: 0.0001 in the checkpoint, 0.001 here",
                                        "model.new: (absent) in the checkpoint, 1 here"]
    assert differences(saved, here, allow=["deq", "model.new"]) == []
    assert differences(saved, here, allow=["deq.max"]) == differences(saved, here)  # a key, not a text prefix
    with pytest.raises(ResumeMismatchError, match=r"resume_allow=\[deq,model\.new\]$"):
        check_same_run({CHECKPOINT_KEY: saved}, "x.ckpt", identity=here)


def _as_recorded_before_partial_optimisers(identity: dict) -> dict:
    """``identity`` as a checkpoint recorded it while model.optimizer was a flat mapping ({name, lr, …, scheduler,
    params}) and model.scheduler did not exist."""
    old = {k: v for k, v in identity.items() if not k.startswith(("model.scheduler", "model.optimizer"))}
    groups = {k.rsplit(".", 1)[0] for k in identity if k.startswith("model.optimizer") and k.endswith("._target_")}
    for group in groups:
        old[f"{group}.name"] = identity[f"{group}._target_"].rsplit(".", 1)[1].lower()
        old.update({k: v for k, v in identity.items() if k.startswith(f"{group}.") and not k.endswith("_")})
        if group != "model.optimizer":
            old[f"{group}.params"] = ["score_net"] if group.endswith("score") else ["encoder", "decoder"]
        if identity.get("model.scheduler._target_", "").endswith("CosineAnnealingLR"):
            old[f"{group}.scheduler"] = "cosine"
    return old


@pytest.mark.parametrize("experiment", ["steep", "vae_mnist", "implicit_bias", "dkef_gaussian"])
def test_a_run_recorded_with_the_flat_optimiser_keys_resumes_under_todays(experiment):
    """model.optimizer {name: sgd, lr, scheduler: cosine} (recorded before model.optimizer became a partial
    torch.optim class) is today's {_target_: torch.optim.SGD, _partial_: true, lr} and model.scheduler: the same
    run; a changed learning rate is still named."""
    from src.runs.identity import run_identity

    here = run_identity(compose_train([f"experiment={experiment}"]))
    assert any(k.endswith("._target_") and str(v).startswith("torch.optim.") for k, v in here.items())
    old = _as_recorded_before_partial_optimisers(here)
    assert not any(k.endswith(("_target_", "_partial_")) and k.startswith("model.optimizer") for k in old)
    check_same_run({CHECKPOINT_KEY: old}, "old.ckpt", identity=here)
    lr = next(k for k in old if k.endswith(".lr"))
    old[lr] = 0.5
    with pytest.raises(ResumeMismatchError, match=rf"{lr}: 0.5 in the checkpoint, "):
        check_same_run({CHECKPOINT_KEY: old}, "old.ckpt", identity=here)


def test_a_run_config_with_the_flat_optimiser_keys_builds_todays_optimisers():
    """src.evaluate / src.sample of a run written before model.optimizer became a partial class: its saved
    config is read as today's (src.config.old_runs.upgrade_optimizer_config)."""
    from omegaconf import OmegaConf

    from src.config.old_runs import upgrade_optimizer_config
    from src.runs.build import build

    cfg = compose_train(["experiment=steep"])
    OmegaConf.set_struct(cfg, False)
    cfg.model.optimizer = {"name": "sgd", "lr": 0.01, "weight_decay": 0.0, "scheduler": "cosine"}
    del cfg.model["scheduler"]
    upgrade_optimizer_config(cfg)
    assert OmegaConf.to_container(cfg.model.scheduler) == {
        "_target_": "torch.optim.lr_scheduler.CosineAnnealingLR", "_partial_": True, "eta_min": 1e-4}
    module = build(cfg.model)
    opt = module.optimizer_factories["main"]
    assert opt.func is torch.optim.SGD and opt.keywords == {"lr": 0.01, "weight_decay": 0.0}
    vae = compose_train(["experiment=vae_mnist"])
    OmegaConf.set_struct(vae, False)
    vae.model.optimizer = {"score": {"params": ["score_net"], "lr": 1e-4}, "vae": {"params": ["encoder"], "lr": 2e-4}}
    upgrade_optimizer_config(vae)
    assert OmegaConf.to_container(vae.model.optimizer) == {
        "score": {"_target_": "torch.optim.Adam", "_partial_": True, "lr": 1e-4},
        "vae": {"_target_": "torch.optim.Adam", "_partial_": True, "lr": 2e-4}}
