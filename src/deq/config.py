"""Configuration of a DEQ block: solver, tolerances, backward mode (paper §3.2–3.4, Alg. 1)."""

from __future__ import annotations

from dataclasses import asdict, dataclass

SOLVERS = ("picard", "anderson", "broyden")
BACKWARDS = ("phantom", "implicit")
STOP_MODES = ("abs", "rel")
NORMS = ("frobenius", "spectral", "none")  # none: the weights as they are (hand-built maps)
INJECTIONS = ("linear", "softplus")  # deq.injection; null: the model family's (src.config.deq.DEPTH_RULES)
BLOCKS = (None, "normalized_residual")  # None: the family's block
PAPER_NORM, PAPER_NORM_LAMBDA = "frobenius", 2.0  # §3.2: W / (λ‖W‖_F), λ = 2 — what an unset deq.norm means


@dataclass
class DEQConfig:
    """The ``deq`` keys of a DEQ block, checked on construction (one-line ``ValueError``s). Its field defaults are
    the one definition of the DEQ defaults: :func:`src.deq.solvers.solve` takes its keyword defaults from them and
    ``conf/shared/deq_solver.yaml`` writes the same values out (a test compares them)."""

    solver: str = "picard"
    # Stop rule: per sample ‖f(z) − z‖ ≤ tol·‖f(z)‖ (rel). A float32 CIFAR-sized state [B, 128, 32, 32] reaches
    # a relative residual of ~5e-8 and ‖z‖ ~ 300, so the former absolute 1e-5 was at its rounding floor and ran
    # to max_iter; rel 1e-4 is three decades above that floor (benchmarks/results/deq_recurrence.md).
    tol: float = 1e-4
    stop_mode: str = "rel"
    max_iter: int = 128
    phantom_steps: int = 2
    warm_start: bool = True
    # Weight normalisation of the map (§3.2): None = the paper's, Frobenius with λ = 2, for the weight-normalised
    # blocks; deq.block=normalized_residual has its own (w = 2‖K₁‖_F‖K₂‖_F) and refuses either key, so that an
    # override meant for another block is never silently ignored (resolved in __post_init__).
    norm_lambda: float | None = None
    norm: str | None = None
    backward: str = "phantom"
    anderson_m: int = 5
    anderson_beta: float = 1.0
    # The model's input injection g (src/models/deq_net.py builds it; the block only receives the module):
    # linear | softplus, None = the model family's default. Kept here so the whole `deq` group maps onto this.
    injection: str | None = None
    # The one-pass control: z* replaced by φ(0; p), one explicit pass of the same map from z = 0 with plain
    # autograd through it (no solve, no warm start, no phantom steps): the same network with the recurrence
    # removed, trained as an explicit net (src.deq.diagnostics.recurrence_share measures what it removes).
    one_pass: bool = False
    # The DEQ block of an image family: None = the family's (NCSN: the Lipschitz-bounded DEQ-ResBlock of App. D.4,
    # normalized by deq.norm); normalized_residual = the paper authors' code's block, (z + ResBlock(z))/w + x
    # with norms inside and w = 2‖K₁‖_F‖K₂‖_F (src.deq.block.NormalizedResidualDEQBlock).
    block: str | None = None
    # The implicit backward's exact orders: derivative orders through the DEQ whose adjoint fixed points are solved
    # (None: every order); the adjoints of higher orders are phantom_steps-term Neumann series (src.deq.implicit).
    # 1 with SSM-VR: the loss's input derivative exact, its parameter gradient truncated (no second-level solve).
    exact_orders: int | None = None
    # Jacobian regularisation (Bai, Koltun & Kolter 2021, "Stabilizing Equilibrium Models by Jacobian
    # Regularization"): γ·‖εᵀ ∂f/∂z‖²/n at the fixed point (ε ~ N(0, I), n = ε's entries; a Hutchinson estimate of
    # ‖J_f‖_F² per state entry) added to the training loss, on the first ``jacobian_penalty_rows`` samples of the
    # batch (0: all). 0 = off. Meant to keep f contracting where the backward alone does not (the phantom K = 1
    # backward ignores the recurrence in the derivatives); on the NCSN's normalised block with K = 1 it did not
    # (γ = 1, 100: solves at the cap within 90 steps, benchmarks/results/ncsn_deq_cost.md).
    jacobian_penalty: float = 0.0
    jacobian_penalty_rows: int = 8

    def __post_init__(self):
        if self.solver not in SOLVERS:
            raise ValueError(f"deq.solver={self.solver!r} is unknown; valid: {', '.join(SOLVERS)}")
        if self.backward not in BACKWARDS:
            raise ValueError(f"deq.backward={self.backward!r} is unknown; valid: {', '.join(BACKWARDS)}")
        if self.stop_mode not in STOP_MODES:
            raise ValueError(f"deq.stop_mode={self.stop_mode!r} is unknown; valid: {', '.join(STOP_MODES)}")
        if self.block == "normalized_residual":
            given = [f"deq.{k}={getattr(self, k)}" for k in ("norm", "norm_lambda") if getattr(self, k) is not None]
            if given:
                raise ValueError(
                    f"{' '.join(given)} does not apply to deq.block=normalized_residual (it divides its ResBlock by "
                    "w = 2||K1||_F ||K2||_F): drop it, or add deq.block=null for the weight-normalised block it sets")
        else:
            self.norm = PAPER_NORM if self.norm is None else self.norm
            self.norm_lambda = PAPER_NORM_LAMBDA if self.norm_lambda is None else self.norm_lambda
        if self.norm is not None and self.norm not in NORMS:
            raise ValueError(f"deq.norm={self.norm!r} is unknown; valid: {', '.join(NORMS)}")
        if self.injection is not None and self.injection not in INJECTIONS:
            raise ValueError(f"deq.injection={self.injection!r} is unknown; valid: linear, softplus "
                             "(or null for the model family's default)")
        if self.block not in BLOCKS:
            raise ValueError(f"deq.block={self.block!r} is unknown; valid: normalized_residual (or null for the "
                             "model family's block)")
        if self.norm_lambda is not None and float(self.norm_lambda) <= 1.0:
            raise ValueError(
                f"deq.norm_lambda={self.norm_lambda} is invalid: it must be > 1 so that the DEQ map is a "
                "contraction (paper §3.2: W <- W / (lambda ||W||_F))"
            )
        if int(self.max_iter) < 1:
            raise ValueError(f"deq.max_iter must be >= 1, got {self.max_iter}")
        if int(self.phantom_steps) < 1:
            raise ValueError(f"deq.phantom_steps must be >= 1 (K of Alg. 1), got {self.phantom_steps}")
        if float(self.tol) < 0:
            raise ValueError(f"deq.tol must be >= 0, got {self.tol}")
        if self.exact_orders is not None:
            if int(self.exact_orders) < 0:
                raise ValueError(f"deq.exact_orders must be >= 0 (or null: every order exact), got {self.exact_orders}")
            if self.backward != "implicit":
                raise ValueError(f"deq.exact_orders={self.exact_orders} applies to deq.backward=implicit (the phantom "
                                 "backward solves no adjoint): add deq.backward=implicit or drop deq.exact_orders")
        if float(self.jacobian_penalty) < 0:
            raise ValueError(f"deq.jacobian_penalty must be >= 0 (0: off), got {self.jacobian_penalty}")
        if int(self.jacobian_penalty_rows) < 0:
            raise ValueError(f"deq.jacobian_penalty_rows must be >= 0 (0: the whole batch), got "
                             f"{self.jacobian_penalty_rows}")
        if float(self.jacobian_penalty) > 0 and self.one_pass:
            raise ValueError("deq.jacobian_penalty does not apply with deq.one_pass=true (no fixed point, no "
                             "recurrence to keep contracting): drop one of them")
        if int(self.anderson_m) < 1:
            raise ValueError(f"deq.anderson_m must be >= 1, got {self.anderson_m}")

    def to_dict(self) -> dict:
        return asdict(self)
