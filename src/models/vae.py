"""SSM-VAE: a VAE with an implicit encoder whose entropy gradient comes from a score estimator (paper §4.1).

*Efficient Score Matching with Deep Equilibrium Layers* §4.1, App. D.3, Tables 1, 6, 7 (after Song et al.
2019, "Sliced score matching", §4.2). The encoder is implicit: z = E(x, ε), ε ~ N(0, I), with no tractable
density q(z|x). The ELBO E_q[log p(x|z) + log p(z) − log q(z|x)] needs ∇_θ E_q[log q(z|x)], and since
E_q[∇_θ log q(z|x)]|_z = 0, that gradient is E_ε[∇_z log q(z|x) · ∂z/∂θ]: the gradient of the surrogate
E_ε[⟨stop-grad(s(z|x)), z⟩] with a score estimator s(z|x) ≈ ∇_z log q(z|x) trained by sliced score matching
on z ~ q(z|x) (:func:`entropy_surrogate`; tests/test_vae.py checks the identity on a Gaussian encoder).

Modules (nn.Modules, no Lightning):

- :class:`ImplicitEncoder` — ``mlp`` (MNIST, as the SSM reference: MLP of concat[x, ε]) or ``conv``
  (conv features of x, concatenated with ε, then a dense layer) → z ∈ R^{D_z};
- :class:`Decoder` — Bernoulli logits (binarised MNIST) or Gaussian means with fixed or learned log σ
  (CIFAR-10/CelebA in [−1, 1]);
- :func:`build_vae_networks` — the three from one set of sizes (``model.net`` of ``model=vae``);
- :class:`ScoreEstimator` — s(z|x) ∈ R^{D_z}. ``conv`` (Table 6): input concat[x, Softplus(Dense(z))]
  (Dense(z) reshaped to the image), a 5×5 Softplus conv to ``m`` channels, the *pre-processing*, stride-2
  5×5 Softplus convs, a dense read-out to D_z. Pre-processing: ``deq=false depth=k`` adds k stride-1 5×5
  convs with m channels and Softplus (k = 0: SSM VAE; 8/16: Aug(8)/Aug(16)); ``deq=true`` replaces the
  input conv and those layers by one conv DEQ block z* = Softplus(Ŵ z* + g(y)) with a *linear* injection
  g = the 5×5 input conv (Table 7), so that Ŵ = 0 gives exactly the k = 0 network (no double squash).
  ``mlp`` (MNIST): concat[x, Softplus(Dense(z))] → Dense(m) Softplus → k dense Softplus layers or a dense
  DEQ block → Dense(D_z).
"""

from __future__ import annotations

import itertools
import math
from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import nn

from src.deq.block import ConvDEQBlock, DenseDEQBlock
from src.deq.config import DEQConfig, resolve_depth
from src.models.deq_net import make_injection

ARCHS = ("mlp", "conv")
LIKELIHOODS = ("bernoulli", "gaussian")


def _n_down(size: int) -> int:
    """Halvings of an image side before it reaches ≤ 4 or turns odd (28 → 2: 7×7; 32 → 3; 64 → 4)."""
    n = 0
    while size % 2 == 0 and size > 4:
        size //= 2
        n += 1
    return n


def conv_out_size(size: int, n: int) -> int:
    for _ in range(n):
        size = (size + 2 * 2 - 5) // 2 + 1
    return size


class ConvFeatures(nn.Module):
    """Stride-2 5×5 Softplus convs ``channels[i] -> channels[i+1]``, then flatten."""

    def __init__(self, channels: list[int]):
        super().__init__()
        self.convs = nn.ModuleList(nn.Conv2d(a, b, 5, stride=2, padding=2) for a, b in itertools.pairwise(channels))

    def forward(self, h):
        for conv in self.convs:
            h = F.softplus(conv(h))
        return h.flatten(1)


class ImplicitEncoder(nn.Module):
    """z = E(x, ε), ε ~ N(0, I_{noise_dim}): no density, only samples (paper §4.1).

    ``mlp``: MLP(concat[x, ε]) with ``hidden`` Softplus units (two hidden layers, as the SSM reference);
    ``conv``: conv features of x (stride-2 5×5 Softplus convs m, 2m, 4m…), concat ε, Dense(hidden) Softplus,
    Dense(D_z)."""

    def __init__(self, image_shape, latent_dim: int, arch: str = "mlp", hidden: int = 256, channels: int = 32,
                 noise_dim: int | None = None):
        super().__init__()
        self.image_shape, self.latent_dim, self.arch = tuple(image_shape), int(latent_dim), arch
        self.noise_dim = int(noise_dim or latent_dim)
        c, h, _ = self.image_shape
        d = math.prod(self.image_shape)
        if arch == "mlp":
            self.features = nn.Flatten()
            feat = d
        elif arch == "conv":
            n = _n_down(h)
            chans = [c] + [channels * 2**i for i in range(n)]
            self.features = ConvFeatures(chans)
            feat = chans[-1] * conv_out_size(h, n) * conv_out_size(self.image_shape[2], n)
        else:
            raise ValueError(f"model.net.arch={arch!r} is unknown; valid: {', '.join(ARCHS)}")
        self.head = nn.Sequential(nn.Linear(feat + self.noise_dim, hidden), nn.Softplus(),
                                  nn.Linear(hidden, hidden), nn.Softplus(), nn.Linear(hidden, self.latent_dim))

    def forward(self, x: torch.Tensor, eps: torch.Tensor | None = None,
                generator: torch.Generator | None = None) -> torch.Tensor:
        if eps is None:
            eps = torch.randn(x.shape[0], self.noise_dim, device=x.device, dtype=x.dtype, generator=generator)
        return self.head(torch.cat([self.features(x), eps], 1))


class Decoder(nn.Module):
    """p(x|z): ``bernoulli`` (logits; binarised MNIST) or ``gaussian`` (mean, and log σ fixed at ``log_sigma``
    or learned as one scalar when ``learn_sigma``; CIFAR-10/CelebA in [−1, 1]).

    ``mlp``: Dense(hidden) Softplus ×2 → Dense(D); ``conv``: Dense(z) → 4m×s₀×s₀, transposed 5×5 stride-2
    Softplus convs up to the image size, a 5×5 conv to C channels."""

    def __init__(self, image_shape, latent_dim: int, arch: str = "mlp", likelihood: str = "bernoulli",
                 hidden: int = 256, channels: int = 32, log_sigma: float = 0.0, learn_sigma: bool = False):
        super().__init__()
        if likelihood not in LIKELIHOODS:
            raise ValueError(f"model.net.likelihood={likelihood!r} is unknown; valid: {', '.join(LIKELIHOODS)}")
        self.image_shape, self.latent_dim, self.arch, self.likelihood = tuple(image_shape), int(latent_dim), arch, likelihood
        c, h, w = self.image_shape
        d = math.prod(self.image_shape)
        if arch == "mlp":
            self.net = nn.Sequential(nn.Linear(latent_dim, hidden), nn.Softplus(), nn.Linear(hidden, hidden),
                                     nn.Softplus(), nn.Linear(hidden, d))
        elif arch == "conv":
            n = _n_down(h)
            self.n_up, self.s0 = n, (h >> n, w >> n)
            chans = [channels * 2 ** max(n - 1 - i, 0) for i in range(n + 1)]  # 4m, 2m, m, m for n = 3
            self.fc = nn.Linear(latent_dim, chans[0] * self.s0[0] * self.s0[1])
            self.ups = nn.ModuleList(nn.ConvTranspose2d(a, b, 5, stride=2, padding=2, output_padding=1)
                                     for a, b in itertools.pairwise(chans))
            self.out = nn.Conv2d(chans[-1], c, 5, padding=2)
        else:
            raise ValueError(f"model.net.arch={arch!r} is unknown; valid: {', '.join(ARCHS)}")
        if learn_sigma:
            self.log_sigma = nn.Parameter(torch.tensor(float(log_sigma)))
        else:
            self.register_buffer("log_sigma", torch.tensor(float(log_sigma)))

    def forward(self, z: torch.Tensor) -> torch.Tensor:
        """Bernoulli logits or Gaussian means, ``[B, C, H, W]``."""
        if self.arch == "mlp":
            return self.net(z).reshape(z.shape[0], *self.image_shape)
        h = F.softplus(self.fc(z)).reshape(z.shape[0], -1, *self.s0)
        for up in self.ups:
            h = F.softplus(up(h))
        return self.out(h)

    def log_prob(self, x: torch.Tensor, z: torch.Tensor) -> torch.Tensor:
        """log p(x|z) per sample ``[B]`` (x binary for Bernoulli)."""
        out = self(z).flatten(1)
        x = x.flatten(1)
        if self.likelihood == "bernoulli":
            return -F.binary_cross_entropy_with_logits(out, x, reduction="none").sum(-1)
        ls = self.log_sigma.to(out.dtype)
        return (-0.5 * ((x - out) * torch.exp(-ls)).pow(2) - ls - 0.5 * math.log(2 * math.pi)).sum(-1)

    def mean(self, z: torch.Tensor) -> torch.Tensor:
        """E[x|z] in the data's model space (sigmoid of the logits, or the Gaussian mean)."""
        out = self(z)
        return torch.sigmoid(out) if self.likelihood == "bernoulli" else out


AUG_INITS = ("kaiming", "torch")


def init_aug_layers(layers) -> None:
    """He (Kaiming) normal weights, gain √2, and zero biases for the k extra Softplus layers of Aug(k).

    Why not PyTorch's default (uniform, variance 1/(3·fan_in)): each default layer shrinks the input-dependent
    part of the features by ≈ 1/√3 times Softplus' slope ≈ ½, so the output of a stack of 8 or 16 layers is
    nearly constant in (z, x) and the SSM objective drives it to s ≈ 0 — measured on binarised MNIST, the
    Aug(8) MLP estimator's test SSM loss stayed at −0.001 after 1000 iterations (the k = 0 estimator: −27.6).
    With this initialisation the 8- and 16-layer stacks train (docs/experiments.md, "SSM-VAE")."""
    for layer in layers:
        nn.init.kaiming_normal_(layer.weight, nonlinearity="relu")
        nn.init.zeros_(layer.bias)


class ScoreEstimator(nn.Module):
    """s(z|x) ≈ ∇_z log q(z|x), ``[B, D_z]`` (paper §4.1, Tables 6–7; see the module docstring).

    ``depth`` k explicit stride-1 layers (conv: 5×5, m channels; mlp: dense, m units), Softplus, when
    ``deq`` is disabled; one DEQ block (conv: ``ConvDEQBlock`` 5×5; mlp: ``DenseDEQBlock``) with a linear
    injection when it is enabled. ``deq`` is the parsed DEQ setting (:mod:`src.deq.config`: a ``DEQConfig``,
    or None for explicit layers); ``depth`` follows :data:`src.deq.config.DEPTH_RULES` (``vae``).
    ``aug_init``: ``kaiming`` (default, :func:`init_aug_layers`) or ``torch`` (PyTorch's default) for those k
    explicit layers."""

    def __init__(self, image_shape, latent_dim: int, arch: str = "mlp", channels: int = 32, depth: int | None = None,
                 deq: DEQConfig | None = None, n_down: int | None = None, aug_init: str = "kaiming"):
        super().__init__()
        if aug_init not in AUG_INITS:
            raise ValueError(f"model.net.aug_init={aug_init!r} is unknown; valid: {', '.join(AUG_INITS)}")
        config = deq
        self.deq_enabled = config is not None
        self.depth = resolve_depth("vae", depth, config)
        self.image_shape, self.latent_dim, self.arch, self.m = tuple(image_shape), int(latent_dim), arch, int(channels)
        c, h, w = self.image_shape
        d = math.prod(self.image_shape)
        self.embed = nn.Linear(latent_dim, d)  # Dense(z), reshaped to the image
        if self.deq_enabled:
            injection = config.injection
            if injection not in (None, "linear"):
                raise ValueError(f"deq.injection={injection!r}: the VAE score estimator's DEQ block takes a linear "
                                 "injection (the input layer's Softplus is the block's; a Softplus g would squash "
                                 "twice)")
        if arch == "conv":
            if self.deq_enabled:
                g = make_injection("conv", "linear", 2 * c, self.m, 5)
                self.block = ConvDEQBlock(2 * c, self.m, 5, injection=g, config=config, name="score_deq")
                self.layers = None
            else:
                self.block = None
                self.inp = nn.Conv2d(2 * c, self.m, 5, padding=2)
                self.layers = nn.ModuleList(nn.Conv2d(self.m, self.m, 5, padding=2) for _ in range(self.depth))
            n = _n_down(h) if n_down is None else int(n_down)
            chans = [self.m] + [self.m * 2**i for i in range(n)]
            self.down = ConvFeatures(chans)
            feat = chans[-1] * conv_out_size(h, n) * conv_out_size(w, n)
        elif arch == "mlp":
            if self.deq_enabled:
                g = make_injection("dense", "linear", 2 * d, self.m)
                self.block = DenseDEQBlock(2 * d, self.m, injection=g, config=config, name="score_deq")
                self.layers = None
            else:
                self.block = None
                self.inp = nn.Linear(2 * d, self.m)
                self.layers = nn.ModuleList(nn.Linear(self.m, self.m) for _ in range(self.depth))
            self.down = nn.Identity()
            feat = self.m
        else:
            raise ValueError(f"model.net.arch={arch!r} is unknown; valid: {', '.join(ARCHS)}")
        if self.layers is not None and aug_init == "kaiming":
            init_aug_layers(self.layers)
        self.readout = nn.Linear(feat, latent_dim)

    def preprocess_input(self, z: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        """y = concat[x, Softplus(Dense(z))] (images: along channels; mlp: flattened)."""
        e = F.softplus(self.embed(z))
        if self.arch == "conv":
            return torch.cat([x, e.reshape(x.shape)], 1)
        return torch.cat([x.flatten(1), e], 1)

    def features(self, y: torch.Tensor) -> torch.Tensor:
        """The pre-processing: Softplus(input layer) then k layers, or the DEQ fixed point."""
        if self.block is not None:
            return self.block(y)
        h = F.softplus(self.inp(y))
        for layer in self.layers:
            h = F.softplus(layer(h))
        return h

    def forward(self, z: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        return self.readout(self.down(self.features(self.preprocess_input(z, x))))


class VAENetworks(NamedTuple):
    """The SSM-VAE's three networks (each updated by its own optimiser: encoder and decoder by ``vae``, the score
    estimator by ``score``)."""

    encoder: ImplicitEncoder
    decoder: Decoder
    score_net: ScoreEstimator


def build_vae_networks(image_shape, *, deq: DEQConfig | None = None, depth: int | None = None, arch: str = "mlp",
                       latent_dim: int = 8, noise_dim: int | None = None, hidden: int = 256, channels: int = 32,
                       aug_init: str = "kaiming", enc_channels: int = 32, likelihood: str = "bernoulli",
                       log_sigma: float = 0.0, learn_sigma: bool = False) -> VAENetworks:
    """Encoder, decoder and score estimator of ``model=vae`` (``model.net``) for images ``image_shape``: ``arch``
    ``mlp`` | ``conv`` for all three; ``latent_dim`` D_z; ``hidden`` the dense width of encoder and decoder heads,
    ``enc_channels`` their base channels (conv); ``channels`` m, ``aug_init``, ``depth`` and ``deq`` (the parsed DEQ
    setting, None: explicit layers) the score estimator's pre-processing (:class:`ScoreEstimator`)."""
    return VAENetworks(
        ImplicitEncoder(image_shape, latent_dim, arch=arch, hidden=hidden, channels=enc_channels, noise_dim=noise_dim),
        Decoder(image_shape, latent_dim, arch=arch, likelihood=likelihood, hidden=hidden, channels=enc_channels,
                log_sigma=log_sigma, learn_sigma=learn_sigma),
        ScoreEstimator(image_shape, latent_dim, arch=arch, channels=channels, depth=depth, deq=deq, aug_init=aug_init))


class ConditionalScore:
    """A model-like view of s(·|x) with x bound, so the objectives of :mod:`src.objectives` (functions of
    ``(model, z)`` that call ``model.score(z)``) train the score estimator on z ~ q(z|x)."""

    def __init__(self, net: ScoreEstimator, x: torch.Tensor):
        self.net, self.x = net, x

    def score(self, z: torch.Tensor) -> torch.Tensor:
        return self.net(z, self.x)


def prior_log_prob(z: torch.Tensor) -> torch.Tensor:
    """log N(z; 0, I) per sample."""
    return -0.5 * z.pow(2).sum(-1) - 0.5 * z.shape[-1] * math.log(2 * math.pi)


def entropy_surrogate(score: torch.Tensor, z: torch.Tensor) -> torch.Tensor:
    """⟨stop-grad(s(z|x)), z⟩ per sample: its gradient w.r.t. the encoder's parameters (through z) is, in
    expectation, the gradient of E_q[log q(z|x)] = −entropy when s = ∇_z log q(z|x) (paper §4.1)."""
    return (score.detach() * z).flatten(1).sum(-1)


def surrogate_negative_elbo(decoder: Decoder, x: torch.Tensor, z: torch.Tensor, score: torch.Tensor,
                            entropy_weight: float = 1.0):
    """Per-sample −log p(x|z) − log p(z) + w·⟨stop-grad(s), z⟩ and its parts (reconstruction, prior).

    w = ``entropy_weight`` = 1 is the ELBO (paper §4.1); w = 0 drops the entropy term, the ablation that
    shows what the score estimator contributes (the encoder then trains on reconstruction + prior only)."""
    rec = -decoder.log_prob(x, z)
    prior = -prior_log_prob(z)
    if entropy_weight == 0:
        return rec + prior, rec, prior
    return rec + prior + entropy_weight * entropy_surrogate(score, z), rec, prior
