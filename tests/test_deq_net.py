"""The shared DEQ builder (src/models/deq_net.py): injection → DEQ block → read-out.

The regression test of the double squash: with Ŵ = 0 the fixed point is z* = Softplus(g(x)), so a DEQ
coupling / feature network with a *linear* injection is exactly the explicit 2-layer network
R·Softplus(Ux + b) with the same weights; a Softplus injection is R·Softplus(Softplus(Ux + b)) instead.
"""

from __future__ import annotations

import pickle

import pytest
import torch
from hydra.utils import instantiate
from torch import nn

from src.deq.config import DEQConfig, deq_setting, resolve_depth, resolve_injection
from src.models.deq_net import DEQNet, DEQNetFactory
from src.models.features import MLPFeatures, build_feature_net, mlp
from src.models.nice import deq_coupling_factory
from tests.conftest import compose_train

TIGHT = {"enabled": True, "tol": 1e-12, "max_iter": 50, "warm_start": False}


def _zero_map(net: DEQNet) -> None:
    with torch.no_grad():
        for w in net.block.weights:
            w.zero_()  # Ŵ = W / (λ(‖W‖_F + ε)) = 0


def _injection_linear(net: DEQNet) -> nn.Linear:
    g = net.block.injection
    return g if isinstance(g, nn.Linear) else g[0]


@pytest.mark.parametrize("injection", ["linear", "softplus"])
def test_nice_coupling_with_zero_map_is_the_explicit_two_layer_mlp(injection):
    torch.manual_seed(0)
    coupling = deq_coupling_factory(7, deq_setting({**TIGHT, "injection": injection}))(5, 4).double()
    _zero_map(coupling)
    explicit = mlp(5, 4, hidden=7, n_layers=2).double()  # Linear(5, 7) → Softplus → Linear(7, 4)
    explicit[0].load_state_dict(_injection_linear(coupling).state_dict())
    explicit[2].load_state_dict(coupling.readout.state_dict())
    x = torch.randn(6, 5, dtype=torch.float64)
    if injection == "linear":
        torch.testing.assert_close(coupling(x), explicit(x), rtol=0, atol=1e-12)
    else:  # the input squashed twice: R·σ(σ(Ux + b)), not the 2-layer MLP
        twice = coupling.readout(nn.functional.softplus(nn.functional.softplus(explicit[0](x))))
        torch.testing.assert_close(coupling(x), twice, rtol=0, atol=1e-12)
        assert (coupling(x) - explicit(x)).abs().max() > 1e-2


@pytest.mark.parametrize("injection", ["linear", "softplus"])
def test_dkef_features_with_zero_map_are_the_explicit_two_layer_net(injection):
    torch.manual_seed(1)
    net = build_feature_net(3, 4, deq=deq_setting({**TIGHT, "injection": injection}), depth=None, deq_width=6).double()
    _zero_map(net)
    explicit = MLPFeatures(3, 4, hidden=6, depth=2).double()  # Linear → Softplus → Linear, + linear skip
    explicit.net[0].load_state_dict(_injection_linear(net).state_dict())
    explicit.net[2].load_state_dict(net.readout.state_dict())
    explicit.skip.load_state_dict(net.skip.state_dict())
    x = torch.randn(5, 3, dtype=torch.float64)
    if injection == "linear":
        torch.testing.assert_close(net(x), explicit(x), rtol=0, atol=1e-12)
    else:
        assert (net(x) - explicit(x)).abs().max() > 1e-3


def test_conv_variant_with_zero_map_is_conv_softplus_readout():
    torch.manual_seed(2)
    net = DEQNet(2, 3, 4, deq=deq_setting({**TIGHT, "injection": "linear"}), kind="conv", kernel_size=3).double()
    with torch.no_grad():
        net.block.kernel.zero_()
    x = torch.randn(2, 2, 5, 5, dtype=torch.float64)
    expected = net.readout(nn.functional.softplus(net.block.injection(x)))
    assert net(x).shape == (2, 3, 5, 5)
    torch.testing.assert_close(net(x), expected, rtol=0, atol=1e-12)
    with pytest.raises(ValueError, match="one convolution"):
        DEQNet(2, 3, 4, kind="conv", n_layers=2)


def test_config_defaults_per_family_and_deq_false_ignores_the_key():
    nice = instantiate(compose_train(["experiment=nice_mnist", "deq=true", "logger=none"]).model)
    assert all(isinstance(c.block.injection, nn.Linear) for c in nice.net.couplings)  # NICE default: linear
    soft = instantiate(compose_train(["model=nice", "deq=true", "deq.injection=softplus", "logger=none",
                                      "data=mnist"]).model)
    assert all(isinstance(c.block.injection, nn.Sequential) for c in soft.net.couplings)
    dkef = instantiate(compose_train(["model=dkef", "deq=true", "logger=none"]).model)
    assert all(f.injection_kind == resolve_injection("dkef", None) for f in dkef.net.features)
    # deq=false never reads deq.injection, whatever it holds
    instantiate(compose_train(["model=dkef", "deq=false", "deq.injection=bogus", "logger=none"]).model)
    with pytest.raises(Exception, match="injection"):
        instantiate(compose_train(["model=dkef", "deq=true", "deq.injection=bogus", "logger=none"]).model)


def test_resolve_depth_and_injection():
    deq = DEQConfig()
    assert [resolve_depth("dkef", None, None), resolve_depth("dkef", None, deq)] == [3, 1]
    assert [resolve_depth("nice", None, None), resolve_depth("nice", None, deq)] == [5, 1]
    assert resolve_depth("nice", 2, deq) == 2
    for bad in (0, -1, 1.5, True, "3"):
        with pytest.raises(ValueError, match="depth"):
            resolve_depth("dkef", bad, None)
    assert resolve_injection("nice", None) == "linear" and resolve_injection("dkef", "softplus") == "softplus"
    with pytest.raises(ValueError, match="injection"):
        resolve_injection("nice", "tanh")
    with pytest.raises(ValueError, match="family"):
        resolve_depth("gan", None, deq)


def test_factory_pickles_and_names_blocks():
    f = DEQNetFactory(5, DEQConfig(injection="softplus"), family="nice", name="c")
    nets = [f(3, 2), f(2, 3)]
    assert [n.block.name for n in nets] == ["c.0", "c.1"] and f.injection == "softplus"
    g = pickle.loads(pickle.dumps(f))
    assert g.injection == "softplus" and g.deq_config == DEQConfig(injection="softplus")
