"""DEQ blocks: z* = f(z*; x) with f a contraction (paper eq. 5, §3.2), in two backward modes, built on
:func:`src.deq.core.equilibrium` (the solve, the backward and the info record live there).

- ``phantom`` (paper Alg. 1): solve z* under ``no_grad``, then K = ``phantom_steps`` iterations of f with
  autograd from the detached z*. Derivatives w.r.t. x are the K-term Neumann series of (I − J)⁻¹
  (Prop. 2), differentiable to every order by plain autograd; error ~ ρ(J)^K.
- ``implicit``: the exact implicit derivatives of every order (Prop. 1, eqs. 8–9) through
  :func:`src.deq.implicit.fixed_point`, at memory independent of the number of solver iterations.

The map is f(z; x) = φ(z; p) (:mod:`src.deq.maps`) with p = (g(x), normalized weights, …) computed
*outside* the solver with ordinary autograd: the injection g(x) and the normalization (§3.2) once per call.
Blocks keep the previous fixed point per batch shape and start the solver there (warm start, §3.4). The weight
normalization is the strategy ``deq.norm`` names in :mod:`src.deq.normalization`'s registry.
"""

from __future__ import annotations

import math

import torch
from torch import nn

from src.deq.config import DEQConfig
from src.deq.core import PHASE_PHANTOM, EquilibriumInfo, NonConvergenceWarning, equilibrium
from src.deq.core import jacobian_penalty as _penalty_estimate
from src.deq.maps import (
    ConditionalResidualMap,
    ConvMap,
    DenseMap,
    NormalizedResidualMap,
    ResidualMap,
    dense_map,
)
from src.deq.normalization import SPECTRAL_PROBE, make_norm
from src.deq.solvers import solve

__all__ = ["PHASE_PHANTOM", "SPECTRAL_PROBE", "ConditionalResidualDEQBlock", "ConvDEQBlock", "DEQBlock",
           "DenseDEQBlock", "NormalizedResidualDEQBlock", "ResidualDEQBlock", "dense_map"]

_WARM_CACHE_SIZE = 8  # batch shapes remembered: train, last smaller batch, replicated (trace) batches, eval
_LOW_PRECISION = (torch.float16, torch.bfloat16)


PHANTOM_TRUNCATION_WARN = 0.05  # relative truncation of the phantom Jacobian above which training is warned


def phantom_truncation(rate: float, phantom_steps: int) -> float:
    """Bound on the relative error of the phantom Jacobian (Alg. 1, K = ``phantom_steps``) at contraction ``rate``.

    K steps of f from z* give ∂z_K/∂x = Σ_{k<K} Jᵏ ∂f/∂x where the implicit derivative (eq. 8) is the whole
    Neumann series Σ_k Jᵏ ∂f/∂x; with ‖J‖₂ = ρ < 1 the missing tail is at most ρᴷ/(1 − ρ) of the leading term.
    Objectives whose loss contains a derivative through the DEQ (SSM, SSM-VR, SM: the divergence) train on the
    truncated value, and a network can lower the truncated loss in ways the exact loss does not reward: a
    spectrally normalised DEQ-NCSN trained with K = 2 raised ρ to 0.16 at 300 steps and 0.38 at 600, where its
    K = 2 SSM-VR loss read −728 and the exact one +417; trained with the implicit backward ρ stayed at 0.08–0.09
    (benchmarks/studies/ncsn_phantom_bias.py).
    """
    rho = float(rate)
    if rho >= 1:
        return math.inf
    return rho ** int(phantom_steps) / (1.0 - rho)


class DEQBlock(nn.Module):
    """Base class: solve, backward mode, warm start and statistics. Subclasses define the map:

    - ``phi``: a picklable callable φ(z, *params) (see :mod:`src.deq.maps`);
    - ``map_params(x, *cond)``: the tuple p, first the injection g(x) (its shape is the state's), built with
      autograd; ``cond`` are optional conditioning inputs (e.g. NCSN's noise-level labels) that a conditional
      block turns into further map parameters, so the implicit backward and the phantom steps see them as
      ordinary parameters of φ (blocks without conditioning take none);
    - ``state_shape(x)``: the shape of z.

    The forward is :func:`src.deq.core.equilibrium` of φ with p, from the warm start (:meth:`initial_state`,
    :meth:`remember`). After each forward, ``last_info`` is its :class:`~src.deq.core.EquilibriumInfo` —
    the public record of the last forward: its solve statistics, the adjoint solves run since (implicit mode), the
    Jacobian penalty of a training forward (``deq.jacobian_penalty`` > 0, already × γ: :meth:`jacobian_penalty`
    on ``deq.jacobian_penalty_rows`` samples) and the fixed-point correction states (``deq.correction_states``).
    ``last_stats`` = ``last_info.stats()`` (``{"iterations", "residual" (max over samples, absolute
    ‖f(z) − z‖), "converged", "hit_cap" (ran to ``deq.max_iter`` unconverged)}``) and ``last_backward_stats`` =
    ``last_info.backward``. With ``deq.one_pass`` the block is its one-pass control: z = φ(0; p), no solve.
    """

    phi = None

    def __init__(self, config: DEQConfig | None = None, name: str = "deq"):
        super().__init__()
        self.config = config if config is not None else DEQConfig()
        self.name = name
        self.last_info: EquilibriumInfo | None = None
        self._warm: dict[tuple, torch.Tensor] = {}
        self._warn = NonConvergenceWarning(name)

    @property
    def last_stats(self) -> dict:
        """The last forward solve's statistics (``{}`` before the first forward)."""
        return self.last_info.stats() if self.last_info is not None else {}

    @property
    def last_backward_stats(self) -> dict:
        """The implicit backward's adjoint solves since the last forward (``{}``: none)."""
        return self.last_info.backward if self.last_info is not None else {}

    def record(self, info: EquilibriumInfo) -> None:
        """Make ``info`` the block's ``last_info`` (a caller that solves the block's map itself: the DKEF jets)."""
        self.last_info = info

    @property
    def warn(self) -> NonConvergenceWarning:
        """The block's throttled non-convergence warning, passed to :func:`~src.deq.core.equilibrium`."""
        self._warn.name = self.name  # the name may be set after construction
        return self._warn

    # subclasses -------------------------------------------------------------------------------
    def map_params(self, x: torch.Tensor, *cond) -> tuple:
        raise NotImplementedError

    def state_shape(self, x: torch.Tensor) -> tuple:
        raise NotImplementedError

    # warm start (§3.4) --------------------------------------------------------------------------
    def reset_warm_start(self) -> None:
        self._warm = {}

    def warm_start_state(self) -> dict:
        """The cached fixed points as ``{"128x64": tensor}`` (CPU copies), for checkpoints."""
        return {"x".join(map(str, k)): v.detach().cpu().clone() for k, v in self._warm.items()}

    def load_warm_start_state(self, state: dict) -> None:
        self._warm = {tuple(int(s) for s in k.split("x")): v.detach() for k, v in state.items()}

    def initial_state(self, x: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
        """z0 for input ``x``: the remembered fixed point of this state shape (``deq.warm_start``), else zeros;
        device and dtype of ``like``."""
        shape = tuple(self.state_shape(x))
        z = self._warm.get(shape) if self.config.warm_start else None
        if z is not None:
            return z.to(device=like.device, dtype=like.dtype)
        return torch.zeros(shape, device=like.device, dtype=like.dtype)

    def remember(self, z_star: torch.Tensor) -> None:
        """Keep ``z_star`` (detached) as the next solve's start for its shape (``deq.warm_start``)."""
        if not self.config.warm_start:
            return
        key = tuple(z_star.shape)
        self._warm.pop(key, None)
        self._warm[key] = z_star.detach()  # never a graph in the cache
        while len(self._warm) > _WARM_CACHE_SIZE:
            self._warm.pop(next(iter(self._warm)))

    # solve ----------------------------------------------------------------------------------------
    def fixed_point_map(self, x: torch.Tensor, *cond):
        """z ↦ f(z; x) with the current weights, detached (for solver benchmarks and analysis)."""
        params = tuple(p.detach() for p in self.map_params(x, *cond))
        phi = self.phi
        return lambda z: phi(z, *params)

    def unroll(self, x: torch.Tensor, steps: int, z0: torch.Tensor | None = None, cond: tuple = ()) -> torch.Tensor:
        """``steps`` plain iterations of f from z0 (zeros) with autograd through all of them.

        The reference the phantom and implicit derivatives are judged against (App. C): exact in the limit,
        at memory proportional to ``steps``. Ignores the solver, the warm start and ``config.backward``.
        ``cond``: the conditioning inputs of a conditional block.
        """
        params = self.map_params(x, *cond)
        z = torch.zeros(self.state_shape(x), device=x.device, dtype=params[0].dtype) if z0 is None else z0
        for _ in range(int(steps)):
            z = self.phi(z, *params)
        return z

    def forward(self, x: torch.Tensor, *cond) -> torch.Tensor:
        """z*(x), shaped ``state_shape(x)``; differentiable w.r.t. x (every order) and the parameters.
        ``cond``: conditioning inputs of a conditional block (passed to ``map_params``)."""
        if torch.is_autocast_enabled(x.device.type):
            # under bf16/fp16 autocast the solver residual stalls at 1e-2…1e-3 (docs/deq.md §8): solve in fp32
            with torch.autocast(device_type=x.device.type, enabled=False):
                return self._forward(x.float() if x.dtype in _LOW_PRECISION else x, *cond)
        return self._forward(x, *cond)

    def contraction_rate(self, x: torch.Tensor, *cond, iters: int = 30) -> float:
        """‖∂f/∂z‖₂ at the fixed point, by power iteration on JᵀJ (detached weights, whole batch as one
        operator = the max over samples): the rate at which the learned map contracts (< 1 for a solve)."""
        phi = self.fixed_point_map(x, *cond)
        with torch.no_grad():
            z = solve(phi, self.initial_state(x, self.map_params(x, *cond)[0].detach()),
                      **self.config.solver_kwargs()).z
        gen = torch.Generator(device="cpu").manual_seed(0)
        v = torch.randn(z.shape, generator=gen, dtype=z.dtype).to(z.device)
        rate = 0.0
        for _ in range(int(iters)):
            v = v / v.norm()
            with torch.enable_grad():
                zz = z.detach().requires_grad_(True)
                out = phi(zz)
                # J v by the double-VJP trick: u ↦ Jᵀu is linear, its VJP with v is J v
                u = torch.zeros_like(out, requires_grad=True)
                (jtu,) = torch.autograd.grad(out, zz, u, create_graph=True)
                (jv,) = torch.autograd.grad(jtu, u, v)
                (jtjv,) = torch.autograd.grad(out, zz, jv)
            rate = float(jv.norm())
            v = jtjv
        return rate

    def _forward(self, x: torch.Tensor, *cond) -> torch.Tensor:
        params = self.map_params(x, *cond)
        z, info = equilibrium(self.phi, self.initial_state(x, params[0]), params, self.config,
                              correction=self.training, warn=self.warn)
        if float(self.config.jacobian_penalty) > 0 and self.training and torch.is_grad_enabled():
            info.jacobian_penalty = float(self.config.jacobian_penalty) * self.jacobian_penalty(x, info.z_star, *cond)
        self.last_info = info
        if not self.config.one_pass:
            self.remember(z)
        return z

    def jacobian_penalty(self, x: torch.Tensor, z_star: torch.Tensor, *cond,
                         eps: torch.Tensor | None = None) -> torch.Tensor:
        """The Jacobian regulariser of Bai, Koltun & Kolter (2021, eq. 6 there): ‖εᵀ ∂f/∂z(z*)‖² / n with
        ε ~ N(0, I) and n the number of ε's entries — an unbiased estimate of ‖J_f(z*)‖_F² per state entry —
        on the first ``deq.jacobian_penalty_rows`` samples (0: all), differentiable w.r.t. the block's parameters
        (the map is evaluated again on those rows at the detached z*, with its parameters p recomputed from
        x and ``cond`` with autograd; z* itself is held fixed, as in the reference implementation). ``eps``: a
        given probe (tests). Not scaled by ``deq.jacobian_penalty``: a training forward records γ × this in
        ``last_info.jacobian_penalty`` (:func:`src.deq.core.jacobian_penalty` is the estimate)."""
        rows = int(self.config.jacobian_penalty_rows) or x.shape[0]
        rows = min(rows, x.shape[0])
        params = self.map_params(x[:rows], *(c[:rows] if torch.is_tensor(c) and c.dim() else c for c in cond))
        return _penalty_estimate(self.phi, z_star.detach()[:rows], params, eps=eps)


# ------------------------------------------------------------------------------------------ blocks
class DenseDEQBlock(DEQBlock):
    """Dense block, eq. 5: f(z; x) = Softplus(W z + g(x)), or ``n_layers`` such layers composed
    (Softplus(W_L … Softplus(W_1 z + g(x)) … + b_L); layer 1 gets the injection g, default
    ``nn.Linear(in_dim, width)``). Every W_i is Frobenius-normalized (§3.2), so f contracts at rate ≤ λ^(−L);
    with ``config.norm="spectral"`` each W_i is divided by λ times its spectral norm (power iteration, one step
    per training call, buffers ``sn_u*``) instead; with ``config.norm="none"`` the W_i are used as they are
    (hand-built maps whose convergence their structure guarantees, e.g. a nilpotent W). ``activation``:
    ``softplus`` (default, the paper's) | ``relu`` | ``identity`` (:class:`src.deq.maps.DenseMap`).
    ``[B, in_dim] -> [B, width]``."""

    def __init__(self, in_dim: int, width: int, n_layers: int = 1, injection: nn.Module | None = None,
                 config: DEQConfig | None = None, name: str = "deq", activation: str = "softplus"):
        super().__init__(config, name)
        if int(n_layers) < 1:
            raise ValueError(f"n_layers must be >= 1 (layers inside the DEQ map f), got {n_layers}")
        self.in_dim, self.width, self.n_layers = int(in_dim), int(width), int(n_layers)
        self.injection = injection if injection is not None else nn.Linear(in_dim, width)
        self.weights = nn.ParameterList(
            nn.Parameter(torch.randn(width, width) / math.sqrt(width)) for _ in range(self.n_layers)
        )
        self.biases = nn.ParameterList(nn.Parameter(torch.zeros(width)) for _ in range(self.n_layers - 1))
        self.activation = activation
        self.phi = dense_map if activation == "softplus" else DenseMap(activation)
        self.normalizer = make_norm(self.config.norm, "dense", self.config.norm_lambda)
        for i, w in enumerate(self.weights):
            self.normalizer.setup(self, f"sn_u{i}", w)  # buffer names of the checkpoints: sn_u0, sn_u1, …

    def state_shape(self, x):
        return (x.shape[0], self.width)

    def map_params(self, x):
        return (self.injection(x), *self.map_weights())

    def map_weights(self) -> tuple:
        """The map's weights after the ``deq.norm`` normalization, (W_1, W_2, b_2, …, W_L, b_L): ``map_params``
        without the injection (one power step per training call under ``deq.norm=spectral``). A caller that
        stacks several blocks' maps into one (src/models/stacked_features.py) takes them from here."""
        ws = [self.normalizer(self, f"sn_u{i}", w) for i, w in enumerate(self.weights)]
        rest = []
        for w, b in zip(ws[1:], self.biases):
            rest += [w, b]
        return (ws[0], *rest)


def _odd(kernel_size: int) -> int:
    if int(kernel_size) % 2 != 1:
        raise ValueError(f"kernel_size must be odd (same padding keeps the state's size), got {kernel_size}")
    return int(kernel_size)


class _ConvKernels:
    """Mixin of the convolutional blocks: normalizes each named kernel by the ``deq.norm`` strategy
    (:func:`src.deq.normalization.make_norm`, kind ``conv``) — Frobenius (§3.2, with the √(k·k) factor when
    ``lipschitz_safe``) or spectral (one power step per training call on the persistent probe ``sn_u_<kernel>``)."""

    def _init_conv(self, in_channels: int, channels: int, kernel_size: int, injection: nn.Module | None,
                   lipschitz_safe: bool) -> int:
        """The settings both convolutional blocks share (``deq.norm`` checked, odd kernel size, the injection g,
        default ``nn.Conv2d(in_channels, channels, k)`` with same padding); returns k."""
        self.normalizer = make_norm(self.config.norm, "conv", self.config.norm_lambda, lipschitz_safe=lipschitz_safe)
        k = _odd(kernel_size)
        self.channels, self.kernel_size, self.lipschitz_safe = int(channels), k, bool(lipschitz_safe)
        self.injection = injection if injection is not None else nn.Conv2d(in_channels, channels, k, padding=k // 2)
        return k

    def _init_spectral(self, *names: str) -> None:
        """Set up the normalization's state of each named kernel (buffers ``sn_u_<kernel>`` when spectral)."""
        for name in names:
            self.normalizer.setup(self, f"sn_u_{name}", getattr(self, name))

    def _normalized(self, name: str) -> torch.Tensor:
        return self.normalizer(self, f"sn_u_{name}", getattr(self, name))


class ConvDEQBlock(_ConvKernels, DEQBlock):
    """Convolutional block, eq. 5 with W a convolution: f(z; y) = Softplus(conv(z, K) + g(y)), same padding,
    g default ``nn.Conv2d(in_channels, channels, kernel_size)``. ``[B, C_in, H, W] -> [B, channels, H, W]``.

    K is Frobenius-normalized (§3.2). With ``lipschitz_safe`` (default) also divided by sqrt(k·k): the paper's
    K/(λ‖K‖_F) bounds a k×k convolution's operator norm only by k/λ (1.5 for k = 3, λ = 2: not a contraction,
    see :func:`src.deq.normalization.conv_lipschitz_factor`); ``lipschitz_safe=False`` is the paper's.
    ``deq.norm=spectral``: K / (λ σ̂(K)) instead, σ̂ the convolution's operator norm by power iteration."""

    def __init__(self, in_channels: int, channels: int, kernel_size: int = 3, injection: nn.Module | None = None,
                 config: DEQConfig | None = None, name: str = "deq", lipschitz_safe: bool = True):
        super().__init__(config, name)
        k = self._init_conv(in_channels, channels, kernel_size, injection, lipschitz_safe)
        self.kernel = nn.Parameter(torch.randn(channels, channels, k, k) / math.sqrt(channels * k * k))
        self.phi = ConvMap(k // 2)
        self._init_spectral("kernel")

    def state_shape(self, x):
        return (x.shape[0], self.channels, *x.shape[2:])

    def map_params(self, x):
        return (self.injection(x), self._normalized("kernel"))


class ResidualDEQBlock(_ConvKernels, DEQBlock):
    """NCSN's DEQ-ResBlock (App. D.4): f(z; y) = h(z) + g(y), h(z) = conv(Softplus(conv(z, K₁) + b₁), K₂)
    (see :class:`src.deq.maps.ResidualMap`), both kernels normalized as in :class:`ConvDEQBlock`, so h — and
    hence f — contracts at rate ≤ λ^(−2). g default ``nn.Conv2d(in_channels, channels, kernel_size)``
    (NCSN uses a conv + ResBlock: pass it as ``injection``)."""

    def __init__(self, in_channels: int, channels: int, kernel_size: int = 3, injection: nn.Module | None = None,
                 config: DEQConfig | None = None, name: str = "deq", lipschitz_safe: bool = True):
        super().__init__(config, name)
        k = self._init_conv(in_channels, channels, kernel_size, injection, lipschitz_safe)
        scale = 1.0 / math.sqrt(channels * k * k)
        self.kernel1 = nn.Parameter(torch.randn(channels, channels, k, k) * scale)
        self.bias1 = nn.Parameter(torch.zeros(channels))
        self.kernel2 = nn.Parameter(torch.randn(channels, channels, k, k) * scale)
        self.phi = ResidualMap(k // 2)
        self._init_spectral("kernel1", "kernel2")

    def state_shape(self, x):
        return (x.shape[0], self.channels, *x.shape[2:])

    def map_params(self, x):
        return (self.injection(x), self._normalized("kernel1"), self.bias1, self._normalized("kernel2"))


class ConditionalResidualDEQBlock(ResidualDEQBlock):
    """:class:`ResidualDEQBlock` conditioned on a class label per sample (NCSN's noise level, App. D.4, Table 9):

        f(z; y, i) = h(z; i) + g(y),  h(z; i) = conv(s_i ⊙ Softplus(conv(z, K₁) + b₁ + β_i), K₂)

    β_i, s_i = 2·sigmoid(a_i) ∈ (0, 2) per channel are embeddings of the label i (``n_classes`` of them;
    a = 0 at initialisation, so s = 1). They are computed from the labels *outside* the solver and enter φ
    as map parameters ``[B, C]`` (:class:`src.deq.maps.ConditionalResidualMap`), so the implicit backward
    stays exact and the phantom gradient is Alg. 1 for them too. A per-channel shift does not change the
    Lipschitz constant and the scale is at most 2, so f contracts at rate ≤ 2·λ^(−2) (0.5 at λ = 2) with the
    Lipschitz-safe kernels. Call ``block(y, labels)``."""

    def __init__(self, in_channels: int, channels: int, n_classes: int, kernel_size: int = 3,
                 injection: nn.Module | None = None, config: DEQConfig | None = None, name: str = "deq",
                 lipschitz_safe: bool = True):
        super().__init__(in_channels, channels, kernel_size, injection, config, name, lipschitz_safe)
        self.n_classes = int(n_classes)
        self.shift = nn.Embedding(self.n_classes, channels)
        self.scale_logit = nn.Embedding(self.n_classes, channels)
        nn.init.zeros_(self.shift.weight)
        nn.init.zeros_(self.scale_logit.weight)
        self.phi = ConditionalResidualMap(kernel_size // 2)

    def map_params(self, x, labels=None):
        if labels is None:
            raise ValueError(f"DEQ block '{self.name}' is conditional: call it as block(x, labels)")
        shift = self.bias1[None, :] + self.shift(labels)
        scale = 2.0 * torch.sigmoid(self.scale_logit(labels))
        return (self.injection(x), self._normalized("kernel1"), shift.to(x.dtype), scale.to(x.dtype),
                self._normalized("kernel2"))


class NormalizedResidualDEQBlock(DEQBlock):
    """The DEQ paper authors' DEQ-NCSN block with identity injection (:class:`src.deq.maps.NormalizedResidualMap`):

        f(z; x) = (z + r(z)) / w + x,  r = conv ∘ ELU ∘ IN ∘ conv ∘ ELU ∘ IN,  w = 2‖K₁‖_F‖K₂‖_F

    ``deq.block=normalized_residual`` (NCSN). The state has the input's shape (``channels`` in and out); the
    kernels are not normalized by ``deq.norm`` — w is the authors' normalization — and ``deq.norm_lambda`` is not
    used (``DEQConfig`` refuses either key with this block). Conditioning enters through x (the features before
    it); ``block(x, labels)`` ignores the labels. Kernels start as ``nn.Conv2d``'s default (so w ≈ 2·C/3 for C
    channels, 3×3)."""

    def __init__(self, channels: int, kernel_size: int = 3, config: DEQConfig | None = None, name: str = "deq"):
        super().__init__(config, name)
        k = _odd(kernel_size)
        self.channels, self.kernel_size = int(channels), k
        bound = 1.0 / math.sqrt(channels * k * k)  # nn.Conv2d's default init: U(−1/√fan_in, 1/√fan_in)
        self.kernel1 = nn.Parameter(torch.empty(channels, channels, k, k).uniform_(-bound, bound))
        self.kernel2 = nn.Parameter(torch.empty(channels, channels, k, k).uniform_(-bound, bound))
        self.gamma1 = nn.Parameter(torch.ones(channels))
        self.beta1 = nn.Parameter(torch.zeros(channels))
        self.gamma2 = nn.Parameter(torch.ones(channels))
        self.beta2 = nn.Parameter(torch.zeros(channels))
        self.phi = NormalizedResidualMap(k // 2)

    def state_shape(self, x):
        return tuple(x.shape)

    def map_params(self, x, labels=None):
        w = 2.0 * torch.linalg.vector_norm(self.kernel1) * torch.linalg.vector_norm(self.kernel2)
        return (x, self.gamma1, self.beta1, self.kernel1, self.gamma2, self.beta2, self.kernel2,
                (1.0 / w).to(x.dtype))
