"""Dequantisation and logit transforms of 8-bit images, with their Jacobians (paper §4.3, NICE on MNIST).

Transforms (pure functions, any tensor shape)
---------------------------------------------
Let v ∈ {0, …, 255}^D be the bytes of an image (D = 784), λ = ``logit_eps``.

1. Uniform dequantisation (paper: "uniform noise in [−1/512, 1/512]" around the bin centre):
       x = (v + u) / 256,  u ~ U(0, 1)^D   ⇔   x = (v + ½)/256 + U(−1/512, 1/512)
   so x ∈ [0, 1) and x lies in v's bin [v/256, (v+1)/256). Without dequantisation: x = (v + ½)/256.
2. Squash into [λ, 1 − λ], then logit:  y = logit(x'),  logit(p) = log p − log(1 − p), with
       ``squash="affine"`` (default): x' = λ + (1 − 2λ) x     — a smooth bijection of [0, 1] onto [λ, 1 − λ];
       ``squash="clamp"`` (reference code): x' = clamp(x, λ, 1 − λ).
   Clamping maps every x < λ (a quarter of the zero pixels, ~20 % of all MNIST pixels, for λ = 1e-3) to the
   same value: the data get a point mass, which an exact-likelihood model can exploit without bound, and
   the map has no Jacobian there. The affine squash keeps the density well defined; ``"clamp"`` is kept to
   reproduce the reference preprocessing.

Densities and bits/dim (every Jacobian included)
------------------------------------------------
A model gives log p_Y(y) in logit space. With u = v + noise ∈ [0, 256)^D and x = u/256:

    log p_X(x) = log p_Y(y) + Σ_i log |dy_i/dx_i|,
        log |dy_i/dx_i| = log(1 − 2λ) − log x'_i − log(1 − x'_i)      (affine; the log(1 − 2λ) term is
                                                                          absent for "clamp", whose
                                                                          clamped entries are ignored)
                        = log(1 − 2λ) + softplus(y_i) + softplus(−y_i)    (the same, from y)
    log p_U(u) = log p_X(x) − D log 256
    bits/dim   = −log p_U(u) / (D ln 2)

Averaged over the dequantisation noise this is an upper bound on the discrete model's bits/dim (Theis et
al. 2016). :func:`logit_log_det_jacobian` (from x) and :func:`bits_per_dim` (from y) implement it.
The reference code and the paper report log p_Y (logit space, no Jacobians): that is ``log_likelihood``
of the model on the batches of :class:`MNISTDataModule`, a :class:`~src.data.contract.ScoreDataModule`
with ``is_image`` and ``has_bits_per_dim``. The images themselves, as ``[B, 1, 28, 28]`` batches for image
score models, are :mod:`src.data.mnist_images`.
"""

from __future__ import annotations

import math

import torch

from src.data.resumable import item_generator

# ----------------------------------------------------------------------------------------- transforms
SQUASH_MODES = ("affine", "clamp")


def check_squash(squash: str, eps: float) -> None:
    if squash not in SQUASH_MODES:
        raise ValueError(f"squash must be one of {SQUASH_MODES}, got {squash!r}")
    if not 0.0 < eps < 0.5:
        raise ValueError(f"logit_eps must be in (0, 0.5), got {eps}")


def dequantize(v: torch.Tensor, generator: torch.Generator | None = None, noise: bool = True) -> torch.Tensor:
    """Bytes v ∈ {0..255} → x = (v + u)/256 with u ~ U(0, 1) (``noise=False``: u = ½), float32 (float64 stays)."""
    dtype = torch.float64 if v.dtype == torch.float64 else torch.float32
    v = v.to(dtype)
    if not noise:
        return (v + 0.5) / 256.0
    if generator is not None and generator.device != v.device:
        u = torch.rand(v.shape, generator=generator, device=generator.device, dtype=dtype).to(v.device)
    else:
        u = torch.rand(v.shape, generator=generator, device=v.device, dtype=dtype)
    return (v + u) / 256.0


def squash_unit(x: torch.Tensor, eps: float = 1e-3, squash: str = "affine") -> torch.Tensor:
    """x ∈ [0, 1] → x' ∈ [λ, 1 − λ] (affine map or clamp)."""
    check_squash(squash, eps)
    if squash == "affine":
        return eps + (1.0 - 2.0 * eps) * x
    return x.clamp(eps, 1.0 - eps)


def to_logit(x: torch.Tensor, eps: float = 1e-3, squash: str = "affine") -> torch.Tensor:
    """Pixels x ∈ [0, 1] → y = logit(x'), x' = squash(x) ∈ [λ, 1 − λ]."""
    p = squash_unit(x, eps, squash)
    return torch.log(p) - torch.log1p(-p)


def from_logit(y: torch.Tensor, eps: float = 1e-3, squash: str = "affine") -> torch.Tensor:
    """Inverse of :func:`to_logit` (for "clamp": inverse on [λ, 1 − λ], i.e. returns sigmoid(y))."""
    check_squash(squash, eps)
    p = torch.sigmoid(y)
    return (p - eps) / (1.0 - 2.0 * eps) if squash == "affine" else p


def logit_log_det_jacobian(x: torch.Tensor, eps: float = 1e-3, squash: str = "affine") -> torch.Tensor:
    """Σ_i log |dy_i/dx_i| of :func:`to_logit` at pixels x, summed over all but the first dim → ``[B]``.

    affine: Σ log(1 − 2λ) − log x' − log(1 − x');  clamp: Σ −log x' − log(1 − x') (the clamp is ignored).
    """
    p = squash_unit(x, eps, squash)
    per_entry = -torch.log(p) - torch.log1p(-p)
    if squash == "affine":
        per_entry = per_entry + math.log1p(-2.0 * eps)
    return per_entry.flatten(1).sum(dim=1)


def logit_log_det_jacobian_from_logit(y: torch.Tensor, eps: float = 1e-3, squash: str = "affine") -> torch.Tensor:
    """The same as :func:`logit_log_det_jacobian`, from y = to_logit(x): Σ softplus(y) + softplus(−y) (+ log(1 − 2λ))."""
    check_squash(squash, eps)
    per_entry = torch.nn.functional.softplus(y) + torch.nn.functional.softplus(-y)
    if squash == "affine":
        per_entry = per_entry + math.log1p(-2.0 * eps)
    return per_entry.flatten(1).sum(dim=1)


def bits_per_dim(log_p_logit: torch.Tensor, y: torch.Tensor, eps: float = 1e-3, squash: str = "affine") -> torch.Tensor:
    """Bits/dim in the 8-bit pixel space from log p_Y(y) ``[B]`` in logit space (module docstring formula)."""
    d = y[0].numel()
    log_p_x = log_p_logit + logit_log_det_jacobian_from_logit(y, eps, squash)
    log_p_u = log_p_x - d * math.log(256.0)
    return -log_p_u / (d * math.log(2.0))


class DequantizeLogit:
    """Collate for training: uint8 rows, fresh uniform noise, squash, logit → float32 [B, 784].

    Picklable (DataLoader workers, DDP). A batch ``(rows, keys)`` of the resumable loader draws row i's noise
    from :func:`src.data.resumable.item_generator` (``seed``, key i): the same noise whatever the workers,
    the global RNG or an interruption. Plain rows (a list or a tensor) draw from the global torch RNG.
    """

    def __init__(self, dequantize: bool = True, eps: float = 1e-3, squash: str = "affine", seed: int = 0):
        check_squash(squash, eps)
        self.dequantize = bool(dequantize)
        self.eps = float(eps)
        self.squash = squash
        self.seed = int(seed)

    def __call__(self, rows) -> torch.Tensor:
        if isinstance(rows, tuple) and len(rows) == 2 and torch.is_tensor(rows[1]):
            v, keys = rows
            x = torch.stack([dequantize(r, generator=item_generator(self.seed, int(k)), noise=self.dequantize)
                             for r, k in zip(v, keys.tolist())]) if len(v) else v.float()
            return to_logit(x, self.eps, self.squash)
        v = torch.stack(rows) if isinstance(rows, (list, tuple)) else rows
        return to_logit(dequantize(v, noise=self.dequantize), self.eps, self.squash)
