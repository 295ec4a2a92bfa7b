"""Shared pieces of the score-matching objectives: the output record, the score, checks and helpers.

Conventions (paper §2.1; reference code ``ermongroup/sliced_score_matching``; see docs/objectives.md):

* A *model* is any object with ``log_density(x) -> [B]`` (unnormalized log p̃, energy models such as DKEF
  and NICE) and/or ``score(x) -> x.shape`` (score networks: the VAE score estimator, NCSN).
* ``x`` is ``[B, D]`` or ``[B, C, H, W]``; every objective flattens the non-batch dimensions internally,
  so ``D`` is the number of elements per sample.
* ``x`` arrives as a data batch. Each objective differentiates w.r.t. its **own leaf**
  ``x.detach().requires_grad_(True)``; nothing is propagated to whatever produced ``x``.
* Every loss is per sample and averaged over the batch. None is divided by ``D``.
* ``create_graph=True`` (training): the loss keeps its graph to the parameters, second derivatives
  included. ``create_graph=False`` (evaluation): second derivatives are taken without a graph and every
  returned tensor is detached. Derivatives w.r.t. ``x`` still need autograd, so the objectives switch
  grad on themselves (``torch.enable_grad``); they cannot run under ``torch.inference_mode`` — use
  ``Trainer(inference_mode=False)``.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field

import torch
from torch import Tensor
from torch.profiler import record_function

PROJECTIONS = ("rademacher", "gaussian")
# Profiler labels of an objective's phases (benchmarks/tools/profile_step.py groups a step's time by them; a no-op
# unless a profiler runs): the score s(x) with its graph, and the derivatives of s w.r.t. x (the exact trace's D
# reverse passes, the sliced objectives' projected ones), each with whatever runs inside (a DEQ solve keeps its own).
PHASE_SCORE = "objective.score"
PHASE_TRACE = "objective.trace"


@dataclass
class ObjectiveOutput:
    """Result of one objective on one batch.

    Attributes:
        loss: scalar, the mean over the batch of ``per_sample``.
        per_sample: ``[B]`` per-sample loss.
        parts: named scalar parts (batch means), e.g. ``{"score_norm": mean ½‖s‖², "trace": mean tr ∇ₓs}``.
        states: None, or — when the model offers ``score_states(x)`` (the scores read out from a DEQ's
            fixed-point correction states, :func:`compute_score_states`) — one output per state, each the same
            objective with the same noise and projections; the last is this output itself.
    """

    loss: Tensor
    per_sample: Tensor
    parts: dict[str, Tensor] = field(default_factory=dict)
    states: list | None = None


# ----------------------------------------------------------------------------------------------- checks
def check_positive_int(name: str, value) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{name} must be an integer >= 1, got {value!r}")
    return value


def check_sigma(value, name: str = "sigma"):
    if isinstance(value, Tensor):
        if not bool((value > 0).all()):
            raise ValueError(f"{name} must be > 0, got {value}")
        return value
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
        raise ValueError(f"{name} must be a number > 0, got {value!r}")
    return float(value)


def check_projection(value: str) -> str:
    if value not in PROJECTIONS:
        raise ValueError(f"projection must be one of {PROJECTIONS}, got {value!r}")
    return value


# ---------------------------------------------------------------------------------------------- helpers
def needs_autograd(fn):
    """Run ``fn`` with grad enabled; refuse inference mode with a message that says what to do."""

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        if torch.is_inference_mode_enabled():
            raise RuntimeError(
                f"{fn.__name__}: score-matching objectives differentiate w.r.t. x and cannot run under "
                "torch.inference_mode(); evaluate with Trainer(inference_mode=False) (grad is switched on "
                "inside the objective)"
            )
        with torch.enable_grad():
            return fn(*args, **kwargs)

    return wrapper


def make_leaf(x: Tensor) -> Tensor:
    """A fresh leaf copy of the data batch that requires grad."""
    if not isinstance(x, Tensor):
        raise TypeError(f"x must be a torch.Tensor, got {type(x).__name__}")
    if x.dim() < 2:
        raise ValueError(f"x must be batched, [B, D] or [B, C, H, W]; got shape {tuple(x.shape)}")
    if not x.is_floating_point():
        raise TypeError(f"x must be a floating-point tensor, got {x.dtype}")
    return x.detach().requires_grad_(True)


def flat(t: Tensor) -> Tensor:
    """``[B, ...] -> [B, D]``."""
    return t.reshape(t.shape[0], -1)


def grad_wrt(outputs, inputs, grad_outputs=None, *, create_graph: bool, retain_graph: bool = True):
    """``torch.autograd.grad`` for one input, with unused or graph-less outputs giving zeros."""
    outs = outputs if isinstance(outputs, (list, tuple)) else [outputs]
    if not any(o.requires_grad for o in outs):
        return torch.zeros_like(inputs)
    (g,) = torch.autograd.grad(
        outputs,
        inputs,
        grad_outputs=grad_outputs,
        create_graph=create_graph,
        retain_graph=retain_graph,
        allow_unused=True,
        materialize_grads=True,
    )
    return g


def has_score(model) -> bool:
    return callable(getattr(model, "score", None))


def has_log_density(model) -> bool:
    return callable(getattr(model, "log_density", None))


def log_density(model, x: Tensor) -> Tensor:
    """``model.log_density(x)`` checked to be ``[B]``."""
    if not has_log_density(model):
        raise TypeError(f"{type(model).__name__} has no log_density(x); this objective needs an energy model")
    logp = model.log_density(x)
    if logp.shape != (x.shape[0],):
        raise ValueError(
            f"{type(model).__name__}.log_density(x) must return shape [B] = ({x.shape[0]},), "
            f"got {tuple(logp.shape)}"
        )
    return logp


def compute_score(model, x: Tensor, create_graph: bool = True) -> Tensor:
    """The model score s(x) = ∇ₓ log p̃(x), shape ``x.shape``.

    ``model.score(x)`` when the model has one; otherwise the autograd gradient of
    ``model.log_density(x).sum()`` w.r.t. ``x`` (samples are independent, so the gradient of the sum is
    the per-sample gradient). If ``x`` does not require grad a fresh leaf is made. ``create_graph`` is
    passed to that gradient: keep it True whenever the score itself is differentiated again (any loss
    with a trace term, or a parameter update).
    """
    if has_score(model):
        with record_function(PHASE_SCORE):
            s = model.score(x)
    elif has_log_density(model):
        if not x.requires_grad:
            x = x.detach().requires_grad_(True)
        with torch.enable_grad(), record_function(PHASE_SCORE):
            logp = log_density(model, x)
            s = grad_wrt(logp.sum(), x, create_graph=create_graph, retain_graph=create_graph)
    else:
        raise TypeError(f"{type(model).__name__} has neither score(x) nor log_density(x)")
    if s.shape != x.shape:
        raise ValueError(f"score must have the shape of x {tuple(x.shape)}, got {tuple(s.shape)}")
    return s


def compute_score_states(model, x: Tensor) -> list[Tensor] | None:
    """The scores along a DEQ's solve, ``model.score_states(x)`` (one per fixed-point correction state, all from
    one forward of ``x``, the last the model's score), checked to have the shape of x; None when the model does
    not offer them (every objective then computes the one score, :func:`compute_score`)."""
    if not callable(getattr(model, "score_states", None)):
        return None
    with record_function(PHASE_SCORE):
        scores = list(model.score_states(x))
    if not scores or any(s.shape != x.shape for s in scores):
        raise ValueError(f"score_states must return one or more scores of the shape of x {tuple(x.shape)}, got "
                         f"{[tuple(s.shape) for s in scores]}")
    return scores


def weighted_states_loss(states: list, weights) -> Tensor:
    """Σ_i w_i ℓ_i over the outputs of an objective's states (``ObjectiveOutput.states``): the fixed-point
    correction loss of Bai et al. (2022, §3.3) with w_i = γ^(n−i) (``src.deq.core.correction_weights``)."""
    if len(states) != len(weights):
        raise ValueError(f"{len(states)} state outputs but {len(weights)} weights")
    return torch.stack([float(w) * o.loss for w, o in zip(weights, states)]).sum()


def draw_projections(
    n: int, like: Tensor, projection: str = "rademacher", generator: torch.Generator | None = None
) -> Tensor:
    """``n`` projection vectors per sample, ``[n, B, D]``, with E[vvᵀ] = I (Rademacher or N(0, I))."""
    check_projection(projection)
    B, D = like.shape[0], like[0].numel()
    v = torch.randn(n, B, D, dtype=like.dtype, device=like.device, generator=generator)
    return v.sign() if projection == "rademacher" else v


def as_projections(v: Tensor, n: int, x: Tensor) -> Tensor:
    """Accept user-given projections ``[B, ...]`` (n = 1) or ``[n, B, ...]``; return ``[n, B, D]``."""
    B, D = x.shape[0], x[0].numel()
    if v.dim() == x.dim():
        v = v.unsqueeze(0)
    if v.dim() != x.dim() + 1 or v.shape[0] != n or v.shape[1] != B or v[0, 0].numel() != D:
        raise ValueError(
            f"v must have shape [B, ...] or [n={n}, B, ...] matching x {tuple(x.shape)}, got {tuple(v.shape)}"
        )
    v = v.reshape(n, B, D)
    return v.to(dtype=x.dtype, device=x.device)


def finalize(per_sample: Tensor, parts: dict[str, Tensor], create_graph: bool) -> ObjectiveOutput:
    if not create_graph:
        per_sample = per_sample.detach()
        parts = {k: v.detach() for k, v in parts.items()}
    return ObjectiveOutput(loss=per_sample.mean(), per_sample=per_sample, parts=parts)
