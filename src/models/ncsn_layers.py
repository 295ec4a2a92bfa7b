"""The layers NCSN's networks are built from (Song & Ermon 2019; paper §4.4, App. D.4): conditional instance
norm++, ResBlocks, RefineNet's RCU / MSF / CRP / RefineBlock, a plain ResBlock stack. One module that both the
single-resolution networks (:mod:`src.models.ncsn`) and the multi-resolution trunk (:mod:`src.models.ncsn_mdeq`)
import, so neither imports the other (see :mod:`src.models.ncsn` for what each part computes).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F
from torch import nn

from src.layers.instance_norm import norm_act


class ConditionalInstanceNorm2dPlus(nn.Module):
    """CIN++ (NCSN): instance norm plus the normalised channel-means term, γ/α/β embedded per label.

    Initialisation as NCSN: γ, α ~ N(1, 0.02²), β = 0 (``bias=False`` drops β). ``norm(x, labels, act=True)``
    is ELU(CIN++(x)) (:func:`src.layers.instance_norm.norm_act`: only x is saved for backward; ``recompute = False``
    on an instance gives the plain autograd map, for comparisons).
    """

    recompute = True

    def __init__(self, num_features: int, num_classes: int, bias: bool = True, eps: float = 1e-5):
        super().__init__()
        self.num_features, self.bias, self.eps = int(num_features), bool(bias), float(eps)
        self.embed = nn.Embedding(int(num_classes), self.num_features * (3 if bias else 2))
        with torch.no_grad():
            self.embed.weight[:, : 2 * self.num_features].normal_(1.0, 0.02)
            self.embed.weight[:, 2 * self.num_features:].zero_()

    def forward(self, x: torch.Tensor, labels: torch.Tensor, act: bool = False) -> torch.Tensor:
        rows = self.embed(labels).to(x.dtype).chunk(3 if self.bias else 2, dim=-1)  # γ, α[, β]  [B, C] each
        return norm_act(x, *rows, act=act, eps=self.eps, recompute=self.recompute)


class InstanceNorm2dPlus(nn.Module):
    """Instance norm++ without conditioning (NCSNv2): one γ, α, β per channel, whatever the noise level.

    Initialisation as NCSNv2: γ, α ~ N(1, 0.02²), β = 0. ``labels`` are accepted and ignored, so the blocks
    call every norm the same way. ``recompute``: as :class:`ConditionalInstanceNorm2dPlus`."""

    recompute = True

    def __init__(self, num_features: int, bias: bool = True, eps: float = 1e-5):
        super().__init__()
        self.num_features, self.eps = int(num_features), float(eps)
        self.gamma = nn.Parameter(torch.empty(self.num_features).normal_(1.0, 0.02))
        self.alpha = nn.Parameter(torch.empty(self.num_features).normal_(1.0, 0.02))
        self.beta = nn.Parameter(torch.zeros(self.num_features)) if bias else None

    def forward(self, x: torch.Tensor, labels: torch.Tensor | None = None, act: bool = False) -> torch.Tensor:
        rows = (self.gamma, self.alpha) if self.beta is None else (self.gamma, self.alpha, self.beta)
        return norm_act(x, *(r.to(x.dtype) for r in rows), act=act, eps=self.eps, recompute=self.recompute)


def norm_layer(num_features: int, num_classes: int | None) -> nn.Module:
    """The blocks' normalisation: CIN++ over ``num_classes`` labels, or instance norm++ when None (σ-scaled
    conditioning, see :class:`NCSN`)."""
    if num_classes is None:
        return InstanceNorm2dPlus(num_features)
    return ConditionalInstanceNorm2dPlus(num_features, num_classes)


def conv3x3(cin: int, cout: int, bias: bool = True, dilation: int = 1) -> nn.Conv2d:
    return nn.Conv2d(cin, cout, 3, padding=dilation, dilation=dilation, bias=bias)


class ConvMeanPool(nn.Module):
    """conv (same padding) followed by 2×2 mean pooling (NCSN's down-sampling; odd sizes floor)."""

    def __init__(self, cin: int, cout: int, kernel_size: int = 3):
        super().__init__()
        self.conv = nn.Conv2d(cin, cout, kernel_size, padding=kernel_size // 2)

    def forward(self, x):
        return F.avg_pool2d(self.conv(x), 2)


class ResBlock(nn.Module):
    """NCSN's ConditionalResidualBlock: CIN++ → ELU → conv → CIN++ → ELU → conv, plus the shortcut
    (identity, or a conv when the width changes / the block down-samples). ``resample="down"`` halves the
    resolution (ConvMeanPool for the second conv and the 1×1 shortcut); ``dilation`` > 1 dilates both convs."""

    def __init__(self, cin: int, cout: int, num_classes: int, resample: str | None = None, dilation: int = 1):
        super().__init__()
        if resample not in (None, "down"):
            raise ValueError(f"resample={resample!r}: None or 'down'")
        self.norm1, self.norm2 = norm_layer(cin, num_classes), norm_layer(cin, num_classes)
        self.conv1 = conv3x3(cin, cin, dilation=dilation)
        if resample == "down":
            self.conv2: nn.Module = ConvMeanPool(cin, cout, 3)
            self.shortcut: nn.Module | None = ConvMeanPool(cin, cout, 1)
        else:
            self.conv2 = conv3x3(cin, cout, dilation=dilation)
            self.shortcut = None if cin == cout else nn.Conv2d(cin, cout, 1)

    def forward(self, x, labels):
        h = self.conv1(self.norm1(x, labels, act=True))
        h = self.conv2(self.norm2(h, labels, act=True))
        return h + (x if self.shortcut is None else self.shortcut(x))


class RCUBlock(nn.Module):
    """Residual conv units: ``n_blocks`` × (``n_stages`` × (CIN++ → ELU → conv3×3 no bias) + identity)."""

    def __init__(self, features: int, n_blocks: int, n_stages: int, num_classes: int):
        super().__init__()
        self.n_blocks, self.n_stages = int(n_blocks), int(n_stages)
        self.norms = nn.ModuleList(norm_layer(features, num_classes) for _ in range(self.n_blocks * self.n_stages))
        self.convs = nn.ModuleList(conv3x3(features, features, bias=False)
                                   for _ in range(self.n_blocks * self.n_stages))

    def forward(self, x, labels):
        k = 0
        for _ in range(self.n_blocks):
            residual = x
            for _ in range(self.n_stages):
                x = self.convs[k](self.norms[k](x, labels, act=True))
                k += 1
            x = x + residual
        return x


class MSFBlock(nn.Module):
    """Multi-resolution fusion: CIN++ → conv3×3 per input, bilinear up-sampling to ``shape``, sum."""

    def __init__(self, in_planes: Sequence[int], features: int, num_classes: int):
        super().__init__()
        self.norms = nn.ModuleList(norm_layer(c, num_classes) for c in in_planes)
        self.convs = nn.ModuleList(conv3x3(c, features) for c in in_planes)

    def forward(self, xs, labels, shape):
        out = 0
        for x, norm, conv in zip(xs, self.norms, self.convs):
            h = conv(norm(x, labels))
            out = out + F.interpolate(h, size=shape, mode="bilinear", align_corners=True)
        return out


class CRPBlock(nn.Module):
    """Chained residual pooling: ELU, then ``n_stages`` × (CIN++ → 5×5 mean pool → conv3×3 no bias), each
    added to the running sum."""

    def __init__(self, features: int, n_stages: int, num_classes: int):
        super().__init__()
        self.norms = nn.ModuleList(norm_layer(features, num_classes) for _ in range(n_stages))
        self.convs = nn.ModuleList(conv3x3(features, features, bias=False) for _ in range(n_stages))

    def forward(self, x, labels):
        x = F.elu(x)
        path = x
        for norm, conv in zip(self.norms, self.convs):
            path = conv(F.avg_pool2d(norm(path, labels), 5, stride=1, padding=2))
            x = path + x
        return x


class RefineBlock(nn.Module):
    """NCSN's conditional RefineNet block: RCU per input → MSF (several inputs, or one of another width) → CRP →
    output RCU."""

    def __init__(self, in_planes: Sequence[int], features: int, num_classes: int, end: bool = False):
        super().__init__()
        self.adapt = nn.ModuleList(RCUBlock(c, 2, 2, num_classes) for c in in_planes)
        fuse = len(in_planes) > 1 or in_planes[0] != features  # one input of another width: MSF's conv adapts it
        self.msf = MSFBlock(in_planes, features, num_classes) if fuse else None
        self.crp = CRPBlock(features, 2, num_classes)
        self.output = RCUBlock(features, 3 if end else 1, 2, num_classes)

    def forward(self, xs, labels, shape):
        hs = [adapt(x, labels) for adapt, x in zip(self.adapt, xs)]
        h = self.msf(hs, labels, shape) if self.msf is not None else hs[0]
        return self.output(self.crp(h, labels), labels)


class ResidualStack(nn.Module):
    """``depth`` plain ResBlocks (width kept): what stands where the DEQ-ResBlock stands when deq=False."""

    def __init__(self, channels: int, num_classes: int, depth: int):
        super().__init__()
        self.blocks = nn.ModuleList(ResBlock(channels, channels, num_classes) for _ in range(int(depth)))

    def forward(self, x, labels):
        for b in self.blocks:
            x = b(x, labels)
        return x
