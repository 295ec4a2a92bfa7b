"""Frobenius weight normalisation of paper §3.2: W -> W / (λ(‖W‖_F + ε)), λ > 1.

For a dense W, ‖W‖_2 ≤ ‖W‖_F, so the normalised map z ↦ Wz has Lipschitz constant < 1/λ; with a
1-Lipschitz activation (Softplus) the DEQ map is a contraction and Picard iteration converges linearly
(Banach). For a convolution kernel K of size k_h × k_w the operator norm is at most
Σ_positions ‖K[:, :, i, j]‖_2 ≤ sqrt(k_h k_w) ‖K‖_F, so conv blocks pass ``scale = sqrt(k_h k_w)`` to keep
the same guarantee (the paper divides by ‖K‖_F alone, which bounds the norm only for 1×1 kernels).
"""

from __future__ import annotations

import torch


def frobenius_normalize(weight: torch.Tensor, norm_lambda: float, eps: float = 1e-6, scale: float = 1.0) -> torch.Tensor:
    """``weight / (norm_lambda · scale · (‖weight‖_F + eps))``; differentiable by ordinary autograd."""
    return weight / (norm_lambda * scale * (weight.norm() + eps))
