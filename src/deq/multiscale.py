"""A multi-resolution equilibrium (MDEQ, Bai, Koltun & Kolter 2020) and its cells, as one DEQ block.

The state is a list of feature maps at n resolutions, z = (z₀, …, z_{n−1}), z_i of shape
``[B, c_i, H_i, W_i]`` with H_{i+1} = ⌈H_i/2⌉ (MDEQ solves for every resolution's features at once, as one
fixed point), *packed* into one flat tensor ``[B, Σ c_i H_i W_i]`` (:func:`pack` / :func:`unpack`, exact reshapes
and one concatenation), so the solvers' per-sample residual, the warm start, the phantom steps and the
implicit backward handle it as any other state. The map (MDEQ's residual cells and multiscale fusion) is, per
branch i,

    c_i = cell_i(z_i; g_i(x)),          z_i' = post_i( Σ_j F_ij(c_j) ),

with g_i the input injection at resolution i (a 3×3 conv of the block's input mean-pooled 2^i times: the image
enters every resolution), F_ii the identity, F_ij for j < i a chain of i − j stride-2 3×3 convolutions
(activation between them), for j > i a 1×1 convolution followed by nearest up-sampling to H_i × W_i — MDEQ's
multiscale fusion. Two cells (``cell``):

- ``resblock`` — NCSN's DEQ-ResBlock branch per resolution (paper App. D.4):
  c_i = conv(s ⊙ σ(conv(z_i, K₁) + β), K₂) + g_i, with the noise level i as (β, s) rows ``[B, c]`` and every
  kernel weight-normalised by the ``deq.norm`` strategy of the registry (:func:`src.deq.normalization.make_norm`,
  kind ``conv``: Frobenius with the √(k·k) factor, or spectral with one ``sn_u_<kernel>`` buffer per kernel). A 1×1 kernel
  before an up-sampling by 2^k is divided by 2^k more (nearest up-sampling has ℓ₂ norm 2^k). Then each cell
  is Lipschitz ≤ 2/λ², each fusion term ≤ 1/λ, and with n = 2 branches the map contracts at ≤ (1 + 1/λ)·2/λ²
  (0.75 at λ = 2): a contraction by construction; no post-fusion layer.
- ``mdeq_gn`` — MDEQ's residual block (their ``BasicBlock``): c_i = GN₃(act(GN₂(conv(act(GN₁(conv(z_i,
  K₁))), K₂) + g_i) + z_i)), group norms (:func:`group_norm`) with per-sample affine rows ``[B, c]`` (the
  noise level inside the cell: a row per level under ``cond_norm``, one shared row under σ-scaling), then a
  group norm after the fusion sum (post_i; MDEQ's post-fusion ReLU → 1×1 conv → GN without its conv). The
  kernels are not weight-normalised (MDEQ's weight norm is a reparametrisation, not a bound, and the norms
  after each convolution cancel a kernel's scale; ``deq.norm`` / ``deq.norm_lambda`` are refused): nothing bounds
  the rate. Convergence is measured
  (``last_stats``: iterations, ``hit_cap``), as for the ``normalized_residual`` block.

With one resolution (``channels`` of length 1) the block is a single-resolution DEQ with that cell: NCSN's
``model.net.cell=mdeq_gn`` at ``model/net=twores``.

Because the branch shapes depend on the input's spatial size, the block keeps one map object per size and
``map_params(x)`` selects it as ``self.phi`` before returning p (every caller of φ — solve, phantom steps,
implicit backward, Jacobian penalty, diagnostics — reads ``block.phi`` after ``block.map_params``). The map is
a small picklable object with no weights: all of p (packed injection first, then per-branch kernels and rows,
then the fusion kernels and post-norm rows) is computed with autograd outside the solver.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch
import torch.nn.functional as F
from torch import nn

from src.deq.block import DEQBlock
from src.deq.config import DEQConfig
from src.deq.normalization import make_norm

__all__ = ["CELLS", "MultiscaleDEQBlock", "MultiscaleMap", "branch_sizes", "group_norm", "pack", "unpack"]

CELLS = ("resblock", "mdeq_gn")
_ACTS = {"elu": F.elu, "relu": F.relu, "softplus": F.softplus}
CELL_ACTIVATIONS = tuple(_ACTS)


# ------------------------------------------------------------------------------------------ packing
def pack(zs: Sequence[torch.Tensor]) -> torch.Tensor:
    """``[B, c_i, H_i, W_i]`` per resolution → one ``[B, Σ c_i H_i W_i]`` tensor (branch 0 first, C-order)."""
    return torch.cat([z.reshape(z.shape[0], -1) for z in zs], dim=1)


def unpack(flat: torch.Tensor, shapes: Sequence[tuple[int, int, int]]) -> list[torch.Tensor]:
    """The inverse of :func:`pack` for branch shapes ``(c_i, H_i, W_i)``: views of ``flat``, exact."""
    sizes = [c * h * w for c, h, w in shapes]
    if flat.shape[1] != sum(sizes):
        raise ValueError(f"a packed multi-resolution state of {flat.shape[1]} entries per sample does not hold "
                         f"branches {list(shapes)} ({sum(sizes)} entries)")
    return [part.reshape(flat.shape[0], *shape) for part, shape in zip(flat.split(sizes, dim=1), shapes)]


def branch_sizes(size: Sequence[int], n: int) -> tuple[tuple[int, int], ...]:
    """``(H_i, W_i)`` of n resolutions from ``size`` = (H, W): halved with ceiling (a stride-2 3×3 conv, padding
    1, and ``avg_pool2d(2, ceil_mode=True)`` both give ⌈H/2⌉)."""
    h, w = int(size[0]), int(size[1])
    out = []
    for _ in range(int(n)):
        out.append((h, w))
        h, w = -(-h // 2), -(-w // 2)
    return tuple(out)


def group_norm(x: torch.Tensor, groups: int, gamma: torch.Tensor, beta: torch.Tensor, eps: float = 1e-5):
    """Group norm (Wu & He 2018) with affine rows γ, β of shape ``[C]`` or ``[B, C]`` (a row per sample: the
    noise level's), in plain ops so it is differentiable to every order and in forward mode."""
    b = x.shape[0]
    xg = x.reshape(b, groups, -1)
    mean = xg.mean(-1, keepdim=True)
    xc = xg - mean
    xn = (xc * torch.rsqrt(xc.pow(2).mean(-1, keepdim=True) + eps)).reshape(x.shape)
    return xn * gamma[..., None, None] + beta[..., None, None]


# ------------------------------------------------------------------------------------------ the map
def _fusion_pairs(n: int) -> list[tuple[int, int, int]]:
    """(i, j, number of kernels) of every fusion term j → i, i ≠ j: i − j stride-2 kernels down, one 1×1 up."""
    return [(i, j, i - j if j < i else 1) for i in range(n) for j in range(n) if i != j]


class MultiscaleMap:
    """φ(z; p) of :class:`MultiscaleDEQBlock` for one input size (see the module docstring). ``p`` =
    (packed injection, per branch the cell's tensors, per fusion pair its kernels, per branch the post-norm
    rows (``mdeq_gn`` with ≥ 2 branches)):

    - ``resblock`` cell: (K₁, K₂, shift ``[B, c]``, scale ``[B, c]``);
    - ``mdeq_gn`` cell: (K₁, K₂, γ₁, β₁, γ₂, β₂, γ₃, β₃), rows ``[B, c]``.
    """

    def __init__(self, channels: Sequence[int], sizes: Sequence[tuple[int, int]], cell: str = "resblock",
                 groups: int = 4, activation: str = "elu", padding: int = 1):
        if cell not in CELLS:
            raise ValueError(f"cell={cell!r} is unknown; valid: {', '.join(CELLS)}")
        if activation not in _ACTS:
            raise ValueError(f"activation={activation!r} is unknown; valid: {', '.join(CELL_ACTIVATIONS)}")
        self.channels, self.sizes = tuple(int(c) for c in channels), tuple(tuple(s) for s in sizes)
        self.shapes = tuple((c, h, w) for c, (h, w) in zip(self.channels, self.sizes))
        self.cell, self.groups, self.activation, self.padding = cell, int(groups), activation, int(padding)
        self.n_cell = 4 if cell == "resblock" else 8
        self.pairs = _fusion_pairs(len(self.channels))
        self.post = cell == "mdeq_gn" and len(self.channels) > 1

    def n_params(self) -> int:
        """How many tensors p holds after the injection."""
        n = len(self.channels)
        return n * self.n_cell + sum(k for _, _, k in self.pairs) + (2 * n if self.post else 0)

    def _cell(self, z, g, p):
        act, pad = _ACTS[self.activation], self.padding
        if self.cell == "resblock":
            k1, k2, shift, scale = p
            h = act(F.conv2d(z, k1, padding=pad) + shift[:, :, None, None])
            return F.conv2d(h * scale[:, :, None, None], k2, padding=pad) + g
        k1, k2, g1, b1, g2, b2, g3, b3 = p
        h = act(group_norm(F.conv2d(z, k1, padding=pad), self.groups, g1, b1))
        h = group_norm(F.conv2d(h, k2, padding=pad) + g, self.groups, g2, b2)
        return group_norm(act(h + z), self.groups, g3, b3)

    def _fuse(self, c, i, j, kernels):
        if j < i:  # down: i − j stride-2 3×3 convolutions, activation between
            for k, kernel in enumerate(kernels):
                c = F.conv2d(c, kernel, stride=2, padding=kernel.shape[-1] // 2)
                if k < len(kernels) - 1:
                    c = _ACTS[self.activation](c)
            return c
        return F.interpolate(F.conv2d(c, kernels[0]), size=self.sizes[i], mode="nearest")

    def __call__(self, z, inj, *params):
        if len(params) != self.n_params():
            raise ValueError(f"the multi-resolution map takes {self.n_params()} tensors after the injection, "
                             f"got {len(params)}")
        zs, gs = unpack(z, self.shapes), unpack(inj, self.shapes)
        n, k = len(self.channels), 0
        cells = []
        for i in range(n):
            cells.append(self._cell(zs[i], gs[i], params[k:k + self.n_cell]))
            k += self.n_cell
        if n == 1:
            return pack(cells)
        outs = list(cells)
        for i, j, m in self.pairs:
            outs[i] = outs[i] + self._fuse(cells[j], i, j, params[k:k + m])
            k += m
        if self.post:
            outs = [group_norm(o, self.groups, params[k + 2 * i], params[k + 2 * i + 1]) for i, o in enumerate(outs)]
        return pack(outs)


# ------------------------------------------------------------------------------------------ the block
class MultiscaleDEQBlock(DEQBlock):
    """A multi-resolution DEQ block (MDEQ) with ``resblock`` or ``mdeq_gn`` cells; see the module docstring.

    ``channels``: the widths c_i of the resolutions (length n: n resolutions, 1: a single-resolution DEQ with
    that cell); ``in_channels``: the input's; ``n_classes``: the number of noise levels whose rows condition the
    cells (None: σ-scaled conditioning, one row for every level; call ``block(x)`` or ``block(x, labels)``,
    the labels then ignored); ``groups``: the group norms' groups (``mdeq_gn``; must divide every c_i);
    ``activation``: ``elu`` (the default: smooth, as NCSN's) | ``relu`` (MDEQ's) | ``softplus``.
    ``[B, in_channels, H, W] -> [B, Σ c_i H_i W_i]`` (:meth:`branches` unpacks it)."""

    def __init__(self, in_channels: int, channels: Sequence[int], n_classes: int | None = None,
                 cell: str = "resblock", groups: int = 4, activation: str = "elu", kernel_size: int = 3,
                 config: DEQConfig | None = None, name: str = "deq"):
        super().__init__(config, name)
        if cell not in CELLS:
            raise ValueError(f"model.net.cell={cell!r} is unknown; valid: {', '.join(CELLS)}")
        if activation not in _ACTS:
            raise ValueError(f"cell activation={activation!r} is unknown; valid: {', '.join(CELL_ACTIVATIONS)}")
        if int(kernel_size) % 2 != 1:
            raise ValueError(f"kernel_size must be odd (same padding keeps each branch's size), got {kernel_size}")
        self.channels = tuple(int(c) for c in channels)
        if not self.channels or min(self.channels) < 1:
            raise ValueError(f"channels={list(channels)}: give one positive width per resolution")
        if cell == "mdeq_gn" and any(c % int(groups) for c in self.channels):
            raise ValueError(f"groups={groups} must divide every branch width {list(self.channels)} (group norm)")
        if self.config.block is not None:
            raise ValueError(f"deq.block={self.config.block} is another block's map; the multi-resolution / "
                             f"model.net.cell={cell} block builds its own: add deq.block=null")
        if cell == "mdeq_gn" and self.config.norm_given:
            raise ValueError(f"{' '.join(self.config.norm_given)} does not apply to model.net.cell=mdeq_gn (its kernels "
                             "are not weight-normalised: the group norms after them cancel their scale): drop it")
        # the resblock cell's kernels: the deq.norm strategy of the registry (src.deq.normalization), kind conv
        self.normalizer = (make_norm(self.config.norm, "conv", self.config.norm_lambda, lipschitz_safe=True)
                           if cell == "resblock" else None)
        self.cell, self.groups, self.activation = cell, int(groups), activation
        self.in_channels, self.kernel_size, self.n_classes = int(in_channels), int(kernel_size), n_classes
        k, n = self.kernel_size, len(self.channels)
        self.injections = nn.ModuleList(nn.Conv2d(in_channels, c, k, padding=k // 2) for c in self.channels)
        self.kernels = nn.ParameterDict()
        for i, c in enumerate(self.channels):
            for m in (1, 2):
                self.kernels[f"b{i}_k{m}"] = nn.Parameter(self._init_kernel(c, c, k))
        for i, j, m in _fusion_pairs(n):
            for step in range(m):
                if j < i:
                    cin = self.channels[j]
                    cout = self.channels[i] if step == m - 1 else self.channels[j]
                    self.kernels[f"f{i}_{j}_{step}"] = nn.Parameter(self._init_kernel(cout, cin, 3))
                else:
                    self.kernels[f"f{i}_{j}_{step}"] = nn.Parameter(self._init_kernel(self.channels[i],
                                                                                       self.channels[j], 1))
        rows = 2 if cell == "resblock" else 6  # (shift, scale logit) or (γ₁, β₁, γ₂, β₂, γ₃, β₃) per branch
        base = [torch.zeros(rows, c) if cell == "resblock" else torch.tensor([1., 0.] * 3)[:, None].repeat(1, c)
                for c in self.channels]
        self.rows = nn.ParameterList(nn.Parameter(b) for b in base)
        self.level_rows = None
        if n_classes is not None:  # per noise level: offsets of the rows, zero at initialisation
            self.level_rows = nn.ModuleList(nn.Embedding(int(n_classes), rows * c) for c in self.channels)
            for e in self.level_rows:
                nn.init.zeros_(e.weight)
        self.post_rows = (nn.ParameterList(nn.Parameter(torch.tensor([1., 0.])[:, None].repeat(1, c))
                                           for c in self.channels) if cell == "mdeq_gn" and n > 1 else None)
        if self.normalizer is not None:
            for name_, kernel in self.kernels.items():
                self.normalizer.setup(self, f"sn_u_{name_}", kernel)  # spectral: the buffers sn_u_b0_k1, …
        self._maps: dict[tuple[int, int], MultiscaleMap] = {}
        self.phi = self._map_for((8, 8))  # replaced by the input's size in map_params

    @staticmethod
    def _init_kernel(cout: int, cin: int, k: int) -> torch.Tensor:
        bound = 1.0 / math.sqrt(cin * k * k)  # nn.Conv2d's default: U(−1/√fan_in, 1/√fan_in)
        return torch.empty(cout, cin, k, k).uniform_(-bound, bound)

    def _map_for(self, size) -> MultiscaleMap:
        key = (int(size[0]), int(size[1]))
        if key not in self._maps:
            self._maps[key] = MultiscaleMap(self.channels, branch_sizes(key, len(self.channels)), self.cell,
                                            self.groups, self.activation, self.kernel_size // 2)
        return self._maps[key]

    def shapes(self, x: torch.Tensor) -> tuple[tuple[int, int, int], ...]:
        """The branches' ``(c_i, H_i, W_i)`` for input ``x``."""
        return self._map_for(x.shape[-2:]).shapes

    def state_shape(self, x):
        return (x.shape[0], sum(c * h * w for c, h, w in self.shapes(x)))

    def branches(self, z: torch.Tensor, x: torch.Tensor) -> list[torch.Tensor]:
        """The packed state ``z`` (of input ``x``) as its per-resolution maps."""
        return unpack(z, self.shapes(x))

    def _kernel(self, name: str) -> torch.Tensor:
        kernel = self.kernels[name]
        if self.cell != "resblock":
            return kernel
        w = self.normalizer(self, f"sn_u_{name}", kernel)
        if name.startswith("f"):  # a 1×1 kernel before nearest up-sampling by 2^(j − i): ℓ₂ norm 2^(j − i)
            i, j = (int(s) for s in name[1:].split("_")[:2])
            if j > i:
                w = w / 2 ** (j - i)
        return w

    def map_params(self, x, labels=None):
        self.phi = phi = self._map_for(x.shape[-2:])
        b, dt = x.shape[0], x.dtype
        inj = pack([g(F.avg_pool2d(x, 2 ** i, ceil_mode=True) if i else x) for i, g in enumerate(self.injections)])
        out = [inj]
        for i, c in enumerate(self.channels):
            rows = self.rows[i][None].expand(b, *self.rows[i].shape)  # [B, r, c]
            if self.level_rows is not None:
                if labels is None:
                    raise ValueError(f"DEQ block '{self.name}' is conditional: call it as block(x, labels)")
                rows = rows + self.level_rows[i](labels).reshape(b, -1, c)
            rows = rows.to(dt)
            if self.cell == "resblock":
                out += [self._kernel(f"b{i}_k1"), self._kernel(f"b{i}_k2"), rows[:, 0], 2 * torch.sigmoid(rows[:, 1])]
            else:
                out += [self.kernels[f"b{i}_k1"], self.kernels[f"b{i}_k2"], *rows.unbind(1)]
        for i, j, m in phi.pairs:
            out += [self._kernel(f"f{i}_{j}_{s}") for s in range(m)]
        if self.post_rows is not None:
            for r in self.post_rows:
                out += [r[0].to(dt), r[1].to(dt)]
        return tuple(out)
