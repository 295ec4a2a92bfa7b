"""``python -m src.train model=X`` for each family alone: it composes a runnable config on the default data
(DKEF, NICE), or stops at start-up with one line naming the data to add (NCSN, VAE) — not deep inside OmegaConf."""

from pathlib import Path

import pytest
from hydra import compose, initialize_config_dir
from omegaconf import OmegaConf

from src.runs.build import build
from src.runs.training import validate_config

CONF = str(Path(__file__).resolve().parents[1] / "conf")


def _compose(*overrides):
    with initialize_config_dir(config_dir=CONF, version_base="1.3"):
        return compose("train", overrides=["logger=none", *overrides], return_hydra_config=False)


@pytest.mark.parametrize("family", ["dkef", "nice"])
def test_a_density_family_builds_on_the_default_data(family):
    cfg = _compose(f"model={family}")
    validate_config(cfg)
    model = build(cfg.model)
    assert sum(p.numel() for p in model.parameters()) > 0


@pytest.mark.parametrize("family", ["ncsn", "vae"])
def test_an_image_family_names_the_data_to_add(family):
    cfg = _compose(f"model={family}")
    with pytest.raises(ValueError, match=f"model={family} needs image data .*: add data=mnist_images"):
        validate_config(cfg)


@pytest.mark.parametrize("family", ["ncsn", "vae"])
def test_an_image_family_composes_with_the_named_data(family):
    cfg = _compose(f"model={family}", "data=mnist_images")
    validate_config(cfg)
    resolved = OmegaConf.to_container(cfg.model, resolve=True)
    assert resolved.get("data_shape", resolved.get("image_shape")) == [1, 28, 28]


@pytest.mark.parametrize(("overrides", "ngf", "batch"), [
    ([], 16, 32),                           # size=cpu, the default on the CPU trainer
    (["size=paper"], 64, 128),              # the configured (paper) sizes on a CPU
    (["trainer=gpu"], 64, 128),             # a GPU trainer chooses size=paper
    (["trainer=gpu", "size=cpu"], 16, 32),  # the command line wins over the trainer's choice
])
def test_the_size_choice_is_visible_and_overridable(overrides, ngf, batch):
    cfg = _compose("model=ncsn", "data=mnist_images", *overrides)
    assert (cfg.model.ngf, cfg.data.batch_size) == (ngf, batch)
