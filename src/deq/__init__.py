"""The shared DEQ block: solvers, phantom and implicit backward, Frobenius normalization (pure torch).

The public core: :func:`equilibrium` — z* of any map f(z, *params) with its phantom or exact implicit backward and an
info record (:mod:`src.deq.core`); every block is built on it. Paper map: eq. 5 → :mod:`src.deq.maps`; §3.2 → :mod:`src.deq.normalization`; Alg. 1 (phantom gradient,
Prop. 2) and warm start (§3.4) → :mod:`src.deq.block`; Prop. 1 / eqs. 8–9 (exact implicit derivatives of every
order) → :mod:`src.deq.implicit`; the multi-resolution equilibrium (MDEQ) → :mod:`src.deq.multiscale`; fixed-point solvers (App. B, F) → :mod:`src.deq.solvers`. The ``deq`` setting
(:class:`DEQConfig`, its one parse and every family's depth rule) → :mod:`src.deq.config`.
"""

from src.deq.block import (
    ConditionalResidualDEQBlock,
    ConvDEQBlock,
    DenseDEQBlock,
    DEQBlock,
    NormalizedResidualDEQBlock,
    ResidualDEQBlock,
)
from src.deq.config import DEQConfig
from src.deq.core import EquilibriumInfo, correction_weights, equilibrium
from src.deq.multiscale import MultiscaleDEQBlock
from src.deq.normalization import frobenius_normalize, make_norm, register_norm
from src.deq.solvers import SolverResult, solve

__all__ = [
           "ConditionalResidualDEQBlock",
           "ConvDEQBlock",
           "DEQBlock",
           "DEQConfig",
           "DenseDEQBlock",
           "EquilibriumInfo",
           "MultiscaleDEQBlock",
           "NormalizedResidualDEQBlock",
           "ResidualDEQBlock",
           "SolverResult",
           "correction_weights",
           "equilibrium",
           "frobenius_normalize",
           "make_norm",
           "register_norm",
           "solve",
]
