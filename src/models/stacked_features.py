"""DKEF's R dense DEQ feature networks as one stacked DEQ: one solve and batched matmuls instead of R of each.

DKEF (paper §4.2, App. D.1) has one feature network per kernel, r = 1..R: z*_r = σ(Ŵ_r z*_r + U_r x + c_r) (eq. 5,
σ = Softplus) read out as u_r = R_r z*_r + b_r + S_r x. The R fixed points are independent, so together they are
the fixed point of the block-diagonal map on the stacked state Z = [z_1; …; z_R] ``[R, N, W]``:

    Z = σ(Z Ŵᵀ + G),   (Z Ŵᵀ)_r = z_r Ŵ_rᵀ  (one batched matmul),   G_r = x U_rᵀ + c_r,

solved once under the blocks' setting (the solver sees the R·N rows as samples, so every (r, n) row meets the
blocks' per-sample stop rule), followed by the K phantom steps of Alg. 1 (Prop. 2) on the stack — carrying the
jet (value, Jacobian ∂/∂x, Laplacian Σ_d ∂²/∂x_d²; src/models/feature_jets.py) when :func:`stacked_jets` asks.
The step of the main job is bound by many small operations (three narrow maps): stacked, it pays each
operation's overhead once instead of R times. The phantom steps' derivatives are the same K-term Neumann series
as each block's own (Alg. 1 applied per block, since the stacked Jacobian is block-diagonal).

Parameters, buffers and warm starts stay the blocks' own, so checkpoints load as before: the weights are stacked
at each call (Ŵ_r from each block's ``map_weights``, its normalization with its power step), each block starts
from its own remembered fixed point and remembers its own, and records the stacked solve's info with its own rows'
residual (:meth:`src.deq.block.DEQBlock.record`). :func:`stacked_features` runs the hooks registered on each block
as ``block(x)`` would (the DEQ monitor's input capture, ``forward_infos``); :func:`stacked_jets`, as the
one-by-one jet route, calls no block — unless it also gives the inducing points' features (``values_of``), whose
call the hooks then see as :func:`stacked_features` shows it.

The phantom steps of the jet route and of the inducing points' features (both differentiated once, w.r.t. the
parameters) are :class:`_PhantomSteps`: a hand-written reverse sweep that recomputes the K steps instead of saving
them, so a step saves the solve's inputs, not K steps' activations (the bytes issue 60 bounds). A DKEF training
step runs both in one: the batch's rows carry the jet, the inducing points' rows their values, through one solve
and one set of steps (``stacked_jets(…, values_of=…)``; one spectral power step per training step).

:func:`stackable` says which feature networks qualify: two or more dense Softplus :class:`DEQNet`s with a linear
injection, equal shapes and one setting with the phantom backward (no Jacobian penalty, no correction states, no
one-pass control). Others are evaluated one by one; the numbers agree (float64: tests/test_dkef_stacked.py).
"""

from __future__ import annotations

import dataclasses

import torch
import torch.nn.functional as F
from torch import nn
from torch.profiler import record_function

from src.deq.block import DenseDEQBlock
from src.deq.core import PHASE_PHANTOM, EquilibriumInfo, equilibrium, solve_only
from src.deq.maps import dense_map
from src.models.deq_net import DEQNet
from src.models.feature_jets import PHASE_JET, PHASE_JET_STEPS


def stackable(nets) -> bool:
    """Whether :func:`stacked_features` / :func:`stacked_jets` take ``nets`` (module docstring)."""
    nets = list(nets)
    if len(nets) < 2 or not all(isinstance(n, DEQNet) and n.kind == "dense" for n in nets):
        return False
    first = nets[0].block
    cfg = first.config
    for net in nets:
        b = net.block
        if not (isinstance(b, DenseDEQBlock) and b.phi is dense_map and type(b.injection) is nn.Linear
                and b.n_layers == 1 and b.config == cfg and (b.width, b.in_dim) == (first.width, first.in_dim)
                and net.readout.out_features == nets[0].readout.out_features
                and (net.skip is None) == (nets[0].skip is None)):
            return False
    return (cfg.backward == "phantom" and not cfg.one_pass and not float(cfg.jacobian_penalty) > 0
            and not int(cfg.correction_states))


def stacked_dense_map(z, inj, w1):
    """:func:`src.deq.maps.dense_map` (one layer) of R blocks at once: σ(z_r Ŵ_rᵀ + G_r) with ``inj`` = G
    ``[R, N, W]`` and ``w1`` = Ŵ ``[R, W, W]``; ``z`` is ``[R, N, W]`` or the solver's rows ``[R·N, W]`` (the output
    has z's shape)."""
    return F.softplus(torch.baddbmm(inj, z.reshape(inj.shape), w1.transpose(1, 2))).reshape(z.shape)


class _Warnings:
    """The non-convergence warning of a stacked solve, passed on to every block's own (throttled) warning."""

    def __init__(self, blocks):
        self.blocks = blocks

    def __call__(self, level, stats, config):
        for b in self.blocks:
            b.warn(level, stats, config)


def _stacked_params(nets, x):
    """(blocks, G ``[R, N, W]``, U_rᵀ ``[R, D, W]`` (∂G/∂x), the stacked map weights), with autograd."""
    blocks = [n.block for n in nets]
    weights = [torch.stack(ws) for ws in zip(*(b.map_weights() for b in blocks))]
    u_t = torch.stack([b.injection.weight for b in blocks]).transpose(1, 2)
    bias = torch.stack([b.injection.bias for b in blocks]).unsqueeze(1)
    g = torch.baddbmm(bias, x.unsqueeze(0).expand(len(blocks), *x.shape), u_t)
    return blocks, g, u_t, weights


def _record(blocks, z: torch.Tensor, info: EquilibriumInfo, rows: list[int] | None = None) -> None:
    """Each block's record (its own rows' residual and fixed point) and warm start: of each input's ``rows`` apart
    when the solve ran several inputs' rows together (the jets and the inducing points' features)."""
    per_block = info.sample_residual.reshape(len(blocks), -1) if info.sample_residual is not None else None
    z_star = info.z_star.reshape(z.shape) if info.z_star is not None else None
    for r, b in enumerate(blocks):
        mine = dataclasses.replace(info, backward={})
        if per_block is not None:
            mine.sample_residual = per_block[r]
            mine.residual = float(per_block[r].max()) if per_block[r].numel() else 0.0
        if z_star is not None:
            mine.z_star = z_star[r]
        b.record(mine)
        for part in z[r].split(rows or [z.shape[1]]):  # each input's rows: its own warm start
            b.remember(part)


def _pre_hooks(blocks, x) -> None:
    """The forward pre-hooks registered on each block, as ``block(x)`` would run them (the DEQ monitor keeps the
    block's last training input there: src/lit/deq_monitor.py)."""
    for b in blocks:
        for hook in list(b._forward_pre_hooks.values()):
            hook(b, (x,))


def _post_hooks(blocks, x, z) -> None:
    """The forward hooks registered on each block, as ``block(x)`` returning its rows ``z[r]`` would run them
    (:func:`src.deq.lookup.forward_infos` collects each forward's record there)."""
    for r, b in enumerate(blocks):
        for hook in list(b._forward_hooks.values()):
            hook(b, (x,), z[r])


def _forward_steps(z_star, g, u_t, w1, steps: int, n_jet: int, keep: bool = False):
    """The K phantom steps from the constant z* (no autograd): the last (z, J, L), where the first ``n_jet`` rows of
    each block carry the jet (J ``[R, n_jet, D, W]``, L ``[R, n_jet, W]``; both None when ``n_jet`` is 0) and every
    row its value; with ``keep`` instead the tape of every step — its input (z, J, L) and its (p, P_J, P_L, σ₁, q)
    — for :class:`_PhantomSteps`' reverse sweep (the last step's output is then not formed)."""
    r, _, w = z_star.shape
    z, j, lap = z_star, None, None
    w1t = w1.transpose(1, 2)
    tape = []
    for k in range(int(steps)):
        p = torch.baddbmm(g, z, w1t)
        if not n_jet:
            if keep:
                tape.append((z, None, None, p, None, None, torch.sigmoid(p), None))
                if k == int(steps) - 1:
                    break
            z = F.softplus(p)
            continue
        if j is None:  # from z*: J = 0, L = 0, so P_J = U_rᵀ for every row and P_L = 0
            pj, pl = u_t.unsqueeze(1).expand(r, n_jet, *u_t.shape[1:]), None
        else:
            pj = torch.bmm(j.reshape(r, -1, w), w1t).reshape(j.shape).add_(u_t.unsqueeze(1))
            pl = torch.bmm(lap, w1t)
        s1 = torch.sigmoid(p)
        q = pj.pow(2).sum(2)
        if keep:
            tape.append((z, j, lap, p, pj, pl, s1, q))
            if k == int(steps) - 1:
                break
        s1j = s1[:, :n_jet]
        s2 = s1j * (1 - s1j)
        z = F.softplus(p)
        j = s1j.unsqueeze(2) * pj
        lap = s2 * q if pl is None else torch.addcmul(s1j * pl, s2, q)
    return (z, j, lap), tape


class _PhantomSteps(torch.autograd.Function):
    """The K phantom steps of Alg. 1 of the stacked one-layer map from the constant z*, the first ``n_jet`` rows of
    each block carrying the jet (0: none), with a hand-written reverse sweep: forward (z*, G, U_rᵀ, Ŵ) ↦ (z_K, J_K,
    L_K) saving only its inputs, backward recomputing the K steps and taking their transposed products (the
    transposes of the jet map's, as in src/models/feature_jets.py's ``JetMap.linearize``): with σ₁ = sigmoid(p),
    σ₂ = σ₁(1 − σ₁), σ₃ = σ₂(1 − 2σ₁) and q = Σ_d P_J,d², the adjoints (a_z, a_J, a_L) of a step's output give
    (the J and L terms on the jet rows only)

        b_p = σ₁ a_z + σ₂ Σ_d a_J,d P_J,d + (σ₂ P_L + σ₃ q) a_L,   b_J = σ₁ a_J + 2σ₂ a_L P_J,   b_L = σ₁ a_L,

    then Ḡ += b_p, Ū += Σ_n b_J, W̄ += b_pᵀz + b_Jᵀ J + b_Lᵀ L and the input's adjoints (b_p, b_J, b_L) Ŵ.
    Bytes saved for backward: the inputs, not K steps' activations. First order only: the jets' and the inducing
    points' features are differentiated once, w.r.t. the parameters (a create_graph backward through it raises,
    where ``once_differentiable`` would let ``torch.autograd.grad`` drop its terms silently)."""

    @staticmethod
    def forward(ctx, z_star, g, u_t, w1, steps, n_jet):
        (z, j, lap), _ = _forward_steps(z_star, g, u_t, w1, steps, n_jet)
        ctx.steps, ctx.n_jet = int(steps), int(n_jet)
        ctx.save_for_backward(z_star, g, u_t, w1)
        return (z, j, lap) if n_jet else z

    @staticmethod
    def backward(ctx, a_z, a_j=None, a_l=None):
        if torch.is_grad_enabled():  # create_graph: a second order would silently miss this backward's terms
            raise RuntimeError("DKEF's stacked DEQ features are differentiable once (their phantom steps' backward "
                               "is written out, src/models/stacked_features.py): a create_graph backward through "
                               "them is not supported; set the DKEF's stack_kernels = False for it")
        z_star, g, u_t, w1 = ctx.saved_tensors
        n_jet = ctx.n_jet
        _, tape = _forward_steps(z_star, g, u_t, w1, ctx.steps, n_jet, keep=True)
        r, _, w = z_star.shape
        g_bar, w_bar = torch.zeros_like(g), torch.zeros_like(w1)
        u_bar = torch.zeros_like(u_t) if n_jet else None
        a_z = torch.zeros_like(z_star) if a_z is None else a_z
        if n_jet:
            a_j = z_star.new_zeros(r, n_jet, u_t.shape[1], w) if a_j is None else a_j
            a_l = z_star.new_zeros(r, n_jet, w) if a_l is None else a_l
        for z, j, lap, p, pj, pl, s1, q in reversed(tape):
            b_p = s1 * a_z
            if n_jet:
                s1j = s1[:, :n_jet]
                s2 = s1j * (1 - s1j)
                c = s2 * (1 - 2 * s1j) * q if pl is None else torch.addcmul(s2 * pl, s2 * (1 - 2 * s1j), q)
                b_p[:, :n_jet].add_(s2 * (a_j * pj).sum(2)).addcmul_(c, a_l)  # the jet rows' terms (a view of b_p)
                b_j = torch.addcmul(s1j.unsqueeze(2) * a_j, (2 * s2 * a_l).unsqueeze(2), pj)
                b_l = s1j * a_l
                u_bar += b_j.sum(1)
            g_bar += b_p
            w_bar.baddbmm_(b_p.transpose(1, 2), z)
            if n_jet and j is not None:  # the first step's J = 0, L = 0 take no product
                w_bar.baddbmm_(b_j.reshape(r, -1, w).transpose(1, 2), j.reshape(r, -1, w))
                w_bar.baddbmm_(b_l.transpose(1, 2), lap)
                a_j = torch.bmm(b_j.reshape(r, -1, w), w1).reshape(b_j.shape)
                a_l = torch.bmm(b_l, w1)
            if z is not z_star:  # z* is a constant: no product for the first step's input
                a_z = torch.bmm(b_p, w1)
        return None, g_bar, u_bar, w_bar, None, None


def _readout(nets, x, z, j=None, lap=None):
    """u_r = R_r z_r + b_r + S_r x (and J_u = J R_rᵀ + S_rᵀ, L_u = L R_rᵀ when the jet is given: of the first rows,
    as many as it has), batched."""
    r, w = z.shape[0], z.shape[2]
    readout_t = torch.stack([net.readout.weight for net in nets]).transpose(1, 2)  # [R, W, F]
    u = torch.baddbmm(torch.stack([net.readout.bias for net in nets]).unsqueeze(1), z, readout_t)
    skip_t = torch.stack([net.skip.weight for net in nets]).transpose(1, 2) if nets[0].skip is not None else None
    if skip_t is not None:
        u = u + torch.matmul(x, skip_t)
    if j is None:
        return u
    ju = torch.bmm(j.reshape(r, -1, w), readout_t).reshape(*j.shape[:3], -1)
    if skip_t is not None:
        ju = ju + skip_t.unsqueeze(1)
    return u, ju, torch.bmm(lap, readout_t)


def stacked_features(nets, x: torch.Tensor, first_order: bool = False) -> torch.Tensor:
    """u_r = φ_r(x) of every network, ``[R, N, F]``, as ``torch.stack([net(x) for net in nets])`` computes it.

    Differentiable to every order (the phantom steps by autograd, :func:`src.deq.core.equilibrium`), or with
    ``first_order`` once, w.r.t. the parameters only, at the bytes of :class:`_PhantomSteps` (the inducing points'
    features in DKEF's jet route)."""
    _pre_hooks([net.block for net in nets], x)
    blocks, g, u_t, (w1,) = _stacked_params(nets, x)
    r, n, w = g.shape
    cfg = blocks[0].config
    z0 = torch.stack([b.initial_state(x, g) for b in blocks]).reshape(r * n, w)
    if first_order:
        z_star, info = solve_only(stacked_dense_map, z0, (g, w1), cfg, warn=_Warnings(blocks))
        with record_function(PHASE_PHANTOM):
            z = _PhantomSteps.apply(z_star.reshape(r, n, w), g, u_t, w1, cfg.phantom_steps, 0)
    else:
        z, info = equilibrium(stacked_dense_map, z0, (g, w1), cfg, correction=False, warn=_Warnings(blocks))
        z = z.reshape(r, n, w)
    _record(blocks, z, info)
    _post_hooks(blocks, x, z)
    return _readout(nets, x, z)


def stacked_jets(nets, x: torch.Tensor, values_of: torch.Tensor | None = None):
    """(u, J, L) of every network: u ``[R, N, F]``, J ``[R, N, D, F]`` (J[r, n, d, f] = ∂u_r,f/∂x_d), L ``[R, N, F]``
    (Σ_d ∂²u_r/∂x_d²), as :func:`src.models.feature_jets.feature_jet` gives them network by network; differentiable
    once w.r.t. the parameters (as the jet route needs, :class:`_PhantomSteps`).

    ``values_of`` (e.g. DKEF's inducing points, ``[M, D]``): also their features u ``[R, M, F]``, as
    ``stacked_features(nets, values_of, first_order=True)`` gives them, returned second — from the same solve and
    phantom steps (their rows carry no jet), so the step pays one solve, one stacking of the weights (one spectral
    power step) and one reverse sweep instead of two of each; each input keeps its own warm start. The blocks' hooks
    then see the call of ``values_of`` (input and rows) as ``stacked_features`` shows it to them: the DEQ monitor
    keeps it as the block's training input, the profiling callback the solve's record."""
    with record_function(PHASE_JET):
        if values_of is not None:
            _pre_hooks([net.block for net in nets], values_of)
        n = x.shape[0]
        rows = [n] if values_of is None else [n, values_of.shape[0]]
        x_all = x if values_of is None else torch.cat([x, values_of])
        blocks, g, u_t, (w1,) = _stacked_params(nets, x_all)
        r, n_all, w = g.shape
        cfg = blocks[0].config
        z0 = torch.stack([torch.cat([b.initial_state(part, g) for part in x_all.split(rows)]) for b in blocks])
        z_star, info = solve_only(stacked_dense_map, z0.reshape(r * n_all, w), (g, w1), cfg, warn=_Warnings(blocks))
        with record_function(PHASE_JET_STEPS):
            z, j, lap = _PhantomSteps.apply(z_star.reshape(r, n_all, w), g, u_t, w1, cfg.phantom_steps, n)
        _record(blocks, z, info, rows)
        u, ju, lu = _readout(nets, x_all, z, j, lap)
        if values_of is None:
            return u, ju, lu
        _post_hooks(blocks, values_of, z[:, n:])
        return (u[:, :n], ju, lu), u[:, n:]
