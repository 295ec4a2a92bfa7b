"""Instance norm++ (NCSN's normalisation) and its ELU, at the memory of one saved input.

``instance_norm_plus(x, γ, α, β)`` is NCSN's instance norm++: per sample b and channel c, with μ_bc, s_bc the
spatial mean and (biased) standard deviation of x_bc, and m_b, v_b the mean and unbiased variance of the μ_bc
over channels,

    out_bc = γ_bc · ((x_bc − μ_bc)/s_bc + α_bc · (μ_bc − m_b)/√(v_b + ε)) + β_bc,

with γ, α, β of shape ``[B, C]`` (a row per sample: the conditional norm's embedding of each sample's noise
level) or ``[C]`` (one row for every sample: the unconditional norm). :func:`norm_act` is the same map,
optionally followed by ELU, as NCSN uses it (norm → ELU → conv).

Why a second implementation. Written with plain autograd ops, the norm and its ELU keep four full-size
tensors per call for backward (the input, the normalised x̂, the norm's output, ELU's output), and the SSM-VR
step's ``create_graph`` backward keeps two more (the gradient flowing back through the multiplications and
ELU's second derivative): six per norm, and at NCSN's 36–71 norms about half of the bytes the step saved
(``benchmarks/tools/step_cost.py ncsn --profile``). :func:`norm_act` (``recompute=True``, the default) keeps two: its
input x (plus the ``[B, C]`` rows), from which it recomputes the cheap statistics in its backward, and the
gradient arriving in that backward, which is itself a recomputing function, so the second backward of the
``create_graph`` step recomputes the rest. Its first and second derivatives are written out (``f.vjp`` and
``f.vjp.vjp`` of :func:`_norm_act`: a few passes over x each, where autograd's takes about three times as
many small operations), so the recomputation costs about what the plain map's backward did (measured: the
step's CPU time is unchanged within the machine's noise, benchmarks/results/ncsn_memory.md).
Gradients are those of the plain map at every order (each backward is the same recomputing function applied
to the vector-Jacobian product of the one before); float64 tests to third order: tests/test_ncsn_norm.py.

Inside the recomputations the tensors autograd keeps live only for the duration of that backward call
(a workspace, freed before it returns); they are kept out of any ``saved_tensors_hooks`` active around the
step (the saved-bytes meter of ``benchmarks/tools/step_cost.py ncsn`` and of ``src.callbacks.profiling`` counts what the
graph keeps between the forward and the backward, which is what recomputation shrinks).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def _rows(p: torch.Tensor) -> torch.Tensor:
    """γ / α / β of shape ``[B, C]`` or ``[C]`` broadcast against ``[B, C, H, W]``."""
    return p[..., None, None]


def instance_norm_plus(x: torch.Tensor, gamma: torch.Tensor, alpha: torch.Tensor, beta: torch.Tensor | None,
                       eps: float = 1e-5) -> torch.Tensor:
    """Instance norm++ with plain autograd ops (the reference; see the module docstring for the formula)."""
    means = x.mean(dim=(2, 3))                                   # μ_bc  [B, C]
    m = means.mean(dim=-1, keepdim=True)
    v = means.var(dim=-1, keepdim=True)                          # unbiased, as torch.var in NCSN
    means = (means - m) / torch.sqrt(v + eps)
    h = F.instance_norm(x, eps=eps) + _rows(means) * _rows(alpha)
    out = _rows(gamma) * h
    return out + _rows(beta) if beta is not None else out


def _affine(x, gamma, alpha, beta, eps):
    """Instance norm++ as one per-(sample, channel) affine map of the centred input, n = a·(x − μ) + c with
    a = γ/s, c = γ α m̂ + β. Returns (x − μ, a, c, 1/s, u = μ − m, √(v + ε), m̂): ``[B, C, H, W]``, then
    ``[B, C, 1, 1]`` or ``[B, C]``. Two passes for s (mean, then mean of squares of x − μ): as stable as
    the fused kernels and about ten times faster on a CPU than ``torch.var_mean``."""
    mu = x.mean(dim=(2, 3), keepdim=True)
    xc = x - mu
    r = torch.rsqrt((xc * xc).mean(dim=(2, 3), keepdim=True) + eps)             # 1/s  [B, C, 1, 1]
    m = mu[..., 0, 0]
    u = m - m.mean(dim=-1, keepdim=True)                                        # μ − m  [B, C]
    sd = torch.sqrt((u * u).sum(dim=-1, keepdim=True) / (x.shape[1] - 1) + eps)  # √(v + ε), v unbiased
    mhat = u / sd
    c = gamma * alpha * mhat
    return xc, _rows(gamma) * r, _rows(c + beta if beta is not None else c), r[..., 0, 0], u, sd, mhat


def _norm_act(act: bool, eps: float):
    """The map (x, γ, α[, β]) ↦ (norm_act(x, …),) in the form :class:`_Recomputed` differentiates, with its
    vector-Jacobian product written out (``f.vjp``: a few passes over x where autograd's takes about twenty)."""

    def f(x, *rows, create_graph=False):
        with torch.set_grad_enabled(create_graph):
            xc, a, c = _affine(x, rows[0], rows[1], rows[2] if len(rows) == 3 else None, eps)[:3]
            out = xc * a + c
            return (F.elu(out) if act else out,)

    def vjp(grad, x, gamma, alpha, beta=None, create_graph=False):
        """(∂ out/∂(x, γ, α[, β]))ᵀ grad, with x̂ = (x − μ)/s, m̂ = (μ − m)/√(v + ε), n = γ(x̂ + α m̂) + β."""
        with torch.set_grad_enabled(create_graph):
            C, N = x.shape[1], x.shape[2] * x.shape[3]
            xc, a, c, r, u, sd, mhat = _affine(x, gamma, alpha, beta, eps)
            if act:
                grad = torch.ops.aten.elu_backward(grad, 1.0, 1, 1, False, xc * a + c)  # g ⊙ ELU'(n)
            s1 = grad.sum(dim=(2, 3))                                  # Σ g  [B, C]
            s2 = r * (grad * xc).sum(dim=(2, 3))                       # Σ g x̂
            d_gamma, d_alpha = s2 + alpha * mhat * s1, gamma * mhat * s1
            # the channel-means term: m̂ = u / sd, u = μ − mean_c μ (unbiased variance in sd)
            g_m = gamma * alpha * s1
            g_u = g_m / sd - u * (g_m * u).sum(dim=-1, keepdim=True) / ((C - 1) * sd**3)
            g_mu = g_u - g_u.mean(dim=-1, keepdim=True)
            # instance norm, g_x̂ = γ g: (1/s)(g_x̂ − mean g_x̂ − x̂ mean(g_x̂ x̂)) = a g + k (x − μ) + k0
            k = _rows(-gamma * r * r * s2 / N)
            k0 = _rows((g_mu - gamma * r * s1) / N)
            gx = grad * a + (xc * k + k0)
            grads = [gx, d_gamma, d_alpha] + ([s1] if beta is not None else [])
            # per-sample rows [B, C] get per-sample grads; one shared row [C] the sum over the batch
            return tuple(g if g.shape == p.shape else g.sum(dim=0)
                         for g, p in zip(grads, (x, gamma, alpha, beta)))

    def vjp2(*args, create_graph=False):
        """The vector-Jacobian product of :func:`vjp`: cotangents (Ḡ of ∂x, then those of ∂γ, ∂α[, ∂β]) and
        vjp's inputs (g, x, γ, α[, β]) ↦ grads w.r.t. g, x, γ, α[, β] — the second derivative of the norm (what
        the backward of a create_graph step runs), reverse mode of vjp's formulas written out. Rows'
        cotangents of shape ``[C]`` (a shared row) broadcast over the batch as its sum did in vjp."""
        k_rows = (len(args) - 3) // 2  # rows: 2 without β, 3 with (args = Ḡ, k dots, g, x, k rows)
        G, dots, (grad, x, gamma, alpha), beta = args[0], args[1:k_rows + 1], args[k_rows + 1:k_rows + 5], None
        if k_rows == 3:
            beta = args[-1]
        with torch.set_grad_enabled(create_graph):
            C, N = x.shape[1], x.shape[2] * x.shape[3]
            xc, a, c, r, u, sd, mhat = _affine(x, gamma, alpha, beta, eps)
            n = xc * a + c if act else None
            gn = torch.ops.aten.elu_backward(grad, 1.0, 1, 1, False, n) if act else grad
            s1, t = gn.sum(dim=(2, 3)), (gn * xc).sum(dim=(2, 3))
            g_m = gamma * alpha * s1
            w = (g_m * u).sum(dim=-1, keepdim=True)
            c1 = C - 1
            # gx = a gn + k xc + k0, k = −γ r³ t / N, k0 = (g_mu − γ r s1) / N
            a_bar, k_bar, k0_bar = (G * gn).sum(dim=(2, 3)), (G * xc).sum(dim=(2, 3)), G.sum(dim=(2, 3))
            gmu_bar = k0_bar / N
            gam_bar = -(r * s1 * k0_bar + r**3 * t * k_bar) / N
            r_bar = -(gamma * s1 * k0_bar + 3 * gamma * r**2 * t * k_bar) / N
            s1_bar = -gamma * r * k0_bar / N
            t_bar = -gamma * r**3 * k_bar / N
            # g_mu = g_u − mean_c g_u, g_u = g_m / sd − u w / ((C − 1) sd³), w = Σ_c g_m u
            gu_bar = gmu_bar - gmu_bar.mean(dim=-1, keepdim=True)
            w_bar = -(u * gu_bar).sum(dim=-1, keepdim=True) / (c1 * sd**3)
            gm_bar = gu_bar / sd + w_bar * u
            u_bar = -w * gu_bar / (c1 * sd**3) + w_bar * g_m
            sd_bar = (-g_m * gu_bar / sd**2 + 3 * u * w * gu_bar / (c1 * sd**4)).sum(dim=-1, keepdim=True)
            # g_m = γ α s1
            gam_bar = gam_bar + alpha * s1 * gm_bar
            alp_bar = gamma * s1 * gm_bar
            s1_bar = s1_bar + gamma * alpha * gm_bar
            # ∂γ = r t + α m̂ s1, ∂α = γ m̂ s1, ∂β = s1
            d_gamma, d_alpha = dots[0], dots[1]
            r_bar = r_bar + t * d_gamma
            t_bar = t_bar + r * d_gamma
            alp_bar = alp_bar + mhat * s1 * d_gamma
            gam_bar = gam_bar + mhat * s1 * d_alpha
            mhat_bar = (alpha * d_gamma + gamma * d_alpha) * s1
            s1_bar = s1_bar + alpha * mhat * d_gamma + gamma * mhat * d_alpha + (dots[2] if k_rows == 3 else 0)
            # s1 = Σ gn, t = Σ gn xc, and gx's a gn + k xc
            gn_bar = G * a + (xc * _rows(t_bar) + _rows(s1_bar))
            k = _rows(-gamma * r**3 * t / N)
            xc_bar = G * k + gn * _rows(t_bar)
            if act:  # gn = g ELU'(n): ∂/∂g = ELU'(n), ∂/∂n = g ELU''(n) = gn [n ≤ 0]
                g_bar = torch.ops.aten.elu_backward(gn_bar, 1.0, 1, 1, False, n)
                n_bar = (gn_bar * gn).masked_fill(n > 0, 0.0)
                a_bar = a_bar + (n_bar * xc).sum(dim=(2, 3))
                c_bar = n_bar.sum(dim=(2, 3))
                xc_bar = xc_bar + n_bar * a
                # c = γ α m̂ + β
                gam_bar = gam_bar + alpha * mhat * c_bar
                alp_bar = alp_bar + gamma * mhat * c_bar
                mhat_bar = mhat_bar + gamma * alpha * c_bar
            else:
                g_bar, c_bar = gn_bar, torch.zeros_like(s1)
            # a = γ r
            gam_bar = gam_bar + r * a_bar
            r_bar = r_bar + gamma * a_bar
            # m̂ = u / sd, sd = √(Σ u² / (C − 1) + ε), u = μ − mean_c μ
            u_bar = u_bar + mhat_bar / sd
            sd_bar = sd_bar - (mhat_bar * u).sum(dim=-1, keepdim=True) / sd**2
            u_bar = u_bar + u * sd_bar / (c1 * sd)
            m_bar = u_bar - u_bar.mean(dim=-1, keepdim=True)
            # r = (mean xc² + ε)^(−1/2), xc = x − μ, μ = mean x
            xc_bar = xc_bar + xc * _rows(-r**3 * r_bar / N)
            x_bar = xc_bar + _rows((m_bar - xc_bar.sum(dim=(2, 3))) / N)
            grads = [g_bar, x_bar, gam_bar, alp_bar] + ([c_bar] if beta is not None else [])
            return tuple(g if g.shape == p.shape else g.sum(dim=0)
                         for g, p in zip(grads, (grad, x, gamma, alpha, beta)))

    vjp.vjp = vjp2
    f.vjp = vjp
    return f


def _vjp(f, n_out: int):
    """The map (u_1…u_n_out, *inputs) ↦ (∂f/∂inputs)ᵀ u of ``f`` (inputs given as leaves requiring grad):
    ``f.vjp`` where ``f`` has one, else autograd's."""
    if getattr(f, "vjp", None) is not None:
        return f.vjp

    def g(*args, create_graph=False):
        cotangents, inputs = args[:n_out], args[n_out:]
        outs = f(*inputs, create_graph=True)
        return torch.autograd.grad(outs, inputs, cotangents, create_graph=create_graph, allow_unused=True,
                                   materialize_grads=True)

    return g


class _Workspace(torch.autograd.graph.saved_tensors_hooks):
    """Identity saved-tensor hooks around a recomputation: its transient graph is not the step's."""

    def __init__(self):
        super().__init__(_identity, _identity)


def _identity(t):
    return t


class _Recomputed(torch.autograd.Function):
    """outputs = f(*inputs), saving only the inputs. Its backward is the same Function applied to f's
    vector-Jacobian product (saving the inputs and the incoming gradients), so every order of derivative
    recomputes what it needs from what was saved: first, second (the create_graph step) and beyond."""

    @staticmethod
    def forward(ctx, f, *inputs):
        ctx.f = f
        ctx.save_for_backward(*inputs)
        with torch.enable_grad(), _Workspace():
            leaves = [t.detach().requires_grad_(t.is_floating_point()) for t in inputs]
            return tuple(o.detach() for o in f(*leaves, create_graph=False))

    @staticmethod
    def backward(ctx, *grads):
        return (None, *_Recomputed.apply(_vjp(ctx.f, len(grads)), *grads, *ctx.saved_tensors))


def norm_act(x: torch.Tensor, gamma: torch.Tensor, alpha: torch.Tensor, beta: torch.Tensor | None = None, *,
             act: bool = False, eps: float = 1e-5, recompute: bool = True) -> torch.Tensor:
    """Instance norm++ of ``x`` (then ELU when ``act``); ``recompute`` (default) saves only x for backward."""
    rows = (gamma, alpha) if beta is None else (gamma, alpha, beta)
    if not torch.is_grad_enabled():
        return _norm_act(bool(act), float(eps))(x, *rows)[0]
    if not recompute:
        out = instance_norm_plus(x, gamma, alpha, beta, eps)
        return F.elu(out) if act else out
    return _Recomputed.apply(_norm_act(bool(act), float(eps)), x, *rows)[0]
