"""Value, Jacobian and Laplacian of a feature network in one forward pass ("jets"), for DKEF's exact SM.

The exact SM loss (paper eq. 1) of DKEF needs, per sample, ∇ₓ k(x, z_m) and Δₓ k(x, z_m) (``src/models/dkef.py``).
With u = φ(x) ∈ R^F, J = ∂u/∂x and L = Σ_d ∂²u/∂x_d² these are closed forms in (u, J, L), so the network is
evaluated once on the batch while carrying, next to every activation a, its Jacobian ∂a/∂x (``[N, D, width]``)
and its Laplacian Σ_d ∂²a/∂x_d² (``[N, width]``):

    linear     a' = a Wᵀ + b         J' = J Wᵀ                 L' = L Wᵀ
    Softplus   a' = σ(p)             J' = σ'(p) ⊙ J            L' = σ'(p) ⊙ L + σ''(p) ⊙ Σ_d J_d ⊙ J_d

(σ' = sigmoid, σ'' = sigmoid·(1 − sigmoid)). Every piece is an ordinary autograd op, so one reverse pass of the
loss gives the exact parameter gradients (no second- or third-order reverse passes as in the replicated route).

DEQ features (paper eq. 5, z* = σ(W z* + g(x))) follow the block's backward mode exactly:

* ``phantom`` (Alg. 1): the solve under ``no_grad``, then the K phantom steps carry the jet from (z*, 0, 0): the
  same K-term Neumann series of the derivatives that autograd through the K steps gives (Prop. 2).
* ``implicit`` (Prop. 1): the jet (z, J, L) is itself the fixed point of the jet map; it is
  :func:`src.deq.core.equilibrium` of that map, whose exact implicit backward gives the parameter gradients.

Both go through the public DEQ core only: the block's warm start (``initial_state`` / ``remember``), its settings
(``block.config``), its non-convergence warning (``block.warn``) and ``block.record(info)`` for its statistics.

Supported: :class:`src.models.features.MLPFeatures` and dense Softplus :class:`src.models.deq_net.DEQNet`
(``supports_jet`` says which networks; others take the autograd route). A Softplus input of more than 20 is
treated as torch's ``F.softplus`` treats it in the value (linear) but with the sigmoid slopes in the
derivatives (they differ from 1 and 0 by < 3e-9).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn
from torch.profiler import record_function

from src.deq.core import equilibrium, solve_only
from src.deq.maps import dense_map
from src.deq.solvers import solve
from src.models.deq_net import DEQNet
from src.models.features import MLPFeatures

PHASE_JET = "dkef.feature_jets"  # profiler label: (u, J, L) of the features of a batch
PHASE_JET_STEPS = "dkef.feature_jets.deq_steps"  # the DEQ's phantom steps / implicit solve carrying the jet

Jet = tuple  # (value [N, W], Jacobian [N, D, W] or [D, W] (shared by all rows) or None (identity), Laplacian or None)


def _linear(jet: Jet, weight: torch.Tensor, bias: torch.Tensor | None) -> Jet:
    a, j, lap = jet
    out = a @ weight.T if bias is None else torch.addmm(bias, a, weight.T)
    jo = weight.T if j is None else j @ weight.T  # None: the input's Jacobian is the identity
    return out, jo, (None if lap is None else lap @ weight.T)


def _softplus(jet: Jet) -> Jet:
    p, j, lap = jet
    s1 = torch.sigmoid(p)
    s2 = s1 * (1 - s1)
    if j.dim() == 2:  # shared by all rows: Σ_d J_d² is one vector
        sq = j.pow(2).sum(0)
        jo = s1.unsqueeze(1) * j
    else:
        sq = j.pow(2).sum(1)
        jo = s1.unsqueeze(1) * j
    lo = s2 * sq if lap is None else s1 * lap + s2 * sq
    return F.softplus(p), jo, lo


def _add(a: Jet, b: Jet) -> Jet:
    lap = a[2] if b[2] is None else (b[2] if a[2] is None else a[2] + b[2])
    return a[0] + b[0], a[1] + b[1], lap


def _module_jet(module: nn.Module, jet: Jet) -> Jet:
    if isinstance(module, nn.Linear):
        return _linear(jet, module.weight, module.bias)
    if isinstance(module, nn.Softplus):
        if module.beta != 1:
            raise ValueError("feature jets support Softplus with beta = 1 only")
        return _softplus(jet)
    if isinstance(module, nn.Sequential):
        for m in module:
            jet = _module_jet(m, jet)
        return jet
    raise TypeError(f"no jet rule for {type(module).__name__}")


def _supported_module(module: nn.Module) -> bool:
    if isinstance(module, nn.Sequential):
        return all(_supported_module(m) for m in module)
    return isinstance(module, nn.Linear) or (isinstance(module, nn.Softplus) and module.beta == 1)


def supports_jet(net: nn.Module) -> bool:
    """Whether :func:`feature_jet` handles ``net`` (explicit MLP features, or a dense Softplus DEQ network)."""
    if isinstance(net, MLPFeatures):
        return _supported_module(net.net)
    if isinstance(net, DEQNet):
        block = net.block
        return (net.kind == "dense" and getattr(block, "phi", None) is dense_map
                and _supported_module(block.injection) and block.config.backward in ("phantom", "implicit")
                and not float(block.config.jacobian_penalty) > 0  # the regulariser lives in the block's forward
                and not int(block.config.correction_states))  # so do the fixed-point correction states
    return False


# ---------------------------------------------------------------------------------------------- DEQ jets
def _dense_map_jet(jet: Jet, inj: Jet, w1: torch.Tensor, rest) -> Jet:
    """The jet of :func:`src.deq.maps.dense_map` φ(z) = σ(W_L … σ(W_1 z + g(x)) …): ``jet`` of z, ``inj`` of g(x)."""
    z, jz, lz = jet
    pre = _add(_linear((z, jz, lz), w1, None), inj)
    h = _softplus(pre)
    for i in range(0, len(rest), 2):
        h = _softplus(_linear(h, rest[i], rest[i + 1]))
    return h


class JetMap:
    """The jet map Φ(s; g, J_g, L_g, W_1, …) on the packed state s = [z | J | L] ``[N, D + 2, W]`` (implicit mode):
    its fixed point is (z*, ∂z*/∂x, Σ_d ∂²z*/∂x_d²). A plain picklable object, as the maps of src/deq/maps.py.
    ``layers``: the map's number of layers L; with L = 1 (the record) it offers :meth:`linearize`, its own J and
    Jᵀ products for the implicit backward's adjoint solves (src.deq.implicit: no autograd graph in them)."""

    def __init__(self, layers: int = 1):
        if int(layers) != 1:
            self.linearize = None  # the generic autograd products (src.deq.implicit._Adjoint.prepare)

    def __call__(self, state, inj, j_inj, l_inj, w1, *rest):
        z, jz, lz = state[:, 0], state[:, 1:-1], state[:, -1]
        out, jo, lo = _dense_map_jet((z, jz, lz), (inj, j_inj, l_inj), w1, rest)
        if jo.dim() == 2:
            jo = jo.unsqueeze(0).expand(z.shape[0], *jo.shape)
        return torch.cat([out.unsqueeze(1), jo, lo.unsqueeze(1)], dim=1)

    def linearize(self, state, inj, j_inj, l_inj, w1):
        """(v ↦ Φ' v, a ↦ Φ'ᵀ a), Φ' = ∂Φ/∂s at ``state`` (one layer), written out, no autograd. With
        p = z W₁ᵀ + g, P_J = J W₁ᵀ + J_g, P_L = L W₁ᵀ + L_g, q = Σ_d P_J,d², σ₁ = sigmoid(p), σ₂ = σ₁(1 − σ₁),
        σ₃ = σ₂(1 − 2σ₁) and the direction's (dp, dP_J, dP_L) = (dz, dJ, dL) W₁ᵀ:

            dz' = σ₁ dp,   dJ' = σ₂ dp P_J + σ₁ dP_J,   dL' = (σ₂ P_L + σ₃ q) dp + σ₁ dP_L + 2σ₂ Σ_d P_J,d dP_J,d;

        the transpose takes a = (a_z, a_J, a_L) to (b_p, b_J, b_L) W₁ with b_J = σ₁ a_J + 2σ₂ a_L P_J,
        b_L = σ₁ a_L, b_p = σ₁ a_z + σ₂ Σ_d a_J,d P_J,d + (σ₂ P_L + σ₃ q) a_L. One matmul and a few elementwise
        ops per product (float64 tests against autograd: tests/test_dkef_fast_trace.py)."""
        with torch.no_grad():
            pre = torch.cat([state[:, :1] @ w1.T + inj.unsqueeze(1), state[:, 1:-1] @ w1.T + j_inj,
                             state[:, -1:] @ w1.T + l_inj.unsqueeze(1)], dim=1)
            p, pj, pl = pre[:, 0], pre[:, 1:-1], pre[:, -1]
            s1 = torch.sigmoid(p)
            s2 = s1 * (1 - s1)
            c = s2 * pl + s2 * (1 - 2 * s1) * pj.pow(2).sum(1)  # σ₂ P_L + σ₃ q
            s1b, s2pj = s1.unsqueeze(1), s2.unsqueeze(1) * pj

        def jvp(v):
            d = v @ w1.T
            dp, dpj, dpl = d[:, 0], d[:, 1:-1], d[:, -1]
            dl = c * dp + s1 * dpl + 2 * (s2pj * dpj).sum(1)
            return torch.cat([(s1 * dp).unsqueeze(1), s2pj * dp.unsqueeze(1) + s1b * dpj, dl.unsqueeze(1)], dim=1)

        def vjp(a):
            a_z, a_j, a_l = a[:, 0], a[:, 1:-1], a[:, -1]
            b_p = s1 * a_z + (a_j * s2pj).sum(1) + c * a_l
            b_j = s1b * a_j + 2 * a_l.unsqueeze(1) * s2pj
            return torch.cat([b_p.unsqueeze(1), b_j, (s1 * a_l).unsqueeze(1)], dim=1) @ w1

        return jvp, vjp


def jet_fixed_point(z_star: torch.Tensor, inj: Jet, w1: torch.Tensor, solver: dict | None = None) -> torch.Tensor:
    """The one-layer jet map's fixed point [z* | J* | L*] ``[N, D + 2, W]`` from z* (no grad).

    Given z*, the jet's equations are linear (row vectors, S = diag(σ₁), σ₁ = sigmoid(z* W₁ᵀ + g)):
    J = (J W₁ᵀ + J_g) S and L = (L W₁ᵀ + L_g) S + σ₂ Σ_d P_J,d², P_J = J W₁ᵀ + J_g — the map's Jacobian
    operator, contracting at its rate. They are iterated with σ₁, σ₂ computed once (one matmul per iteration on
    the packed [J | L], under ``solver``: keyword arguments of :func:`src.deq.solvers.solve`, the block's), not
    the whole jet map; a batched LU of the ``[N, W, W]`` matrices costs more on a CPU at these sizes. The implicit
    core then confirms the fixed point in one evaluation of :class:`JetMap`."""
    g, j_g, l_g = inj
    with torch.no_grad():
        s1 = torch.sigmoid(z_star @ w1.T + g).unsqueeze(1)
        s2 = s1 * (1 - s1)
        d = j_g.shape[-2]
        inj_jl = torch.cat([j_g.expand(z_star.shape[0], *j_g.shape[-2:]), l_g.unsqueeze(1)], dim=1)

        def step(x):  # x = [J | L] [N, D + 1, W]
            pre = x @ w1.T + inj_jl
            out = s1 * pre
            out[:, -1:] += s2 * pre[:, :d].pow(2).sum(1, keepdim=True)
            return out

        x = solve(step, s1 * inj_jl, **(solver or {})).z
        return torch.cat([z_star.unsqueeze(1), x], dim=1)


def _zeros_like_laplacian(inj: Jet) -> torch.Tensor:
    return inj[2] if inj[2] is not None else torch.zeros_like(inj[0])


def _deq_jet(net: DEQNet, x: torch.Tensor) -> Jet:
    block = net.block
    params = block.map_params(x)  # (g(x), W_1, W_2, b_2, …): the block's own call, spectral updates included
    inj_value, w1, rest = params[0], params[1], params[2:]
    inj = _module_jet(block.injection, (x, None, None))
    inj = (inj_value, inj[1], inj[2])
    z0 = block.initial_state(x, inj_value)
    cfg = block.config
    # z* alone first (cheap: the deq.solve span), then the jet's steps or fixed point from it
    z_star, info = solve_only(dense_map, z0, params, cfg, warn=block.warn)
    z_info = info
    if cfg.backward == "implicit":  # the jet's fixed point from (z*, 0, 0)
        n, d, w = x.shape[0], x.shape[1], z_star.shape[1]
        l_inj = _zeros_like_laplacian(inj)
        with record_function(PHASE_JET_STEPS):
            if rest:  # several layers in the map: the jet map's own fixed-point iteration from (z*, 0, 0)
                state0 = torch.zeros(n, d + 2, w, dtype=z_star.dtype, device=z_star.device)
                state0[:, 0] = z_star
            else:  # one layer: the jet's linear equations iterated at z*; the core's solve confirms it
                state0 = jet_fixed_point(z_star, (inj[0].detach(), inj[1].detach(), l_inj.detach()), w1.detach(),
                                         cfg.solver_kwargs())
            state, info = equilibrium(JetMap(1 + len(rest) // 2), state0, (inj[0], inj[1], l_inj, w1, *rest), cfg,
                                      correction=False, warn=block.warn)
        z, jz, lz = state[:, 0], state[:, 1:-1], state[:, -1]
        info.iterations, info.residual, info.converged, info.hit_cap, info.z_star = (  # the block's solve: z*'s
            z_info.iterations, z_info.residual, z_info.converged, z_info.hit_cap, z_info.z_star)
    else:
        z, jz, lz = z_star, None, None
        with record_function(PHASE_JET_STEPS):
            for k in range(int(cfg.phantom_steps)):
                if k == 0:  # z_0 = z* is a constant: the first step's jet needs no product with J_z
                    pre = (z @ w1.T + inj[0], inj[1], inj[2])
                    h = _softplus(pre)
                    for i in range(0, len(rest), 2):
                        h = _softplus(_linear(h, rest[i], rest[i + 1]))
                    z, jz, lz = h
                else:
                    z, jz, lz = _dense_map_jet((z, jz, lz), inj, w1, rest)
        if jz is None:  # phantom_steps = 0: z* is constant in x
            jz = torch.zeros(x.shape[0], x.shape[1], z.shape[1], dtype=z.dtype, device=z.device)
            lz = torch.zeros_like(z)
    if jz.dim() == 2:
        jz = jz.unsqueeze(0).expand(x.shape[0], *jz.shape)
    if lz is None:
        lz = torch.zeros_like(z)
    block.record(info)
    block.remember(z)
    out = _linear((z, jz, lz), net.readout.weight, net.readout.bias)
    if net.skip is not None:
        out = _add(out, _linear((x, None, None), net.skip.weight, None))
    return out


# ---------------------------------------------------------------------------------------------- entry point
def feature_jet(net: nn.Module, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(u, J, L) of the feature network at x ``[N, D]``: u = φ(x) ``[N, F]``, J[n, d, f] = ∂u_f/∂x_d
    ``[N, D, F]``, L[n, f] = Σ_d ∂²u_f/∂x_d² ``[N, F]``; differentiable w.r.t. every parameter (first order)."""
    with record_function(PHASE_JET):
        if isinstance(net, MLPFeatures):
            u, j, lap = _module_jet(net.net, (x, None, None))
            if net.skip is not None:
                u, j, lap = _add((u, j, lap), _linear((x, None, None), net.skip.weight, None))
        elif isinstance(net, DEQNet):
            u, j, lap = _deq_jet(net, x)
        else:
            raise TypeError(f"no jet rule for feature network {type(net).__name__}")
        if j.dim() == 2:  # a linear network: the same Jacobian for every row
            j = j.unsqueeze(0).expand(x.shape[0], *j.shape)
        if lap is None:
            lap = torch.zeros_like(u)
        return u, j, lap
