"""NICE flow (Dinh et al. 2014) as used by the paper (§4.3, App. D.2) and the SSM reference code.

    x ──permute (even indices, then odd)──> (h₁, h₂)
      ──4 additive couplings, alternating:  h₂ += m₀(h₁),  h₁ += m₁(h₂),  h₂ += m₂(h₁),  h₁ += m₃(h₂)
      ──concatenate, diagonal scale:        y = [h₁, h₂] · exp(s)           (s initialised to 0)

    log p(x) = Σ_i log N(y_i; 0, 1) + Σ_i s_i

Every coupling has Jacobian determinant 1 and the permutation |det| = 1, so the density is exact and
normalised in the input space (for MNIST: the logit space of ``src/data/mnist.py``; pixel-space bits/dim
adds that module's Jacobians). The latent ``y`` is kept in the permuted order (even input indices first):
the prior is isotropic, so the order does not matter, and ``inverse`` undoes it.

Each coupling function m maps one half to the other (``ceil(D/2)`` and ``floor(D/2)`` entries; equal for
D = 784). By default it is the reference MLP: ``mlp_layers`` dense layers, ``hidden`` wide, Softplus between
them (784 → 392→1000→1000→1000→1000→392 per coupling, 15.15 M parameters in all). Any other network is
plugged in through ``coupling_net``, a factory ``(in_dim, out_dim) -> nn.Module`` called once per coupling,
in order; :func:`deq_coupling_factory` builds the paper's DEQ variant (each MLP → one dense DEQ block, via
the shared builder :mod:`src.models.deq_net`: injection → DEQ block → linear read-out).
Because m's output is only *added*, the flow stays exactly invertible whatever m is, provided m is a
deterministic function of its input (a DEQ solved to tolerance ``tol`` is, up to ``tol``).

The permutation is index-based (no dense 784×784 matmul, unlike the reference code).
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
from torch import nn

from src.deq.config import DEQConfig, resolve_depth
from src.models.deq_net import DEQNetFactory
from src.models.features import mlp

CouplingFactory = Callable[[int, int], nn.Module]


class MLPCouplingFactory:
    """Picklable factory of the reference coupling MLP (the default of :class:`NICE`)."""

    def __init__(self, hidden: int = 1000, n_layers: int = 5):
        self.hidden = int(hidden)
        self.n_layers = int(n_layers)

    def __call__(self, in_dim: int, out_dim: int) -> nn.Module:
        return mlp(in_dim, out_dim, hidden=self.hidden, n_layers=self.n_layers)

    def __repr__(self) -> str:
        return f"MLPCouplingFactory(hidden={self.hidden}, n_layers={self.n_layers})"


class DEQCouplingFactory(DEQNetFactory):
    """Picklable factory of DEQ coupling functions (paper App. D.2): :class:`src.models.deq_net.DEQNet`
    ``injection g → DenseDEQBlock(width, n_layers) → Linear(width, out_dim)``, no skip, with the NICE family's
    defaults (``deq.injection: null`` → linear). Blocks are named ``f"{name}.{k}"`` for the k-th call."""

    def __init__(self, width: int, deq_config: DEQConfig | None = None, n_layers: int = 1, name: str = "nice.coupling",
                 injection: str | None = None):
        super().__init__(width, deq_config, n_layers=n_layers, family="nice", injection=injection, kind="dense",
                         skip=False, name=name)


def deq_coupling_factory(width: int, deq_config: DEQConfig | None = None, n_layers: int = 1,
                         injection: str | None = None) -> DEQCouplingFactory:
    """Factory for ``NICE(coupling_net=...)``: each coupling MLP becomes one dense DEQ block ``width`` wide.

    ``deq_config`` is the blocks' setting, a :class:`src.deq.config.DEQConfig` (its ``injection`` key picks g),
    or None for the defaults.
    """
    return DEQCouplingFactory(width, deq_config, n_layers=n_layers, injection=injection)


class NICE(nn.Module):
    """Additive-coupling flow with a diagonal scaling layer and a standard-normal prior (see module doc).

    Inputs are ``[B, dim]``; ``[B, *shape]`` with ``prod(shape) == dim`` (e.g. ``[B, 1, 28, 28]``) is
    flattened, and results have the flat shape.
    """

    def __init__(
        self,
        dim: int = 784,
        n_couplings: int = 4,
        hidden: int = 1000,
        mlp_layers: int = 5,
        coupling_net: CouplingFactory | None = None,
    ):
        super().__init__()
        if dim < 2:
            raise ValueError(f"NICE needs dim >= 2 (two halves to couple), got {dim}")
        if n_couplings < 1:
            raise ValueError(f"n_couplings must be >= 1, got {n_couplings}")
        self.dim = int(dim)
        self.n_couplings = int(n_couplings)
        self.n_first = (self.dim + 1) // 2  # even input indices 0, 2, 4, ...
        self.n_second = self.dim // 2  # odd input indices 1, 3, 5, ...
        perm = torch.cat([torch.arange(0, self.dim, 2), torch.arange(1, self.dim, 2)])
        self.register_buffer("perm", perm, persistent=False)
        self.register_buffer("inv_perm", torch.argsort(perm), persistent=False)

        factory = coupling_net if coupling_net is not None else MLPCouplingFactory(hidden, mlp_layers)
        nets = []
        for k in range(self.n_couplings):
            # even k updates the second half from the first, odd k the first from the second
            src, dst = (self.n_first, self.n_second) if k % 2 == 0 else (self.n_second, self.n_first)
            nets.append(factory(src, dst))
        self.couplings = nn.ModuleList(nets)
        self.log_scale = nn.Parameter(torch.zeros(self.dim))

    # ------------------------------------------------------------------ transforms
    def _flat(self, x: torch.Tensor) -> torch.Tensor:
        x = x.flatten(1) if x.dim() > 2 else x
        if x.dim() != 2 or x.shape[1] != self.dim:
            raise ValueError(f"NICE(dim={self.dim}) expects inputs [B, {self.dim}] (or [B, ...] with "
                             f"{self.dim} entries per sample), got shape {tuple(x.shape)}")
        return x

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Data → latent y (in the permuted order: even input indices first)."""
        h = self._flat(x)[:, self.perm]
        h1, h2 = h[:, : self.n_first], h[:, self.n_first :]
        for k, m in enumerate(self.couplings):
            if k % 2 == 0:
                h2 = h2 + m(h1)
            else:
                h1 = h1 + m(h2)
        return torch.cat([h1, h2], dim=1) * self.log_scale.exp()

    def inverse(self, y: torch.Tensor) -> torch.Tensor:
        """Latent → data (flat ``[B, dim]``, original index order)."""
        h = self._flat(y) * torch.exp(-self.log_scale)
        h1, h2 = h[:, : self.n_first], h[:, self.n_first :]
        for k in reversed(range(self.n_couplings)):
            m = self.couplings[k]
            if k % 2 == 0:
                h2 = h2 - m(h1)
            else:
                h1 = h1 - m(h2)
        return torch.cat([h1, h2], dim=1)[:, self.inv_perm]

    def log_det_jacobian(self) -> torch.Tensor:
        """log |det ∂y/∂x| = Σ s (the same for every input: couplings and permutation contribute 0)."""
        return self.log_scale.sum()

    # ------------------------------------------------------------------ densities
    def log_likelihood(self, x: torch.Tensor) -> torch.Tensor:
        """Exact normalised log density of x in the input space, ``[B]``."""
        y = self.forward(x)
        log_prior = -0.5 * y.pow(2).sum(dim=1) - 0.5 * self.dim * math.log(2 * math.pi)
        return log_prior + self.log_det_jacobian()

    def log_density(self, x: torch.Tensor) -> torch.Tensor:
        """log p̃(x) for the score-matching objectives: the normalised :meth:`log_likelihood` itself."""
        return self.log_likelihood(x)

    @torch.no_grad()
    def sample(self, n: int, generator: torch.Generator | None = None) -> torch.Tensor:
        """``n`` samples ``[n, dim]`` (no autograd graph): x = f⁻¹(y), y ~ N(0, I)."""
        ref = self.log_scale
        if generator is not None and generator.device != ref.device:
            y = torch.randn(n, self.dim, generator=generator, device=generator.device, dtype=ref.dtype)
            y = y.to(ref.device)
        else:
            y = torch.randn(n, self.dim, generator=generator, device=ref.device, dtype=ref.dtype)
        return self.inverse(y)

    def extra_repr(self) -> str:
        return f"dim={self.dim}, n_couplings={self.n_couplings}"


def build_nice(dim: int, *, deq: DEQConfig | None = None, depth: int | None = None, n_couplings: int = 4,
               hidden: int = 1000, deq_width: int = 1000) -> NICE:
    """The NICE of ``model=nice`` (``model.net``): ``n_couplings`` couplings, each an MLP of ``depth`` dense layers
    ``hidden`` wide (``deq`` None), or one dense DEQ block ``deq_width`` wide with ``depth`` layers inside its map
    (``deq``: the parsed DEQ setting, a ``DEQConfig``); ``depth`` None: the family's default
    (:func:`src.deq.config.resolve_depth`, 5 explicit layers, 1 inside the DEQ)."""
    depth = resolve_depth("nice", depth, deq)
    if deq is not None:
        return NICE(dim, n_couplings=n_couplings, coupling_net=deq_coupling_factory(deq_width, deq, n_layers=depth))
    return NICE(dim, n_couplings=n_couplings, hidden=hidden, mlp_layers=depth)
