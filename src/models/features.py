"""Feature networks φ(x) shared by the models: an explicit k-layer MLP or one DEQ block.

The explicit network is the reference code's ``Phi_w`` (App. D.1 of the paper): ``depth`` dense layers of
width ``hidden`` with Softplus between them and a linear read-out, plus a bias-free linear skip from x.
The implicit one replaces the hidden stack by one dense DEQ block (paper eq. 5):
``z* = Softplus(W z* + g(x))`` with the input injection g of ``deq.injection`` (DKEF default: linear,
``g(x) = U x + c``; see :mod:`src.models.deq_net` for what App. D.1's "single layer MLP with Softplus" means
here), followed by the same linear read-out and skip. Both are built by :mod:`src.models.deq_net`.
"""

from __future__ import annotations

import torch
from torch import nn

from src.deq.config import DEQConfig, resolve_depth
from src.models.deq_net import DEQNet


def mlp(in_dim: int, out_dim: int, hidden: int = 1000, n_layers: int = 5, setting: str = "mlp_layers",
        ) -> nn.Sequential:
    """``n_layers`` dense layers in_dim → hidden → … → hidden → out_dim with Softplus between them (the
    explicit stack of DKEF's feature network and of NICE's couplings); ``setting``: the config key of
    ``n_layers``, named when it is < 1."""
    if n_layers < 1:
        raise ValueError(f"{setting} must be >= 1 (number of dense layers), got {n_layers}")
    layers: list[nn.Module] = []
    width = in_dim
    for _ in range(n_layers - 1):
        layers += [nn.Linear(width, hidden), nn.Softplus()]
        width = hidden
    layers.append(nn.Linear(width, out_dim))
    return nn.Sequential(*layers)


class MLPFeatures(nn.Module):
    """``depth`` dense layers with Softplus in between, linear read-out to ``out_dim``, linear skip from x."""

    def __init__(self, in_dim: int, out_dim: int, hidden: int = 30, depth: int = 3, skip: bool = True):
        super().__init__()
        self.net = mlp(in_dim, out_dim, hidden=hidden, n_layers=depth, setting="depth")
        self.skip = nn.Linear(in_dim, out_dim, bias=False) if skip else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.net(x)
        return out + self.skip(x) if self.skip is not None else out


def DEQFeatures(in_dim: int, out_dim: int, width: int = 64, n_layers: int = 1, deq: DEQConfig | None = None,
                skip: bool = True, name: str = "deq", injection: str | None = None) -> DEQNet:
    """One dense DEQ block between the input injection and a linear read-out, plus the skip (App. D.1):
    :class:`src.models.deq_net.DEQNet` with the DKEF family's defaults. ``n_layers`` = layers inside f."""
    return DEQNet(in_dim, out_dim, width, deq=deq, injection=injection, family="dkef", n_layers=n_layers,
                  kind="dense", skip=skip, name=name)


def build_feature_net(
    in_dim: int,
    out_dim: int,
    *,
    deq: DEQConfig | None,
    depth: int | None,
    hidden: int = 30,
    deq_width: int = 64,
    skip: bool = True,
    name: str = "deq",
) -> nn.Module:
    """Feature network selected by the DEQ setting and the ``depth`` key.

    ``depth`` counts explicit dense layers with ``deq=false`` (default 3) and layers inside the
    DEQ's f with ``deq=true`` (default 1), so every point of a ``deq x depth`` sweep is a valid model
    (:func:`src.deq.config.resolve_depth`); ``deq`` is the parsed setting (:mod:`src.deq.config`): a
    ``DEQConfig``, or None for explicit layers.
    """
    depth = resolve_depth("dkef", depth, deq)
    if deq is not None:
        return DEQFeatures(in_dim, out_dim, width=deq_width, n_layers=int(depth), deq=deq, skip=skip, name=name)
    return MLPFeatures(in_dim, out_dim, hidden=hidden, depth=int(depth), skip=skip)
