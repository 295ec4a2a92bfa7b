"""The fixed-point maps φ(z; p) of the DEQ blocks, as pure functions of tensors (paper eq. 5, App. D.4).

p = (g(x), normalized weights, biases) is computed by the block with ordinary autograd; φ sees only tensors,
so the solvers, the phantom steps and the implicit Function can all call it. Module-level functions and
small classes (no closures): blocks that hold them stay picklable (DDP).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from src.layers.instance_norm import norm_act


def dense_map(z, inj, w1, *rest):
    """Eq. 5, dense, L layers: φ(z) = σ(W_L … σ(W_2 σ(W_1 z + g(x)) + b_2) … + b_L), σ = Softplus.

    ``rest = (W_2, b_2, …, W_L, b_L)``. Each W_i has spectral norm < 1/λ and Softplus is 1-Lipschitz, so φ is
    a contraction with rate ≤ λ^(−L).
    """
    h = F.softplus(z @ w1.T + inj)
    for i in range(0, len(rest), 2):
        h = F.softplus(h @ rest[i].T + rest[i + 1])
    return h


def _dense_linearize(z, inj, w1, *rest):
    """(v ↦ J v, a ↦ Jᵀ a), J = ∂φ/∂z of :func:`dense_map` at ``z``, written out (no autograd): with σ'ᵢ the
    sigmoid of layer i's pre-activation, J v = σ'_L ⊙ (W_L … σ'_1 ⊙ (W_1 v)) and Jᵀ a = W_1ᵀ(σ'_1 ⊙ … W_Lᵀ(σ'_L ⊙ a)).
    The implicit backward's adjoint solves take one per iteration (src.deq.implicit) instead of a VJP on a graph
    of φ built for them (float64 tests against autograd: tests/test_deq_implicit.py)."""
    with torch.no_grad():
        pre = z @ w1.T + inj
        slopes, weights = [torch.sigmoid(pre)], [w1] + [rest[i] for i in range(0, len(rest), 2)]
        for i in range(0, len(rest), 2):
            pre = F.softplus(pre) @ rest[i].T + rest[i + 1]
            slopes.append(torch.sigmoid(pre))

    def jvp(v):
        for s, w in zip(slopes, weights):
            v = s * (v @ w.T)
        return v

    def vjp(a):
        for s, w in zip(reversed(slopes), reversed(weights)):
            a = (s * a) @ w
        return a

    return jvp, vjp


dense_map.linearize = _dense_linearize  # read by src.deq.implicit._Adjoint.prepare


_ACTIVATIONS = {"softplus": F.softplus, "relu": F.relu, "identity": lambda h: h}
ACTIVATIONS = tuple(_ACTIVATIONS)


class DenseMap:
    """:func:`dense_map` with another activation σ: ``softplus`` (the paper's, eq. 5), ``relu`` or ``identity``.

    ReLU and the identity are 1-Lipschitz too, so a normalized map still contracts at rate ≤ λ^(−L). With
    ``deq.norm=none`` (hand-built weights, e.g. the nilpotent W of the ReLU DEQ in *Separation and Bias of Deep
    Equilibrium Models*, Theorem 1) nothing bounds the rate: convergence is the weights' business.
    """

    def __init__(self, activation: str = "softplus"):
        if activation not in _ACTIVATIONS:
            raise ValueError(f"activation={activation!r} is unknown; valid: {', '.join(ACTIVATIONS)}")
        self.activation = activation

    def __call__(self, z, inj, w1, *rest):
        act = _ACTIVATIONS[self.activation]
        h = act(z @ w1.T + inj)
        for i in range(0, len(rest), 2):
            h = act(h @ rest[i].T + rest[i + 1])
        return h


class ConvMap:
    """Eq. 5 with W a convolution: φ(z) = σ(conv(z, K) + g(y)), σ = Softplus, same padding."""

    def __init__(self, padding: int):
        self.padding = padding

    def __call__(self, z, inj, kernel):
        return F.softplus(F.conv2d(z, kernel, padding=self.padding) + inj)


class ResidualMap:
    """NCSN's DEQ-ResBlock (App. D.4): φ(z) = h(z) + g(y), h(z) = conv(σ(conv(z, K₁) + b₁), K₂).

    h is the residual branch of a ResBlock with both kernels normalized (Lipschitz ≤ λ^(−2)). The identity
    shortcut is left out on purpose: inside a fixed point it changes nothing but the scale of g
    (z = ½(z + r(z)) + g ⇔ z = r(z) + 2g) while it caps the contraction rate at ≥ ½.
    """

    additive_injection = True  # φ(z) = h(z) + g: src.deq.diagnostics reports ‖h(z*)‖ / ‖g‖

    def __init__(self, padding: int):
        self.padding = padding

    def __call__(self, z, inj, k1, b1, k2):
        h = F.softplus(F.conv2d(z, k1, padding=self.padding) + b1[None, :, None, None])
        return F.conv2d(h, k2, padding=self.padding) + inj


class ConditionalResidualMap:
    """:class:`ResidualMap` conditioned per sample: φ(z) = conv(s ⊙ σ(conv(z, K₁) + β), K₂) + g(y), β and s
    ``[B, C]`` (NCSN's noise-level conditioning, computed outside the solver; App. D.4). Lipschitz in z
    ≤ max|s| · ‖K₁‖ · ‖K₂‖, so a bounded scale keeps the contraction."""

    additive_injection = True  # φ(z) = h(z) + g: src.deq.diagnostics reports ‖h(z*)‖ / ‖g‖

    def __init__(self, padding: int):
        self.padding = padding

    def __call__(self, z, inj, k1, shift, scale, k2):
        h = F.softplus(F.conv2d(z, k1, padding=self.padding) + shift[:, :, None, None])
        return F.conv2d(h * scale[:, :, None, None], k2, padding=self.padding) + inj


def instance_norm(z, gamma, beta, eps: float = 1e-5):
    """Per-sample, per-channel normalization over the spatial dimensions, then ``γ·ẑ + β`` (``[C]`` each): the
    norm of the authors' DEQ-NCSN ResBlock, written with plain ops so it is differentiable to every order."""
    mean = z.mean(dim=(2, 3), keepdim=True)
    var = (z - mean).pow(2).mean(dim=(2, 3), keepdim=True)
    return (z - mean) / (var + eps).sqrt() * gamma[None, :, None, None] + beta[None, :, None, None]


class NormalizedResidualMap:
    """The DEQ paper authors' DEQ-NCSN map (their ``ncsn/models/ncsnv2.py``): a whole normalized ResBlock with
    its identity shortcut, divided by w, plus the block's input x as the injection (identity injection):

        φ(z; x) = (z + r(z)) / w + x,  r(z) = conv(ELU(IN(conv(ELU(IN(z)), K₁))), K₂),  w = 2‖K₁‖_F‖K₂‖_F

    (IN: :func:`instance_norm` with affine γ, β; ``inv_w`` = 1/w is a map parameter, computed with autograd by the
    block). The norms make r invariant to the scale of z, so the division by w shrinks the ResBlock's output
    without making the map nearly constant in z (where K/(λ√9‖K‖_F) does). Nothing bounds its Lipschitz constant
    (an instance norm's is 1/std); convergence is measured (``last_stats``, ``hit_cap``), not guaranteed.
    """

    additive_injection = True  # φ(z) = h(z) + x: src.deq.diagnostics reports ‖h(z*)‖ / ‖x‖

    def __init__(self, padding: int, recompute: bool = True, hand_products: bool = True):
        self.padding = padding
        # hand_products=False: the implicit backward's adjoint solves take autograd's generic Jacobian products
        # instead of :meth:`linearize`'s (a benchmark arm: benchmarks/studies/ncsn_deq_cost.py)
        if not hand_products:
            self.linearize = None
        # ELU(IN(·)) by the recomputing norm (src.layers.instance_norm.norm_act with α = 0: instance norm++ without
        # its channel-means term is the instance norm): it saves only its input for backward and recomputes the
        # rest, at every derivative order. The exact second-order path of SSM-VR builds φ's graph and its
        # create_graph backward at every level of the implicit backward, and with plain ops the norms kept six
        # full-size tensors each there: at ncsn_mnist recomputing cuts the record block's step from 558 to 413 MB
        # saved and 2.30 to 2.04 s (benchmarks/results/ncsn_deq_cost.md, record_plain_norms vs record). False: plain
        # ops.
        self.recompute = bool(recompute)

    @property
    def forward_mode_map(self) -> NormalizedResidualMap:
        """The same map in plain ops, for forward-mode AD (the recomputing norm has no JVP rule); the implicit
        backward itself steps with :meth:`linearize`'s products (src.deq.implicit)."""
        return NormalizedResidualMap(self.padding, recompute=False)

    def linearize(self, z, inj, g1, b1, k1, g2, b2, k2, inv_w, eps: float = 1e-5):
        """(v ↦ J v, v ↦ Jᵀ v) with J = ∂φ/∂z at ``z`` (the fixed point), written out by hand, no autograd: the
        products the implicit backward's adjoint solves take once per iteration (src.deq.implicit). The
        recomputing norm has no forward-mode rule, and autograd's generic products cost 1.4x (VJP on a graph built
        once) to 3-4x (torch.func.jvp) a forward evaluation on a CPU; these cost about one forward evaluation
        (two convolutions plus elementwise work).

        Per layer, n = γ·(x − μ)·r + β with r = (mean((x − μ)²) + ε)^(−1/2) and e = ELU(n):
        de = ELU'(n)·γ·(r·P dx − r³·(x − μ)·mean((x − μ)·P dx)), P the spatial centring (self-adjoint), whose
        transpose is Tᵀy = P(r·a y − r³·(x − μ)·mean((x − μ)·a y)), a = ELU'(n)·γ; a convolution's transpose is
        the convolution with the flipped, transposed kernel. J v = (v + h'(z) v)·inv_w.
        Float64 tests against autograd: tests/test_deq_normalized_residual.py."""
        pad = self.padding
        with torch.no_grad():
            def layer(x, gamma, beta):  # what T and Tᵀ need that does not depend on the direction, computed once
                mu = x.mean(dim=(2, 3), keepdim=True)
                xc = x - mu
                r = torch.rsqrt((xc * xc).mean(dim=(2, 3), keepdim=True) + eps)
                n = xc * r * gamma[None, :, None, None] + beta[None, :, None, None]
                e = F.elu(n)
                a = torch.where(n > 0, torch.ones_like(n), e + 1) * gamma[None, :, None, None]  # ELU'(n)·γ
                r3xc = r.pow(3) * xc
                return e, (xc, a * r, a * r3xc, r3xc, xc * a)

            e1, s1 = layer(z, g1, b1)
            _, s2 = layer(F.conv2d(e1, k1, padding=pad), g2, b2)
            # a stride-1 convolution's transpose: the convolution with the flipped, in/out-swapped kernel and
            # padding k − 1 − p (a little faster on a CPU than conv_transpose2d)
            (k1t, p1t), (k2t, p2t) = ((k.flip(2, 3).transpose(0, 1).contiguous(), k.shape[-1] - 1 - pad)
                                      for k in (k1, k2))

        def centred(x):
            return x - x.mean(dim=(2, 3), keepdim=True)

        def tangent(dx, s):  # a·r·P dx − a·r³·xc·mean(xc·P dx)
            xc, ar, ar3xc, _, _ = s
            dxc = centred(dx)
            return ar * dxc - ar3xc * (xc * dxc).mean(dim=(2, 3), keepdim=True)

        def cotangent(y, s):  # P(a·r·y − r³·xc·mean(xc·a·y))
            _, ar, _, r3xc, xca = s
            return centred(ar * y - r3xc * (xca * y).mean(dim=(2, 3), keepdim=True))

        def jvp(v):
            d = F.conv2d(tangent(v, s1), k1, padding=pad)
            return (v + F.conv2d(tangent(d, s2), k2, padding=pad)) * inv_w

        def vjp(v):
            d = cotangent(F.conv2d(v, k2t, padding=p2t), s2)
            return (v + cotangent(F.conv2d(d, k1t, padding=p1t), s1)) * inv_w

        return jvp, vjp

    def _norm_elu(self, z, gamma, beta):
        if self.recompute and z.shape[1] > 1:  # the channel-means term needs ≥ 2 channels (it is 0 here anyway)
            return norm_act(z, gamma, torch.zeros_like(gamma), beta, act=True)
        return F.elu(instance_norm(z, gamma, beta))

    def __call__(self, z, inj, g1, b1, k1, g2, b2, k2, inv_w):
        h = F.conv2d(self._norm_elu(z, g1, b1), k1, padding=self.padding)
        h = F.conv2d(self._norm_elu(h, g2, b2), k2, padding=self.padding)
        return (z + h) * inv_w + inj
