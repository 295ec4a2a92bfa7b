"""Weight normalization that makes the DEQ map a contraction (paper §3.2)."""

from __future__ import annotations

import math

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


def conv_lipschitz_factor(weight: torch.Tensor) -> float:
    """``sqrt(kh·kw)`` of a kernel ``[C_out, C_in, kh, kw]``: the bound ‖conv_W‖_2 ≤ sqrt(kh·kw) ‖W‖_F.

    A stride-1 convolution is Σ_ij W_ij S_ij with shifts S_ij of norm ≤ 1, so ‖conv‖ ≤ Σ_ij ‖W_ij‖_F ≤
    sqrt(kh·kw) ‖W‖_F (Cauchy–Schwarz). The bound is attained (an all-ones kernel on a constant image), so the
    paper's plain Frobenius normalization guarantees only ‖conv‖ < sqrt(kh·kw)/λ (3/λ for 3×3).
    """
    return math.sqrt(math.prod(weight.shape[2:]))
