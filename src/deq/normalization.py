"""Weight normalization that makes the DEQ map a contraction (paper §3.2), and the registry ``deq.norm`` picks from.

The blocks do not build a normalization in: each asks :func:`make_norm` for the strategy ``deq.norm`` names, for
its kind of weight (``dense`` matrices or ``conv`` kernels), and calls it per weight. A strategy is a plain object
(no parameters, no state_dict entries of its own) with

- ``setup(module, buffer, weight)``: register what it keeps between calls on the block (the spectral norms' power
  vector, under the buffer name the block gives, so checkpoints keep their keys ``sn_u0``, ``sn_u_kernel1``, …);
- ``__call__(module, buffer, weight)``: the normalized weight, plain autograd in ``weight``.

:func:`register_norm` adds one (``deq.norm=<name>`` then validates and builds it).
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch


def frobenius_normalize(weight: torch.Tensor, norm_lambda: float, eps: float = 1e-6,
                        scale: float = 1.0) -> torch.Tensor:
    """§3.2: ``W / (λ · scale · (‖W‖_F + ε))``, λ > 1, for dense matrices and convolution kernels alike.

    For a dense W, ‖W‖_2 ≤ ‖W‖_F, so the result has spectral norm < 1/λ < 1 and z ↦ σ(Wz + g) is a
    contraction for any 1-Lipschitz σ (Softplus); Picard iteration converges linearly (Banach). For a conv
    kernel pass ``scale=conv_lipschitz_factor(W)`` to keep that guarantee. Plain autograd: differentiable to
    every order.
    """
    if norm_lambda <= 1:
        raise ValueError(f"norm_lambda must be > 1 (paper §3.2); got {norm_lambda}")
    return weight / (norm_lambda * scale * (torch.linalg.vector_norm(weight) + eps))


def spectral_normalize(weight: torch.Tensor, u: torch.Tensor, norm_lambda: float, n_power_iterations: int = 1,
                       update: bool = True, eps: float = 1e-12) -> torch.Tensor:
    """``W / (λ σ̂(W))``, σ̂ = uᵀWv by power iteration on the persistent left vector ``u`` (Miyato et al. 2018).

    An alternative to §3.2's Frobenius normalization (``deq.norm=spectral``, dense blocks): the contraction
    rate is ≈ 1/λ whatever W's rank, where ‖W‖_2 ≤ ‖W‖_F makes the Frobenius-normalized map of a wide block
    contract far faster than 1/λ (width 1000 at init: ‖W‖_2 ≈ 2‖W‖_F/√1000), i.e. nearly a one-layer network.
    ``u`` and v are constants for autograd (as in ``torch.nn.utils.spectral_norm``): the result is plain autograd in
    W, differentiable to every order. σ̂ ≤ ‖W‖_2, tracking it as W changes by ``n_power_iterations`` per call;
    ``update=False`` (evaluation) leaves ``u`` as it is, so repeated calls give the same result.
    """
    if norm_lambda <= 1:
        raise ValueError(f"norm_lambda must be > 1 (paper §3.2); got {norm_lambda}")
    with torch.no_grad():
        left = u
        for _ in range(max(1, int(n_power_iterations))):
            right = torch.nn.functional.normalize(weight.t() @ left, dim=0, eps=eps)
            left = torch.nn.functional.normalize(weight @ right, dim=0, eps=eps)
        if update:
            u.copy_(left)
    sigma = torch.dot(left, weight @ right)
    return weight / (norm_lambda * sigma.clamp_min(eps))


def _circular_conv(z: torch.Tensor, kernel: torch.Tensor) -> torch.Tensor:
    ph, pw = kernel.shape[-2] // 2, kernel.shape[-1] // 2
    return torch.nn.functional.conv2d(torch.nn.functional.pad(z, (pw, pw, ph, ph), mode="circular"), kernel)


def conv_spectral_normalize(kernel: torch.Tensor, u: torch.Tensor, norm_lambda: float, n_power_iterations: int = 1,
                            update: bool = True, eps: float = 1e-12) -> torch.Tensor:
    """``K / (λ σ̂(K))`` for a stride-1 convolution kernel ``[C_out, C_in, k, k]`` (odd k): the spectral
    bound of ``deq.norm=spectral`` for convolutional DEQ maps.

    σ̂ is the operator norm of the *circular* convolution on the probe grid of the persistent input vector
    ``u`` ``[1, C_in, P, P]``, by power iteration (its adjoint is the circular convolution with the
    transposed, flipped kernel). That norm is max over the P×P frequency lattice of ‖K̂(ω)‖₂; every same-
    padded convolution of K, on any image size, has norm ≤ sup_ω ‖K̂(ω)‖₂ (a restriction of the convolution
    on the infinite grid), which the lattice maximum approaches as P grows (P = 16: within a few per cent for
    3×3 kernels). So the normalized map contracts at ≈ 1/λ per kernel whatever the channel count — where
    :func:`frobenius_normalize` with the √(k·k) factor leaves a 128-channel 3×3 kernel at ≈ 1/(17λ) at
    initialisation. As in :func:`spectral_normalize`, ``u`` and the output-side vector are constants for
    autograd, σ̂ = ⟨v, conv(u; K)⟩ is plain autograd in K, and ``update=False`` leaves ``u`` untouched.
    """
    if norm_lambda <= 1:
        raise ValueError(f"norm_lambda must be > 1 (paper §3.2); got {norm_lambda}")
    adjoint = kernel.transpose(0, 1).flip(-2, -1)
    with torch.no_grad():
        left = u
        for _ in range(max(1, int(n_power_iterations))):
            out = _circular_conv(left, kernel)
            out = out / out.norm().clamp_min(eps)
            left = _circular_conv(out, adjoint)
            left = left / left.norm().clamp_min(eps)
        if update:
            u.copy_(left)
        out = _circular_conv(left, kernel)
        out = out / out.norm().clamp_min(eps)
    sigma = (out * _circular_conv(left, kernel)).sum()
    return kernel / (norm_lambda * sigma.clamp_min(eps))


def conv_lipschitz_factor(weight: torch.Tensor) -> float:
    """``sqrt(kh·kw)`` of a kernel ``[C_out, C_in, kh, kw]``: the bound ‖conv_W‖_2 ≤ sqrt(kh·kw) ‖W‖_F.

    A stride-1 convolution is Σ_ij W_ij S_ij with shifts S_ij of norm ≤ 1, so ‖conv‖ ≤ Σ_ij ‖W_ij‖_F ≤
    sqrt(kh·kw) ‖W‖_F (Cauchy–Schwarz). The bound is attained (an all-ones kernel on a constant image), so the
    paper's plain Frobenius normalization guarantees only ‖conv‖ < sqrt(kh·kw)/λ (3/λ for 3×3).
    """
    return math.sqrt(math.prod(weight.shape[2:]))


# ------------------------------------------------------------------------------------------ the deq.norm registry
SPECTRAL_PROBE = 16  # P of the P×P probe grid of the conv spectral norm (see conv_spectral_normalize)


class Norm:
    """The strategy interface (see the module docstring); ``norm_lambda`` is λ of §3.2."""

    def __init__(self, norm_lambda: float | None = None, **_):
        self.norm_lambda = norm_lambda

    def setup(self, module: torch.nn.Module, buffer: str, weight: torch.Tensor) -> None:
        """Register the state kept between calls (default: none)."""

    def __call__(self, module: torch.nn.Module, buffer: str, weight: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError


class Identity(Norm):
    """``deq.norm=none``: the weights as they are (hand-built maps whose structure guarantees convergence)."""

    def __call__(self, module, buffer, weight):
        return weight


class Frobenius(Norm):
    """§3.2: W / (λ‖W‖_F); a conv kernel also by √(k·k) when ``lipschitz_safe`` (:func:`conv_lipschitz_factor`)."""

    def __init__(self, norm_lambda=None, lipschitz_safe: bool = False, **_):
        super().__init__(norm_lambda)
        self.lipschitz_safe = bool(lipschitz_safe)

    def __call__(self, module, buffer, weight):
        scale = conv_lipschitz_factor(weight) if self.lipschitz_safe and weight.dim() > 2 else 1.0
        return frobenius_normalize(weight, self.norm_lambda, scale=scale)


class DenseSpectral(Norm):
    """W / (λ σ̂(W)) (:func:`spectral_normalize`), one power step per training call on the buffer ``buffer``."""

    def setup(self, module, buffer, weight):
        u = torch.nn.functional.normalize(torch.randn(weight.shape[0]), dim=0)
        module.register_buffer(buffer, u)
        spectral_normalize(weight.detach(), u, self.norm_lambda, n_power_iterations=50)  # u near the top vector

    def __call__(self, module, buffer, weight):
        return spectral_normalize(weight, getattr(module, buffer), self.norm_lambda,
                                  update=module.training and torch.is_grad_enabled())


class ConvSpectral(Norm):
    """K / (λ σ̂(K)) (:func:`conv_spectral_normalize`), one power step per training call on the buffer ``buffer``
    (a ``[1, C_in, P, P]`` probe, P = :data:`SPECTRAL_PROBE`)."""

    def setup(self, module, buffer, weight):
        u = torch.randn(1, weight.shape[1], SPECTRAL_PROBE, SPECTRAL_PROBE)
        u /= u.norm()
        module.register_buffer(buffer, u)
        with torch.no_grad():  # start u near the top singular vector
            conv_spectral_normalize(weight.detach(), u, self.norm_lambda, n_power_iterations=30)

    def __call__(self, module, buffer, weight):
        return conv_spectral_normalize(weight, getattr(module, buffer), self.norm_lambda,
                                       update=module.training and torch.is_grad_enabled())


# name -> {kind -> strategy class}; kinds: "dense" (matrices), "conv" (convolution kernels)
_NORMS: dict[str, dict[str, Callable[..., Norm]]] = {
    "frobenius": {"dense": Frobenius, "conv": Frobenius},
    "spectral": {"dense": DenseSpectral, "conv": ConvSpectral},
    "none": {"dense": Identity},  # a convolutional block with nothing bounding its map is refused
}


def register_norm(name: str, **kinds: Callable[..., Norm]) -> None:
    """Add (or replace) the normalization ``deq.norm=name``: ``dense=`` and/or ``conv=`` strategy factories, each
    called as ``factory(norm_lambda=λ, lipschitz_safe=…)``."""
    unknown = set(kinds) - {"dense", "conv"}
    if unknown or not kinds:
        raise ValueError(f"register_norm({name!r}): give dense= and/or conv= strategies, got {sorted(kinds)}")
    _NORMS[str(name)] = dict(kinds)


def norm_names() -> tuple[str, ...]:
    """The valid values of ``deq.norm``."""
    return tuple(_NORMS)


def make_norm(name: str, kind: str, norm_lambda: float | None, **options) -> Norm:
    """The strategy ``deq.norm=name`` for weights of ``kind`` (one-line refusal when the name has none for it)."""
    if name not in _NORMS:
        raise ValueError(f"deq.norm={name!r} is unknown; valid: {', '.join(_NORMS)}")
    if kind not in _NORMS[name]:
        valid = [n for n, kinds in _NORMS.items() if kind in kinds]
        raise ValueError(f"deq.norm={name!r} is not available for {'convolutional' if kind == 'conv' else kind} DEQ "
                         f"blocks; valid: {', '.join(valid)}"
                         + (" (none is for dense blocks only: nothing would bound the map)" if name == "none" else ""))
    return _NORMS[name][kind](norm_lambda=norm_lambda, **options)
