"""The multi-resolution DEQ block (MDEQ) and its cells (``src.deq.multiscale``): packing the state is exact, the
block's derivatives w.r.t. input and parameters — phantom with K large and the exact implicit backward, first and
second order in x plus the loss's parameter gradient — match autograd through a long unroll in float64, the
Jacobian penalty is Hutchinson's unbiased estimate of ‖J‖_F²/n on it, and the NCSN builds it (model.arch=mdeq,
model.cell=mdeq_gn)."""

from __future__ import annotations

import functools

import pytest
import torch

from src.deq import DEQConfig
from src.deq.diagnostics import recurrence_share
from src.deq.multiscale import MultiscaleDEQBlock, branch_sizes, group_norm, pack, unpack
from src.models.ncsn import NCSN
from tests.derivative_checks import rel, sm_loss_and_grads

pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py

UNROLL = 110  # the reference: autograd through 110 iterations of φ from zero (its error ~ ρ¹¹⁰ < 1e-25 at these maps)
# the two-resolution group-norm map converges slowly (≈ 45 iterations to 1e-13): its third-order checks take ~2 min
# and run with the slow tests (`make test-all`); its input gradient (finite differences) and penalty run always
SLOW_GN = pytest.param("mdeq_gn", (2, 4), marks=pytest.mark.slow, id="mdeq_gn-two_resolutions")
# slow: resblock-two_resolutions runs this branch's cell, the second branch and the fusion at every order
CASES = [pytest.param("resblock", (2,), marks=pytest.mark.slow, id="resblock-one_resolution"),
         pytest.param("resblock", (2, 4), id="resblock-two_resolutions"),
         pytest.param("mdeq_gn", (2,), id="mdeq_gn-one_resolution"), SLOW_GN]


def make_block(cell: str, channels, **cfg) -> MultiscaleDEQBlock:
    """A float64 block with conditional rows that matter (random level offsets) and a contracting map: the resblock
    cell with spectral kernels at λ = 1.3 (rate ≈ 0.3), the mdeq_gn cell with GN₁ / GN₃ / post-norm scales shrunk
    and a stronger injection (it has no weight bound, and at random small widths it does not contract at all; so
    tuned, its solve from zero reaches 1e-13 in ≈ 55 iterations)."""
    torch.manual_seed(0)
    norm = {"norm": "spectral", "norm_lambda": 1.3} if cell == "resblock" else {}
    config = DEQConfig(**{"tol": 1e-13, "stop_mode": "abs", "max_iter": 400, "warm_start": False, **norm, **cfg})
    block = MultiscaleDEQBlock(1, channels, n_classes=3, cell=cell, groups=2, config=config).double()
    with torch.no_grad():
        for e in block.level_rows:
            e.weight.normal_(0.0, 0.3)
        if cell == "mdeq_gn":
            for r in block.rows:
                r[0].mul_(0.3)
                r[4].mul_(0.3)
            for r in block.post_rows or ():
                r[0].mul_(0.5)
            for inj in block.injections:
                inj.weight.mul_(30.0)
    block.eval()  # spectral probe vectors fixed: the block and its unroll see the same kernels
    return block


def _inputs(block):
    x = torch.randn(2, 1, 3, 3, dtype=torch.float64)  # branches 3×3 and 2×2: 9 input dimensions for the trace
    labels = torch.tensor([0, 2])
    n = block.state_shape(x)[1]
    head = [torch.randn(n, 3, dtype=torch.float64, requires_grad=True), torch.randn(3, dtype=torch.float64)]
    return x, labels, head


@functools.lru_cache(maxsize=4)
def unrolled_reference(cell: str, channels: tuple[int, ...]):
    """Score, Hessian trace and the SM loss's parameter gradient through UNROLL iterations of :func:`make_block`'s map
    at :func:`_inputs`' x, labels and head, computed once per map for the checks below (each drew the same x and
    head after make_block; the backward setting changes no weight)."""
    block = make_block(cell, channels)
    x, labels, head = _inputs(block)
    return sm_loss_and_grads(lambda u: block.unroll(u, UNROLL, cond=(labels,)), x, head, [*block.parameters(), head[0]])


# ------------------------------------------------------------------------------------------ packing
def test_pack_and_unpack_are_exact_inverses():
    torch.manual_seed(0)
    shapes = ((3, 7, 5), (6, 4, 3), (6, 2, 2))
    zs = [torch.randn(2, *s, dtype=torch.float64) for s in shapes]
    flat = pack(zs)
    assert flat.shape == (2, 3 * 35 + 6 * 12 + 6 * 4)
    for a, b in zip(unpack(flat, shapes), zs):
        assert torch.equal(a, b)
    assert torch.equal(pack(unpack(flat, shapes)), flat)
    # per-sample layout: sample 1's entries are sample 1's branches, branch 0 first
    assert torch.equal(flat[1, :105], zs[0][1].flatten())
    with pytest.raises(ValueError, match="does not hold branches"):
        unpack(flat[:, 1:], shapes)


def test_branch_sizes_halve_with_ceiling_as_the_strided_convs_do():
    assert branch_sizes((28, 28), 3) == ((28, 28), (14, 14), (7, 7))
    assert branch_sizes((7, 5), 3) == ((7, 5), (4, 3), (2, 2))
    z = torch.zeros(1, 1, 7, 5)
    down = torch.nn.functional.conv2d(z, torch.zeros(1, 1, 3, 3), stride=2, padding=1)
    assert tuple(down.shape[2:]) == (4, 3)


def test_the_block_state_is_the_packed_branches():
    block = make_block("mdeq_gn", (2, 4))
    x, labels, _ = _inputs(block)
    z = block(x, labels)
    parts = block.branches(z, x)
    assert [tuple(p.shape) for p in parts] == [(2, 2, 3, 3), (2, 4, 2, 2)]
    assert torch.equal(pack(parts), z)


def test_group_norm_matches_torch():
    torch.manual_seed(0)
    x = torch.randn(3, 6, 5, 4, dtype=torch.float64)
    g, b = torch.randn(6, dtype=torch.float64), torch.randn(6, dtype=torch.float64)
    ref = torch.nn.functional.group_norm(x, 3, g, b, eps=1e-5)
    torch.testing.assert_close(group_norm(x, 3, g, b), ref, rtol=1e-12, atol=1e-12)
    rows = torch.randn(3, 6, dtype=torch.float64)  # a row per sample
    torch.testing.assert_close(group_norm(x, 3, rows, b)[1], group_norm(x[1:2], 3, rows[1], b)[0], rtol=1e-12,
                               atol=1e-12)


# ------------------------------------------------------------------------------------------ derivatives
@pytest.mark.parametrize(("cell", "channels"), CASES)
def test_implicit_backward_matches_the_unrolled_reference(cell, channels):
    """Exact implicit backward: score (first order in x), Hessian trace (second) and the SM loss's parameter
    gradient (third) against autograd through 110 unrolled iterations, float64, conditional rows included."""
    block = make_block(cell, channels, backward="implicit")
    x, labels, head = _inputs(block)
    stats = recurrence_share(block, x, labels)
    assert stats["share_mean"] > 0.05 and not stats["hit_cap"]  # the recurrence matters in this map
    params = [*block.parameters(), head[0]]
    s_i, tr_i, g_i = sm_loss_and_grads(lambda u: block(u, labels), x, head, params)
    s_r, tr_r, g_r = unrolled_reference(cell, channels)
    assert block.last_stats["converged"]
    assert rel(s_i, s_r) < 1e-8 and rel(tr_i, tr_r) < 1e-8 and rel(g_i, g_r) < 1e-8


@pytest.mark.parametrize(("cell", "channels"), [CASES[1], SLOW_GN])
def test_phantom_with_many_steps_matches_the_unrolled_reference(cell, channels):
    """Alg. 1 with K = 110 phantom steps from the converged z*: the same three quantities to 1e-7."""
    block = make_block(cell, channels, backward="phantom", phantom_steps=UNROLL)
    x, labels, head = _inputs(block)
    params = [*block.parameters(), head[0]]
    s_p, tr_p, g_p = sm_loss_and_grads(lambda u: block(u, labels), x, head, params)
    s_r, tr_r, g_r = unrolled_reference(cell, channels)
    assert rel(s_p, s_r) < 1e-7 and rel(tr_p, tr_r) < 1e-7 and rel(g_p, g_r) < 1e-7


def test_phantom_with_two_steps_is_truncated():
    """The comparison above can fail: K = 2 misses the Neumann tail."""
    block = make_block("resblock", (2, 4), backward="phantom", phantom_steps=2)
    x, labels, head = _inputs(block)
    params = [*block.parameters(), head[0]]
    _, _, g_p = sm_loss_and_grads(lambda u: block(u, labels), x, head, params)
    _, _, g_r = unrolled_reference("resblock", (2, 4))
    assert rel(g_p, g_r) > 1e-4


def test_input_gradient_matches_finite_differences():
    """An independent reference for the implicit first derivative: central differences of a scalar of z*(x)."""
    block = make_block("mdeq_gn", (2, 4), backward="implicit")
    x, labels, head = _inputs(block)
    w = head[0].detach()[:, 0]

    def scalar(u):
        return (block(u, labels) @ w).sum()

    xx = x.clone().requires_grad_(True)
    (g,) = torch.autograd.grad(scalar(xx), xx)
    h, fd = 1e-6, torch.zeros_like(x)
    with torch.no_grad():
        for i in range(x.numel()):
            e = torch.zeros_like(x).flatten()
            e[i] = h
            e = e.reshape(x.shape)
            fd.view(-1)[i] = (scalar(x + e) - scalar(x - e)) / (2 * h)
    assert rel(g, fd) < 1e-6


def test_one_pass_is_phi_at_zero():
    block = make_block("mdeq_gn", (2, 4), one_pass=True)
    x, labels, _ = _inputs(block)
    params = block.map_params(x, labels)
    ref = block.phi(torch.zeros(block.state_shape(x), dtype=torch.float64), *params)
    torch.testing.assert_close(block(x, labels), ref, rtol=0, atol=0)


# ------------------------------------------------------------------------------------------ Jacobian penalty
def _exact_frobenius_per_entry(block, x, labels, z_star):
    n = z_star.shape[1]
    total = 0.0
    for i in range(x.shape[0]):
        params = block.map_params(x[i:i + 1], labels[i:i + 1])
        jac = torch.autograd.functional.jacobian(lambda z, p=params: block.phi(z, *p), z_star[i:i + 1])
        total += jac.reshape(n, n).pow(2).sum().item()
    return total / (x.shape[0] * n), n


@pytest.mark.parametrize("cell", ["resblock", "mdeq_gn"])
def test_jacobian_penalty_is_an_unbiased_estimate_of_the_frobenius_norm(cell):
    """deq.jacobian_penalty on the multi-resolution map: with a given probe ε it equals ‖εᵀJ‖²/n from the exact
    Jacobian (J by autograd.functional.jacobian, float64, to 1e-10), and over 3000 probes its mean is
    ‖J‖_F²/n within 4 % (Hutchinson: E εεᵀ = I); the penalty's gradient reaches the block's parameters."""
    block = make_block(cell, (2, 4), jacobian_penalty=1.0, jacobian_penalty_rows=0)
    x, labels, _ = _inputs(block)
    z_star = block(x, labels).detach()
    exact, n = _exact_frobenius_per_entry(block, x, labels, z_star)
    eps = torch.randn_like(z_star)
    ours = block.jacobian_penalty(x, z_star, labels, eps=eps)
    jac_rows = []
    for i in range(2):
        params = block.map_params(x[i:i + 1], labels[i:i + 1])
        jac = torch.autograd.functional.jacobian(lambda z, p=params: block.phi(z, *p), z_star[i:i + 1]).reshape(n, n)
        jac_rows.append(eps[i] @ jac)
    by_hand = torch.stack(jac_rows).pow(2).sum() / eps.numel()
    assert ours.item() == pytest.approx(by_hand.item(), rel=1e-10)
    grads = torch.autograd.grad(ours, list(block.kernels.values()), allow_unused=True)
    assert all(g is not None and g.abs().sum() > 0 for g in grads)
    torch.manual_seed(1)
    with torch.no_grad():
        draws = torch.stack([block.jacobian_penalty(x, z_star, labels) for _ in range(3000)])
    assert draws.mean().item() == pytest.approx(exact, rel=0.04)


# ------------------------------------------------------------------------------------------ in the NCSN
def _sigmas():
    return torch.tensor([1.0, 0.5, 0.1])


@pytest.mark.parametrize(("arch", "cell", "conditioning"), [("mdeq", "resblock", "cond_norm"),
                                                            ("mdeq", "mdeq_gn", "sigma"),
                                                            ("deq", "mdeq_gn", "cond_norm")])
def test_ncsn_builds_the_multiresolution_and_cell_designs(arch, cell, conditioning):
    torch.manual_seed(0)
    net = NCSN(1, _sigmas(), arch=arch, ngf=8, deq=DEQConfig(max_iter=30, solver="anderson"), cell=cell,
               conditioning=conditioning, scales=2)
    x, labels = torch.rand(2, 1, 12, 12), torch.tensor([0, 2])
    out = net(x, labels)
    assert out.shape == x.shape and torch.isfinite(out).all()
    block = net.deq_block()
    assert isinstance(block, MultiscaleDEQBlock) and block.cell == cell
    assert block.channels == ((8, 16) if arch == "mdeq" else (8,))
    assert block.state_shape(net.deq_input(x, labels)) == ((2, 8 * 144 + 16 * 36) if arch == "mdeq" else (2, 8 * 144))
    out.sum().backward()
    assert all(p.grad is not None for p in block.parameters())


def test_ncsn_refuses_what_it_cannot_build():
    with pytest.raises(ValueError, match="model/net=mdeq is a multi-resolution equilibrium: give deq=true"):
        NCSN(1, _sigmas(), arch="mdeq", deq=None)
    with pytest.raises(ValueError, match="model.net.cell='nope' is unknown"):
        NCSN(1, _sigmas(), arch="deq", deq=DEQConfig(), cell="nope")
    with pytest.raises(ValueError, match="add deq.block=null"):
        NCSN(1, _sigmas(), arch="mdeq", deq=DEQConfig(block="normalized_residual"))
    with pytest.raises(ValueError, match="model.net.cell=mdeq_gn is the DEQ map's cell"):
        NCSN(1, _sigmas(), arch="deq", deq=None, cell="mdeq_gn")
    with pytest.raises(ValueError, match=r"deq.norm=spectral deq.norm_lambda=1.5 does not apply to model.net.cell=mdeq_gn"):
        NCSN(1, _sigmas(), arch="mdeq", deq=DEQConfig(norm="spectral", norm_lambda=1.5), cell="mdeq_gn", ngf=4)
    with pytest.raises(ValueError, match=r"deq.norm_lambda=3 does not apply to model.net.cell=mdeq_gn"):
        NCSN(1, _sigmas(), arch="deq", deq=DEQConfig(norm_lambda=3), cell="mdeq_gn", ngf=4)
    with pytest.raises(ValueError, match="deq.norm='none' is not available for convolutional DEQ blocks"):
        NCSN(1, _sigmas(), arch="mdeq", deq=DEQConfig(norm="none"), ngf=4)


@pytest.mark.parametrize("norm", ["spectral", "frobenius"])
def test_resblock_kernels_are_normalised_by_the_registry_strategy_with_their_checkpoint_keys(norm):
    """The resblock cell's kernels go through deq.norm's conv strategy (src.deq.normalization): one ``sn_u_<kernel>``
    buffer per kernel under spectral (none under Frobenius), and each normalised kernel equals the normalisation
    function applied by hand (a 1×1 up-fusion kernel also divided by 2^(j−i))."""
    from src.deq.normalization import conv_lipschitz_factor, conv_spectral_normalize, frobenius_normalize

    torch.manual_seed(0)
    block = MultiscaleDEQBlock(2, (4, 8, 8), 3, config=DEQConfig(norm=norm, norm_lambda=1.5)).double()
    names = list(block.kernels)
    assert len(names) == 13  # 3 branches × 2 + fusion 1→0, 2→0 (1×1), 0→1, 2→1 (1×1), 0→2 (2 convs), 1→2
    buffers = [k for k in block.state_dict() if k.startswith("sn_u")]
    assert buffers == ([f"sn_u_{n}" for n in names] if norm == "spectral" else [])
    block.eval()
    for name in names:
        kernel = block.kernels[name]
        if norm == "spectral":
            want = conv_spectral_normalize(kernel, getattr(block, f"sn_u_{name}").clone(), 1.5, update=False)
        else:
            want = frobenius_normalize(kernel, 1.5, scale=conv_lipschitz_factor(kernel))
        if name.startswith("f"):
            i, j = (int(s) for s in name[1:].split("_")[:2])
            want = want / 2 ** (j - i) if j > i else want
        assert torch.equal(block._kernel(name), want), name
    if norm == "spectral":  # a training call moves the power vectors, an evaluation call does not
        x, labels = torch.randn(2, 2, 8, 8, dtype=torch.float64), torch.tensor([0, 2])
        before = {k: v.clone() for k, v in block.state_dict().items() if k.startswith("sn_u")}
        with torch.no_grad():
            block(x, labels)
        assert all(torch.equal(before[k], block.state_dict()[k]) for k in before)
        block.train()
        block(x, labels)
        assert all(not torch.equal(before[k], block.state_dict()[k]) for k in before)
