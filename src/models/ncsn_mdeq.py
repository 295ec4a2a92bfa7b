"""The NCSN trunk of ``model/net=mdeq``: a multi-resolution equilibrium read out to the score (MDEQ, Bai et al. 2020).

    conv3×3 (in NCSN) → ResBlock → MDEQ block (n resolutions: ngf at H×W, 2·ngf at ⌈H/2⌉×⌈W/2⌉, …)
      → RefineBlock(all resolutions → ngf, the last NCSN RefineBlock) (→ CIN++ → ELU → conv3×3 in NCSN)

Where ``arch=deq`` (TwoRes' layout) runs the DEQ-ResBlock at one resolution and then an explicit ResBlock, a
down-sampling ResBlock pair and two RefineBlocks, here the equilibrium itself spans the resolutions
(:class:`src.deq.multiscale.MultiscaleDEQBlock`: a cell per resolution, strided-conv / up-sampling fusion, the
injection at every resolution), so the explicit down path and the first RefineBlock go and one RefineBlock
fuses the equilibrium's resolutions into the output — MDEQ's point: the multiscale features are the fixed
point, not a stack. The noise level enters every cell (``cond_norm``: a row per level; ``sigma``: none, the
score is the output / σ) and every explicit layer as in NCSN. ``deq.one_pass=true`` is its one-pass control.
"""

from __future__ import annotations

from torch import nn

from src.deq.config import DEQConfig
from src.deq.multiscale import MultiscaleDEQBlock
from src.models.ncsn_layers import RefineBlock, ResBlock


class MultiscaleTrunk(nn.Module):
    """``trunk(h, labels)`` → the features before NCSN's end norm, ``[B, ngf, H, W]`` (see the module doc).

    ``ngf``: branch 0's width (the branches: ngf, 2·ngf, 2·ngf, …, NCSN's widths); ``scales``:
    the number of resolutions (≥ 1); ``cell``: ``resblock`` | ``mdeq_gn``; ``groups``, ``activation``: the
    cell's (:class:`MultiscaleDEQBlock`); ``num_classes``: levels of the conditional norms (None: σ-scaled)."""

    def __init__(self, ngf: int, num_classes: int | None, config: DEQConfig, scales: int = 2,
                 cell: str = "resblock", groups: int = 4, activation: str = "elu", name: str = "ncsn.mdeq"):
        super().__init__()
        if int(scales) < 1:
            raise ValueError(f"model.net.scales={scales}: the multi-resolution equilibrium needs >= 1 resolution")
        self.channels = tuple(ngf * (2 if i else 1) for i in range(int(scales)))
        self.res_in = ResBlock(ngf, ngf, num_classes)
        self.block = MultiscaleDEQBlock(ngf, self.channels, num_classes, cell=cell, groups=groups,
                                        activation=activation, config=config, name=name)
        self.refine = RefineBlock(list(self.channels), ngf, num_classes, end=True)

    def deq_input(self, h, labels):
        """The DEQ block's input y (for contraction rates and the recurrence share)."""
        return self.res_in(h, labels)

    def readout(self, z, y, labels):
        """The packed equilibrium state ``z`` (of block input ``y``) fused by the RefineBlock: the features."""
        return self.refine(self.block.branches(z, y), labels, y.shape[2:])

    def forward(self, h, labels):
        y = self.res_in(h, labels)
        return self.readout(self.block(y, labels), y, labels)
