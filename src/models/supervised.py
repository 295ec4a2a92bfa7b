"""Supervised networks for the DEQ-vs-feed-forward studies (*Separation and Bias of Deep Equilibrium Models*):
an explicit MLP, a dense DEQ (the shared builder :class:`src.models.deq_net.DEQNet`: linear injection → one
:class:`src.deq.block.DenseDEQBlock` → linear read-out, re-exported here), the diagonal linear DEQ and the
diagonal linear network. Every net maps [B, d] → [B, out] and exposes ``features(x)`` (the
representation before the linear read-out) for the feature-density heatmaps.

``depth`` means what it means elsewhere in deqsm: the number of explicit dense layers (depth − 1 hidden layers
and the read-out) when ``deq=false``, the number of layers inside the DEQ map f when ``deq=true``.
"""

from __future__ import annotations

import itertools
import math

import torch
from torch import nn

from src.deq.config import DEQConfig, resolve_depth
from src.models.deq_net import DEQNet

ARCHS = ("auto", "mlp", "deq", "diag_deq", "diag_net")
_ACT = {"relu": nn.ReLU, "softplus": nn.Softplus, "identity": nn.Identity, "tanh": nn.Tanh}


def mlp_params(in_dim: int, out_dim: int, hidden: int, depth: int) -> int:
    if depth == 1:
        return in_dim * out_dim + out_dim
    return in_dim * hidden + hidden + (depth - 2) * (hidden * hidden + hidden) + hidden * out_dim + out_dim


def deq_params(in_dim: int, out_dim: int, width: int, n_layers: int = 1) -> int:
    return in_dim * width + width + n_layers * width * width + (n_layers - 1) * width + width * out_dim + out_dim


def hidden_for_params(target: int, in_dim: int, out_dim: int, depth: int) -> int:
    """The hidden width whose depth-``depth`` MLP has the parameter count closest to ``target``."""
    if depth < 2:
        raise ValueError("matching parameters needs depth >= 2 (a depth-1 MLP has no hidden layer)")
    best = min(range(1, 4096), key=lambda h: abs(mlp_params(in_dim, out_dim, h, depth) - target))
    return best


class MLP(nn.Module):
    """``depth`` dense layers (depth − 1 hidden of width ``hidden``, then the read-out), activation in between."""

    def __init__(self, in_dim: int, out_dim: int, hidden: int, depth: int, activation: str = "relu"):
        super().__init__()
        if int(depth) < 1:
            raise ValueError(f"depth={depth} is invalid: an MLP needs >= 1 dense layer")
        dims = [in_dim] + [hidden] * (int(depth) - 1)
        self.hidden_layers = nn.ModuleList(nn.Linear(a, b) for a, b in itertools.pairwise(dims))
        self.act = _ACT[activation]()
        self.readout = nn.Linear(dims[-1], out_dim)
        self.activation = activation

    def features(self, x):
        for layer in self.hidden_layers:
            x = self.act(layer(x))
        return x

    def forward(self, x):
        return self.readout(self.features(x))

    def linear_layers(self):
        """[(W, b), …] float64 numpy, read-out last (for the exact region counter)."""
        return [(m.weight.detach().double().numpy(), m.bias.detach().double().numpy())
                for m in [*self.hidden_layers, self.readout]]


class DiagonalLinearDEQ(nn.Module):
    """z = diag(w) z + x, output 1ᵀz* (+ b): z* = x / (1 − w) in closed form, so the output is βᵀx + b with
    β = 1/(1 − w) (Theorem 3's model; w = 0 ⇒ β = 1)."""

    def __init__(self, in_dim: int, bias: bool = False, beta0: float = 1.0):
        super().__init__()
        if beta0 <= 0:
            raise ValueError("beta0 must be > 0 (β = 1/(1 − w) stays on the side of its start)")
        self.w = nn.Parameter(torch.full((in_dim,), 1.0 - 1.0 / float(beta0)))
        self.bias = nn.Parameter(torch.zeros(1)) if bias else None

    @property
    def beta(self):
        return 1.0 / (1.0 - self.w)

    def features(self, x):
        return x * self.beta

    def forward(self, x):
        out = self.features(x).sum(-1, keepdim=True)
        return out + self.bias if self.bias is not None else out


class DiagonalLinearNet(nn.Module):
    """β = u⊙u − v⊙v from u = v = α (β(0) = 0), output βᵀx (+ b) (Woodworth et al., 2020)."""

    def __init__(self, in_dim: int, bias: bool = False, alpha: float = 0.1):
        super().__init__()
        self.u = nn.Parameter(torch.full((in_dim,), float(alpha)))
        self.v = nn.Parameter(torch.full((in_dim,), float(alpha)))
        self.bias = nn.Parameter(torch.zeros(1)) if bias else None

    @property
    def beta(self):
        return self.u * self.u - self.v * self.v

    def features(self, x):
        return x * self.beta

    def forward(self, x):
        out = self.features(x).sum(-1, keepdim=True)
        return out + self.bias if self.bias is not None else out


def build_supervised_net(in_dim: int, out_dim: int = 1, *, arch: str = "auto", deq: DEQConfig | None = None,
                         depth: int | None = None, width: int = 16, hidden: int | None = None,
                         match: str | None = None, activation: str = "relu", bias: bool = True,
                         beta0: float = 1.0, alpha: float = 0.1) -> nn.Module:
    """The net the config asks for. ``arch=auto``: a DEQ with ``deq=true`` else an MLP. For the MLP the hidden
    width is ``hidden``, or matched to the DEQ of width ``width`` (depth 1): ``match=params`` (equal parameter
    count), ``match=neurons`` (``width`` hidden neurons spread over the depth − 1 hidden layers). ``deq``: the
    parsed DEQ setting (a ``DEQConfig``, or None: explicit layers; ``arch=deq`` with None: the default keys)."""
    if arch not in ARCHS:
        raise ValueError(f"model.arch={arch!r} is unknown; valid: {', '.join(ARCHS)}")
    if arch == "auto":
        arch = "deq" if deq is not None else "mlp"
    if arch == "diag_deq":
        return DiagonalLinearDEQ(in_dim, bias=bias, beta0=beta0)
    if arch == "diag_net":
        return DiagonalLinearNet(in_dim, bias=bias, alpha=alpha)
    if arch == "deq":  # a DEQ whether or not deq.enabled (the module parsed its keys all the same)
        config = deq if deq is not None else DEQConfig()
        return DEQNet(in_dim, out_dim, int(width), deq=config, family="supervised",
                      n_layers=resolve_depth("supervised", depth, config), activation=activation)
    depth = resolve_depth("supervised", depth, None)
    if match == "params":
        hidden = hidden_for_params(deq_params(in_dim, out_dim, int(width)), in_dim, out_dim, depth)
    elif match == "neurons":
        if depth < 2:
            raise ValueError("match=neurons needs depth >= 2")
        hidden = max(1, math.floor(int(width) / (depth - 1)))
    elif match not in (None, "none"):
        raise ValueError(f"model.match={match!r} is unknown; valid: params, neurons, none")
    if hidden is None:
        raise ValueError("an MLP needs model.hidden or model.match=params|neurons")
    return MLP(in_dim, out_dim, int(hidden), depth, activation)


def forward_flops(net: nn.Module, iterations: float | None = None) -> float:
    """Multiply-adds × 2 of one forward per sample: MLP Σ 2·in·out; DEQ 2·(d·m + it·L·m² + m·out)."""
    if isinstance(net, MLP):
        return float(sum(2 * m.weight.numel() for m in [*net.hidden_layers, net.readout]))
    if isinstance(net, DEQNet):
        b = net.block
        it = iterations if iterations is not None else b.last_stats.get("iterations", 0)
        inj = 2 * b.injection.weight.numel()
        return float(inj + it * sum(2 * w.numel() for w in b.weights) + 2 * net.readout.weight.numel())
    return float(2 * sum(p.numel() for p in net.parameters()))
