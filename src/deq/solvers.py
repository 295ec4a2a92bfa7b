"""Fixed-point solvers for z = f(z), run under ``torch.no_grad()`` (paper Alg. 1, step 1).

- ``picard``: z ← f(z), the paper's choice (App. F); converges linearly at the contraction rate.
- ``anderson``: Anderson acceleration with memory m; the Tikhonov regulariser of the small least-squares
  problem is scaled to the Gram matrix's size (an absolute 1e-4 stalls; docs/deq.md §3).
- ``broyden``: limited-memory "good" Broyden on g(z) = f(z) − z, with a Picard step as fallback.

Stopping: per sample, ‖f(z) − z‖ ≤ tol (``abs``) or ≤ tol·‖f(z)‖ (``rel``), L2 over non-batch dimensions;
the solve stops when every sample meets it or after ``max_iter`` evaluations of f. The defaults of every keyword
(solver, tol, stop_mode, max_iter, anderson_m, anderson_beta, anderson_lam, broyden_memory) are
:class:`src.deq.config.DEQConfig`'s, their one definition.

Trajectory (``keep``): the iterates after the evaluations of f numbered in ``keep`` (1-based), for the fixed-point
correction of Bai et al. (2022) (:func:`src.deq.core.equilibrium`); a solve that stops before one of them
keeps its final iterate there, as TorchDEQ's indexing does. Empty (the default): nothing is kept.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from src.deq.config import DEQConfig as _D  # the defaults' one definition (its fields' default values)


@dataclass
class SolverResult:
    z: torch.Tensor
    iterations: int
    residual: torch.Tensor  # [B] final ‖f(z) − z‖ per sample (absolute, whatever the stop_mode)
    converged: bool
    trajectory: list = field(default_factory=list)  # the iterates at the evaluations numbered in ``keep``


def _residual(fz: torch.Tensor, z: torch.Tensor) -> torch.Tensor:
    return (fz - z).flatten(1).norm(dim=1)


def _done(res: torch.Tensor, fz: torch.Tensor, tol: float, stop_mode: str) -> bool:
    if stop_mode == "rel":
        return bool((res <= tol * fz.flatten(1).norm(dim=1).clamp_min(1e-30)).all())
    return bool((res <= tol).all())


@torch.no_grad()
def picard(f, z0, *, tol=_D.tol, max_iter=_D.max_iter, stop_mode=_D.stop_mode, keep=(), **_) -> SolverResult:
    z = z0
    res = torch.full((z0.shape[0],), float("inf"), device=z0.device, dtype=z0.dtype)
    kept = []
    for it in range(1, max_iter + 1):
        fz = f(z)
        res = _residual(fz, z)
        z = fz
        if keep and it in keep:
            kept.append(fz)
        if _done(res, fz, tol, stop_mode):
            return SolverResult(z, it, res, True, kept)
    return SolverResult(z, max_iter, res, False, kept)


_ANDERSON_GEMM_MIN = 1024  # state entries per sample from which Anderson's history products are batched GEMMs


def _mix(alpha: torch.Tensor, hist: torch.Tensor, small: bool) -> torch.Tensor:
    """Σ_i α_i hist_i per sample: α ``[B, n, 1]``, hist ``[B, n, d]`` -> ``[B, d]``."""
    return (alpha * hist).sum(1) if small else torch.bmm(alpha.transpose(1, 2), hist).squeeze(1)


@torch.no_grad()
def anderson(f, z0, *, tol=_D.tol, max_iter=_D.max_iter, stop_mode=_D.stop_mode, anderson_m=_D.anderson_m,
             anderson_beta=_D.anderson_beta, anderson_lam=_D.anderson_lam, keep=(), **_):
    """Anderson acceleration (type II) with memory m = ``anderson_m``, mixing β = ``anderson_beta`` and the
    Tikhonov regulariser ``anderson_lam`` × the mean diagonal of the residuals' Gram matrix H = G Gᵀ.

    z ← Σ_i α_i (β f(z_i) + (1 − β) z_i), α = H⁻¹1 / 1ᵀH⁻¹1 over the last m iterates. The histories are ring
    buffers ``[B, m, n]`` written in place, and H is updated by one row per iteration (G g_new, one product with the
    history) instead of rebuilt (m products): each iteration costs two products with the history, not m + 2 and
    three stacked copies of it. The order of the history does not change α's combination.
    """
    lam = anderson_lam
    kept = []
    bsz, shape = z0.shape[0], z0.shape
    m = int(anderson_m)
    z = z0.reshape(bsz, -1)
    beta = float(anderson_beta)
    fs = z.new_empty(bsz, m, z.shape[1])  # f(z_k), g_k = f(z_k) − z_k and (β ≠ 1) z_k of the last m iterates
    gs = z.new_empty(bsz, m, z.shape[1])
    xs = z.new_empty(bsz, m, z.shape[1]) if beta != 1.0 else None
    gram = z.new_zeros(bsz, m, m)
    # the two products with the history: batched GEMMs for a large state, elementwise for a small one, where a
    # batched GEMM pays a per-sample call overhead (one thread, [500, 5, 64]: 0.05 against 0.09-0.2 ms; [64, 5,
    # 12544]: 0.6-1.0 against 1.9-2.1 ms; benchmarks/results/solvers_vs_torchdeq.md has the solvers' totals)
    small = z.shape[1] < _ANDERSON_GEMM_MIN
    res = torch.full((bsz,), float("inf"), device=z0.device, dtype=z0.dtype)
    for it in range(1, max_iter + 1):
        fz = f(z.reshape(shape)).reshape(bsz, -1)
        g = fz - z
        res = g.norm(dim=1)
        if keep and it in keep:
            kept.append(fz.reshape(shape))
        if _done(res, fz, tol, stop_mode):
            return SolverResult(fz.reshape(shape), it, res, True, kept)
        slot, n = (it - 1) % m, min(it, m)
        fs[:, slot] = fz
        gs[:, slot] = g
        if xs is not None:
            xs[:, slot] = z
        # [B, n]: the new residual against the history; a large state's as gᵀ Gᵀ (several times faster on a CPU
        # than G g, which takes a slow matrix-vector path)
        row = ((gs[:, :n] * g[:, None]).sum(-1) if small
               else torch.bmm(g.unsqueeze(1), gs[:, :n].transpose(1, 2)).squeeze(1))
        gram[:, slot, :n] = row
        gram[:, :n, slot] = row
        if n == 1:
            z = fz
            continue
        H = gram[:, :n, :n]
        reg = lam * H.diagonal(dim1=1, dim2=2).mean(-1).clamp_min(1e-30)  # relative to the Gram matrix's scale
        H = H + reg[:, None, None] * torch.eye(n, dtype=z.dtype, device=z.device)
        try:
            w = torch.linalg.solve(H, torch.ones(bsz, n, 1, dtype=z.dtype, device=z.device))
        except RuntimeError:
            z = fz
            continue
        alpha = w / w.sum(1, keepdim=True)  # [B, n, 1], sums to 1
        z = _mix(alpha, fs[:, :n], small)
        if xs is not None:
            z = beta * z + (1 - beta) * _mix(alpha, xs[:, :n], small)
    fz = f(z.reshape(shape))
    res = _residual(fz, z.reshape(shape))
    return SolverResult(fz, max_iter, res, _done(res, fz, tol, stop_mode), kept)


@torch.no_grad()
def broyden(f, z0, *, tol=_D.tol, max_iter=_D.max_iter, stop_mode=_D.stop_mode, broyden_memory=_D.broyden_memory,
            keep=(), **_) -> SolverResult:
    """Limited-memory Broyden ("good" update) on g(z) = f(z) − z, inverse Jacobian B ≈ −I + Σ u vᵀ.

    Keeps the last ``broyden_memory`` pairs (u, v): 2·memory extra copies of the state (mind large conv states).
    """
    memory = int(broyden_memory)
    kept = []
    bsz, shape = z0.shape[0], z0.shape
    z = z0.reshape(bsz, -1)

    def g(zf):
        fz = f(zf.reshape(shape)).reshape(bsz, -1)
        return fz - zf, fz

    gz, fz = g(z)
    us, vs = [], []

    def apply_b(x):  # B x with B = -I + Σ u_k v_kᵀ (per sample)
        out = -x
        for u, v in zip(us, vs):
            out = out + u * (v * x).sum(-1, keepdim=True)
        return out

    def apply_bt(x):  # Bᵀ x
        out = -x
        for u, v in zip(us, vs):
            out = out + v * (u * x).sum(-1, keepdim=True)
        return out

    res = gz.norm(dim=1)
    for it in range(1, max_iter + 1):
        if keep and it in keep:
            kept.append(fz.reshape(shape))
        if _done(res, fz, tol, stop_mode):
            return SolverResult(fz.reshape(shape), it, res, True, kept)
        dz = -apply_b(gz)  # Newton-like step  z_new = z - B g
        z_new = z + dz
        g_new, f_new = g(z_new)
        dg = g_new - gz
        # good Broyden: B_new = B + (dz - B dg)(dzᵀ B) / (dzᵀ B dg)
        b_dg = apply_b(dg)
        bt_dz = apply_bt(dz)
        denom = (dz * b_dg).sum(-1, keepdim=True)
        ok = denom.abs() > 1e-30
        u = torch.where(ok, (dz - b_dg) / torch.where(ok, denom, torch.ones_like(denom)), torch.zeros_like(dz))
        us.append(u)
        vs.append(bt_dz)
        if len(us) > memory:
            us.pop(0)
            vs.pop(0)
        z, gz, fz = z_new, g_new, f_new
        res = gz.norm(dim=1)
    return SolverResult(fz.reshape(shape), max_iter, res, _done(res, fz, tol, stop_mode), kept)


SOLVER_FUNCTIONS = {"picard": picard, "anderson": anderson, "broyden": broyden}


def solve(f, z0, *, method=_D.solver, tol=_D.tol, max_iter=_D.max_iter, stop_mode=_D.stop_mode,
          anderson_m=_D.anderson_m, anderson_beta=_D.anderson_beta, anderson_lam=_D.anderson_lam,
          broyden_memory=_D.broyden_memory, keep=()):
    """Solve z = f(z) from z0 with the named method (always under ``no_grad``). ``keep``: 1-based evaluation
    numbers whose iterates come back in ``SolverResult.trajectory`` (one per entry; the final iterate stands for
    those the solve did not reach)."""
    try:
        fn = SOLVER_FUNCTIONS[method]
    except KeyError:
        raise ValueError(f"unknown solver {method!r}; valid: {', '.join(SOLVER_FUNCTIONS)}") from None
    result = fn(f, z0, tol=tol, max_iter=max_iter, stop_mode=stop_mode, anderson_m=anderson_m,
                anderson_beta=anderson_beta, anderson_lam=anderson_lam, broyden_memory=broyden_memory, keep=keep)
    if keep:
        result.trajectory = result.trajectory + [result.z] * (len(keep) - len(result.trajectory))
    return result
