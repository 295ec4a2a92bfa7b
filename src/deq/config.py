"""The ``deq`` setting's one home: the typed setting of a DEQ block, its one parse, every family's depth rule.

:class:`DEQConfig` holds a DEQ block's keys — solver, tolerances, backward mode, normalisation (paper §3.2–3.4,
Alg. 1) — checked on construction; its field defaults are the one definition of the DEQ defaults.

``deq=true`` / ``deq=false`` pick the config group ``conf/deq/{true,false}.yaml``: one mapping with ``enabled`` and
the keys of :class:`DEQConfig`. :func:`deq_setting` turns it into the one typed value every network takes — a
:class:`DEQConfig` (a DEQ block, eq. 5) or ``None`` (explicit layers) — and is the only reader of ``enabled``. It is
called once per run, where the LightningModule is built (:class:`src.lit.base.DeqsmModule`, which keeps the plain
mapping as a hyper-parameter so that a checkpoint stays weights-only loadable), and refuses there, in one line naming
the keys, every combination the family cannot run (a block of another family, the one-pass control without a DEQ,
``loss=cp`` with the implicit backward). The networks receive the typed value and parse nothing.

:data:`DEPTH_RULES` holds what ``depth: null`` means and which depths are valid, per family: the explicit default
(DKEF: the reference Φ_w's 3 dense layers; NICE: the reference coupling MLP's 5; the VAE score estimator: 0 extra
layers, the SSM VAE; NCSN: 1 plain ResBlock standing for the DEQ-ResBlock), and the DEQ default (1 layer inside f,
the paper's) — fixed at 1 where the family's DEQ block has exactly one layer (VAE, NCSN). :func:`resolve_depth`
applies it; :func:`resolve_injection` resolves ``deq.injection: null``.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import asdict, dataclass
from typing import Any

SOLVERS = ("picard", "anderson", "broyden")
BACKWARDS = ("phantom", "implicit")
STOP_MODES = ("abs", "rel")
INJECTIONS = ("linear", "softplus")  # deq.injection; null: the model family's (DEPTH_RULES below)
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
    # The stop rule of the implicit backward's adjoint solves (v = ū + Jᵀv and the higher levels; the same
    # stop_mode), None = tol. torchdeq's b_tol: the adjoint is a linear fixed point whose error enters the
    # gradient once, not the state every later layer reads, so a looser rule may buy time at a bounded bias.
    # A solver key like anderson_m: the phantom backward solves no adjoint and does not read it.
    backward_tol: float | None = None
    max_iter: int = 128
    # The rest of the adjoint solves' settings, symmetric to the forward's (torchdeq's b_solver, b_max_iter,
    # b_stop_mode); None = the forward's (solver, max_iter, stop_mode). Read by the implicit backward only.
    backward_solver: str | None = None
    backward_max_iter: int | None = None
    backward_stop_mode: str | None = None
    # Anderson's Tikhonov regulariser, relative to the mean diagonal of the residuals' Gram matrix (an absolute
    # 1e-4 stalls: docs/deq.md §3), and Broyden's memory (pairs kept: 2 x memory copies of the state).
    anderson_lam: float = 1e-8
    broyden_memory: int = 30
    # Fixed-point correction (Bai et al. 2022, "Deep Equilibrium Optical Flow Estimation", §3.3; torchdeq's
    # n_states): > 0 makes a training forward return this many differentiable states taken along the solve's
    # trajectory at evaluations max_iter·i/n (i = 1..n; a solve that stops earlier gives its final iterate there),
    # each the phantom steps (Alg. 1) applied from the detached iterate, the last one the block's output; the loss
    # weights them by correction_gamma^(n − i) (src.deq.core.correction_weights). 0 = off.
    correction_states: int = 0
    correction_gamma: float = 0.8
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
        if self.backward_solver is not None and self.backward_solver not in SOLVERS:
            raise ValueError(f"deq.backward_solver={self.backward_solver!r} is unknown; valid: {', '.join(SOLVERS)} "
                             "(or null: deq.solver)")
        if self.backward_stop_mode is not None and self.backward_stop_mode not in STOP_MODES:
            raise ValueError(f"deq.backward_stop_mode={self.backward_stop_mode!r} is unknown; valid: "
                             f"{', '.join(STOP_MODES)} (or null: deq.stop_mode)")
        if self.backward_max_iter is not None and int(self.backward_max_iter) < 1:
            raise ValueError(f"deq.backward_max_iter must be >= 1 (or null: deq.max_iter), got {self.backward_max_iter}")
        if not 0 <= float(self.anderson_lam) < 1:
            raise ValueError(f"deq.anderson_lam must be in [0, 1) (relative to the Gram matrix's mean diagonal), got "
                             f"{self.anderson_lam}")
        if int(self.broyden_memory) < 1:
            raise ValueError(f"deq.broyden_memory must be >= 1 (pairs of the inverse-Jacobian update kept), got "
                             f"{self.broyden_memory}")
        if int(self.correction_states) < 0 or int(self.correction_states) > int(self.max_iter):
            raise ValueError(f"deq.correction_states must be in [0, deq.max_iter={self.max_iter}] (0: off; states "
                             f"are taken every max_iter/n evaluations), got {self.correction_states}")
        if not 0 < float(self.correction_gamma) <= 1:
            raise ValueError(f"deq.correction_gamma must be in (0, 1] (the loss weight gamma^(n - i) of state i), got "
                             f"{self.correction_gamma}")
        if int(self.correction_states) > 0 and self.one_pass:
            raise ValueError("deq.correction_states does not apply with deq.one_pass=true (no solve, no trajectory): "
                             "drop one of them")
        # the weight-norm keys the user set (before the defaults fill them): a block with no weight norm refuses them
        self.norm_given = tuple(f"deq.{k}={getattr(self, k)}" for k in ("norm", "norm_lambda")
                                if getattr(self, k) is not None)
        if self.block == "normalized_residual":
            given = self.norm_given
            if given:
                raise ValueError(
                    f"{' '.join(given)} does not apply to deq.block=normalized_residual (it divides its ResBlock by "
                    "w = 2||K1||_F ||K2||_F): drop it, or add deq.block=null for the weight-normalised block it sets")
        else:
            self.norm = PAPER_NORM if self.norm is None else self.norm
            self.norm_lambda = PAPER_NORM_LAMBDA if self.norm_lambda is None else self.norm_lambda
        if self.norm is not None:
            from src.deq.normalization import norm_names  # the registry of normalisations (pluggable)

            if self.norm not in norm_names():
                raise ValueError(f"deq.norm={self.norm!r} is unknown; valid: {', '.join(norm_names())}")
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
        if self.backward_tol is not None and float(self.backward_tol) < 0:
            raise ValueError(f"deq.backward_tol must be >= 0 (or null: deq.tol), got {self.backward_tol}")
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

    def solver_kwargs(self, adjoint: bool = False) -> dict:
        """The keyword arguments of :func:`src.deq.solvers.solve`: the forward solve's, or (``adjoint``) the implicit
        backward's adjoint solves' (each ``backward_*`` key that is set replaces its forward key)."""
        pick = (lambda b, f: f if not adjoint or b is None else b)
        return {"method": pick(self.backward_solver, self.solver), "tol": float(pick(self.backward_tol, self.tol)),
                "max_iter": int(pick(self.backward_max_iter, self.max_iter)),
                "stop_mode": pick(self.backward_stop_mode, self.stop_mode), "anderson_m": int(self.anderson_m),
                "anderson_beta": float(self.anderson_beta), "anderson_lam": float(self.anderson_lam),
                "broyden_memory": int(self.broyden_memory)}


# ------------------------------------------------------------------------------------------ the one parse
# The DEQ blocks beyond the family's own (``deq.block: null``) that a family can build: a ``deq.block`` of another
# family is refused in one line (model=dkef with deq.block=normalized_residual was a TypeError deep in the block).
FAMILY_BLOCKS: dict[str, tuple[str, ...]] = {"ncsn": ("normalized_residual",)}


def deq_setting(deq: Any, family: str | None = None, loss: str | None = None,
                enabled: bool | None = None) -> DEQConfig | None:
    """The ``deq`` config group → ``DEQConfig`` (``enabled: true``) or ``None`` (``enabled: false``, or no group).

    The one place that reads ``deq.enabled`` (``enabled`` given: a family whose architecture is a DEQ by its own
    choice, the supervised ``model.arch=deq``, takes the keys whatever the group says); the other keys are checked
    by ``DEQConfig`` (one-line errors). Refused first, each in one line naming the keys: with ``family`` given
    (``dkef``, ``nice``, …) a ``deq.block`` that family cannot build (:func:`check_block`); ``deq=false`` with
    ``deq.one_pass=true`` (the one-pass control replaces a DEQ's fixed point, and explicit layers have none; the
    other solver keys stay valid with ``deq=false``, so that sweeps over ``deq=true,false`` keep them); with
    ``loss`` given, ``loss=cp`` with ``deq.backward=implicit``. A ``DEQConfig`` passes through (checked the same
    way)."""
    if deq is None:
        return None
    if isinstance(deq, DEQConfig):
        check_block(family, deq.block)
        return check_correction(family, check_loss(deq, loss))
    if not isinstance(deq, Mapping):
        raise ValueError(f"deq={deq!r}: give the deq config group (deq=true or deq=false, then deq.<key>=<value>)")  # noqa: TRY004
    keys = {k: deq[k] for k in deq if k != "enabled"}  # plain values (a DictConfig resolves interpolations here)
    if not (bool(deq.get("enabled", False)) if enabled is None else enabled):
        if keys.get("one_pass"):
            raise ValueError("deq.one_pass=true needs deq=true: the one-pass control replaces the DEQ's fixed point "
                             "by one explicit pass, and deq=false has no DEQ; drop deq.one_pass or use deq=true")
        return None
    check_block(family, keys.get("block"))  # before the other keys: their messages assume the block is possible
    return check_correction(family, check_loss(DEQConfig(**keys), loss))


CORRECTION_FAMILIES = ("ncsn",)  # the families whose training step reads the loss from each correction state


def check_correction(family: str | None, config: DEQConfig) -> DEQConfig:
    """Refuse ``deq.correction_states`` > 0 for a family whose training step does not use the states (one line);
    ``config`` otherwise (nothing is refused when ``family`` is None)."""
    if family is not None and int(config.correction_states) > 0 and family not in CORRECTION_FAMILIES:
        raise ValueError(f"deq.correction_states={config.correction_states}: fixed-point correction is trained by "
                         f"model={', '.join(CORRECTION_FAMILIES)} only, not model={family}; drop it (or set 0)")
    return config


def check_block(family: str | None, block: str | None) -> None:
    """Refuse ``deq.block`` when ``family`` cannot build it (:data:`FAMILY_BLOCKS`; nothing is refused when
    ``family`` or ``block`` is None), in one line naming the keys."""
    if family is None or block is None or block in FAMILY_BLOCKS.get(family, ()):
        return
    owners = [f"model={f}" for f, blocks in FAMILY_BLOCKS.items() if block in blocks]
    raise ValueError(f"deq.block={block} is a block of {', '.join(owners) or 'no model family'} only: model={family} "
                     "has its own DEQ block, so drop deq.block (or set deq.block=null)")


def check_loss(config: DEQConfig, loss: str | None) -> DEQConfig:
    """Refuse ``loss=cp`` with ``deq.backward=implicit`` (one line); ``config`` otherwise."""
    if loss == "cp" and config.backward == "implicit":
        raise ValueError(
            "loss=cp cannot run with deq.backward=implicit: curvature propagation records the network's elementary "
            "ops, and the implicit DEQ hides them inside one autograd Function. Use deq.backward=phantom with cp, "
            "or an exact/sliced loss (sm, ssm, ssm_vr, dsm) with the implicit backward"
        )
    return config


# ------------------------------------------------------------------------------------------ depth per family
@dataclass(frozen=True)
class DepthRule:
    """What ``depth`` means for one family: explicit layers when ``deq=false``, layers inside f when ``deq=true``."""

    explicit_default: int  # depth: null with deq=false
    explicit_min: int = 1  # the smallest explicit depth
    deq_default: int = 1  # depth: null with deq=true (the paper's one layer inside f)
    deq_only_default: str = ""  # non-empty: the DEQ block has exactly deq_default layers; why (the refusal)
    injection: str = "linear"  # what deq.injection: null means (src/models/deq_net.py says why linear)
    meaning: str = "explicit layers when deq=false, layers inside the DEQ map f when deq=true"


DEPTH_RULES: dict[str, DepthRule] = {
    "dkef": DepthRule(explicit_default=3),
    "nice": DepthRule(explicit_default=5),
    "supervised": DepthRule(explicit_default=3),  # the DEQ-vs-feed-forward studies (src/separation)
    "vae": DepthRule(explicit_default=0, explicit_min=0,
                     deq_only_default="the VAE score estimator's DEQ block has one layer inside f",
                     meaning="extra stride-1 layers of the VAE score estimator (0: the SSM VAE; 8, 16: Aug(8), "
                             "Aug(16)) when deq=false"),
    "ncsn": DepthRule(explicit_default=1,
                      deq_only_default="the DEQ-ResBlock's map has one residual branch (depth 1)",
                      meaning="the plain ResBlocks standing in for the DEQ-ResBlock when deq=false"),
}


def _rule(family: str) -> DepthRule:
    try:
        return DEPTH_RULES[family]
    except KeyError:
        raise ValueError(f"unknown model family {family!r}; known: {', '.join(DEPTH_RULES)}") from None


def resolve_depth(family: str, depth: int | None, deq: DEQConfig | None) -> int:
    """The ``depth`` key of ``family``, validated, with ``None`` replaced by the family's default
    (:data:`DEPTH_RULES`); ``deq`` is :func:`deq_setting`'s value (``None``: explicit layers)."""
    rule = _rule(family)
    enabled = deq is not None
    if depth is None:
        return rule.deq_default if enabled else rule.explicit_default
    minimum = 1 if enabled else rule.explicit_min
    if isinstance(depth, bool) or not isinstance(depth, (int, float)) or int(depth) != depth or depth < minimum:
        default = f"{rule.deq_default} with deq=true, {rule.explicit_default} with deq=false"
        raise ValueError(f"depth={depth!r} is invalid for {family}: give an integer >= {minimum} ({rule.meaning}), "
                         f"or leave it unset for the {family} default ({default})")
    if enabled and rule.deq_only_default and int(depth) != rule.deq_default:
        raise ValueError(f"depth={depth} with deq=true: {rule.deq_only_default}; leave depth unset "
                         f"(or {rule.deq_default})")
    return int(depth)


def resolve_injection(family: str, injection: str | None) -> str:
    """``deq.injection``: ``linear`` | ``softplus``, or ``None`` for the family's default."""
    value = _rule(family).injection if injection is None else injection
    if value not in INJECTIONS:
        raise ValueError(f"deq.injection={injection!r} is unknown; valid: {', '.join(INJECTIONS)} "
                         "(or null for the model family's default)")
    return value


def run_depth(cfg: Mapping, family: str) -> tuple[int, bool]:
    """``(depth, ran a DEQ)`` of a finished run's composed config (``cfg['deq']``, ``cfg['depth']``), as its module
    resolved them when it was built (the sweep report's memory-vs-depth figure)."""
    setting = deq_setting(cfg.get("deq"))
    return resolve_depth(family, cfg.get("depth"), setting), setting is not None
