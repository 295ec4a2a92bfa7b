"""Deep kernel exponential family (DKEF), paper §4.2 and App. D.1, as the reference code implements it.

    log p̃(x) = Σ_m α_m k(x, z_m) + log q0(x),
    k(x, z)  = Σ_r ρ_r exp(−‖φ_r(x) − φ_r(z)‖² / (2·10^{ℓ_r}))          (r = 1..n_kernels)
    log q0(x) = −‖x‖² / (2 σ0²)                                          (σ0 = 2, fixed)

with ρ = softmax(w), trainable inducing points z_m, bandwidths ℓ_r (not squared, as in the reference), and
feature networks φ_r that are explicit MLPs or one DEQ block each (``src/models/features.py``).

α is not a parameter: for a batch X_t it is fitted in closed form as the minimiser of the chosen score
matching loss, which is quadratic in α (reference ``update_alpha``):

    J(α) = ½ αᵀ G α + αᵀ b + const,   α = −(G + λI)⁻¹ b,   λ = 10^{log_lambda} (trainable)

    exact  (SM):     G = E[∇k ∇kᵀ],             b = E[Δk + ∇k·∇log q0]
    sliced (SSM):    G = E[(vᵀ∇k)(vᵀ∇k)ᵀ],      b = E[vᵀ∇²k v + (vᵀ∇k)(vᵀ∇log q0)]
    dsm:             G = E[∇k(x̃) ∇k(x̃)ᵀ],       b = E[∇k(x̃)·(∇log q0(x̃) + (x̃ − x)/σ²)]

(the DSM form here is in the standard units of eq. 2, not the reference's σ⁴-scaled ones; α is the same).
All derivatives of k are assembled from first and second directional derivatives of the features, computed
by reverse-mode autograd only (``src/models/directional.py``) so the fit is exact and differentiable
through a DEQ in either backward mode.

The exact mode (and the exact SM loss's score and trace, :meth:`DKEF.score_and_trace`) has a second route,
``exact_route="jet"``: with u = φ_r(x), J = ∂u/∂x, L = Σ_d ∂²u/∂x_d² (one forward pass carrying them,
``src/models/feature_jets.py``) and k = exp(−‖u − u_m‖²/(2h)), u_m = φ_r(z_m),

    ∇ₓk = −(k/h) Jᵀ(u − u_m),      Δₓk = (k/h²) ‖Jᵀ(u − u_m)‖² − (k/h) (‖J‖²_F + (u − u_m)·L),

which are the same numbers as the D replicated reverse passes of ``exact_route="autograd"`` (float64 tests:
tests/test_dkef_fast_trace.py) at a fraction of their cost at high D (benchmarks/results/dkef_step_profile.md).

Dense one-layer DEQ features with the phantom backward (the main job's block of record) run as one stacked DEQ
for all kernels (``src/models/stacked_features.py``: one solve, batched matmuls, the jets' and the inducing points'
phantom steps with a written-out reverse sweep), the same numbers as the networks one by one (float64:
tests/test_dkef_stacked.py); ``stack_kernels = False`` on an instance runs them one by one.
"""

from __future__ import annotations

import math
from contextlib import contextmanager

import torch
from torch import nn
from torch.profiler import record_function

from src.deq.config import DEQConfig
from src.models.directional import directional_derivatives
from src.models.feature_jets import feature_jet, supports_jet
from src.models.features import build_feature_net
from src.models.stacked_features import stackable, stacked_features, stacked_jets
from src.objectives.base import PHASE_SCORE, PHASE_TRACE

ALPHA_FIT_MODES = ("exact", "sliced", "dsm")
# How the exact mode's ∇k, Δk (α fit) and the exact SM loss's score and trace are computed: "jet" (closed form from
# the features' forward jets), "autograd" (x replicated D times, reverse passes), "auto" (jet when supported)
EXACT_ROUTES = ("auto", "jet", "autograd")
PHASE_KERNEL_DERIVATIVES = "dkef.kernel_derivatives"  # profiler label: ∇k, Δk from the feature jets
PHASE_FEATURES = "dkef.features"  # profiler label: φ(x) of data (forward only; its derivative passes are elsewhere)
PHASE_INDUCING = "dkef.inducing_features"  # profiler label: φ(z_m) of the inducing points
PHASE_ALPHA_FIT = "dkef.alpha_fit"  # profiler label of the closed-form α fit (benchmarks/tools/profile_step.py)


class DKEFWithAlpha:
    """The DKEF density with a given (possibly differentiable) α, as the objectives see it (``log_density(x)``)."""

    independent_rows = True  # log p̃(x_n) depends on row n only: exact SM may replicate x (src/objectives/sm.py)

    def __init__(self, dkef: DKEF, alpha: torch.Tensor):
        self.dkef, self.alpha = dkef, alpha

    def log_density(self, x: torch.Tensor) -> torch.Tensor:
        return self.dkef.log_density(x, alpha=self.alpha)

    def own_trace_route(self, x: torch.Tensor) -> bool:
        """Whether exact SM should take :meth:`score_and_trace` (src/objectives/sm.py, ``trace_route="auto"``)."""
        return self.dkef.own_trace_route(x)

    def score_and_trace(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return self.dkef.score_and_trace(x, alpha=self.alpha)


class DKEF(nn.Module):
    independent_rows = True  # log p̃(x_n) depends on row n only: exact SM may replicate x (src/objectives/sm.py)
    stack_kernels = True  # DEQ features of the kernels as one stacked DEQ where they qualify (:meth:`stacked`)

    def __init__(
        self,
        input_dim: int,
        *,
        deq: DEQConfig | None = None,
        depth: int | None = None,
        n_kernels: int = 3,
        n_inducing: int = 200,
        feature_dim: int = 30,
        hidden: int = 30,
        deq_width: int = 64,
        log_bandwidth_init: tuple[float, ...] = (0.0, 0.5185, 1.0),
        log_lambda_init: float = -2.0,
        q0_std: float = 2.0,
        skip: bool = True,
        exact_route: str = "auto",
    ):
        super().__init__()
        if exact_route not in EXACT_ROUTES:
            raise ValueError(f"exact_route={exact_route!r} is invalid; valid: {', '.join(EXACT_ROUTES)}")
        if input_dim < 1:
            raise ValueError(f"input_dim must be >= 1, got {input_dim}")
        if n_inducing < 1 or n_kernels < 1:
            raise ValueError(f"n_inducing and n_kernels must be >= 1, got {n_inducing} and {n_kernels}")
        if len(log_bandwidth_init) < n_kernels:
            log_bandwidth_init = tuple(torch.linspace(0.0, 1.0, n_kernels).tolist())
        self.input_dim = int(input_dim)
        self.q0_std = float(q0_std)
        self.features = nn.ModuleList(
            build_feature_net(
                self.input_dim, feature_dim, deq=deq, depth=depth, hidden=hidden, deq_width=deq_width,
                skip=skip, name=f"dkef.features.{r}",
            )
            for r in range(n_kernels)
        )
        self.inducing = nn.Parameter(torch.randn(n_inducing, self.input_dim))
        self.log_bandwidth = nn.Parameter(torch.tensor(log_bandwidth_init[:n_kernels], dtype=torch.float32))
        self.kernel_logits = nn.Parameter(torch.zeros(n_kernels))
        self.log_lambda = nn.Parameter(torch.tensor(float(log_lambda_init)))
        # α used outside training (validation, test, sampling): fitted on training data, saved with the model
        self.register_buffer("alpha", torch.zeros(n_inducing))
        self.register_buffer("alpha_fitted", torch.tensor(False))
        self._inducing_cache: list | None = None  # φ(inducing points) within shared_inducing_features()
        self.exact_route = exact_route
        if exact_route == "jet" and not self.jets_supported():
            raise ValueError("exact_route='jet' needs explicit MLP features or dense Softplus DEQ features with "
                             "phantom or implicit backward and no deq.jacobian_penalty; use exact_route='autograd' "
                             "(or 'auto')")

    # ---------------------------------------------------------------- density
    def log_q0(self, x: torch.Tensor) -> torch.Tensor:
        return -(x.pow(2).sum(-1)) / (2 * self.q0_std**2)

    def grad_log_q0(self, x: torch.Tensor) -> torch.Tensor:
        return -x / self.q0_std**2

    def _all_features(self, x: torch.Tensor) -> torch.Tensor:
        """Features of every kernel side by side: [N, n_kernels * F]."""
        with record_function(PHASE_INDUCING if x is self.inducing else PHASE_FEATURES):
            if self.stacked():
                return self._side_by_side(stacked_features(self.features, x))
            return torch.cat([phi(x) for phi in self.features], dim=-1)

    @staticmethod
    def _side_by_side(u: torch.Tensor) -> torch.Tensor:
        """The stacked features ``[R, N, F]`` as ``[N, R * F]`` (kernel r's in columns r·F … (r + 1)·F − 1)."""
        return u.transpose(0, 1).reshape(u.shape[1], -1)

    def stacked(self) -> bool:
        """Whether the kernels' feature networks run as one stacked DEQ (src/models/stacked_features.py: dense DEQ
        features with the phantom backward; ``stack_kernels`` False turns it off, for comparisons)."""
        return (self.stack_kernels and not torch.is_autocast_enabled(self.inducing.device.type)
                and stackable(self.features))

    def _split(self, u: torch.Tensor) -> list[torch.Tensor]:
        return list(u.chunk(len(self.features), dim=-1))

    @contextmanager
    def shared_inducing_features(self):
        """Within the block the inducing points' features φ(z) are computed once (with their graph) and reused by
        every α fit and density evaluation: one training step's α fit and loss see the same parameters, so
        they need φ(z) once, and its backward runs once (for DEQ features: one solve instead of two)."""
        self._inducing_cache = []
        try:
            yield
        finally:
            self._inducing_cache = None

    def _inducing_features(self, first_order: bool = False) -> torch.Tensor:
        """φ(z) of every kernel for the inducing points, [M, n_kernels * F] (shared within
        :meth:`shared_inducing_features`). ``first_order``: the caller differentiates them once, w.r.t. the
        parameters (the jet route); a later caller that needs every order (the autograd route, CP's graph walk)
        gets them computed anew in their every-order form, which then stays shared."""
        cache = self._inducing_cache
        if cache and (first_order or not cache[0][1]):
            return cache[0][0]
        if first_order and self.stacked():  # differentiated once, w.r.t. the parameters: fewer bytes kept
            with record_function(PHASE_INDUCING):
                uz = self._side_by_side(stacked_features(self.features, self.inducing, first_order=True))
        else:
            uz = self._all_features(self.inducing)
        if cache is not None:
            cache[:] = [(uz, first_order)]
        return uz

    def kernel_matrix(self, x: torch.Tensor) -> torch.Tensor:
        """k(x_n, z_m) mixed over kernels: [N, M]."""
        fx, fz = self._split(self._all_features(x)), self._split(self._inducing_features())
        rho = torch.softmax(self.kernel_logits, 0)
        out = 0.0
        for r, (u, uz) in enumerate(zip(fx, fz)):
            bw = 10 ** self.log_bandwidth[r]
            sq = u.pow(2).sum(-1, keepdim=True) - 2 * u @ uz.T + uz.pow(2).sum(-1)
            out = out + rho[r] * torch.exp(-sq / (2 * bw))
        return out

    def with_alpha(self, alpha: torch.Tensor) -> DKEFWithAlpha:
        """This density with the kernel weights ``alpha`` (e.g. fitted on another half-batch, eq. of App. D.1)."""
        return DKEFWithAlpha(self, alpha)

    def log_density(self, x: torch.Tensor, alpha: torch.Tensor | None = None) -> torch.Tensor:
        """Unnormalised log p̃(x), [N]. Uses the stored α unless one is given (training)."""
        return self.kernel_matrix(x) @ self._alpha_or_stored(alpha) + self.log_q0(x)

    def _alpha_or_stored(self, alpha: torch.Tensor | None) -> torch.Tensor:
        if alpha is not None:
            return alpha
        if not bool(self.alpha_fitted):
            raise RuntimeError("DKEF.log_density needs α: call fit_alpha(x_train) or set_alpha(...) before evaluating")
        return self.alpha

    # ---------------------------------------------------------------- α fit
    def _kernel_directional(self, x: torch.Tensor, v: torch.Tensor, second: bool):
        """D_v k and D_v² k for every inducing point, [N, M] each (second is None if not asked)."""
        u, a, c = directional_derivatives(self._all_features, x, v, second=second)
        uz_all = self._inducing_features()
        rho = torch.softmax(self.kernel_logits, 0)
        d1 = d2 = 0.0
        for r, (ur, ar, uz) in enumerate(zip(self._split(u), self._split(a), self._split(uz_all))):
            bw = 10 ** self.log_bandwidth[r]
            sq = ur.pow(2).sum(-1, keepdim=True) - 2 * ur @ uz.T + uz.pow(2).sum(-1)
            k = torch.exp(-sq / (2 * bw))
            da = (ur * ar).sum(-1, keepdim=True) - ar @ uz.T  # (φ(x) − φ(z))·D_vφ
            d1 = d1 + rho[r] * (-k / bw * da)
            if second:
                cr = self._split(c)[r]
                dc = (ur * cr).sum(-1, keepdim=True) - cr @ uz.T  # (φ(x) − φ(z))·D_v²φ
                aa = ar.pow(2).sum(-1, keepdim=True)
                d2 = d2 + rho[r] * (k / bw**2 * da.pow(2) - k / bw * (aa + dc))
        return d1, (d2 if second else None)

    # ---------------------------------------------------------------- jet route (closed-form ∇k, Δk)
    def jets_supported(self) -> bool:
        return all(supports_jet(phi) for phi in self.features)

    def uses_jets(self) -> bool:
        """The exact route resolved: jets unless ``exact_route="autograd"`` or a feature network has no jet rule.
        ``auto`` takes the jets at every D: measured side by side they are faster from D = 11 up
        (benchmarks/results/dkef_step_profile.md)."""
        if self.exact_route == "autograd":
            return False
        return self.jets_supported()

    def own_trace_route(self, x: torch.Tensor) -> bool:
        return x.dim() == 2 and self.uses_jets()

    def _kernel_jet_factors(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """∇ₓk and Δₓk of every inducing point, mixed over kernels, in factored closed form (module docstring):

            ∇ₓk(x_n, z_m) = Σ_r J_r[n] B_r[n, m],   B_r[n, m] = −(ρ_r k_r[n, m] / h_r) (u_r[n] − u_r(z_m))
            Δₓk(x_n, z_m) = Σ_r ρ_r k_r (‖J_rᵀ(u_r − u_r(z_m))‖² / h_r² − (‖J_r‖²_F + (u_r − u_r(z_m))·L_r) / h_r)

        where J_r[n] = (∂u_r/∂x)ᵀ is stored ``[D, F]``, so the module docstring's Jᵀ(u − u_m) is J_r[n](u − u_m) here,
        and ‖J_r[n]v‖² = vᵀ(J_r[n]ᵀJ_r[n])v goes through the [F, F] Gram matrix: no [N, D, M] tensor is formed.
        Returns J = [J_1 | J_2 | …] ``[N, D, R·F]``, B ``[N, M, R·F]`` and Δₓk ``[N, M]``."""
        cache = self._inducing_cache
        if self.stacked() and not cache:  # the inducing points' features from the jets' own solve and steps
            stacked, uz = stacked_jets(self.features, x, values_of=self.inducing)
            jets = list(zip(*(t.unbind(0) for t in stacked)))
            uz_all = self._side_by_side(uz)
            if cache is not None:  # within shared_inducing_features(): kept for the step's other uses
                cache[:] = [(uz_all, True)]
        else:
            if self.stacked():
                jets = list(zip(*(t.unbind(0) for t in stacked_jets(self.features, x))))
            else:
                jets = [feature_jet(phi, x) for phi in self.features]
            uz_all = self._inducing_features(first_order=True)
        with record_function(PHASE_KERNEL_DERIVATIVES):
            rho = torch.softmax(self.kernel_logits, 0)
            lap = 0.0
            factors = []
            for r, ((u, j, lu), uz) in enumerate(zip(jets, self._split(uz_all))):
                bw = 10 ** self.log_bandwidth[r]
                diff = u.unsqueeze(1) - uz.unsqueeze(0)  # u − u_m, [N, M, F]
                k = torch.exp(-diff.pow(2).sum(-1) / (2 * bw))  # [N, M]
                gram = j.transpose(1, 2) @ j  # JᵀJ, [N, F, F]
                quad = ((diff @ gram) * diff).sum(-1)  # ‖J(u − u_m)‖², [N, M]
                trace = gram.diagonal(dim1=1, dim2=2).sum(-1, keepdim=True)  # ‖J‖²_F, [N, 1]
                du_l = (diff @ lu.unsqueeze(-1)).squeeze(-1)  # (u − u_m)·L, [N, M]
                lap = lap + rho[r] * k * (quad / bw**2 - (trace + du_l) / bw)
                factors.append((-rho[r] / bw) * k.unsqueeze(-1) * diff)
            return torch.cat([jet[1] for jet in jets], dim=-1), torch.cat(factors, dim=-1), lap

    def kernel_gradient_laplacian(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """∇ₓk(x_n, z_m) ``[N, D, M]`` and Δₓk(x_n, z_m) ``[N, M]`` mixed over kernels, in closed form from the
        features' jets (module docstring; App. D.1's kernel)."""
        j, b, lap = self._kernel_jet_factors(x)
        with record_function(PHASE_KERNEL_DERIVATIVES):
            return j @ b.transpose(1, 2), lap

    def score_and_trace(self, x: torch.Tensor, alpha: torch.Tensor | None = None
                        ) -> tuple[torch.Tensor, torch.Tensor]:
        """s(x) = ∇ₓlog p̃ ``[N, D]`` and tr ∇ₓs = Δₓlog p̃ ``[N]`` (exact SM, eq. 1) by the jet route:
        s = Σ_m α_m ∇ₓk_m + ∇log q0 = J (Bᵀα) + ∇log q0 (:meth:`_kernel_jet_factors`)."""
        alpha = self._alpha_or_stored(alpha)
        j, b, lap = self._kernel_jet_factors(x)
        with record_function(PHASE_SCORE):
            s = (j @ (alpha @ b).unsqueeze(-1)).squeeze(-1) + self.grad_log_q0(x)
        with record_function(PHASE_TRACE):
            tr = lap @ alpha - self.input_dim / self.q0_std**2
        return s, tr

    def _exact_system(self, x: torch.Tensor, grad: torch.Tensor, lap: torch.Tensor
                      ) -> tuple[torch.Tensor, torch.Tensor]:
        """Sums of the exact mode's G = Σ ∇k ∇kᵀ and b = Σ (Δk + ∇k·∇log q0) from ∇k ``[N, D, M]``, Δk ``[N, M]``."""
        n, d = x.shape
        flat_grad = grad.reshape(n * d, grad.shape[-1])
        b = lap.sum(0) + self.grad_log_q0(x).reshape(n * d) @ flat_grad
        return flat_grad.T @ flat_grad, b

    def fit_and_exact_sm(self, x_fit: torch.Tensor, x_loss: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """One training step's α (exact fit on ``x_fit``) and the score and trace of ``x_loss`` under it, by the
        jet route with the features of both halves in one pass: the numbers of ``fit_alpha(x_fit, "exact")``
        followed by :meth:`score_and_trace` of ``x_loss`` (src/lit/dkef.py uses it for exact SM)."""
        n = x_fit.shape[0]
        j, b, lap = self._kernel_jet_factors(torch.cat([x_fit, x_loss]))
        with record_function(PHASE_ALPHA_FIT):
            g, b_vec = self._exact_system(x_fit, j[:n] @ b[:n].transpose(1, 2), lap[:n])
            alpha = self.solve_alpha(g / n, b_vec / n)
        with record_function(PHASE_SCORE):
            s = (j[n:] @ (alpha @ b[n:]).unsqueeze(-1)).squeeze(-1) + self.grad_log_q0(x_loss)
        with record_function(PHASE_TRACE):
            tr = lap[n:] @ alpha - self.input_dim / self.q0_std**2
        return s, tr

    def alpha_system(
        self,
        x: torch.Tensor,
        mode: str = "exact",
        *,
        n_projections: int = 1,
        sigma: float | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor, int]:
        """Sums (not means) of G and b over the batch x, and the number of samples they cover."""
        if mode not in ALPHA_FIT_MODES:
            raise ValueError(f"unknown alpha fit mode {mode!r}; valid: {', '.join(ALPHA_FIT_MODES)}")
        n, d = x.shape
        if mode == "exact" and self.uses_jets():
            return (*self._exact_system(x, *self.kernel_gradient_laplacian(x)), n)
        if mode == "sliced":
            xr = x.repeat(n_projections, 1)
            v = torch.randint(0, 2, xr.shape, device=x.device).to(x.dtype) * 2 - 1
            weight = 1.0 / n_projections
        else:
            if mode == "dsm":
                if sigma is None or sigma <= 0:
                    raise ValueError("alpha fit mode 'dsm' needs sigma > 0")
                x_noisy = x + sigma * torch.randn_like(x)
                target = self.grad_log_q0(x_noisy) + (x_noisy - x) / sigma**2
                xr = x_noisy.repeat(d, 1)
            else:
                xr = x.repeat(d, 1)
            v = torch.eye(d, dtype=x.dtype, device=x.device).repeat_interleave(n, dim=0)
            weight = 1.0
        d1, d2 = self._kernel_directional(xr, v, second=(mode != "dsm"))
        if mode == "dsm":
            base = (v * target.repeat(d, 1)).sum(-1, keepdim=True)
            b = (d1 * base).sum(0)
        else:
            base = (v * self.grad_log_q0(xr)).sum(-1, keepdim=True)
            b = (d2 + d1 * base).sum(0) * weight
        g = d1.T @ d1 * weight
        return g, b, n

    def solve_alpha(self, g_mean: torch.Tensor, b_mean: torch.Tensor,
                    log_lambda: torch.Tensor | None = None) -> torch.Tensor:
        """α = −(G + λI)⁻¹ b with λ = 10^{log_lambda} (the model's trained ``log_lambda`` unless one is given)."""
        lam = 10 ** (self.log_lambda if log_lambda is None else log_lambda)
        eye = torch.eye(g_mean.shape[0], dtype=g_mean.dtype, device=g_mean.device)
        return -torch.linalg.solve(g_mean + lam * eye, b_mean)

    def fit_alpha(self, x: torch.Tensor, mode: str = "exact", **kw) -> torch.Tensor:
        """α for the batch x (differentiable w.r.t. every parameter)."""
        with record_function(PHASE_ALPHA_FIT):
            g, b, n = self.alpha_system(x, mode, **kw)
            return self.solve_alpha(g / n, b / n)

    @torch.no_grad()
    def set_alpha(self, alpha: torch.Tensor) -> None:
        self.alpha.copy_(alpha.detach())
        self.alpha_fitted.fill_(True)

    def alpha_system_on(self, data: torch.Tensor, mode: str = "exact", chunk: int = 100,
                        **kw) -> tuple[torch.Tensor, torch.Tensor]:
        """Means of G and b over many points, accumulated in chunks (evaluation: no parameter graph kept)."""
        g_sum = b_sum = None
        count = 0
        # the jet route needs no graph to differentiate; the autograd route differentiates through the features
        no_graph = mode == "exact" and self.uses_jets()
        with torch.no_grad() if no_graph else torch.enable_grad():
            for start in range(0, data.shape[0], chunk):
                g, b, n = self.alpha_system(data[start : start + chunk], mode, **kw)
                g, b = g.detach(), b.detach()
                g_sum = g if g_sum is None else g_sum + g
                b_sum = b if b_sum is None else b_sum + b
                count += n
        return g_sum / count, b_sum / count

    def fit_alpha_on(self, data: torch.Tensor, mode: str = "exact", chunk: int = 100, **kw) -> torch.Tensor:
        """Fit and store α on many points, accumulating G and b in chunks (evaluation, no parameter graph)."""
        g_mean, b_mean = self.alpha_system_on(data, mode, chunk, **kw)
        with torch.no_grad():
            alpha = self.solve_alpha(g_mean, b_mean)
        self.set_alpha(alpha)
        return alpha

    def exact_sm_of_alpha(self, alpha: torch.Tensor, g_mean: torch.Tensor, b_mean: torch.Tensor,
                          x: torch.Tensor) -> torch.Tensor:
        """Exact SM loss (eq. 1) of the points ``x`` whose exact-mode means are ``g_mean``, ``b_mean``, for any α:
        J(α) = ½ αᵀGα + αᵀb + E[½‖∇log q0‖² + Δlog q0] (the loss is quadratic in α; module docstring)."""
        q0_term = x.pow(2).sum(-1).mean() / (2 * self.q0_std**4) - self.input_dim / self.q0_std**2
        return 0.5 * alpha @ g_mean @ alpha + alpha @ b_mean + q0_term

    def refit_lambda(self, fit: torch.Tensor, val: torch.Tensor, steps: int, lr: float,
                     chunk: int = 100) -> dict[str, float]:
        """The DKEF reference's final stage (``finalize``): α on every point of ``fit`` (exact fit), then only
        log10 λ trained by Adam (``steps`` steps at ``lr``) on the exact SM loss of ``val``, the feature
        networks fixed; stores the new λ and α. Returns λ and the validation SM loss before and after."""
        g_fit, b_fit = (t.double() for t in self.alpha_system_on(fit, "exact", chunk))
        g_val, b_val = (t.double() for t in self.alpha_system_on(val, "exact", chunk))
        x_val = val.double()

        def val_loss(log_lambda: torch.Tensor) -> torch.Tensor:
            return self.exact_sm_of_alpha(self.solve_alpha(g_fit, b_fit, log_lambda), g_val, b_val, x_val)

        start = float(self.log_lambda.detach())
        log_lambda = torch.tensor(start, dtype=torch.float64, device=g_fit.device, requires_grad=True)
        with torch.enable_grad():
            before = float(val_loss(log_lambda).detach())
            opt = torch.optim.Adam([log_lambda], lr=lr)
            for _ in range(int(steps)):
                opt.zero_grad()
                loss = val_loss(log_lambda)
                if not torch.isfinite(loss):
                    raise FloatingPointError(f"non-finite validation SM loss at log10 λ = {log_lambda.item():.4g} "
                                             "in the λ refit; lower model.final_refit.lr or its steps")
                loss.backward()
                opt.step()
        final = log_lambda.item()
        with torch.no_grad():
            self.log_lambda.fill_(final)
            after = float(val_loss(log_lambda))
            alpha = self.solve_alpha(g_fit.to(self.alpha.dtype), b_fit.to(self.alpha.dtype))
        self.set_alpha(alpha)
        return {"log10_lambda_trained": start, "log10_lambda": final,
                "val_sm_loss_before": before, "val_sm_loss": after}

    # ---------------------------------------------------------------- normaliser
    @torch.no_grad()
    def log_normalizer(
        self, n_samples: int = 100_000, proposal_std: float = 2.0, batch_size: int = 10_000,
        generator: torch.Generator | None = None,
    ) -> torch.Tensor:
        """log Z by importance sampling with proposal N(0, proposal_std² I) (reference protocol: std 2)."""
        device = self.inducing.device
        dtype = self.inducing.dtype
        d = self.input_dim
        log_w = []
        done = 0
        while done < n_samples:
            m = min(batch_size, n_samples - done)
            y = torch.randn(m, d, generator=generator, dtype=dtype, device="cpu").to(device) * proposal_std
            log_q = -0.5 * (y / proposal_std).pow(2).sum(-1) - d * math.log(proposal_std * math.sqrt(2 * math.pi))
            log_w.append(self.log_density(y) - log_q)
            done += m
        log_w = torch.cat(log_w)
        return torch.logsumexp(log_w, 0) - math.log(n_samples)
