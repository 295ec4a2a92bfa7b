"""Denoising score matching (Vincent 2011), paper eq. 2.

    ½ ‖ s(x̃) + (x̃ − x)/σ² ‖²,   x̃ = x + σ ε,  ε ~ N(0, I)      (so (x̃ − x)/σ² = ε/σ)

in **standard units**: the score is matched to the score of the Gaussian perturbation kernel. The SSM
reference repository (``losses/dsm.py``) instead minimizes ½‖σ² s(x̃) + σε‖², which is σ⁴ times this
loss; its values are therefore not comparable with the SM/SSM losses, whereas these are (up to the usual
DSM constant). NCSN's ``dsm_score_estimation`` uses the same units as here.
"""

from __future__ import annotations

import torch
from torch import Tensor

from .base import (
    ObjectiveOutput,
    check_sigma,
    compute_score,
    compute_score_states,
    finalize,
    flat,
    make_leaf,
    needs_autograd,
)


@needs_autograd
def dsm(
    model,
    x: Tensor,
    *,
    sigma: float | Tensor = 0.1,
    create_graph: bool = True,
    eps: Tensor | None = None,
    generator: torch.Generator | None = None,
):
    """Denoising score matching, paper eq. 2, per sample ``½‖s(x̃) + (x̃−x)/σ²‖²`` with x̃ = x + σε.

    Standard units (NOT the σ⁴-scaled variant of the SSM reference code; see the module docstring).

    Args:
        sigma: noise level > 0, a number or a ``[B]`` tensor (one level per sample, used by
            :func:`~src.objectives.conditional.noise_conditional`).
        eps: optional given standard-normal noise of shape ``x.shape``; drawn when None.
        generator: optional ``torch.Generator`` for the draw.

    Returns:
        ObjectiveOutput with part ``score_norm`` (mean ½‖s(x̃)‖²); with ``states`` (one per score) when the
        model offers ``score_states`` (:func:`~src.objectives.base.compute_score_states`).
    """
    sigma = check_sigma(sigma)
    B = x.shape[0]
    if isinstance(sigma, Tensor):
        if sigma.shape != (B,):
            raise ValueError(f"a tensor sigma must have shape [B] = ({B},), got {tuple(sigma.shape)}")
        sig = sigma.detach().to(dtype=x.dtype, device=x.device).reshape(B, *([1] * (x.dim() - 1)))
    else:
        sig = sigma
    if eps is None:
        eps = torch.randn(x.shape, dtype=x.dtype, device=x.device, generator=generator)
    elif eps.shape != x.shape:
        raise ValueError(f"eps must have the shape of x {tuple(x.shape)}, got {tuple(eps.shape)}")
    xt = make_leaf(x.detach() + sig * eps)
    scores = compute_score_states(model, xt)
    if scores is None:
        return _dsm_of(compute_score(model, xt, create_graph=create_graph), eps, sig, create_graph)
    outs = [_dsm_of(s, eps, sig, create_graph) for s in scores]  # the same x̃ (noise) for every state
    return ObjectiveOutput(outs[-1].loss, outs[-1].per_sample, outs[-1].parts, states=outs)


def _dsm_of(s: Tensor, eps: Tensor, sig, create_graph: bool) -> ObjectiveOutput:
    per_sample = 0.5 * (flat(s) + flat(eps / sig)).pow(2).sum(-1)
    score_norm = 0.5 * flat(s).pow(2).sum(-1)
    return finalize(per_sample, {"score_norm": score_norm.mean()}, create_graph)
