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
    assert (cfg.model.net.ngf, cfg.data.batch_size) == (ngf, batch)


@pytest.mark.parametrize(("overrides", "block"), [
    (["model=dkef"], ("spectral", 1.8, 5)),                                # the main job: conf/deq/family/dkef.yaml
    (["model=dkef", "deq.norm=frobenius", "deq.norm_lambda=2", "deq.phantom_steps=2"],
     ("frobenius", 2.0, 2)),                                               # the paper's block
    (["experiment=dkef_uci"], ("spectral", 2.0, 2)),                       # the UCI block of record, as measured
    (["experiment=dkef_gaussian"], ("frobenius", 2.0, 2)),                 # Table 3: the paper's block, unchanged
    (["model=nice", "data=mnist"], (None, None, 2)),                       # other families: the group's (paper's)
])
def test_the_dkef_deq_block_where_no_experiment_sets_one(overrides, block):
    """Issue 49: model=dkef alone runs the family's block (spectral, lambda 1.8 since issue 60) with K = 5 phantom
    steps; the experiments keep theirs."""
    deq = _compose("deq=true", *overrides).deq
    assert (deq.norm, deq.norm_lambda, deq.phantom_steps) == block


def test_the_main_jobs_deq_recurs_where_the_papers_block_is_near_inert(recwarn):
    """At initialisation (seed 0, 64 inputs) the main job's three feature blocks carry 14-15 % of their state (above
    the 10 % near-inert mark: no warning), the paper's Frobenius block 3.8-5.7 % (three warnings)."""
    import torch

    from src.deq.diagnostics import NEAR_INERT_SHARE
    from src.deq.lookup import blocks_of

    shares = {}
    for name, overrides in (("main", []), ("paper", ["deq.norm=frobenius", "deq.norm_lambda=2", "deq.phantom_steps=2"])):
        cfg = _compose("model=dkef", "loss=sm", "deq=true", "model.n_inducing=16", *overrides)
        torch.manual_seed(0)
        module = build(cfg.model)
        module._deq_inputs = {block: (torch.randn(64, int(cfg.data.dim)),) for block, _ in blocks_of(module)}
        metrics = module.deq_recurrence_metrics("val")
        shares[name] = [v for k, v in sorted(metrics.items()) if k.startswith("val/deq_recurrence_share/")]
    assert len(shares["main"]) == 3 and all(0.12 < s < 0.16 for s in shares["main"]), shares
    assert all(0.03 < s < 0.06 < NEAR_INERT_SHARE for s in shares["paper"]), shares
    assert sum("near-inert" in str(w.message) for w in recwarn) == 3  # the paper's three blocks only
