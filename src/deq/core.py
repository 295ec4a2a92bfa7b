"""The public, differentiable equilibrium of any map: ``z, info = equilibrium(f, z0, params, config)``.

z* = f(z*, *params) (paper eq. 5) is solved under ``no_grad`` from the caller's ``z0`` (warm start as explicit
state, §3.4: the caller keeps ``z.detach()`` and passes it back next time), then made differentiable w.r.t.
``params`` by ``config.backward``:

- ``phantom`` (Alg. 1, Prop. 2): K = ``config.phantom_steps`` iterations of f with autograd from the detached z*,
  differentiable to every order by plain autograd; error ~ ρ(J)^K;
- ``implicit`` (Prop. 1, eqs. 8–9): the exact implicit derivatives of every order,
  :func:`src.deq.implicit.fixed_point` (adjoint solves set by ``config.backward_*``);

and with ``config.one_pass`` the one-pass control z = f(0, *params). ``f`` is any callable f(z, *params) of tensors
(an ``nn.Module``'s forward, a function from :mod:`src.deq.maps`): tensors the map reads that are not in ``params``
are constants to the implicit backward (they get no gradient), so pass every tensor that needs one in ``params``.

The info record (:class:`EquilibriumInfo`) carries the forward solve's statistics, the adjoint solves' (filled in
while the implicit backward runs), the Jacobian penalty when asked for, and — with ``config.correction_states`` =
n > 0 and gradients on — the fixed-point correction states of Bai et al. (2022, §3.3; TorchDEQ's ``n_states``):
the solver's iterates at evaluations ⌈max_iter·i/n⌉, i = 1..n, each followed by the K phantom steps from its
detached value, the last one ``z`` itself; a loss Σ_i γ^(n−i) ℓ(states[i]) (:func:`correction_weights`) trains
the map to reach its fixed point along the way, not only at the end.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
from torch.profiler import record_function

from src.deq.config import DEQConfig
from src.deq.implicit import PHASE_SOLVE, fixed_point
from src.deq.solvers import SolverResult, solve

__all__ = ["PHASE_PHANTOM", "EquilibriumInfo", "NonConvergenceWarning", "correction_weights", "equilibrium",
           "jacobian_penalty", "solve_only"]

PHASE_PHANTOM = "deq.phantom_steps"  # profiler label of the K phantom steps (forward; their graph is backpropagated
# by whoever differentiates the output: the objective's trace / projection pass or the loss's backward)


@dataclass
class EquilibriumInfo:
    """What one :func:`equilibrium` call did.

    ``iterations``, ``residual`` (max over samples of the absolute ‖f(z) − z‖), ``converged``, ``hit_cap`` (ran
    to ``max_iter`` unconverged): the forward solve. ``backward``: the implicit backward's adjoint solves since
    this call, ``{"solves", "iterations" (max), "residual" (max), "converged", "hit_cap"}`` — empty until a
    backward runs (and always with the phantom backward). ``z_star``: the solver's fixed point (detached).
    ``jacobian_penalty``: ‖εᵀ ∂f/∂z(z*)‖²/n (unscaled, differentiable w.r.t. the map's parameters) when asked for.
    ``states``: the fixed-point correction states (None when off), last = the output. A record that holds the
    penalty or the states holds their graphs too (a block keeps its last record until its next forward).
    ``sample_residual``: the forward solve's final ‖f(z) − z‖ per sample ``[B]`` (detached; ``residual`` is its
    max), so a caller that solves several blocks' rows in one state can report each block's own.
    """

    iterations: int = 0
    residual: float = 0.0
    converged: bool = True
    hit_cap: bool = False
    backward: dict = field(default_factory=dict)
    z_star: torch.Tensor | None = None
    jacobian_penalty: torch.Tensor | None = None
    states: list | None = None
    sample_residual: torch.Tensor | None = None

    def stats(self) -> dict:
        """The forward solve's statistics as a dict (iterations, residual, converged, hit_cap)."""
        return {"iterations": self.iterations, "residual": self.residual, "converged": self.converged,
                "hit_cap": self.hit_cap}


class NonConvergenceWarning:
    """Throttled ``RuntimeWarning`` of unconverged solves (the 1st, 2nd, 4th, 8th, … occurrence): one per caller
    that solves repeatedly (a DEQ block keeps one), so a long run is informed, not flooded."""

    def __init__(self, name: str = "deq"):
        self.name = name
        self.count = 0

    def __call__(self, level: int, stats: dict, config: DEQConfig) -> None:
        self.count += 1
        n = self.count
        if n & (n - 1):
            return
        what = "forward solve" if level == 0 else f"adjoint solve (backward, order {level})"
        tol = config.tol if level == 0 or config.backward_tol is None else config.backward_tol
        warnings.warn(
            f"DEQ block '{self.name}': {what} did not converge: residual {stats['residual']:.3e} > tol {tol:g} "
            f"({config.stop_mode}) after {stats['iterations']} iterations (occurrence {n}). Raise deq.max_iter, "
            "raise deq.norm_lambda (a stronger contraction), or change deq.solver (anderson helps when the "
            "contraction is slow).",
            RuntimeWarning,
            stacklevel=4,
        )


def _stats(result: SolverResult, max_iter: int) -> dict:
    return {"iterations": int(result.iterations),
            "residual": float(result.residual.max()) if result.residual.numel() else 0.0,
            "converged": bool(result.converged),
            "hit_cap": bool(not result.converged and int(result.iterations) >= int(max_iter))}


def _reporter(info: EquilibriumInfo, config: DEQConfig, warn: Callable | None) -> Callable[[int, SolverResult], None]:
    """(level, result) ↦ info updated: level 0 the forward solve, level ≥ 1 the adjoint solves (accumulated)."""
    def report(level: int, result: SolverResult) -> None:
        cap = config.max_iter if level == 0 or config.backward_max_iter is None else config.backward_max_iter
        stats = _stats(result, cap)
        if level == 0:
            info.iterations, info.residual = stats["iterations"], stats["residual"]
            info.converged, info.hit_cap = stats["converged"], stats["hit_cap"]
            info.z_star = result.z.detach()  # never a graph in the record (the implicit output is attached)
            info.sample_residual = result.residual.detach()
            info.states = result.trajectory or None  # the detached iterates; made differentiable by the caller
        else:
            b = info.backward
            b["solves"] = b.get("solves", 0) + 1
            b["iterations"] = max(b.get("iterations", 0), stats["iterations"])
            b["residual"] = max(b.get("residual", 0.0), stats["residual"])
            b["converged"] = b.get("converged", True) and stats["converged"]
            b["hit_cap"] = b.get("hit_cap", False) or stats["hit_cap"]
        if not stats["converged"] and warn is not None:
            warn(level, stats, config)

    return report


def _keep(config: DEQConfig) -> tuple[int, ...]:
    """TorchDEQ's indexing: evaluations ⌈max_iter·i/n⌉, i = 1..n (n = ``correction_states``)."""
    n, cap = int(config.correction_states), int(config.max_iter)
    return tuple(-(-cap * i // n) for i in range(1, n + 1))


def solve_only(f: Callable, z0: torch.Tensor, params: tuple = (), config: DEQConfig | None = None, *,
               warn: Callable | None = None, keep: tuple = ()) -> tuple[torch.Tensor, EquilibriumInfo]:
    """The forward solve alone, (z* detached, info): under ``no_grad`` with the detached parameters, in the
    ``deq.solve`` profiler span; for a caller that builds its own differentiable steps from z* (the DKEF jets)."""
    config = config if config is not None else DEQConfig()
    info = EquilibriumInfo()
    detached = tuple(p.detach() if torch.is_tensor(p) else p for p in params)
    with record_function(PHASE_SOLVE):
        result = solve(lambda u: f(u, *detached), z0.detach(), **config.solver_kwargs(), keep=keep)
    _reporter(info, config, warn)(0, result)
    return result.z.detach(), info


def _phantom(f: Callable, z: torch.Tensor, params: tuple, steps: int) -> torch.Tensor:
    for _ in range(int(steps)):
        z = f(z, *params)
    return z


def equilibrium(f: Callable, z0: torch.Tensor, params: tuple = (), config: DEQConfig | None = None, *,
                penalty: bool = False, correction: bool = True,
                warn: Callable | None = None) -> tuple[torch.Tensor, EquilibriumInfo]:
    """z* = f(z*, *params) from ``z0``, differentiable w.r.t. ``params`` by ``config.backward`` (module docstring).

    ``config``: a :class:`DEQConfig` (solver, stop rule, backward mode, adjoint settings; default DEQConfig()).
    ``penalty``: also return the Jacobian penalty at z* (:func:`jacobian_penalty`) in ``info.jacobian_penalty``.
    ``correction``: return the fixed-point correction states when ``config.correction_states`` > 0 and
    gradients are on (a block passes its training flag). ``warn(level, stats, config)``: called on every
    unconverged solve (:class:`NonConvergenceWarning`; None: silent). Returns ``(z, info)``.
    """
    config = config if config is not None else DEQConfig()
    info = EquilibriumInfo()
    if config.one_pass:  # the one-pass control: f(0, p), plain autograd, exactly an explicit network
        z = f(torch.zeros_like(z0), *params)
        info.iterations = 1
        return z, info
    report = _reporter(info, config, warn)
    want_states = correction and int(config.correction_states) > 0 and torch.is_grad_enabled()
    keep = _keep(config) if want_states else ()
    if config.backward == "implicit":
        solver = config.solver_kwargs()
        if keep:
            solver = {**solver, "keep": keep}
        z = fixed_point(f, z0, params, solver, report, config.exact_orders, config.phantom_steps,
                        adjoint_solver=config.solver_kwargs(adjoint=True))
    else:  # phantom gradient, Alg. 1
        detached = tuple(p.detach() if torch.is_tensor(p) else p for p in params)
        with record_function(PHASE_SOLVE):
            result = solve(lambda u: f(u, *detached), z0.detach(), **config.solver_kwargs(), keep=keep)
        report(0, result)
        with record_function(PHASE_PHANTOM):
            z = _phantom(f, result.z.detach(), params, config.phantom_steps)
    if want_states:
        with record_function(PHASE_PHANTOM):
            info.states = [_phantom(f, s.detach(), params, config.phantom_steps) for s in info.states[:-1]] + [z]
    else:
        info.states = None
    if penalty:
        info.jacobian_penalty = jacobian_penalty(f, info.z_star, params)
    return z, info


def jacobian_penalty(f: Callable, z_star: torch.Tensor, params: tuple,
                     eps: torch.Tensor | None = None) -> torch.Tensor:
    """The Jacobian regulariser of Bai, Koltun & Kolter (2021, eq. 6 there): ‖εᵀ ∂f/∂z(z*)‖² / n, ε ~ N(0, I)
    (or the given probe ``eps``) and n its number of entries — an unbiased estimate of ‖J_f(z*)‖_F² per state
    entry — differentiable w.r.t. ``params`` (z* itself held fixed, as in the reference implementation)."""
    with torch.enable_grad():
        zs = z_star.detach().requires_grad_(True)
        fz = f(zs, *params)
        probe = torch.randn_like(fz) if eps is None else eps
        (vjp,) = torch.autograd.grad(fz, zs, probe, create_graph=True)
    return vjp.pow(2).sum() / probe.numel()


def correction_weights(n: int, gamma: float) -> list[float]:
    """The fixed-point correction's loss weights γ^(n−i), i = 1..n (Bai et al. 2022, §3.3: the last state, the
    output, weighs 1)."""
    return [float(gamma) ** (int(n) - i) for i in range(1, int(n) + 1)]
