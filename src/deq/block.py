"""DEQ blocks: z* = f(z*; x) with f a contraction (paper eq. 5, §3.2), in two backward modes.

- ``phantom`` (paper Alg. 1): solve z* under ``no_grad``, then K = ``phantom_steps`` iterations of f with
  autograd from the detached z*. Derivatives w.r.t. x are the K-term Neumann series of (I − J)⁻¹
  (Prop. 2), differentiable to every order by plain autograd; error ~ ρ(J)^K.
- ``implicit``: the exact implicit derivatives of every order (Prop. 1, eqs. 8–9) through
  :func:`src.deq.implicit.fixed_point`, at memory independent of the number of solver iterations.

The map is f(z; x) = φ(z; p) with p = (g(x), normalised weights...) computed *outside* the solver with
ordinary autograd: the input injection g(x) once per call, the Frobenius normalisation (§3.2) once per call.
Blocks keep the previous fixed point per batch shape and start the solver there (warm start, §3.4).
"""

from __future__ import annotations

import math
import warnings

import torch
import torch.nn.functional as F
from torch import nn

from src.deq.config import DEQConfig
from src.deq.implicit import fixed_point
from src.deq.normalization import frobenius_normalize
from src.deq.solvers import solve

_WARM_CACHE_SIZE = 8


# ---------------------------------------------------------------------------------------------- maps
def dense_map(z, inj, w1, *rest):
    """φ(z) = σ(W_L … σ(W_2 σ(W_1 z + g(x)) + b_2) … + b_L), σ = Softplus; rest = (W_2, b_2, …)."""
    h = F.softplus(z @ w1.T + inj)
    for i in range(0, len(rest), 2):
        h = F.softplus(h @ rest[i].T + rest[i + 1])
    return h


class ConvMap:
    """φ(z) = σ(conv(z, K) + g(y)) (eq. 5 with W a convolution)."""

    def __init__(self, padding: int):
        self.padding = padding

    def __call__(self, z, inj, kernel):
        return F.softplus(F.conv2d(z, kernel, padding=self.padding) + inj)


class ResidualMap:
    """φ(z) = h(z) + g(y), h(z) = conv(σ(conv(z, K₁) + b₁), K₂) (NCSN's DEQ-ResBlock, App. D.4)."""

    def __init__(self, padding: int):
        self.padding = padding

    def __call__(self, z, inj, k1, b1, k2):
        h = F.softplus(F.conv2d(z, k1, padding=self.padding) + b1[None, :, None, None])
        return F.conv2d(h, k2, padding=self.padding) + inj


# --------------------------------------------------------------------------------------------- base
class DEQBlock(nn.Module):
    """Base class: solve, backward mode, warm start and statistics. Subclasses define the map."""

    def __init__(self, config: DEQConfig | None = None, name: str = "deq"):
        super().__init__()
        self.config = config if config is not None else DEQConfig()
        self.name = name
        self.last_stats: dict = {}
        self._warm: dict[tuple, torch.Tensor] = {}
        self._nonconverged = 0

    # subclasses -------------------------------------------------------------------------------
    def map_params(self, x: torch.Tensor) -> tuple:
        raise NotImplementedError

    def state_shape(self, x: torch.Tensor) -> tuple:
        raise NotImplementedError

    phi = None  # the map φ(z, *params): a picklable callable

    # warm start -------------------------------------------------------------------------------
    def reset_warm_start(self) -> None:
        self._warm = {}

    def warm_start_state(self) -> dict:
        return {"x".join(map(str, k)): v.detach().cpu().clone() for k, v in self._warm.items()}

    def load_warm_start_state(self, state: dict) -> None:
        self._warm = {tuple(int(s) for s in k.split("x")): v for k, v in state.items()}

    def _initial(self, x: torch.Tensor) -> torch.Tensor:
        shape = self.state_shape(x)
        z = self._warm.get(tuple(shape)) if self.config.warm_start else None
        if z is not None:
            return z.to(device=x.device, dtype=x.dtype)
        return torch.zeros(shape, device=x.device, dtype=x.dtype)

    def _remember(self, z_star: torch.Tensor) -> None:
        if not self.config.warm_start:
            return
        key = tuple(z_star.shape)
        self._warm.pop(key, None)
        self._warm[key] = z_star.detach()
        while len(self._warm) > _WARM_CACHE_SIZE:
            self._warm.pop(next(iter(self._warm)))

    # solve ----------------------------------------------------------------------------------------
    def _solver_kwargs(self) -> dict:
        c = self.config
        return {"method": c.solver, "tol": float(c.tol), "max_iter": int(c.max_iter), "stop_mode": c.stop_mode,
                "anderson_m": int(c.anderson_m), "anderson_beta": float(c.anderson_beta)}

    def fixed_point_map(self, x: torch.Tensor):
        """z ↦ f(z; x) with the current weights, detached (for solver benchmarks and analysis)."""
        params = tuple(p.detach() for p in self.map_params(x))
        phi = self.phi
        return lambda z: phi(z, *params)

    def unroll(self, x: torch.Tensor, steps: int, z0: torch.Tensor | None = None) -> torch.Tensor:
        """``steps`` plain iterations of f from z0 (zeros) with autograd through all of them.

        The reference the phantom and implicit derivatives are judged against (App. C): exact in the limit,
        at memory proportional to ``steps``. Ignores the solver, the warm start and ``config.backward``.
        """
        params = self.map_params(x)
        z = torch.zeros(self.state_shape(x), device=x.device, dtype=params[0].dtype) if z0 is None else z0
        for _ in range(int(steps)):
            z = self.phi(z, *params)
        return z

    def _record(self, stats: dict) -> None:
        self.last_stats = stats
        if not stats.get("converged", True):
            self._nonconverged += 1
            n = self._nonconverged
            if n & (n - 1) == 0:  # 1st, 2nd, 4th, 8th, ... occurrence: informative, not a flood
                warnings.warn(
                    f"DEQ block '{self.name}' did not converge: residual {stats['residual']:.3e} > "
                    f"tol {self.config.tol:g} after {stats['iterations']} iterations (occurrence {n}). "
                    "Raise deq.max_iter, raise deq.norm_lambda (a stronger contraction), or try "
                    "deq.solver=anderson.",
                    RuntimeWarning,
                    stacklevel=3,
                )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        params = self.map_params(x)
        z0 = self._initial(x)
        phi, cfg = self.phi, self.config
        if cfg.backward == "implicit":
            stats: dict = {}
            z = fixed_point(phi, z0, params, self._solver_kwargs(), stats)
            self._remember(z)
        else:
            detached = tuple(p.detach() for p in params)
            res = solve(lambda u: phi(u, *detached), z0, **self._solver_kwargs())
            stats = {"iterations": res.iterations, "residual": float(res.residual.max()),
                     "converged": res.converged}
            self._remember(res.z)
            z = res.z.detach()
            for _ in range(int(cfg.phantom_steps)):
                z = phi(z, *params)
        self._record(stats)
        return z


# ------------------------------------------------------------------------------------------ blocks
class DenseDEQBlock(DEQBlock):
    """Dense block, eq. 5: f(z; x) = Softplus(W z + g(x)), or ``n_layers`` such layers composed (layer 1
    gets the injection); every W Frobenius-normalised (§3.2) so f is a contraction."""

    def __init__(self, in_dim: int, width: int, n_layers: int = 1, injection: nn.Module | None = None,
                 config: DEQConfig | None = None, name: str = "deq"):
        super().__init__(config, name)
        if int(n_layers) < 1:
            raise ValueError(f"n_layers must be >= 1 (layers inside the DEQ map f), got {n_layers}")
        self.in_dim, self.width, self.n_layers = int(in_dim), int(width), int(n_layers)
        self.injection = injection if injection is not None else nn.Linear(in_dim, width)
        self.weights = nn.ParameterList(
            nn.Parameter(torch.randn(width, width) / math.sqrt(width)) for _ in range(self.n_layers)
        )
        self.biases = nn.ParameterList(nn.Parameter(torch.zeros(width)) for _ in range(self.n_layers - 1))
        self.phi = dense_map

    def state_shape(self, x):
        return (x.shape[0], self.width)

    def map_params(self, x):
        lam = self.config.norm_lambda
        ws = [frobenius_normalize(w, lam) for w in self.weights]
        rest = []
        for w, b in zip(ws[1:], self.biases):
            rest += [w, b]
        return (self.injection(x), ws[0], *rest)


class ConvDEQBlock(DEQBlock):
    """Convolutional block: f(z; y) = Softplus(conv(z, K) + g(y)), K Frobenius-normalised (with the
    sqrt(k_h k_w) factor that makes the convolution's operator norm < 1/λ)."""

    def __init__(self, in_channels: int, channels: int, kernel_size: int = 3, injection: nn.Module | None = None,
                 config: DEQConfig | None = None, name: str = "deq.conv"):
        super().__init__(config, name)
        if kernel_size % 2 != 1:
            raise ValueError(f"kernel_size must be odd (same padding), got {kernel_size}")
        self.channels, self.kernel_size = int(channels), int(kernel_size)
        pad = kernel_size // 2
        self.injection = injection if injection is not None else nn.Conv2d(in_channels, channels, kernel_size, padding=pad)
        self.kernel = nn.Parameter(torch.randn(channels, channels, kernel_size, kernel_size) / math.sqrt(channels * kernel_size**2))
        self.phi = ConvMap(pad)

    def state_shape(self, x):
        return (x.shape[0], self.channels, *x.shape[2:])

    def map_params(self, x):
        k = frobenius_normalize(self.kernel, self.config.norm_lambda, scale=float(self.kernel_size))
        return (self.injection(x), k)


class ResidualDEQBlock(DEQBlock):
    """NCSN's DEQ-ResBlock (App. D.4): f(z; y) = h(z) + g(y) with h(z) = conv(σ(conv(z) + b)), both kernels
    normalised so h — and hence f — is a contraction."""

    def __init__(self, in_channels: int, channels: int, kernel_size: int = 3, injection: nn.Module | None = None,
                 config: DEQConfig | None = None, name: str = "deq.res"):
        super().__init__(config, name)
        self.channels, self.kernel_size = int(channels), int(kernel_size)
        pad = kernel_size // 2
        self.injection = injection if injection is not None else nn.Conv2d(in_channels, channels, kernel_size, padding=pad)
        scale = 1.0 / math.sqrt(channels * kernel_size**2)
        self.kernel1 = nn.Parameter(torch.randn(channels, channels, kernel_size, kernel_size) * scale)
        self.bias1 = nn.Parameter(torch.zeros(channels))
        self.kernel2 = nn.Parameter(torch.randn(channels, channels, kernel_size, kernel_size) * scale)
        self.phi = ResidualMap(pad)

    def state_shape(self, x):
        return (x.shape[0], self.channels, *x.shape[2:])

    def map_params(self, x):
        lam, s = self.config.norm_lambda, float(self.kernel_size)
        return (self.injection(x), frobenius_normalize(self.kernel1, lam, scale=s), self.bias1,
                frobenius_normalize(self.kernel2, lam, scale=s))
