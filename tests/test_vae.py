"""SSM-VAE modules (paper §4.1, App. D.3, Tables 6–7): the entropy-gradient identity behind the surrogate
ELBO, the shapes of every variant, and the conv DEQ score estimator's derivatives against a long unroll."""

from __future__ import annotations

import itertools
import math

import pytest
import torch
from torch import nn

from src.deq.config import DEQConfig, deq_setting, resolve_depth
from src.models.vae import (
    ConditionalScore,
    Decoder,
    ImplicitEncoder,
    ScoreEstimator,
    entropy_surrogate,
    prior_log_prob,
    surrogate_negative_elbo,
)
from src.objectives.ssm import ssm

pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py


class GaussianEncoder(nn.Module):
    """z = μ_θ(x) + σ_θ(x) ε with μ = A x + a, log σ = C x + c: q(z|x) is Gaussian with a closed-form score."""

    def __init__(self, dx, dz):
        super().__init__()
        g = torch.Generator().manual_seed(0)
        self.A = nn.Parameter(torch.randn(dz, dx, generator=g, dtype=torch.float64))
        self.a = nn.Parameter(torch.randn(dz, generator=g, dtype=torch.float64))
        self.C = nn.Parameter(0.3 * torch.randn(dz, dx, generator=g, dtype=torch.float64))
        self.c = nn.Parameter(0.3 * torch.randn(dz, generator=g, dtype=torch.float64))

    def forward(self, x, eps):
        mu, log_sigma = x @ self.A.T + self.a, x @ self.C.T + self.c
        return mu + log_sigma.exp() * eps, mu, log_sigma


def standardised_noise(n, b, d, g):
    """ε [n, b, d] whose sample mean is exactly 0 and sample second moment exactly 1 per (b, d)."""
    e = torch.randn(n, b, d, generator=g, dtype=torch.float64)
    e = e - e.mean(0)
    return e / e.pow(2).mean(0).sqrt()


@pytest.mark.parametrize("exact", [True, False])
def test_entropy_gradient_identity_on_a_gaussian_encoder(exact):
    """∇_θ E_ε⟨stop-grad(∇_z log q(z|x)), z⟩ = ∇_θ E_q[log q(z|x)] (= −∇_θ entropy, closed form).

    With standardised ε (sample mean 0, second moment 1) the identity holds exactly in the sample; with
    plain N(0, I) draws it holds up to Monte-Carlo error, bounded here by a few standard errors."""
    dx, dz, b, n = 4, 3, 5, 4000
    g = torch.Generator().manual_seed(1)
    enc = GaussianEncoder(dx, dz)
    x = torch.randn(b, dx, generator=g, dtype=torch.float64)
    eps = standardised_noise(n, b, dz, g) if exact else torch.randn(n, b, dz, generator=g, dtype=torch.float64)
    z, mu, log_sigma = enc(x.expand(n, b, dx), eps)
    true_score = -(z - mu) / (2 * log_sigma).exp()  # ∇_z log q(z|x), stop-gradded by the surrogate
    surrogate = entropy_surrogate(true_score.reshape(n * b, dz), z.reshape(n * b, dz)).mean() * b
    grads = torch.autograd.grad(surrogate, list(enc.parameters()), retain_graph=True)
    # E_q log q(z|x) = −Σ_d log σ_d − D/2 log(2πe): per x, summed over the batch
    expected_log_q = (-log_sigma[0].sum(-1) - 0.5 * dz * math.log(2 * math.pi * math.e)).sum()
    truth = torch.autograd.grad(expected_log_q, list(enc.parameters()), allow_unused=True, materialize_grads=True,
                                retain_graph=True)
    # Monte-Carlo standard errors: ∂/∂μ terms average −ε/σ (variance 1/σ²), ∂/∂log σ terms −ε² (variance 2)
    inv_var = (-2 * log_sigma[0]).exp().detach()  # [b, dz]
    se = {"A": (inv_var.T @ x.pow(2) / n).sqrt(), "a": (inv_var.sum(0) / n).sqrt(),
          "C": (2 * torch.ones(dz, b, dtype=torch.float64) @ x.pow(2) / n).sqrt(),
          "c": torch.full((dz,), math.sqrt(2 * b / n), dtype=torch.float64)}
    for name, got, want in zip(["A", "a", "C", "c"], grads, truth):
        if exact:
            torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-10, msg=name)
        else:
            assert ((got - want).abs() < 5 * se[name]).all(), (name, got, want, se[name])
    # the stop-grad matters: differentiating through the score as well gives a different (wrong) gradient
    wrong = torch.autograd.grad((true_score * z).sum(-1).mean(0).sum(), [enc.C])[0]
    assert (wrong - truth[2]).abs().max() > 0.5


def test_surrogate_elbo_parts():
    torch.manual_seed(0)
    dec = Decoder((1, 4, 4), 3, arch="mlp", likelihood="bernoulli", hidden=8)
    x = torch.bernoulli(torch.full((6, 1, 4, 4), 0.4))
    z = torch.randn(6, 3)
    s = torch.randn(6, 3)
    total, rec, prior = surrogate_negative_elbo(dec, x, z, s)
    p = torch.sigmoid(dec(z)).flatten(1)
    xf = x.flatten(1)
    torch.testing.assert_close(rec, -(xf * p.log() + (1 - xf) * (1 - p).log()).sum(-1))
    torch.testing.assert_close(prior, 0.5 * z.pow(2).sum(-1) + 1.5 * math.log(2 * math.pi))
    torch.testing.assert_close(total, rec + prior + (s * z).sum(-1))
    for w in (0.0, 0.5):  # model.entropy_weight: the entropy term scaled, or dropped (the ablation)
        total_w, _, _ = surrogate_negative_elbo(dec, x, z, s, entropy_weight=w)
        torch.testing.assert_close(total_w, rec + prior + w * (s * z).sum(-1))
    gdec = Decoder((3, 4, 4), 3, arch="mlp", likelihood="gaussian", hidden=8, log_sigma=-1.0)
    xg = torch.randn(6, 3, 4, 4)
    want = torch.distributions.Normal(gdec(z), math.exp(-1.0)).log_prob(xg).flatten(1).sum(-1)
    torch.testing.assert_close(gdec.log_prob(xg, z), want)
    assert prior_log_prob(torch.zeros(2, 4)).allclose(torch.full((2,), -2 * math.log(2 * math.pi)))


DEQ_ON = DEQConfig(tol=1e-6, max_iter=100)


@pytest.mark.parametrize("shape,arch", [((1, 28, 28), "mlp"), ((1, 28, 28), "conv"), ((3, 32, 32), "conv"),
                                        ((3, 64, 64), "conv")])
@pytest.mark.parametrize("depth,deq", [(0, None), (2, None), (None, DEQ_ON)])
def test_shapes_of_every_variant(shape, arch, depth, deq):
    torch.manual_seed(0)
    dz, b = 8, 2
    enc = ImplicitEncoder(shape, dz, arch=arch, hidden=16, channels=4)
    dec = Decoder(shape, dz, arch=arch, likelihood="bernoulli" if shape[0] == 1 else "gaussian", hidden=16,
                  channels=4, learn_sigma=True)
    est = ScoreEstimator(shape, dz, arch=arch, channels=4, depth=depth, deq=deq)
    x = torch.rand(b, *shape)
    z = enc(x)
    assert z.shape == (b, dz)
    assert dec(z).shape == (b, *shape) and dec.mean(z).shape == (b, *shape)
    assert dec.log_prob(x, z).shape == (b,)
    assert est(z, x).shape == (b, dz)
    if deq is None:
        assert len(est.layers) == depth and est.block is None
    else:
        assert est.block is not None and est.block.last_stats["converged"]


def test_depth_rules():
    deq = DEQConfig()
    assert resolve_depth("vae", None, None) == 0 and resolve_depth("vae", 16, None) == 16
    assert resolve_depth("vae", None, deq) == 1
    with pytest.raises(ValueError, match="one layer inside f"):
        resolve_depth("vae", 8, deq)
    with pytest.raises(ValueError, match="linear"):
        ScoreEstimator((1, 8, 8), 3, arch="conv", deq=deq_setting({"enabled": True, "injection": "softplus"}))


def test_aug_layers_start_input_dependent_with_he_initialisation():
    """The reason for ``model.aug_init=kaiming``: with PyTorch's default initialisation a 16-layer Softplus
    stack (MNIST Aug(16), 256 units) starts with features that barely depend on (z, x) — relative spread
    over inputs 4e-8 measured, vs 5e-3 with He initialisation and 0.16 for the k = 0 network — so its SSM
    gradient with respect to the input dependence vanishes (Aug(8) did not train in 1000 iterations)."""

    def spread(init, depth):
        torch.manual_seed(0)
        est = ScoreEstimator((1, 28, 28), 8, arch="mlp", channels=256, depth=depth, aug_init=init)
        x, z = (torch.rand(256, 1, 28, 28) < 0.3).float(), torch.randn(256, 8)
        with torch.no_grad():
            h = est.features(est.preprocess_input(z, x))
        return float(h.std(0).mean() / h.mean(0).abs().mean())

    assert spread("kaiming", 16) > 1e-3
    assert spread("torch", 16) < 1e-5
    assert spread("kaiming", 16) > 1e3 * spread("torch", 16)
    with pytest.raises(ValueError, match="aug_init"):
        ScoreEstimator((1, 4, 4), 2, arch="mlp", depth=2, aug_init="xavier")


def test_deq_with_zero_kernel_is_the_explicit_ssm_vae_estimator():
    """Ŵ = 0: the DEQ pre-processing Softplus(Ŵz + g(y)) is the k = 0 network Softplus(conv(y)) (no double
    squash), with the same weights."""
    torch.manual_seed(0)
    shape, dz = (1, 8, 8), 3
    deq = ScoreEstimator(shape, dz, arch="conv", channels=4, deq=DEQConfig(tol=1e-10))
    ex = ScoreEstimator(shape, dz, arch="conv", channels=4, depth=0)
    with torch.no_grad():
        deq.block.kernel.zero_()
        deq.block.kernel[0, 0, 0, 0] = 1e-30  # the Frobenius normalisation divides by ‖K‖
    ex.embed.load_state_dict(deq.embed.state_dict())
    ex.inp.load_state_dict(deq.block.injection.state_dict())
    ex.down.load_state_dict(deq.down.state_dict())
    ex.readout.load_state_dict(deq.readout.state_dict())
    x, z = torch.rand(5, *shape), torch.randn(5, dz)
    torch.testing.assert_close(deq(z, x), ex(z, x), rtol=1e-6, atol=1e-6)


def _ssm_grads(est, x, z, v, forward):
    """SSM loss (eq. 3, fixed v) of s(·|x) at z, its score and its parameter gradients."""
    model = type("M", (), {"score": staticmethod(lambda zz: forward(zz, x))})()
    out = ssm(model, z, v=v)
    s = forward(z, x)
    grads = torch.autograd.grad(out.loss, [p for p in est.parameters()])
    return s.detach(), out.loss.detach(), grads


def _unrolled(est, steps=300):
    def forward(z, x):
        return est.readout(est.down(est.block.unroll(est.preprocess_input(z, x), steps)))
    return forward


def _max_rel(a, b):
    return max(float((u - w).abs().max() / w.abs().max().clamp_min(1e-30)) for u, w in zip(a, b))


def test_conv_deq_score_estimator_derivatives_against_a_long_unroll():
    """float64, tiny image: ``deq.backward=implicit`` equals autograd through 300 Picard steps (< 1e-8) for
    the score and the SSM loss's parameter gradients (second-order in z); the phantom gradient's error
    decreases geometrically in K (Alg. 1, Prop. 2)."""
    torch.manual_seed(0)
    shape, dz, b = (1, 8, 8), 3, 3
    cfg = {"enabled": True, "tol": 1e-13, "max_iter": 400, "warm_start": False, "backward": "implicit"}
    est = ScoreEstimator(shape, dz, arch="conv", channels=3, deq=deq_setting(cfg)).double()
    x = torch.rand(b, *shape, dtype=torch.float64)
    z = torch.randn(b, dz, dtype=torch.float64)
    v = torch.randn(b, dz, dtype=torch.float64)
    s_ref, loss_ref, g_ref = _ssm_grads(est, x, z, v, _unrolled(est))
    s_imp, loss_imp, g_imp = _ssm_grads(est, x, z, v, est)
    assert _max_rel([s_imp], [s_ref]) < 1e-8
    assert abs(float(loss_imp - loss_ref)) < 1e-8 * abs(float(loss_ref)) + 1e-12
    assert _max_rel(g_imp, g_ref) < 1e-8
    errors = []
    for k in (1, 2, 4, 8):
        est.block.config.backward, est.block.config.phantom_steps = "phantom", k
        _, _, g = _ssm_grads(est, x, z, v, est)
        errors.append(_max_rel(g, g_ref))
    assert all(b < 0.7 * a for a, b in itertools.pairwise(errors)), errors
    assert errors[-1] < 1e-2 * errors[0], errors


def test_score_estimator_learns_a_gaussian_posterior_score():
    """1000 SSM steps (the objective of :mod:`src.objectives`) on z ~ N(μ(x), σ²I) bring the MLP
    estimator close to the true score −(z − μ(x))/σ²: a real check that ConditionalScore wires x in."""
    torch.manual_seed(0)
    shape, dz = (1, 2, 2), 2
    est = ScoreEstimator(shape, dz, arch="mlp", channels=32, depth=1)
    opt = torch.optim.Adam(est.parameters(), lr=1e-2)
    sigma = 0.5

    def draw(n):
        x = torch.randint(0, 2, (n, *shape)).float()
        mu = 2 * x.flatten(1)[:, :dz] - 1
        return x, mu, mu + sigma * torch.randn(n, dz)

    for _ in range(1000):
        x, _, z = draw(128)
        loss = ssm(ConditionalScore(est, x), z, projection="gaussian").loss
        opt.zero_grad()
        loss.backward()
        opt.step()
    x, mu, z = draw(2000)
    with torch.no_grad():
        err = (est(z, x) - (-(z - mu) / sigma**2)).pow(2).sum(-1).mean()
        scale = ((z - mu) / sigma**2).pow(2).sum(-1).mean()
    assert err < 0.1 * scale, (float(err), float(scale))
