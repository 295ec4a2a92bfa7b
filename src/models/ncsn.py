"""Noise-conditional score networks (NCSN; Song & Ermon 2019) from one set of parts, paper §4.4, App. D.4.

Parts (all conditioned on the noise-level label i ∈ {0, …, L−1} through conditional instance norm++):

- :class:`src.models.ncsn_layers.ConditionalInstanceNorm2dPlus` (CIN++): per channel, with μ_c, s_c the spatial mean and standard
  deviation of channel c and m, v the mean and (unbiased) variance of the μ_c across channels,
  ``out = γ_i,c · ((x − μ_c)/s_c + α_i,c · (μ_c − m)/√(v + ε)) + β_i,c``;
- :class:`ResBlock`: CIN++ → ELU → conv3×3 → CIN++ → ELU → conv3×3 (+ shortcut), optional down-sampling
  (the second conv and a 1×1 shortcut conv followed by 2×2 mean pooling) or dilation;
- :class:`RefineBlock`: NCSN's conditional RefineNet block, RCU (2 residual conv units per input) → MSF
  (multi-resolution fusion: conv3×3 per input, up-sampled to the largest, summed) → CRP (chained residual
  pooling, 2 stages) → output RCU (3 units in the last block, else 1).

Architectures (``arch``), each mapping ``(x, labels) → s(x, i)`` with NCSN's output scaling ``/ σ_i``
(the network predicts σ_i·s, so one network serves every level), inputs centred 2x − 1:

- ``refinenet`` — Table 8a, the NCSN baseline: conv3×3 → ResBlocks (ngf, ngf), (ngf → 2ngf down, 2ngf),
  (2ngf dilation 2)×2, (2ngf dilation 4)×2 → 4 cascaded RefineBlocks → CIN++ → ELU → conv3×3;
- ``deq`` — Tables 8b/9: conv3×3 → ResBlock → **DEQ-ResBlock** → ResBlock → ResBlock down (ngf → 2ngf)
  → ResBlock → 2 RefineBlocks (2ngf → ngf, then ngf with the skip from before the down-sampling) → CIN++ →
  ELU → conv3×3. With ``deq=True`` the DEQ-ResBlock is a
  :class:`src.deq.block.ConditionalResidualDEQBlock`, f(z; y, i) = h(z; i) + g(y) with g a linear conv of
  the previous ResBlock's output (added after h's nonlinearity: no double squash, see
  :mod:`src.models.deq_net`) and the noise level entering h as map parameters; with ``deq=False`` it is
  ``depth`` plain ResBlocks (``depth=1``: the paper's TwoRes NCSN). ``cell=mdeq_gn`` gives the DEQ-ResBlock
  MDEQ's group-norm cell instead (:mod:`src.deq.multiscale`, one resolution);
- ``mdeq`` — a multi-resolution equilibrium (MDEQ, Bai et al. 2020; :mod:`src.models.ncsn_mdeq`): conv3×3 →
  ResBlock → MDEQ block over ``scales`` resolutions (ngf at H×W, 2ngf below), ``cell`` ``resblock`` | ``mdeq_gn``
  → one RefineBlock fusing its resolutions → CIN++ → ELU → conv3×3; needs ``deq=True``.

At ngf = 128 on CIFAR-10 the paper lists 28M parameters for NCSN and 9M for DEQ-NCSN (Table 5);
:func:`count_parameters` gives ours (tests/test_ncsn.py checks the ratio).
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch
from torch import nn

from src.deq.block import ConditionalResidualDEQBlock, NormalizedResidualDEQBlock, ResidualDEQBlock
from src.deq.config import DEQConfig, resolve_depth
from src.deq.multiscale import CELLS, MultiscaleDEQBlock
from src.models.ncsn_layers import (
    RefineBlock,
    ResBlock,
    ResidualStack,
    conv3x3,
    norm_layer,
)
from src.models.ncsn_mdeq import MultiscaleTrunk

ARCHS = ("refinenet", "deq", "mdeq")
DEQ_ARCHS = ("deq", "mdeq")  # the architectures with a DEQ block (deq=true)
CONDITIONINGS = ("cond_norm", "sigma")


def geometric_sigmas(sigma_begin: float = 1.0, sigma_end: float = 0.01, num_classes: int = 10) -> torch.Tensor:
    """σ₁ > … > σ_L, geometric from ``sigma_begin`` to ``sigma_end`` (NCSN's noise levels; L = ``num_classes``)."""
    if not (sigma_begin > sigma_end > 0) or int(num_classes) < 1:
        raise ValueError(f"noise levels need sigma_begin > sigma_end > 0 and num_classes >= 1, got "
                         f"{sigma_begin}, {sigma_end}, {num_classes}")
    if int(num_classes) == 1:
        return torch.tensor([float(sigma_begin)], dtype=torch.float64)
    return torch.exp(torch.linspace(math.log(sigma_begin), math.log(sigma_end), int(num_classes),
                                    dtype=torch.float64))


class LabelFreeResidualDEQBlock(ResidualDEQBlock):
    """:class:`src.deq.block.ResidualDEQBlock` called as the conditional one, ``block(y, labels)``: the labels do
    not enter its map (σ-scaled conditioning)."""

    def map_params(self, x, labels=None):
        return super().map_params(x)


class DEQResBlock(nn.Module):
    """The DEQ-ResBlock (Table 9): z* = h(z*; i) + g(y), g a conv3×3 of the input y (linear: one squash).

    ``num_classes`` labels: the noise level enters h as map parameters
    (:class:`src.deq.block.ConditionalResidualDEQBlock`); None (σ-scaled conditioning): h has no per-level
    parameters (:class:`src.deq.block.ResidualDEQBlock`), called with the labels all the same. ``config`` is the
    run's DEQ setting, parsed once where the module was built (:mod:`src.deq.config`)."""

    def __init__(self, channels: int, num_classes: int | None, config: DEQConfig, name: str = "ncsn.deq",
                 cell: str = "resblock", groups: int = 4, activation: str = "elu"):
        super().__init__()
        if cell == "mdeq_gn":  # MDEQ's group-norm cell at one resolution (src.deq.multiscale)
            self.block = MultiscaleDEQBlock(channels, (channels,), num_classes, cell=cell, groups=groups,
                                            activation=activation, config=config, name=name)
        elif cell != "resblock":
            raise ValueError(f"model.net.cell={cell!r} is unknown; valid: {', '.join(CELLS)}")
        elif config.block == "normalized_residual":  # the paper authors' code's block (identity injection)
            self.block = NormalizedResidualDEQBlock(channels, 3, config=config, name=name)
        elif num_classes is None:
            self.block = LabelFreeResidualDEQBlock(channels, channels, 3, config=config, name=name)
        else:
            self.block = ConditionalResidualDEQBlock(channels, channels, num_classes, 3, config=config, name=name)

    def forward(self, y, labels):
        return self.shaped(self.block(y, labels), y)

    def shaped(self, z, y):
        """The block's state ``z`` (of input ``y``) as a feature map: the packed one-resolution state unpacked."""
        return z.reshape(y.shape) if isinstance(self.block, MultiscaleDEQBlock) else z


class NCSN(nn.Module):
    """Noise-conditional score network ``score(x, labels)`` = net(2x − 1, labels) / σ_labels (see module doc).

    ``sigmas`` (the L noise levels, σ₁ > … > σ_L) are a buffer of the network, so samplers and losses read
    them from the model. ``arch``: ``refinenet`` | ``deq`` | ``mdeq``; ``deq`` (the parsed DEQ setting, a
    ``DEQConfig``) puts the DEQ-ResBlock in the ``deq`` architecture, None ``depth`` ResBlocks (``refinenet`` has
    no DEQ and ignores ``deq`` and ``depth``; ``mdeq`` needs it). ``cell`` (``resblock`` | ``mdeq_gn``),
    ``groups`` and ``cell_activation``: the DEQ map's cell; ``scales``: ``mdeq``'s resolutions.

    ``conditioning``: how the noise level enters —

    - ``cond_norm`` (NCSN, Song & Ermon 2019): every norm is CIN++ with a γ/α/β row per level (and the DEQ map
      a shift/scale row per level), and the output is divided by σ_i; parameters grow with L (≈ 2.5 k per
      norm channel per 10 levels); the paper's Table 5 counts (28M / 9M / 9M at L = 10);
    - ``sigma`` (NCSNv2's technique 3, Song & Ermon 2020): the network is unconditional (instance norm++
      with one γ/α/β per channel, a DEQ map without per-level rows) and the score is its output / σ_i; the
      parameter count does not depend on L (the paper authors' code, 232 levels on CIFAR-10).
    """

    def __init__(self, channels: int, sigmas: Sequence[float] | torch.Tensor, arch: str = "deq", ngf: int = 64,
                 deq: DEQConfig | None = None, depth: int | None = None, centered_input: bool = True,
                 conditioning: str = "cond_norm", cell: str = "resblock", scales: int = 2, groups: int = 4,
                 cell_activation: str = "elu"):
        super().__init__()
        if arch not in ARCHS:
            raise ValueError(f"model.net.arch={arch!r} is unknown; valid: {', '.join(ARCHS)} (model/net=refinenet | twores | mdeq)")
        if conditioning not in CONDITIONINGS:
            raise ValueError(f"model.net.conditioning={conditioning!r} is unknown; valid: {', '.join(CONDITIONINGS)} "
                             "(cond_norm: a norm row per noise level; sigma: unconditional network, output / σ)")
        self.conditioning = conditioning
        sig = torch.as_tensor(sigmas, dtype=torch.float64).reshape(-1)
        if sig.numel() < 1 or bool((sig <= 0).any()):
            raise ValueError("NCSN needs at least one positive noise level")
        self.register_buffer("sigmas", sig.float())
        self.arch, self.ngf, self.centered_input = arch, int(ngf), bool(centered_input)
        self.num_classes = sig.numel()
        n = self.num_classes if conditioning == "cond_norm" else None  # what the blocks are conditioned on
        setting = deq if arch in DEQ_ARCHS else None
        self.deq_enabled = setting is not None
        if arch == "mdeq" and setting is None:
            raise ValueError("model/net=mdeq is a multi-resolution equilibrium: give deq=true (deq.one_pass=true for "
                             "its one-pass control)")
        if cell not in CELLS:
            raise ValueError(f"model.net.cell={cell!r} is unknown; valid: {', '.join(CELLS)}")
        if cell != "resblock" and not self.deq_enabled:
            raise ValueError(f"model.net.cell={cell} is the DEQ map's cell: give deq=true with model/net=twores or mdeq "
                             "(or model.net.cell=resblock)")
        self.cell = cell
        c1, c2 = self.ngf, 2 * self.ngf
        self.begin = conv3x3(channels, c1)
        if arch == "refinenet":
            self.res1 = nn.ModuleList([ResBlock(c1, c1, n), ResBlock(c1, c1, n)])
            self.res2 = nn.ModuleList([ResBlock(c1, c2, n, resample="down"), ResBlock(c2, c2, n)])
            self.res3 = nn.ModuleList([ResBlock(c2, c2, n, dilation=2), ResBlock(c2, c2, n, dilation=2)])
            self.res4 = nn.ModuleList([ResBlock(c2, c2, n, dilation=4), ResBlock(c2, c2, n, dilation=4)])
            self.refine = nn.ModuleList([RefineBlock([c2], c2, n), RefineBlock([c2, c2], c2, n),
                                         RefineBlock([c2, c2], c1, n), RefineBlock([c1, c1], c1, n, end=True)])
        elif arch == "mdeq":  # the multi-resolution equilibrium read out by one RefineBlock (src.models.ncsn_mdeq)

            self.trunk = MultiscaleTrunk(c1, n, setting, scales=scales, cell=cell, groups=groups,
                                         activation=cell_activation)
        else:
            depth = resolve_depth("ncsn", depth, setting)
            self.depth = depth
            self.res_in = ResBlock(c1, c1, n)
            self.middle = (DEQResBlock(c1, n, setting, cell=cell, groups=groups, activation=cell_activation)
                           if self.deq_enabled else ResidualStack(c1, n, depth))
            self.res_out = ResBlock(c1, c1, n)
            self.down = nn.ModuleList([ResBlock(c1, c2, n, resample="down"), ResBlock(c2, c2, n)])
            # the low-resolution RefineBlock outputs ngf (as NCSN's third block does): ≈ 8M parameters at ngf 128
            self.refine = nn.ModuleList([RefineBlock([c2], c1, n), RefineBlock([c1, c1], c1, n, end=True)])
        self.end_norm = norm_layer(c1, n)
        self.end = conv3x3(c1, channels)

    def features(self, x: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        """The network before the 1/σ scaling: σ_i · s(x, i)."""
        h = self.begin(2 * x - 1 if self.centered_input else x)
        if self.arch == "refinenet":
            outs = []
            for stage in (self.res1, self.res2, self.res3, self.res4):
                for block in stage:
                    h = block(h, labels)
                outs.append(h)
            l1, l2, l3, l4 = outs
            r = self.refine[0]([l4], labels, l4.shape[2:])
            r = self.refine[1]([l3, r], labels, l3.shape[2:])
            r = self.refine[2]([l2, r], labels, l2.shape[2:])
            r = self.refine[3]([l1, r], labels, l1.shape[2:])
        elif self.arch == "mdeq":
            r = self.trunk(h, labels)
        else:
            r = self._after_middle(self.middle(self.res_in(h, labels), labels), labels)
        return self.end(self.end_norm(r, labels, act=True))

    def _after_middle(self, h: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        """``arch=deq``: the layers after the DEQ-ResBlock (or its explicit stack), up to the end norm."""
        h = self.res_out(h, labels)
        l1 = h
        for block in self.down:
            h = block(h, labels)
        r = self.refine[0]([h], labels, h.shape[2:])
        return self.refine[1]([l1, r], labels, l1.shape[2:])

    def _scaled(self, features: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        sigma = self.sigmas.to(features.dtype)[labels].reshape(-1, *([1] * (features.dim() - 1)))
        return features / sigma

    def forward(self, x: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        return self._scaled(self.features(x, labels), labels)

    def scores_along_solve(self, x: torch.Tensor, labels: torch.Tensor) -> list[torch.Tensor]:
        """The scores read out from the DEQ block's fixed-point correction states (Bai et al. 2022, §3.3;
        ``deq.correction_states`` = n): one forward of the layers before the block and one solve, then each of the
        n states (``block.last_info.states``, the last the fixed point) through the same layers after the block
        as the fixed point, each divided by σ_i. The last entry is exactly ``self(x, labels)``. A forward that
        returns no states (evaluation, gradients off, correction off) gives ``[self(x, labels)]``."""
        block = self.deq_block()
        if block is None:
            return [self(x, labels)]
        h = self.begin(2 * x - 1 if self.centered_input else x)
        if self.arch == "mdeq":
            y = self.trunk.res_in(h, labels)
            z = self.trunk.block(y, labels)
            states = block.last_info.states or [z]
            outs = [self.trunk.readout(s, y, labels) for s in states]
        else:
            y = self.res_in(h, labels)
            z = self.middle(y, labels)
            states = [self.middle.shaped(s, y) for s in block.last_info.states] if block.last_info.states else [z]
            outs = [self._after_middle(s, labels) for s in states]
        return [self._scaled(self.end(self.end_norm(r, labels, act=True)), labels) for r in outs]

    def score(self, x: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        return self(x, labels)

    def deq_block(self):
        """The DEQ block (None unless arch=deq or mdeq with deq=true)."""
        if not self.deq_enabled:
            return None
        return self.trunk.block if self.arch == "mdeq" else self.middle.block

    def deq_input(self, x: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        """The DEQ block's input y (the output of the ResBlock before it), for contraction-rate estimates."""
        h = self.begin(2 * x - 1 if self.centered_input else x)
        return self.trunk.deq_input(h, labels) if self.arch == "mdeq" else self.res_in(h, labels)


def count_parameters(module: nn.Module) -> int:
    return sum(p.numel() for p in module.parameters())
