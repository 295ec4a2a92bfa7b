"""NCSN parts and architectures (paper §4.4, App. D.4, Tables 5, 8, 9): CIN++ against its formula, shapes,
the conditional DEQ-ResBlock's exact implicit derivatives and phantom gradient, the contraction rate, and
the parameter counts at the paper's CIFAR-10 size."""

from __future__ import annotations

import itertools

import pytest
import torch

from src.deq.block import ConditionalResidualDEQBlock
from src.deq.config import DEQConfig, deq_setting
from src.models.ncsn import NCSN, count_parameters, geometric_sigmas
from src.models.ncsn_layers import ConditionalInstanceNorm2dPlus
from tests.derivative_checks import rel

pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py

TIGHT = {"tol": 1e-13, "max_iter": 400, "warm_start": False, "norm_lambda": 2.0, "backward": "implicit"}
SIGMAS = geometric_sigmas(1.0, 0.01, 4)


def test_geometric_sigmas():
    s = geometric_sigmas(1.0, 0.01, 10)
    assert s[0].item() == pytest.approx(1.0) and s[-1].item() == pytest.approx(0.01)
    ratios = s[1:] / s[:-1]
    assert torch.allclose(ratios, torch.full_like(ratios, 0.01 ** (1 / 9)), rtol=1e-12)
    with pytest.raises(ValueError):
        geometric_sigmas(0.01, 1.0, 10)


def test_cin_plus_matches_its_formula():
    torch.manual_seed(0)
    norm = ConditionalInstanceNorm2dPlus(5, 3).double()
    with torch.no_grad():
        norm.embed.weight.normal_()
    x = torch.randn(4, 5, 6, 7, dtype=torch.float64) * 3 + torch.randn(4, 5, 1, 1, dtype=torch.float64)
    labels = torch.tensor([0, 2, 1, 2])
    out = norm(x, labels)
    eps = 1e-5
    ref = torch.empty_like(x)
    for b in range(4):
        gamma, alpha, beta = norm.embed.weight[labels[b]].detach().reshape(3, 5)
        mu = [x[b, c].mean().item() for c in range(5)]
        m = sum(mu) / 5
        v = sum((u - m) ** 2 for u in mu) / 4  # unbiased variance of the channel means
        for c in range(5):
            var_c = ((x[b, c] - mu[c]) ** 2).mean()  # biased spatial variance (instance norm)
            h = (x[b, c] - mu[c]) / torch.sqrt(var_c + eps) + alpha[c] * (mu[c] - m) / (v + eps) ** 0.5
            ref[b, c] = gamma[c] * h + beta[c]
    assert torch.allclose(out, ref, atol=1e-12, rtol=1e-12)


@pytest.mark.parametrize("shape", [(1, 28, 28), (3, 32, 32)], ids=["mnist", "cifar10"])
@pytest.mark.parametrize("arch,deq,depth", [("refinenet", False, None), ("deq", True, None), ("deq", False, 1),
                                            ("deq", False, 3)], ids=["refinenet", "deq", "twores", "res3"])
def test_shapes_and_output_scaling(shape, arch, deq, depth):
    torch.manual_seed(1)
    net = NCSN(shape[0], SIGMAS, arch=arch, ngf=4, deq=deq_setting({"enabled": deq, "warm_start": False}), depth=depth)
    x = torch.rand(2, *shape)
    labels = torch.tensor([0, 3])
    s = net.score(x, labels)
    assert s.shape == x.shape and torch.isfinite(s).all()
    # NCSN's output scaling: score = features / σ_label
    feats = net.features(x, labels)
    assert torch.allclose(s * SIGMAS[labels].float().reshape(2, 1, 1, 1), feats, rtol=1e-5, atol=1e-6)
    assert (net.deq_block() is not None) == (arch == "deq" and deq)
    if arch == "deq" and not deq:
        assert len(net.middle.blocks) == depth


def test_depth_with_a_deq_block_is_refused():
    with pytest.raises(ValueError, match="depth=2 with deq=true"):
        NCSN(1, SIGMAS, arch="deq", ngf=4, deq=DEQConfig(), depth=2)


@pytest.mark.parametrize("arch,deq,depth", [("refinenet", False, None), ("deq", True, None), ("deq", False, 1)],
                         ids=["refinenet", "deq", "twores"])
def test_sigma_conditioning_score_scales_as_one_over_sigma(arch, deq, depth):
    """conditioning=sigma: the network's output does not depend on the level, so σ_i·s(x, i) is one function
    of x for every i (and s = output / σ_i); cond_norm's does depend on it."""
    torch.manual_seed(2)
    sig = geometric_sigmas(50.0, 0.01, 6)
    x = torch.rand(1, 1, 8, 8).repeat(6, 1, 1, 1)
    labels = torch.arange(6)
    for conditioning in ("sigma", "cond_norm"):
        net = NCSN(1, sig, arch=arch, ngf=4, deq=deq_setting({"enabled": deq, "warm_start": False}), depth=depth,
                   conditioning=conditioning).double()
        with torch.no_grad():  # per-level rows that differ (cond_norm), as after training
            for m in net.modules():
                if hasattr(m, "embed"):
                    m.embed.weight.normal_(1.0, 0.3)
        s = net.score(x.double(), labels)
        scaled = s * net.sigmas[labels].reshape(-1, 1, 1, 1)  # the buffer (float32 values)
        assert torch.allclose(scaled, net.features(x.double(), labels), rtol=1e-12, atol=1e-12)
        spread = (scaled - scaled[:1]).abs().max().item()
        if conditioning == "sigma":
            assert spread < 1e-12 and torch.allclose(s[0] * net.sigmas[0], s[5] * net.sigmas[5], rtol=1e-12, atol=0)
        else:
            assert spread > 1e-3


def test_sigma_conditioning_parameters_do_not_grow_with_levels():
    """cond_norm holds 3C numbers per norm (2C per DEQ map) per level; sigma none: same count at 10 and 232."""
    def count(conditioning, levels, arch="deq", deq=True):
        return count_parameters(NCSN(3, geometric_sigmas(50.0, 0.01, levels), arch=arch, ngf=8,
                                     deq=deq_setting({"enabled": deq}), conditioning=conditioning))

    for arch, deq in (("refinenet", False), ("deq", True), ("deq", False)):
        assert count("sigma", 10, arch, deq) == count("sigma", 232, arch, deq)
        net = NCSN(3, geometric_sigmas(), arch=arch, ngf=8, deq=deq_setting({"enabled": deq}))
        norm_rows = sum(m.embed.weight.shape[1] for m in net.modules() if hasattr(m, "embed"))
        deq_rows = 2 * 8 if deq else 0  # the DEQ map's shift and scale rows
        assert count("cond_norm", 232, arch, deq) - count("cond_norm", 10, arch, deq) == 222 * (norm_rows + deq_rows)
        # sigma: one γ/α/β row per norm instead of one per level, and no DEQ rows
        assert count("cond_norm", 10, arch, deq) - count("sigma", 10, arch, deq) == 9 * norm_rows + 10 * deq_rows


def test_unknown_conditioning_is_refused():
    with pytest.raises(ValueError, match="model.net.conditioning='film' is unknown; valid: cond_norm, sigma"):
        NCSN(1, SIGMAS, arch="deq", ngf=4, conditioning="film")


def test_parameter_counts_at_the_paper_cifar10_size():
    """Table 5: NCSN 28M, DEQ-NCSN 9M parameters at ngf = 128 on CIFAR-10 (≤ 0.35×)."""
    counts = {arch: count_parameters(NCSN(3, geometric_sigmas(), arch=arch, ngf=128, deq=deq_setting({"enabled": deq})))
              for arch, deq in (("refinenet", False), ("deq", True))}
    assert counts["refinenet"] == 28_937_475
    assert counts["deq"] == 8_762_243
    assert counts["deq"] <= 0.35 * counts["refinenet"]


# --------------------------------------------------------------------- the conditional DEQ-ResBlock
def tiny_ncsn(backward="implicit", phantom_steps=2, norm="frobenius"):
    torch.manual_seed(3)
    cfg = {**TIGHT, "backward": backward, "phantom_steps": phantom_steps, "enabled": True, "norm": norm}
    net = NCSN(1, SIGMAS, arch="deq", ngf=3, deq=deq_setting(cfg)).double()
    with torch.no_grad():  # non-trivial noise-level conditioning of the DEQ map
        block = net.deq_block()
        block.shift.weight.normal_(0, 0.5)
        block.scale_logit.weight.normal_(0, 1.0)
    return net


def unrolled(net, steps=300):
    """The same network with the DEQ block replaced by autograd through ``steps`` Picard iterations."""
    block = net.deq_block()
    net.middle.forward = lambda y, labels: block.unroll(y, steps, cond=(labels,))
    return net


def score_div_ssmvr(net, x, labels, v):
    x = x.clone().requires_grad_(True)
    s = net.score(x, labels)
    d = x[0].numel()
    sf = s.flatten(1)
    div = sum(torch.autograd.grad(sf[:, i].sum(), x, create_graph=True)[0].flatten(1)[:, i] for i in range(d))
    (gvs,) = torch.autograd.grad((s * v).sum(), x, create_graph=True)
    loss = (0.5 * sf.pow(2).sum(1) + (gvs * v).flatten(1).sum(1)).mean()
    return s, div, loss


def flat_grad(loss, params):
    return torch.cat([g.flatten() for g in torch.autograd.grad(loss, params)])


def inputs():
    g = torch.Generator().manual_seed(4)
    x = torch.rand(2, 1, 6, 6, generator=g, dtype=torch.float64)
    v = torch.randint(0, 2, x.shape, generator=g).to(x) * 2 - 1
    return x, torch.tensor([0, 2]), v


@pytest.mark.parametrize("norm", ["frobenius", "spectral"])
def test_conditional_deq_resblock_implicit_matches_a_long_unroll(norm):
    """Score, divergence (exact trace) and SSM-VR parameter gradients of a whole tiny DEQ-NCSN, float64:
    deq.backward=implicit vs autograd through 300 Picard steps (rate ≤ 2/λ² = 0.5), relative error < 1e-8,
    with either normalization of the convolutions (spectral: σ̂ enters the map parameters, so its gradient
    is exact too)."""
    x, labels, v = inputs()
    net, ref = tiny_ncsn(norm=norm), unrolled(tiny_ncsn(norm=norm))
    s_i, div_i, loss_i = score_div_ssmvr(net, x, labels, v)
    s_r, div_r, loss_r = score_div_ssmvr(ref, x, labels, v)
    assert net.deq_block().last_stats["converged"]
    assert rel(s_i, s_r) < 1e-8
    assert rel(div_i, div_r) < 1e-8
    names = [n for n, _ in net.named_parameters()]
    g_i = dict(zip(names, torch.autograd.grad(loss_i, list(net.parameters()))))
    g_r = dict(zip(names, torch.autograd.grad(loss_r, list(ref.parameters()))))
    assert rel(torch.cat([g.flatten() for g in g_i.values()]), torch.cat([g.flatten() for g in g_r.values()])) < 1e-8
    # the noise-level embeddings of the DEQ map get their exact gradient too
    for name in ("middle.block.shift.weight", "middle.block.scale_logit.weight"):
        assert g_r[name].norm() > 0 and rel(g_i[name], g_r[name]) < 1e-8, name


def test_phantom_gradient_error_decreases_geometrically_in_k():
    """Alg. 1 with K = 1…6 phantom steps vs the exact implicit SSM-VR gradient: error ~ ρ^K (Prop. 2)."""
    x, labels, v = inputs()
    net = tiny_ncsn()
    exact = flat_grad(score_div_ssmvr(net, x, labels, v)[2], list(net.parameters()))
    errors = []
    for k in range(1, 7):
        ph = tiny_ncsn("phantom", k)
        errors.append(rel(flat_grad(score_div_ssmvr(ph, x, labels, v)[2], list(ph.parameters())), exact))
    ratios = [b / a for a, b in itertools.pairwise(errors)]
    assert all(r < 0.6 for r in ratios), (errors, ratios)
    assert errors[-1] < 1e-2 * errors[0], errors


def test_contraction_rate_is_the_jacobian_norm_and_within_the_bound():
    torch.manual_seed(5)
    block = ConditionalResidualDEQBlock(2, 2, n_classes=3, config=DEQConfig(**TIGHT)).double()
    with torch.no_grad():
        block.scale_logit.weight.normal_(0, 2.0)
        block.shift.weight.normal_()
    y = torch.randn(1, 2, 3, 3, dtype=torch.float64)
    labels = torch.tensor([1])
    rate = block.contraction_rate(y, labels, iters=200)
    phi = block.fixed_point_map(y, labels)
    z = block(y, labels).detach()
    jac = torch.autograd.functional.jacobian(lambda u: phi(u.reshape(z.shape)).flatten(), z.flatten())
    assert rate == pytest.approx(torch.linalg.matrix_norm(jac, 2).item(), rel=1e-6)
    assert 0 < rate < 2 / block.config.norm_lambda**2
    with pytest.raises(ValueError, match="conditional"):
        block(y)
