"""How much a DEQ block's recurrence contributes to its fixed point (paper eq. 5, §3.2).

A DEQ block computes z* = φ(z*; p). The same block with the recurrence removed — one explicit pass from
z = 0 — computes φ(0; p). When the map is so contractive that z* ≈ φ(0; p), the "DEQ" is a shallow explicit
network with extra solver cost, and a comparison of it with an explicit network says nothing about the
recurrence. :func:`recurrence_share` measures that per block:

- ``share`` = ‖z* − φ(0; p)‖ / ‖z*‖ per sample (mean and max over the samples);
- for maps with an additive injection, φ(z; p) = h(z) + g(x) (``additive_injection`` on the map, e.g. the
  NCSN's residual maps), ``branch`` = ‖h(z*)‖ / ‖g(x)‖ = ‖z* − g(x)‖ / ‖g(x)‖, the nonlinear branch against the
  input injection;
- the contraction rate ‖∂φ/∂z‖₂ at z* (:meth:`src.deq.block.DEQBlock.contraction_rate`), the solver's
  iterations and whether it stopped at ``deq.max_iter`` without meeting ``deq.tol``.

Why ``NEAR_INERT_SHARE = 0.10``: for a map contracting at rate ρ from z = 0, ‖z* − φ(0)‖ ≤ ρ/(1 − ρ)·‖φ(0) − 0‖,
so a share below 10 % means the recurrence adds less than one tenth of the state — the size of what one more
explicit layer of a weight-decayed network changes — and a block that is replaced by its one-pass control
(``deq.one_pass=true``) changes the features by less than that. The issue that introduced this measure found
0.08–6.5 % in every family's trained DEQ at λ = 2 (Frobenius), i.e. below it everywhere.
"""

from __future__ import annotations

import torch

from src.deq.solvers import solve

NEAR_INERT_SHARE = 0.10  # recurrence share below which a block is reported as near-inert (see module docstring)


def _per_sample_norm(t: torch.Tensor) -> torch.Tensor:
    return t.flatten(1).norm(dim=1)


@torch.no_grad()
def recurrence_share(block, x: torch.Tensor, *cond, rate: bool = True) -> dict[str, float]:
    """The recurrence share of ``block`` (a :class:`src.deq.block.DEQBlock`) at inputs ``x`` (and ``cond``):

    ``{"share_mean", "share_max", "iterations", "hit_cap", "residual_rel"}``, plus ``"branch_mean"`` /
    ``"branch_max"`` for maps with an additive injection and ``"contraction_rate"`` when ``rate``.
    The solve starts at z = 0 (no warm start; the block's warm-start cache is left as it is) with the block's
    solver and stop rule; ``hit_cap`` is 1.0 when it ran to ``deq.max_iter`` without meeting the stop rule.
    For a ``deq.one_pass`` block the share is 0 by definition (it has no recurrence). Pure: the block's
    parameters, buffers (spectral-norm vectors) and statistics are not changed.
    """
    params = tuple(p.detach() for p in block.map_params(x, *cond))
    phi = block.phi
    zero = torch.zeros(block.state_shape(x), device=params[0].device, dtype=params[0].dtype)
    one_pass = phi(zero, *params)
    if getattr(block.config, "one_pass", False):
        out = {"share_mean": 0.0, "share_max": 0.0, "iterations": 1.0, "hit_cap": 0.0, "residual_rel": 0.0,
               "one_pass": 1.0}
        z_star = one_pass
    else:
        result = solve(lambda u: phi(u, *params), zero, **block.config.solver_kwargs())
        z_star = result.z
        tiny = torch.finfo(z_star.dtype).tiny
        share = _per_sample_norm(z_star - one_pass) / _per_sample_norm(z_star).clamp_min(tiny)
        rel = result.residual / _per_sample_norm(z_star).clamp_min(tiny)
        out = {"share_mean": float(share.mean()), "share_max": float(share.max()),
               "iterations": float(result.iterations), "hit_cap": float(not result.converged),
               "residual_rel": float(rel.max())}
    if getattr(phi, "additive_injection", False):
        inj = params[0]
        tiny = torch.finfo(inj.dtype).tiny
        branch = _per_sample_norm(phi(z_star, *params) - inj) / _per_sample_norm(inj).clamp_min(tiny)
        out["branch_mean"], out["branch_max"] = float(branch.mean()), float(branch.max())
    if rate:
        out["contraction_rate"] = float(block.contraction_rate(x, *cond)) if not getattr(
            block.config, "one_pass", False) else 0.0
    return out


def near_inert(stats: dict[str, float], threshold: float = NEAR_INERT_SHARE) -> bool:
    """Whether :func:`recurrence_share`'s ``stats`` say the recurrence is near-inert (mean share < threshold);
    a one-pass block (no recurrence by construction) is not reported."""
    return not stats.get("one_pass") and stats["share_mean"] < threshold
