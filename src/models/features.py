"""Feature networks φ(x) shared by the models: an explicit k-layer MLP or one DEQ block.

The explicit network is the reference code's ``Phi_w`` (App. D.1 of the paper): ``depth`` dense layers of
width ``hidden`` with Softplus between them and a linear read-out, plus a bias-free linear skip from x.
The implicit one replaces the hidden stack by one dense DEQ block (paper eq. 5):
``z* = Softplus(W z* + g(x))`` with the input injection ``g(x) = Softplus(U x + c)`` (App. D.1), followed by
the same linear read-out and skip.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch
from torch import nn


def deq_config_from_mapping(cfg: Mapping | None):
    """Build a ``src.deq.config.DEQConfig`` from the ``deq`` config group (its ``enabled`` flag is not part of it)."""
    from src.deq.config import DEQConfig

    if isinstance(cfg, DEQConfig):
        return cfg
    cfg = dict(cfg or {})
    cfg.pop("enabled", None)
    return DEQConfig(**cfg)


class MLPFeatures(nn.Module):
    """``depth`` dense layers with Softplus in between, linear read-out to ``out_dim``, linear skip from x."""

    def __init__(self, in_dim: int, out_dim: int, hidden: int = 30, depth: int = 3, skip: bool = True):
        super().__init__()
        if depth < 1:
            raise ValueError(f"depth must be >= 1 (number of dense layers of the feature network), got {depth}")
        layers: list[nn.Module] = []
        width = in_dim
        for _ in range(depth - 1):
            layers += [nn.Linear(width, hidden), nn.Softplus()]
            width = hidden
        layers.append(nn.Linear(width, out_dim))
        self.net = nn.Sequential(*layers)
        self.skip = nn.Linear(in_dim, out_dim, bias=False) if skip else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.net(x)
        return out + self.skip(x) if self.skip is not None else out


class DEQFeatures(nn.Module):
    """One dense DEQ block (eq. 5) between a Softplus input injection and a linear read-out (App. D.1).

    ``n_layers`` is the number of dense layers inside the DEQ's map f (the paper uses 1).
    """

    def __init__(
        self,
        in_dim: int,
        out_dim: int,
        width: int = 64,
        n_layers: int = 1,
        deq: Mapping | None = None,
        skip: bool = True,
        name: str = "deq",
    ):
        super().__init__()
        if n_layers < 1:
            raise ValueError(f"depth must be >= 1 (number of layers inside the DEQ map f), got {n_layers}")
        from src.deq.block import DenseDEQBlock

        config = deq_config_from_mapping(deq)
        injection = nn.Sequential(nn.Linear(in_dim, width), nn.Softplus())
        self.block = DenseDEQBlock(in_dim, width, n_layers=n_layers, injection=injection, config=config, name=name)
        self.readout = nn.Linear(width, out_dim)
        self.skip = nn.Linear(in_dim, out_dim, bias=False) if skip else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.readout(self.block(x))
        return out + self.skip(x) if self.skip is not None else out


def build_feature_net(
    in_dim: int,
    out_dim: int,
    *,
    deq: Mapping | None,
    depth: int | None,
    hidden: int = 30,
    deq_width: int = 64,
    skip: bool = True,
    name: str = "deq",
) -> nn.Module:
    """Feature network selected by the ``deq`` and ``depth`` config keys.

    ``depth`` counts explicit dense layers when ``deq.enabled`` is false (default 3) and layers inside the
    DEQ's f when it is true (default 1), so every point of a ``deq x depth`` sweep is a valid model.
    """
    enabled = bool(deq and deq.get("enabled", False))
    if depth is None:
        depth = 1 if enabled else 3
    if int(depth) != depth or depth < 1:
        raise ValueError(
            f"depth={depth} is invalid: it must be a positive integer (explicit layers when deq=false, "
            "layers inside the DEQ map f when deq=true)"
        )
    if enabled:
        return DEQFeatures(in_dim, out_dim, width=deq_width, n_layers=int(depth), deq=deq, skip=skip, name=name)
    return MLPFeatures(in_dim, out_dim, hidden=hidden, depth=int(depth), skip=skip)
