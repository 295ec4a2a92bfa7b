"""One builder for every DEQ network of the models: input injection g → DEQ block → read-out (+ skip).

    z* = f(z*; x),  f(z; x) = σ(Ŵ z + g(x))      (paper eq. 5, σ = Softplus, Ŵ = W / (λ‖W‖_F))
    out = R z* (+ S x)

``kind="dense"`` (DKEF feature networks, NICE couplings) uses :class:`src.deq.block.DenseDEQBlock` with
``n_layers`` dense layers inside f; ``kind="conv"`` (image models) a :class:`src.deq.block.ConvDEQBlock`
with a convolutional injection and a 1×1 convolutional read-out. A family's defaults (the ``depth`` key, the
``deq.injection`` key) are resolved in :mod:`src.deq.config`; the networks take the setting parsed there (a
:class:`~src.deq.config.DEQConfig`) and parse nothing.

**The injection.** App. D.1/D.2 say the injection is "a single layer MLP with Softplus". In the paper's
authors' code that Softplus is *the* nonlinearity of a one-hidden-layer network: their fixed point is
z = Ŵz + Softplus(Ux + b) (DKEF) or z = ½·Softplus(L₂ Softplus(L₁ z)) + Softplus(Ux + b) (NICE), i.e. the
injection is added *after* the map's own nonlinearity, so with Ŵ = 0 the network is the explicit 2-layer
MLP R·Softplus(Ux + b). Eq. 5 (this framework's map) puts g *inside* the Softplus, σ(Ŵz + g(x)): there
the equivalent of the authors' network is a **linear** injection g(x) = Ux + b, whose Ŵ = 0 limit is the same
2-layer MLP R·σ(Ux + b). A Softplus injection inside eq. 5 squashes the input twice (Ŵ = 0:
R·σ(σ(Ux + b))), which on NICE costs ≈ 600 nats of test log-likelihood (benchmarks/results/nice.md).
``injection="softplus"`` is kept as a choice (it is what this framework built before) for comparisons.
"""

from __future__ import annotations

import torch
from torch import nn

from src.deq import block as blocks
from src.deq.config import INJECTIONS, DEQConfig, resolve_injection
from src.deq.maps import ACTIVATIONS

KINDS = ("dense", "conv")


def make_injection(kind: str, injection: str, in_features: int, width: int, kernel_size: int = 3) -> nn.Module:
    """g: ``Linear(in, width)`` / ``Conv2d(in, width, k)`` (``linear``), followed by Softplus (``softplus``)."""
    if kind == "dense":
        layer: nn.Module = nn.Linear(in_features, width)
    elif kind == "conv":
        layer = nn.Conv2d(in_features, width, kernel_size, padding=kernel_size // 2)
    else:
        raise ValueError(f"kind={kind!r} is unknown; valid: {', '.join(KINDS)}")
    if injection == "linear":
        return layer
    if injection == "softplus":
        return nn.Sequential(layer, nn.Softplus())
    raise ValueError(f"injection={injection!r} is unknown; valid: {', '.join(INJECTIONS)}")


class DEQNet(nn.Module):
    """injection g → one DEQ block → read-out R (+ a bias-free linear skip S from x): ``out = R z* (+ S x)``.

    ``kind="dense"``: ``[B, in_features] → [B, out_features]``, ``n_layers`` dense layers inside f.
    ``kind="conv"``: ``[B, C_in, H, W] → [B, out_features, H, W]``, f a ``kernel_size`` convolution,
    R (and S) 1×1 convolutions. ``deq`` is the block's setting, a ``DEQConfig`` (parsed where the module is
    built, :mod:`src.deq.config`) or None (the defaults); ``injection`` overrides its ``injection`` key;
    ``family`` resolves a ``None`` injection to that family's default.
    ``activation`` σ of the dense map (Softplus, or ReLU / identity for the supervised studies).
    """

    def __init__(self, in_features: int, out_features: int, width: int, *, deq: DEQConfig | None = None,
                 injection: str | None = None, family: str = "nice", n_layers: int = 1, kind: str = "dense",
                 skip: bool = False, kernel_size: int = 3, name: str = "deq", activation: str = "softplus"):
        super().__init__()
        if activation != "softplus":
            if activation not in ACTIVATIONS:
                raise ValueError(f"activation={activation!r}: a DEQ block takes one of {', '.join(ACTIVATIONS)}")
            if kind == "conv":
                raise ValueError(f"activation={activation!r}: conv DEQ maps use Softplus")

        config = deq if deq is not None else DEQConfig()
        self.injection_kind = resolve_injection(family, injection if injection is not None else config.injection)
        if int(width) < 1 or int(n_layers) < 1:
            raise ValueError(f"width and n_layers must be >= 1, got width={width}, n_layers={n_layers}")
        if kind not in KINDS:
            raise ValueError(f"kind={kind!r} is unknown; valid: {', '.join(KINDS)}")
        self.kind = kind
        g = make_injection(kind, self.injection_kind, in_features, int(width), kernel_size)
        if kind == "dense":
            self.block = blocks.DenseDEQBlock(in_features, int(width), n_layers=int(n_layers), injection=g, config=config,
                                              name=name, activation=activation)
            self.readout = nn.Linear(int(width), out_features)
            self.skip = nn.Linear(in_features, out_features, bias=False) if skip else None
        else:
            if int(n_layers) != 1:
                raise ValueError(f"conv DEQ networks have one convolution inside f, got n_layers={n_layers}")
            self.block = blocks.ConvDEQBlock(in_features, int(width), kernel_size, injection=g, config=config, name=name)
            self.readout = nn.Conv2d(int(width), out_features, 1)
            self.skip = nn.Conv2d(in_features, out_features, 1, bias=False) if skip else None

    def features(self, x: torch.Tensor) -> torch.Tensor:
        """The fixed point z* (before the read-out)."""
        return self.block(x)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.readout(self.features(x))
        return out + self.skip(x) if self.skip is not None else out

    def extra_repr(self) -> str:
        return f"kind={self.kind}, injection={self.injection_kind}"


class DEQNetFactory:
    """Picklable factory ``(in_features, out_features) -> DEQNet`` (no lambdas or closures: DDP pickles).

    The k-th network built is named ``f"{name}.{k}"`` (solver statistics are reported per block name).
    ``deq``: the blocks' setting, a ``DEQConfig`` (or None: the defaults).
    """

    def __init__(self, width: int, deq: DEQConfig | None = None, *, n_layers: int = 1, family: str = "nice",
                 injection: str | None = None, kind: str = "dense", skip: bool = False, kernel_size: int = 3,
                 name: str = "deq"):
        if int(width) < 1 or int(n_layers) < 1:
            raise ValueError(f"width and n_layers must be >= 1, got width={width}, n_layers={n_layers}")
        self.width, self.n_layers = int(width), int(n_layers)
        self.deq_config = deq
        self.injection = resolve_injection(family, injection if injection is not None else getattr(deq, "injection", None))
        self.family, self.kind, self.skip, self.kernel_size, self.name = family, kind, bool(skip), kernel_size, name
        self._built = 0

    def __call__(self, in_features: int, out_features: int) -> DEQNet:
        net = DEQNet(in_features, out_features, self.width, deq=self.deq_config, injection=self.injection,
                     family=self.family, n_layers=self.n_layers, kind=self.kind, skip=self.skip,
                     kernel_size=self.kernel_size, name=f"{self.name}.{self._built}")
        self._built += 1
        return net

    def __repr__(self) -> str:
        return (f"DEQNetFactory(width={self.width}, n_layers={self.n_layers}, injection={self.injection}, "
                f"kind={self.kind}, deq_config={self.deq_config})")
