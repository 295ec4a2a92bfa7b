"""model.net (src/lit/nets.py): a partial network class the config names, completed by the LightningModule; the
NCSN model/net choices; one-line refusals of a size the network does not take and of a key the module sets."""

from __future__ import annotations

import functools

import pytest
import torch

from src.lit.dkef import DKEFLitModule
from src.lit.nets import complete_net, net_factory
from src.models.dkef import DKEF
from src.runs.build import build
from tests.conftest import compose_train


def test_a_partial_and_its_mapping_build_the_same_network():
    sizes = {"n_inducing": 5, "feature_dim": 3, "hidden": 4, "n_kernels": 2}
    torch.manual_seed(0)
    a = DKEFLitModule(2, loss={"name": "sm"}, net=functools.partial(DKEF, **sizes), depth=2)
    torch.manual_seed(0)
    b = DKEFLitModule(2, loss={"name": "sm"}, net={"_target_": "src.models.dkef.DKEF", **sizes}, depth=2)
    assert a.net.inducing.shape == (5, 2) and len(a.net.features) == 2
    assert all(torch.equal(x, y) for x, y in zip(a.state_dict().values(), b.state_dict().values()))
    assert a.hparams["net"] == {"_target_": "src.models.dkef.DKEF", "_partial_": True, **sizes}
    default = DKEFLitModule(2, loss={"name": "sm"}, depth=2)  # none given: the class's own defaults
    assert default.net.inducing.shape == (200, 2)


def test_a_size_the_network_does_not_take_or_a_key_the_module_sets_is_refused_in_one_line():
    with pytest.raises(ValueError, match=r"^model\.net: DKEF takes no argument widht; its sizes: .*hidden") as info:
        complete_net(net_factory({"_target_": "src.models.dkef.DKEF", "widht": 3}), input_dim=2)
    assert "\n" not in str(info.value)
    with pytest.raises(ValueError, match=r"^model\.net\.input_dim: the LightningModule sets input_dim of DKEF itself"):
        complete_net(functools.partial(DKEF, input_dim=3), input_dim=2)
    with pytest.raises(ValueError, match=r"^model\.net=3: model\.net is a partial network class"):
        net_factory(3)
    cfg = compose_train(["model.net.n_inducing=4", "+model.net.widht=3"])
    with pytest.raises(ValueError, match=r"^model\.net: DKEF takes no argument widht"):
        build(cfg.model)


@pytest.mark.parametrize(("choice", "arch", "deq_block"), [("twores", "deq", True), ("refinenet", "refinenet", False),
                                                            ("mdeq", "mdeq", True)])
def test_each_ncsn_net_choice_builds_its_network(choice, arch, deq_block):
    cfg = compose_train(["model=ncsn", f"model/net={choice}", "model.net.ngf=4", "deq=true", "model.noise.num_classes=2",
                         "data=mnist_images", "loss=dsm"])
    module = build(cfg.model)
    assert module.net.arch == arch and module.net.ngf == 4 and (module.net.deq_block() is not None) is deq_block
    assert (module.deq is not None) is deq_block  # refinenet: no DEQ, the deq group ignored
    out = module.net(torch.rand(2, 1, 28, 28), torch.tensor([0, 1]))
    assert out.shape == (2, 1, 28, 28) and torch.isfinite(out).all()
