"""Runs, checkpoints and commands of the flat network keys (``model.arch``, ``model.ngf``, ``model.n_inducing``, …,
before ``model.net``) work today (src/config/old_runs.py): two runs written by deqsm at 05c6fb9
(tests/fixtures/before_model_net/) resume under their recorded command and load for evaluation with the same weights;
old command-line spellings compose today's ``model.net`` / ``model/net`` choice for the family the command builds."""

from __future__ import annotations

import logging
import lzma
import shutil
from pathlib import Path

import pytest
import torch
import yaml
from omegaconf import OmegaConf

from src.config.old_runs import FLAT_NET_KEYS, NCSN_NETS, upgrade_identity
from src.runs.identity import CHECKPOINT_KEY, ResumeMismatchError, check_same_run, run_identity
from src.runs.training import train
from tests.conftest import CONF_DIR, compose_train

pytestmark = pytest.mark.usefixtures("one_thread")

FIXTURES = Path(__file__).parent / "fixtures" / "before_model_net"


def old_run(name: str, tmp_path: Path, request) -> tuple[Path, list[str]]:
    """The fixture run ``name`` unpacked into a run directory: its checkpoint and its recorded command (data root:
    this machine's)."""
    run = tmp_path / "old"
    (run / ".hydra").mkdir(parents=True)
    (run / "checkpoints").mkdir()
    shutil.copy(FIXTURES / name / ".hydra" / "config.yaml", run / ".hydra" / "config.yaml")
    ckpt = run / "checkpoints" / "last.ckpt"
    ckpt.write_bytes(lzma.decompress((FIXTURES / name / "last.ckpt.xz").read_bytes()))
    overrides = yaml.safe_load((FIXTURES / name / ".hydra" / "overrides.yaml").read_text())
    overrides = [o for o in overrides if not o.startswith(("data.root=", "trainer.max_steps="))]
    if name == "ncsn":
        overrides.append(f"data.root={request.getfixturevalue('mnist_root')}")
    return ckpt, overrides


@pytest.mark.parametrize("name", ["dkef", "ncsn"])
def test_a_checkpoint_written_before_model_net_resumes_under_its_recorded_command(tmp_path, request, caplog, name):
    ckpt, command = old_run(name, tmp_path, request)
    saved = torch.load(ckpt, map_location="cpu", weights_only=True)
    assert not any(k.startswith("model.net.") for k in saved[CHECKPOINT_KEY])  # written with the flat keys
    if name == "dkef":  # the main job's default bound was λ = 2 when it was written (1.8 since issue 60): today's
        with pytest.raises(ResumeMismatchError, match=r"deq\.norm_lambda: 2\.0 in the checkpoint, 1\.8 here"):
            train(compose_train([*command, f"ckpt_path={ckpt}", "trainer.max_steps=3"], tmp_path / "default"))
        command = [*command, "deq.norm_lambda=2.0"]  # its day's default, spelled out
    cfg = compose_train([*command, f"ckpt_path={ckpt}", "trainer.max_steps=3"], tmp_path / "resumed")
    flat = set(FLAT_NET_KEYS[name]) & set(cfg.model)
    assert not flat and cfg.model.net._target_ in ("src.models.dkef.DKEF", "src.models.ncsn.NCSN")
    if name == "ncsn":  # model.arch=mdeq model.scales=1 model.ngf=2, as recorded
        assert (cfg.model.net.arch, cfg.model.net.scales, cfg.model.net.ngf) == ("mdeq", 1, 2)

    # the checkpoint without its recorded run (as a still older one): checked through its hyper-parameters
    older = {k: v for k, v in saved.items() if k != CHECKPOINT_KEY}
    check_same_run(older, ckpt, identity=run_identity(cfg))

    # a changed network setting (of the same shapes) is still another run
    key, old, new = ("model.net.cell_activation", "elu", "relu") if name == "ncsn" else \
        ("model.net.log_lambda_init", "-2.0", "-1.0")
    with pytest.raises(ResumeMismatchError, match=rf"{key}: {old} in the checkpoint, {new} here"):
        train(compose_train([*command, f"{key}={new}", f"ckpt_path={ckpt}", "trainer.max_steps=3"],
                            tmp_path / "changed"))

    caplog.clear()
    with caplog.at_level(logging.INFO):
        metrics = train(cfg)
    assert metrics["global_step"] >= 3 and f"Restored all states from the checkpoint at {ckpt}" in caplog.text


@pytest.mark.parametrize("name", ["dkef", "ncsn"])
def test_a_run_written_before_model_net_loads_for_evaluation_with_its_weights(tmp_path, request, name):
    from src.runs.load import load_module

    ckpt, command = old_run(name, tmp_path, request)
    overrides = [o for o in command if o.startswith("data.root=")]
    module, _, cfg, _ = load_module(ckpt, overrides)
    assert "net" in cfg.model and not set(FLAT_NET_KEYS[name]) & set(cfg.model)
    state = torch.load(ckpt, map_location="cpu", weights_only=True)["state_dict"]
    assert set(module.state_dict()) == set(state)  # state_dict keys unchanged by model.net
    assert all(torch.equal(v, state[k]) for k, v in module.state_dict().items())
    if name == "ncsn":
        with pytest.raises(ValueError, match=r"^model\.arch=refinenet: a checkpoint is evaluated with the network it "):
            load_module(ckpt, [*overrides, "model.arch=refinenet"])
        assert load_module(ckpt, [*overrides, "model.ngf=2"])[2].model.net.ngf == 2  # a flat size: today's key
        assert OmegaConf.to_container(cfg.model.net) == {
            "_target_": "src.models.ncsn.NCSN", "_partial_": True, "arch": "mdeq", "ngf": 2, "conditioning": "cond_norm",
            "cell": "resblock", "scales": 1, "groups": 4, "cell_activation": "elu"}


@pytest.mark.parametrize("arch", list(NCSN_NETS))
def test_an_old_ncsn_identity_is_todays_for_each_architecture(tmp_path, arch):
    """A checkpoint's recorded run of each old model.arch (main recorded every NCSN key for every arch) is the run of
    today's model/net choice; the keys that choice does not hold were unused by it."""
    ckpt = lzma.decompress((FIXTURES / "ncsn" / "last.ckpt.xz").read_bytes())
    (tmp_path / "c.ckpt").write_bytes(ckpt)
    old = dict(torch.load(tmp_path / "c.ckpt", map_location="cpu", weights_only=True)[CHECKPOINT_KEY])
    old["model.arch"] = arch
    command = yaml.safe_load((FIXTURES / "ncsn" / ".hydra" / "overrides.yaml").read_text())
    here = run_identity(compose_train([*command, f"model/net={NCSN_NETS[arch][0]}", "model.net.ngf=2",
                                       *(["model.net.scales=1"] if arch == "mdeq" else [])]))
    check_same_run({CHECKPOINT_KEY: old}, "old.ckpt", identity=here)
    assert upgrade_identity(old)["model.net.arch"] == arch


def test_the_old_ncsn_table_is_the_model_net_configs():
    """NCSN_NETS (what an old model.arch becomes) holds the keys of conf/model/net/<choice>.yaml, and the flat keys of
    each family are its model.net's."""
    for arch, (choice, keys) in NCSN_NETS.items():
        net = OmegaConf.load(CONF_DIR / "model" / "net" / f"{choice}.yaml")
        assert net.arch == arch and set(net) - {"_target_", "_partial_", "arch"} == set(keys)
    assert set(FLAT_NET_KEYS["ncsn"]) == {"arch", *(k for _, keys in NCSN_NETS.values() for k in keys)}
    for family in ("dkef", "nice", "vae"):
        net = OmegaConf.load(CONF_DIR / "model" / f"{family}.yaml").net
        assert set(net) - {"_target_", "_partial_"} == set(FLAT_NET_KEYS[family])


@pytest.mark.parametrize(("command", "expected"), [
    (["model=ncsn", "model.arch=refinenet"], {"arch": "refinenet", "ngf": 16}),
    (["model=ncsn", "model.arch=deq", "model.scales=3"], {"arch": "deq", "scales": 3}),  # unused, as before
    (["experiment=ncsn_mnist_long", "model.arch=mdeq", "model.cell=mdeq_gn", "model.ngf=8"],
     {"arch": "mdeq", "cell": "mdeq_gn", "ngf": 8, "conditioning": "sigma"}),
    (["experiment=ncsn_mnist", "model.arch=deq", "model.conditioning=sigma"], {"arch": "deq", "conditioning": "sigma"}),
    (["model.n_inducing=16", "model.hidden=5"], {"n_inducing": 16, "hidden": 5}),  # model=dkef, the default
    (["experiment=vae_mnist", "model.arch=conv", "model.latent_dim=4"], {"arch": "conv", "latent_dim": 4}),
    (["model=nice", "model.hidden=16"], {"hidden": 16, "deq_width": 1000}),
])
def test_old_network_overrides_compose_todays_net(command, expected):
    net = OmegaConf.to_container(compose_train(command).model.net)
    assert {k: net[k] for k in expected} == expected


def test_old_network_overrides_are_left_to_a_family_that_keeps_them():
    cfg = compose_train(["experiment=gotu", "model.arch=mlp", "model.hidden=64"])  # supervised: flat keys
    assert "net" not in cfg.model and (cfg.model.arch, cfg.model.hidden) == ("mlp", 64)
    from hydra.errors import ConfigCompositionException

    with pytest.raises(ConfigCompositionException, match=r"^model\.arch=twores: NCSN's network is the model/net group "
                                                         r"now .*write model/net=twores"):
        compose_train(["model=ncsn", "model.arch=twores"])
