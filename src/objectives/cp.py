"""Score matching with the Hessian diagonal estimated by curvature propagation (CP).

CP = J. Martens, I. Sutskever, K. Swersky, "Estimating the Hessian by back-propagating curvature",
ICML 2012. Per sample the loss is

    ½ ‖s(x)‖² + Σ_j d̂_j(x),     E[d̂] = diag ∇²ₓ log p̃(x),

an unbiased estimate of the exact SM loss (paper eq. 1) that needs two reverse passes per noise sample,
whatever D is.

How the diagonal is estimated (generic; no hand-written backward per layer)
----------------------------------------------------------------------------
Write log p̃ as a graph of affine maps and element-wise nonlinearities ``a_l = σ_l(u_l)``. Then, exactly,

    H = ∇²ₓ log p̃ = Σ_l J_lᵀ diag(M_l) J_l,   J_l = ∂u_l/∂x,   M_l = (∂log p̃/∂a_l) ∘ σ_l''(u_l).

With fresh Rademacher vectors v_l (one per op, per sample), put

    S_r = Σ_l J_lᵀ (√relu(M_l) ∘ v_l),   S_i = Σ_l J_lᵀ (√relu(−M_l) ∘ v_l);

then E[S_r S_rᵀ − S_i S_iᵀ] = H, so ``S_r² − S_i²`` (element-wise) is an unbiased estimate of diag H.
Each of S_r, S_i is ONE vector-Jacobian product ``autograd.grad([u_l], x, grad_outputs=[w_l])``, and all
∂log p̃/∂a_l come from one ``autograd.grad`` call together with the score. The pairs (u_l, a_l) are
recorded during ``model.log_density(x)`` by a ``torch.overrides.TorchFunctionMode``
(:class:`CurvatureRecorder`), which tracks which tensors depend on x.

Supported element-wise nonlinearities (analytic σ''):
    softplus (β, threshold as torch), exp, exp2, expm1, log, log2, log10, log1p, sigmoid, logsigmoid,
    tanh, elu, celu, selu, silu, gelu (exact, not ``approximate='tanh'``), sin, cos, sinh, cosh, erf,
    sqrt, rsqrt, reciprocal, square, pow(u, p) with p a number or an x-independent tensor, c ** u,
    c / u, a * u with ``a is u`` (a square).
Zero curvature (piecewise linear, treated as affine): relu, relu6, leaky_relu, hardtanh, abs, clamp,
    max/min/maximum/minimum/amax/amin, max pooling, where, masked_fill, dropout.
Affine (any number of x-dependent inputs): add, sub, neg, sum, mean, cumsum, cat, stack, views,
    reshapes, indexing, padding, average pooling, interpolation, ...; (multi)linear ops — mul, matmul,
    linear, conv, einsum, bmm, ... — and division by an x-independent tensor, provided at most ONE
    operand depends on x.
Detected and refused (the decomposition would be silently wrong): a product/matmul/einsum of two
    different x-dependent tensors, division by an x-dependent tensor together with an x-dependent
    numerator, any other op on an x-dependent tensor that is not listed (softmax, logsumexp, norm, cdist,
    layer_norm, linalg.*, ...), in-place nonlinearities, in-place modification of a recorded tensor,
    and custom ``autograd.Function`` nodes (the implicit DEQ backward: CP cannot see inside them; use
    the phantom-gradient DEQ, whose K steps are plain ops, or ``ssm_vr``/``sm``).
Unknown ops are refused rather than guessed, so the list errs on the side of raising.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import Tensor
from torch.overrides import TorchFunctionMode
from torch.utils._pytree import tree_flatten

from .base import (
    check_positive_int,
    finalize,
    flat,
    grad_wrt,
    has_log_density,
    log_density,
    make_leaf,
    needs_autograd,
)

_MARK = "_deqsm_cp_depends_on_x"


def _ops(names: str) -> list[str]:
    """Op names written as whitespace-separated words (the lists below are long)."""
    return names.split()


_AFFINE = frozenset(_ops("""
    add sub rsub neg negative positive sum mean nansum cumsum trace diagonal diag diag_embed tril triu
    view view_as reshape reshape_as flatten unflatten squeeze unsqueeze permute transpose swapaxes swapdims
    t T mT movedim moveaxis expand expand_as broadcast_to repeat repeat_interleave tile
    cat concat concatenate stack hstack vstack dstack split split_with_sizes tensor_split chunk unbind
    narrow select index_select gather take_along_dim getitem setitem masked_select
    clone contiguous to type double float half bfloat16 cpu cuda real requires_grad_
    flip fliplr flipud roll rot90 pad avg_pool1d avg_pool2d avg_pool3d adaptive_avg_pool1d adaptive_avg_pool2d
    adaptive_avg_pool3d interpolate upsample pixel_shuffle pixel_unshuffle unfold fold
""") + _ops("""
    relu relu6 leaky_relu hardtanh abs absolute clamp clip clamp_min clamp_max max min amax amin maximum minimum
    fmax fmin max_pool1d max_pool2d max_pool3d max_pool1d_with_indices max_pool2d_with_indices
    max_pool3d_with_indices adaptive_max_pool1d adaptive_max_pool2d where masked_fill threshold sort topk
    dropout dropout1d dropout2d dropout3d alpha_dropout feature_alpha_dropout
"""))  # the first group is affine; the second piecewise linear (zero curvature), treated as affine
# multilinear: affine in each operand; at most one operand may depend on x
_MULTILINEAR = frozenset(_ops("""
    mul multiply matmul mm bmm mv dot vdot inner outer ger linear bilinear einsum tensordot kron
    conv1d conv2d conv3d conv_transpose1d conv_transpose2d conv_transpose3d
"""))
# first operand is added, the rest multiplied together
_ADD_MULTILINEAR = frozenset(["addmm", "addmv", "addbmm", "baddbmm", "addr", "addcmul"])
_DIV = frozenset(["div", "divide", "true_divide"])
_REFLECTED = frozenset(["add", "sub", "mul", "div", "truediv", "matmul", "pow"])


# -------------------------------------------------------------------------------- second derivatives
def _arg(args, kwargs, i, name, default):
    if name in kwargs:
        return kwargs[name]
    return args[i] if len(args) > i else default


def _sd_softplus(u, a, args, kwargs):
    beta = _arg(args, kwargs, 1, "beta", 1.0)
    threshold = _arg(args, kwargs, 2, "threshold", 20.0)
    t = u * beta
    sg = torch.sigmoid(t)
    return torch.where(t > threshold, torch.zeros_like(u), beta * sg * (1 - sg))


def _sd_elu(u, a, args, kwargs):
    alpha = _arg(args, kwargs, 1, "alpha", 1.0)
    return torch.where(u > 0, torch.zeros_like(u), alpha * torch.exp(u))


def _sd_celu(u, a, args, kwargs):
    alpha = _arg(args, kwargs, 1, "alpha", 1.0)
    return torch.where(u > 0, torch.zeros_like(u), torch.exp(u / alpha) / alpha)


_SELU_ALPHA, _SELU_SCALE = 1.6732632423543772848170429916717, 1.0507009873554804934193349852946


def _sd_selu(u, a, args, kwargs):
    return torch.where(u > 0, torch.zeros_like(u), _SELU_SCALE * _SELU_ALPHA * torch.exp(u))


def _sd_silu(u, a, args, kwargs):
    sg = torch.sigmoid(u)
    return sg * (1 - sg) * (2 + u * (1 - 2 * sg))


def _sd_gelu(u, a, args, kwargs):
    if _arg(args, kwargs, 1, "approximate", "none") != "none":
        raise NotImplementedError("cp: gelu(approximate='tanh') is not supported; use approximate='none'")
    pdf = torch.exp(-0.5 * u * u) / math.sqrt(2 * math.pi)
    return pdf * (2 - u * u)


def _sd_logsigmoid(u, a, args, kwargs):
    sg = torch.sigmoid(u)
    return -sg * (1 - sg)


_ELEMENTWISE: dict[str, Callable] = {
    "softplus": _sd_softplus,
    "elu": _sd_elu,
    "celu": _sd_celu,
    "selu": _sd_selu,
    "silu": _sd_silu,
    "gelu": _sd_gelu,
    "log_sigmoid": _sd_logsigmoid,
    "logsigmoid": _sd_logsigmoid,
    "exp": lambda u, a, *_: a,
    "exp2": lambda u, a, *_: a * math.log(2) ** 2,
    "expm1": lambda u, a, *_: a + 1,
    "log": lambda u, a, *_: -1 / (u * u),
    "log2": lambda u, a, *_: -1 / (u * u * math.log(2)),
    "log10": lambda u, a, *_: -1 / (u * u * math.log(10)),
    "log1p": lambda u, a, *_: -1 / ((1 + u) * (1 + u)),
    "sigmoid": lambda u, a, *_: a * (1 - a) * (1 - 2 * a),
    "tanh": lambda u, a, *_: -2 * a * (1 - a * a),
    "sin": lambda u, a, *_: -a,
    "cos": lambda u, a, *_: -a,
    "sinh": lambda u, a, *_: a,
    "cosh": lambda u, a, *_: a,
    "erf": lambda u, a, *_: -4 / math.sqrt(math.pi) * u * torch.exp(-u * u),
    "sqrt": lambda u, a, *_: -0.25 / (a * a * a),
    "rsqrt": lambda u, a, *_: 0.75 * a**5,
    "reciprocal": lambda u, a, *_: 2 * a**3,
    "square": lambda u, a, *_: torch.full_like(u, 2.0),
}


def _sd_power(p):
    """σ(u) = u**p with p a number or an x-independent tensor."""
    if isinstance(p, (int, float)):
        if p in (0, 1):
            return lambda u, a, *_: torch.zeros_like(u)
        if p == 2:
            return lambda u, a, *_: torch.full_like(u, 2.0)
        return lambda u, a, *_: p * (p - 1) * u ** (p - 2)
    return lambda u, a, *_: torch.where(p * (p - 1) == 0, torch.zeros_like(u), p * (p - 1) * u ** (p - 2))


def _sd_base_power(c):
    """σ(u) = c**u, c > 0 a number or an x-independent tensor."""
    logc = math.log(c) if isinstance(c, (int, float)) else torch.log(c)
    return lambda u, a, *_: a * logc * logc


def _sd_scaled_reciprocal(c):
    """σ(u) = c / u."""
    return lambda u, a, *_: 2 * c / (u * u * u)


# ---------------------------------------------------------------------------------------------- recorder
@dataclass
class CurvatureRecord:
    """One element-wise nonlinearity a = σ(u) met on the way from x to log p̃."""

    op: str
    u: Tensor
    a: Tensor
    second_derivative: Callable[[Tensor, Tensor], Tensor]  # (u, a) -> σ''(u)
    u_version: int
    a_version: int


def _op_name(func) -> str:
    name = getattr(func, "__name__", None) or repr(func)
    if name == "__get__":  # properties such as Tensor.T
        name = getattr(getattr(func, "__self__", None), "__name__", name)
    return name


def _normalize(name: str) -> tuple[str, bool, bool]:
    """``(core name, in_place, reflected)``."""
    if name.startswith("__") and name.endswith("__"):
        core = name[2:-2]
        if core.startswith("i") and core[1:] in _REFLECTED:
            return core[1:], True, False
        if core.startswith("r") and core[1:] in _REFLECTED:
            return core[1:], False, True
        return core, False, False
    if name.endswith("_") and name != "requires_grad_":
        return name[:-1], True, False
    return name, False, False


class CurvatureRecorder(TorchFunctionMode):
    """Records element-wise nonlinearities on tensors that depend on ``x`` (see the module docstring).

    A tensor depends on x when it is x or the differentiable output of an intercepted op with an input
    that depends on x. Only ops run with grad enabled are looked at.
    """

    def __init__(self, x: Tensor):
        super().__init__()
        self.records: list[CurvatureRecord] = []
        self._token = object()
        self._mark(x)

    def _mark(self, t: Tensor) -> None:
        setattr(t, _MARK, self._token)

    def depends(self, t) -> bool:
        return isinstance(t, Tensor) and getattr(t, _MARK, None) is self._token

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        if not torch.is_grad_enabled():
            return out
        inputs, _ = tree_flatten((args, kwargs))
        dep = [t for t in inputs if self.depends(t)]
        if not dep:
            return out
        name = _op_name(func)
        core, in_place, reflected = _normalize(name)
        if core == "setitem":  # in-place write of an x-dependent value: the target now depends on x
            self._mark(args[0])
            return out
        outs = [t for t in tree_flatten(out)[0] if isinstance(t, Tensor) and t.requires_grad]
        if not outs:  # shapes, comparisons, indices, .item(), ...: nothing differentiable
            return out
        self._classify(name, core, in_place, reflected, args, kwargs, out, dep)
        for t in outs:
            self._mark(t)
        return out

    def _record(self, op, u, a, sd):
        self.records.append(CurvatureRecord(op, u, a, sd, u._version, a._version))

    def _classify(self, name, core, in_place, reflected, args, kwargs, out, dep):
        linear_kinds = _AFFINE | _MULTILINEAR | _ADD_MULTILINEAR | _DIV
        if (kwargs.get("inplace", False) or in_place) and core not in linear_kinds:
            raise NotImplementedError(
                f"cp: in-place nonlinear op '{name}' on a tensor that depends on x; use the out-of-place form"
            )
        if core in _AFFINE:
            return
        if core in _MULTILINEAR or core in _ADD_MULTILINEAR:
            operands = [t for t in tree_flatten(list(args[1:] if core in _ADD_MULTILINEAR else args))[0]]
            operands += [
                t for k, t in kwargs.items() if k in ("other", "input", "weight", "tensor1", "tensor2")
            ]
            dep_ops = [t for t in operands if self.depends(t)]
            if core in ("mul", "multiply") and len(args) >= 2 and args[0] is args[1] and not in_place:
                self._record("square", args[0], out, _ELEMENTWISE["square"])
                return
            if len(dep_ops) > 1:
                raise NotImplementedError(
                    f"cp: '{name}' of two tensors that both depend on x is not affine in x, and curvature "
                    "propagation here only handles element-wise nonlinearities; write it with element-wise "
                    "ops (e.g. x * x -> x ** 2) or use sm / ssm_vr"
                )
            return
        if core in _DIV:
            num, den = (
                (args[1], args[0])
                if reflected
                else (args[0], args[1] if len(args) > 1 else kwargs.get("other"))
            )
            if not self.depends(den):
                return  # division by a constant: affine
            if self.depends(num):
                raise NotImplementedError(
                    f"cp: '{name}' with x-dependent numerator and denominator is not supported"
                )
            if kwargs.get("rounding_mode") is not None:
                raise NotImplementedError(f"cp: '{name}' with rounding_mode is not supported")
            self._record("c/u", den, out, _sd_scaled_reciprocal(num))
            return
        if core in ("pow", "float_power"):
            base = args[1] if reflected else _arg(args, kwargs, 0, "input", None)
            expo = args[0] if reflected else _arg(args, kwargs, 1, "exponent", None)
            if self.depends(base) and self.depends(expo):
                raise NotImplementedError(f"cp: '{name}' with x-dependent base and exponent is not supported")
            if self.depends(base):
                self._record("pow", base, out, _sd_power(expo))
            else:
                self._record("c**u", expo, out, _sd_base_power(base))
            return
        sd = _ELEMENTWISE.get(core)
        if sd is not None:
            u = args[0] if args else kwargs["input"]
            if not self.depends(u) or len(dep) > 1:
                raise NotImplementedError(f"cp: '{name}' with an x-dependent parameter is not supported")
            if out is u:
                raise NotImplementedError(
                    f"cp: in-place nonlinear op '{name}' on a tensor that depends on x; use the out-of-place form"
                )
            self._record(core, u, out, lambda uu, aa, _sd=sd, _a=args, _k=kwargs: _sd(uu, aa, _a, _k))
            return
        raise NotImplementedError(
            f"cp: op '{name}' applied to a tensor that depends on x is not supported by curvature propagation "
            "(supported: affine ops and the element-wise nonlinearities listed in src/objectives/cp.py); "
            "use sm, ssm or ssm_vr for this model"
        )


def _check_no_custom_function(root: Tensor) -> None:
    """Refuse graphs with custom autograd.Function nodes: CP cannot see the ops inside them."""
    seen, stack = set(), [root.grad_fn]
    while stack:
        node = stack.pop()
        if node is None or node in seen:
            continue
        seen.add(node)
        if isinstance(node, torch.autograd.function.BackwardCFunction):
            raise NotImplementedError(
                f"cp: the log-density's graph contains the custom autograd.Function node "
                f"{type(node).__name__}; curvature propagation cannot see the ops inside it (e.g. an implicit "
                "DEQ backward). Use the phantom-gradient DEQ, or sm / ssm_vr"
            )
        stack.extend(n for n, _ in node.next_functions)


def curvature_terms(model, x: Tensor, create_graph: bool = True):
    """Forward with recording. Returns ``(xl, s [B, D], records, curvatures)`` where ``curvatures[l]`` is
    M_l = (∂log p̃/∂a_l) ∘ σ_l''(u_l), so that ∇²ₓ log p̃ = Σ_l J_lᵀ diag(M_l) J_l with J_l = ∂u_l/∂xl."""
    if not has_log_density(model):
        raise TypeError(
            f"cp needs an energy model with log_density(x); {type(model).__name__} has none "
            "(score networks: use ssm_vr, ssm, dsm or sm)"
        )
    xl = make_leaf(x)
    rec = CurvatureRecorder(xl)
    with rec:
        logp = log_density(model, xl)
    if logp.requires_grad:
        _check_no_custom_function(logp)
    records = rec.records
    for r in records:
        if r.u._version != r.u_version or r.a._version != r.a_version:
            raise NotImplementedError(
                f"cp: the input or output of '{r.op}' was modified in place after it was recorded; "
                "avoid in-place ops in log_density"
            )
    if not logp.requires_grad:
        z = torch.zeros_like(flat(xl))
        return xl, z, [], []
    grads = torch.autograd.grad(
        logp.sum(),
        [xl] + [r.a for r in records],
        create_graph=create_graph,
        retain_graph=True,
        allow_unused=True,
        materialize_grads=True,
    )
    curv = [g_a * r.second_derivative(r.u, r.a) for g_a, r in zip(grads[1:], records)]
    return xl, flat(grads[0]), records, curv


def _sqrt_pos(m: Tensor) -> Tensor:
    """√relu(m) with a finite (zero) gradient where m ≤ 0."""
    pos = m > 0
    return torch.where(pos, torch.sqrt(torch.where(pos, m, torch.ones_like(m))), torch.zeros_like(m))


@needs_autograd
def cp(
    model,
    x: Tensor,
    *,
    n_samples: int = 1,
    create_graph: bool = True,
    generator: torch.Generator | None = None,
):
    """Score matching with curvature propagation (Martens, Sutskever & Swersky 2012) for the trace.

    Per sample ``½‖s(x)‖² + Σ_j (S_r² − S_i²)_j`` averaged over ``n_samples`` independent noise draws;
    an unbiased estimate of the exact SM loss of paper eq. 1 (see the module docstring for the method
    and the list of supported ops). Needs ``model.log_density``.

    Returns:
        ObjectiveOutput with parts ``score_norm`` (mean ½‖s‖²) and ``trace`` (mean CP trace estimate).
    """
    check_positive_int("n_samples", n_samples)
    xl, s, records, curv = curvature_terms(model, x, create_graph=create_graph)
    B = s.shape[0]
    trace = torch.zeros(B, dtype=s.dtype, device=s.device)
    if records:
        us = [r.u for r in records]
        sq_pos = [_sqrt_pos(m) for m in curv]
        sq_neg = [_sqrt_pos(-m) for m in curv]
        for _ in range(n_samples):
            vs = [
                torch.randint(0, 2, m.shape, generator=generator, device=m.device).to(m.dtype) * 2 - 1
                for m in curv
            ]
            s_r, s_i = (grad_wrt(us, xl, [w * v for w, v in zip(sq, vs)], create_graph=create_graph)
                        for sq in (sq_pos, sq_neg))
            trace = trace + (flat(s_r) ** 2 - flat(s_i) ** 2).sum(-1)
        trace = trace / n_samples
    score_norm = 0.5 * (s**2).sum(-1)
    return finalize(
        score_norm + trace, {"score_norm": score_norm.mean(), "trace": trace.mean()}, create_graph
    )


__all__ = ["CurvatureRecord", "CurvatureRecorder", "cp", "curvature_terms"]
