"""DEQ blocks: phantom gradient (Alg. 1, Prop. 2), warm start, statistics and warnings, modes and dtypes."""

from __future__ import annotations

import itertools
import pickle
import warnings

import pytest
import torch
import torch.nn.functional as F

from src.deq.block import ConvDEQBlock, DenseDEQBlock, ResidualDEQBlock
from src.deq.config import DEQConfig

pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py


def score_of(block, head, x):
    x = x.detach().clone().requires_grad_(True)
    z = block(x)
    (s,) = torch.autograd.grad((F.softplus(z @ head[0]) @ head[1]).sum(), x, create_graph=True)
    return s


def aligned_block(norm_lambda=2.0, width=12, **cfg):
    """W ≈ 11ᵀ and a large injection bias: the contraction rate ρ is close to its bound 1/λ."""
    torch.manual_seed(0)
    block = DenseDEQBlock(3, width, config=DEQConfig(norm_lambda=norm_lambda, **cfg)).double()
    with torch.no_grad():
        block.weights[0].copy_(torch.ones(width, width) + 0.3 * torch.randn(width, width))
        block.injection.bias.fill_(2.0)
    return block


def spectral_radius(block, x):
    """max over samples of ρ(J), J = ∂f/∂z at z* = diag(σ'(W̃z* + g(x))) W̃ for a one-layer dense block."""
    with torch.no_grad():
        inj, w = block.map_params(x)
        z = block(x)
        jac = torch.sigmoid(z @ w.T + inj)[:, :, None] * w
        return torch.linalg.eigvals(jac).abs().max().item()


def test_phantom_score_error_falls_geometrically_at_the_contraction_rate():
    """Prop. 2: the K-step phantom derivative is the K-term Neumann series, error ~ ρ(J)^K."""
    block = aligned_block(tol=1e-13, max_iter=1000, warm_start=False)
    head = [torch.randn(12, 4, dtype=torch.float64), torch.randn(4, dtype=torch.float64)]
    x = torch.randn(8, 3, dtype=torch.float64)
    rho = spectral_radius(block, x)
    assert 0.3 < rho < 0.5  # the bound is 1/λ = 0.5

    xr = x.clone().requires_grad_(True)
    z_ref = block.unroll(xr, 300)
    (s_ref,) = torch.autograd.grad((F.softplus(z_ref @ head[0]) @ head[1]).sum(), xr)
    errors = []
    for k in range(1, 9):
        block.config.phantom_steps = k
        s = score_of(block, head, x)
        errors.append(((s - s_ref).norm() / s_ref.norm()).item())
    ratios = [b / a for a, b in itertools.pairwise(errors)]
    assert all(r < 1.1 * rho for r in ratios), (rho, ratios)
    assert errors[7] < errors[1] * (1.1 * rho) ** 6
    assert errors[7] > errors[1] * (0.8 * rho) ** 6  # geometric at rate ρ, not an accident
    assert errors[1] > 1e-2  # K = 2 is far from exact on this slowly contracting block


def test_phantom_second_derivatives_converge_too():
    """Prop. 2, second part: the Hessian trace of the K-step map tends to the implicit one."""
    block = aligned_block(tol=1e-13, max_iter=1000, warm_start=False)
    head = [torch.randn(12, 4, dtype=torch.float64), torch.randn(4, dtype=torch.float64)]
    x = torch.randn(4, 3, dtype=torch.float64, requires_grad=True)

    def trace(energy_of_x):
        (s,) = torch.autograd.grad(energy_of_x(x).sum(), x, create_graph=True)
        return sum(torch.autograd.grad(s[:, i].sum(), x, retain_graph=True)[0][:, i] for i in range(3))

    def energy(k):
        block.config.phantom_steps = k
        return lambda x: F.softplus(block(x) @ head[0]) @ head[1]

    ref = trace(lambda x: F.softplus(block.unroll(x, 300) @ head[0]) @ head[1])
    errors = [((trace(energy(k)) - ref).norm() / ref.norm()).item() for k in (2, 10, 40)]
    assert errors[0] > errors[1] > errors[2] and errors[2] < 1e-10


def test_warm_start_cuts_iterations_and_can_be_reset_and_checkpointed():
    block = aligned_block(tol=1e-9, max_iter=500)
    x = torch.randn(16, 3, dtype=torch.float64)
    block(x)
    cold = block.last_stats["iterations"]
    block(x)
    warm = block.last_stats["iterations"]
    assert cold > 20 and warm <= 2

    state = block.warm_start_state()
    assert set(state) == {"16x12"}
    assert all(not t.requires_grad and t.grad_fn is None for t in state.values())  # no graph in the cache

    block(torch.randn(5, 3, dtype=torch.float64))  # another batch shape has its own entry
    assert set(block.warm_start_state()) == {"16x12", "5x12"}

    block.reset_warm_start()
    block(x)
    assert block.last_stats["iterations"] == cold

    other = aligned_block(tol=1e-9, max_iter=500)
    other.load_warm_start_state(state)
    other(x)
    assert other.last_stats["iterations"] <= 2


def test_warm_start_off_always_starts_cold():
    block = aligned_block(tol=1e-9, max_iter=500, warm_start=False)
    x = torch.randn(16, 3, dtype=torch.float64)
    block(x)
    first = block.last_stats["iterations"]
    block(x)
    assert block.last_stats["iterations"] == first and block.warm_start_state() == {}


@pytest.mark.parametrize("backward", ["phantom", "implicit"])
def test_non_convergence_warns_with_name_residual_iterations_and_advice(backward):
    block = aligned_block(norm_lambda=1.05, tol=1e-12, max_iter=3, backward=backward)
    block.name = "dkef.features"
    with pytest.warns(RuntimeWarning) as record:
        block(torch.randn(4, 3, dtype=torch.float64))
    msg = str(record[0].message)
    for part in ("dkef.features", "after 3 iterations", "residual", "deq.max_iter", "deq.norm_lambda", "deq.solver"):
        assert part in msg, msg
    assert block.last_stats["iterations"] == 3 and block.last_stats["converged"] is False
    assert block.last_stats["residual"] > 1e-12


def test_stats_after_forward():
    block = aligned_block(tol=1e-8, stop_mode="abs")
    block(torch.randn(4, 3, dtype=torch.float64))
    stats = block.last_stats
    assert set(stats) == {"iterations", "residual", "converged", "hit_cap"}
    assert stats["converged"] and stats["residual"] <= 1e-8 and isinstance(stats["residual"], float)
    assert stats["hit_cap"] is False


@pytest.mark.parametrize("backward", ["phantom", "implicit"])
def test_eval_mode_with_enable_grad_gives_the_training_score(backward):
    block = aligned_block(tol=1e-12, backward=backward, warm_start=False)
    head = [torch.randn(12, 4, dtype=torch.float64), torch.randn(4, dtype=torch.float64)]
    x = torch.randn(4, 3, dtype=torch.float64)
    s_train = score_of(block, head, x)
    block.eval()
    with torch.no_grad(), torch.enable_grad():
        s_eval = score_of(block, head, x)
    assert torch.allclose(s_train, s_eval, rtol=0, atol=1e-12)
    with torch.no_grad():
        assert not block(x).requires_grad


@pytest.mark.parametrize("backward", ["phantom", "implicit"])
@pytest.mark.parametrize("make", [
    lambda cfg: DenseDEQBlock(3, 8, n_layers=2, config=cfg),
    lambda cfg: ConvDEQBlock(2, 3, config=cfg),
    lambda cfg: ResidualDEQBlock(2, 3, config=cfg),
], ids=["dense", "conv", "residual"])
def test_float32_matches_float64_and_the_block_pickles(make, backward):
    torch.manual_seed(0)
    block64 = make(DEQConfig(tol=1e-6, backward=backward, phantom_steps=20)).double()
    block32 = pickle.loads(pickle.dumps(block64)).float()
    x = torch.randn(2, 3) if isinstance(block64, DenseDEQBlock) else torch.randn(2, 2, 4, 4)
    x = x.double().requires_grad_(True)
    z64 = block64(x)
    (g64,) = torch.autograd.grad(z64.pow(2).sum(), x)
    x32 = x.detach().float().requires_grad_(True)
    z32 = block32(x32)
    (g32,) = torch.autograd.grad(z32.pow(2).sum(), x32)
    assert z32.dtype == torch.float32 and block32.last_stats["converged"]
    assert torch.allclose(z32.double(), z64, atol=1e-5) and torch.allclose(g32.double(), g64, atol=1e-4)
    again = pickle.loads(pickle.dumps(block64))  # after a forward: the warm-start cache pickles too
    assert torch.equal(again(x.detach()), block64(x.detach()))


def test_bf16_autocast_keeps_the_solver_in_fp32():
    torch.manual_seed(0)
    block = DenseDEQBlock(3, 16, config=DEQConfig(tol=1e-6))
    x = torch.randn(4, 3)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        z = block(x)
    assert z.dtype == torch.float32 and block.last_stats["converged"]
    assert torch.allclose(z, block(x), atol=1e-6)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_implicit_matches_cpu():
    torch.manual_seed(0)
    block = DenseDEQBlock(3, 8, n_layers=2, config=DEQConfig(tol=1e-12, backward="implicit")).double()
    head = [torch.randn(8, 4, dtype=torch.float64), torch.randn(4, dtype=torch.float64)]
    x = torch.randn(5, 3, dtype=torch.float64)
    s_cpu = score_of(block, head, x)
    block_gpu = block.cuda()
    s_gpu = score_of(block_gpu, [h.cuda() for h in head], x.cuda())
    assert torch.allclose(s_gpu.cpu(), s_cpu, atol=1e-10)


def test_implicit_backward_stats_record_the_adjoint_solves():
    block = aligned_block(tol=1e-10, stop_mode="abs", backward="implicit")
    head = [torch.randn(12, 4, dtype=torch.float64), torch.randn(4, dtype=torch.float64)]
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # every solve converged: no warning
        # but torch's own DeprecationWarning (torch.jit.script), raised where the first forward-mode product of a
        # process loads torch's jvp decompositions: not a solve's, and it failed this test when run first
        warnings.filterwarnings("ignore", category=DeprecationWarning, module=r"torch\.")
        s = score_of(block, head, torch.randn(4, 3, dtype=torch.float64))
        s.pow(2).sum().backward()
    b = block.last_backward_stats
    # the score's adjoint (order 1); for the loss: the adjoint of that adjoint (order 2) and a fresh order-1
    # adjoint for z*'s own dependence on θ
    assert b["solves"] == 3 and b["converged"] and b["residual"] <= 1e-10


# ------------------------------------------------------------------------------ spectral normalization
def test_spectral_normalize_matches_the_exact_spectral_norm_and_its_gradient():
    from src.deq.normalization import spectral_normalize

    torch.manual_seed(0)
    w = torch.randn(30, 20, dtype=torch.float64, requires_grad=True)
    u = F.normalize(torch.randn(30, dtype=torch.float64), dim=0)
    g = torch.randn(30, 20, dtype=torch.float64)
    w_n = spectral_normalize(w, u, 2.0, n_power_iterations=500)
    ref = w / (2.0 * torch.linalg.matrix_norm(w, ord=2))  # independent reference: SVD
    assert torch.linalg.matrix_norm(w_n.detach(), ord=2).item() == pytest.approx(0.5, rel=1e-10)
    torch.testing.assert_close(w_n, ref, rtol=1e-10, atol=1e-12)
    (grad,) = torch.autograd.grad((w_n * g).sum(), w)
    (grad_ref,) = torch.autograd.grad((ref * g).sum(), w)
    torch.testing.assert_close(grad, grad_ref, rtol=1e-8, atol=1e-10)
    # evaluation: u is left alone, so repeated calls agree exactly
    u0 = u.clone()
    spectral_normalize(w.detach() + 0.1, u, 2.0, update=False)
    assert torch.equal(u, u0)


def test_spectral_block_contracts_at_its_rate_and_passes_gradcheck():
    torch.manual_seed(0)
    frob = DenseDEQBlock(3, 40, config=DEQConfig(tol=1e-12, max_iter=500)).double()
    spec = DenseDEQBlock(3, 40, config=DEQConfig(norm="spectral", tol=1e-12, max_iter=500,
                                                 backward="implicit")).double()
    spec.load_state_dict(frob.state_dict(), strict=False)  # same W and injection
    spec.sn_u0.copy_(F.normalize(torch.randn(40, dtype=torch.float64), dim=0))
    for _ in range(100):  # training-mode calls track the top singular vector
        spec.map_params(torch.zeros(1, 3, dtype=torch.float64))
    w_spec = spec.map_params(torch.zeros(1, 3, dtype=torch.float64))[1].detach()
    w_frob = frob.map_params(torch.zeros(1, 3, dtype=torch.float64))[1].detach()
    assert torch.linalg.matrix_norm(w_spec, ord=2).item() == pytest.approx(0.5, rel=1e-6)
    # Frobenius: a 40-wide random W contracts much faster than 1/λ (‖W‖_2 ≪ ‖W‖_F)
    assert torch.linalg.matrix_norm(w_frob, ord=2).item() < 0.2
    spec.eval()
    x = torch.randn(4, 3, dtype=torch.float64)
    z = spec(x)
    inj, w = spec.map_params(x)
    torch.testing.assert_close(z, F.softplus(z @ w.T + inj), rtol=0, atol=1e-10)  # a fixed point
    # exact implicit derivatives (first and second order) through the spectrally normalized map
    xg = x[:2].clone().requires_grad_(True)
    assert torch.autograd.gradcheck(spec, (xg,))
    assert torch.autograd.gradgradcheck(spec, (xg,))


def lattice_symbol_norm(kernel: torch.Tensor, n: int) -> torch.Tensor:
    """max over the n × n frequency lattice of ‖K̂(ω)‖₂ by FFT and SVD (autograd): the operator norm of the
    circular convolution on an n × n grid, independent of the power iteration."""
    kh, kw = kernel.shape[-2:]
    padded = F.pad(kernel, (0, n - kw, 0, n - kh))  # tap offsets only change phases, not singular values
    sym = torch.fft.fft2(padded).permute(2, 3, 0, 1)  # [n, n, C_out, C_in]
    return torch.linalg.matrix_norm(sym, ord=2).max()


def conv_matrix_norm(kernel: torch.Tensor, size: int) -> float:
    """Operator norm of the same-padded (zero) convolution on a size × size image, from its dense matrix."""
    c_in = kernel.shape[1]
    eye = torch.eye(c_in * size * size, dtype=kernel.dtype).reshape(-1, c_in, size, size)
    mat = F.conv2d(eye, kernel, padding=kernel.shape[-1] // 2).reshape(eye.shape[0], -1)
    return torch.linalg.matrix_norm(mat, ord=2).item()


def test_conv_spectral_normalize_against_fft_and_the_zero_padded_operator():
    from src.deq.normalization import conv_spectral_normalize

    torch.manual_seed(0)
    k = torch.randn(4, 3, 3, 3, dtype=torch.float64, requires_grad=True)
    u = torch.randn(1, 3, 16, 16, dtype=torch.float64)
    u /= u.norm()
    k_n = conv_spectral_normalize(k, u, 2.0, n_power_iterations=2000)
    sigma_lattice = lattice_symbol_norm(k.detach(), 16).item()
    assert (k / k_n).mean().item() == pytest.approx(2.0 * sigma_lattice, rel=1e-8)
    # the lattice maximum is within a few per cent of sup_ω ‖K̂(ω)‖ (fine lattice), which bounds every
    # zero-padded convolution with K: so the normalized kernel's convolutions have norm ≤ ≈ 1/λ
    sup = lattice_symbol_norm(k.detach(), 256).item()
    assert sigma_lattice <= sup * (1 + 1e-12) and sigma_lattice > 0.97 * sup
    for size in (3, 5, 8):
        assert conv_matrix_norm(k.detach(), size) <= sup * (1 + 1e-10)
        assert conv_matrix_norm(k_n.detach(), size) <= 0.5 * sup / sigma_lattice * (1 + 1e-10)
    # gradient: the normalization is autograd in K with σ̂ = ⟨v, conv(u; K)⟩ (u, v constants); at the top
    # singular pair that is the derivative of the exact lattice norm
    g = torch.randn_like(k)
    (grad,) = torch.autograd.grad((k_n * g).sum(), k)
    kd = k.detach().clone().requires_grad_(True)
    (grad_ref,) = torch.autograd.grad((kd / (2.0 * lattice_symbol_norm(kd, 16)) * g).sum(), kd)
    torch.testing.assert_close(grad, grad_ref, rtol=1e-6, atol=1e-9)
    # evaluation: u is left alone
    u0 = u.clone()
    conv_spectral_normalize(k.detach() + 0.1, u, 2.0, update=False)
    assert torch.equal(u, u0)


def test_spectral_conv_blocks_contract_near_their_bound_where_frobenius_does_not():
    """The same 32-channel residual DEQ map: Frobenius (with √(k·k)) contracts at a small fraction of its bound
    λ⁻² = 0.25; spectral normalization brings each convolution to ≈ 1/λ, so the rate is a sizeable fraction
    of λ⁻² (Softplus' slope < 1 keeps it below)."""
    torch.manual_seed(0)
    cfg = {"tol": 1e-12, "max_iter": 500}
    frob = ResidualDEQBlock(3, 32, config=DEQConfig(**cfg)).double()
    spec = ResidualDEQBlock(3, 32, config=DEQConfig(norm="spectral", **cfg)).double()
    spec.load_state_dict(frob.state_dict(), strict=False)  # same kernels and injection
    for _ in range(50):  # training-mode calls track the top singular vectors of the loaded kernels
        spec.map_params(torch.zeros(1, 3, 8, 8, dtype=torch.float64))
    y = torch.randn(2, 3, 8, 8, dtype=torch.float64)
    r_frob, r_spec = frob.contraction_rate(y, iters=100), spec.contraction_rate(y, iters=100)
    assert r_frob < 0.02 * 0.25
    assert 0.1 * 0.25 < r_spec < 0.25 * 1.05
    assert r_spec > 10 * r_frob
    spec.eval()
    z = spec(y)
    torch.testing.assert_close(z, spec.fixed_point_map(y)(z), rtol=0, atol=1e-10)


def test_norm_none_is_refused_for_conv_blocks_and_unknown_norms():
    with pytest.raises(ValueError, match="not available for convolutional DEQ blocks"):
        ConvDEQBlock(2, 4, config=DEQConfig(norm="none"))
    with pytest.raises(ValueError, match="deq.norm='bogus' is unknown"):
        DEQConfig(norm="bogus")
