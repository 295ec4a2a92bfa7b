"""Score-matching objectives as pure functions of ``(model, x)`` (paper §2.1; docs/objectives.md).

=========  ==================================================  ======================
name       per-sample loss                                     function
=========  ==================================================  ======================
sm         ½‖s‖² + tr ∇ₓ s  (eq. 1, exact, not divided by D)   :func:`sm`
ssm        ½(vᵀs)² + vᵀ∇ₓ(vᵀs)  (eq. 3)                        :func:`ssm`
ssm_vr     ½‖s‖² + vᵀ∇ₓ(vᵀs)  (eq. 4)                          :func:`ssm_vr`
dsm        ½‖s(x̃) + (x̃−x)/σ²‖²  (eq. 2)                       :func:`dsm`
cp         ½‖s‖² + Σ CP diag-Hessian estimate (Martens 2012)   :func:`cp`
mle        −log p(x)  (tractable models only)                  :func:`mle`
=========  ==================================================  ======================

``get_objective(name, **kwargs)`` binds hyper-parameters; ``noise_conditional`` gives the NCSN form.
"""

from .base import ObjectiveOutput, compute_score, draw_projections
from .conditional import LabelConditioned, noise_conditional
from .cp import CurvatureRecorder, cp, curvature_terms
from .dsm import dsm
from .mle import mle
from .registry import OBJECTIVES, get_objective
from .sm import TRACE_ROUTES, hessian_trace, sm
from .ssm import ssm, ssm_vr

__all__ = [
    "OBJECTIVES",
    "TRACE_ROUTES",
    "CurvatureRecorder",
    "LabelConditioned",
    "ObjectiveOutput",
    "compute_score",
    "cp",
    "curvature_terms",
    "draw_projections",
    "dsm",
    "get_objective",
    "hessian_trace",
    "mle",
    "noise_conditional",
    "sm",
    "ssm",
    "ssm_vr",
]
