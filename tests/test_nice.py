"""NICE: exact inverse, log-likelihood against a brute-force change of variables, normalisation, plumbing."""

from __future__ import annotations

import math
import pickle

import pytest
import torch
from torch import nn

from src.deq.config import DEQConfig
from src.models.nice import NICE, DEQCouplingFactory, deq_coupling_factory


def small_nice(dim: int = 8, seed: int = 0, **kw) -> NICE:
    torch.manual_seed(seed)
    model = NICE(dim=dim, hidden=16, mlp_layers=3, **kw).double()
    with torch.no_grad():  # a non-trivial scaling layer (it starts at 0)
        model.log_scale.copy_(0.3 * torch.randn(dim, dtype=torch.float64))
    return model


@pytest.mark.parametrize("dim", [8, 7])
def test_forward_inverse_exact(dim):
    model = small_nice(dim)
    x = 2.0 * torch.randn(32, dim, dtype=torch.float64)
    y = model(x)
    assert y.shape == (32, dim)
    assert (model.inverse(y) - x).abs().max().item() < 1e-12
    y2 = torch.randn(32, dim, dtype=torch.float64)
    assert (model(model.inverse(y2)) - y2).abs().max().item() < 1e-12
    # the couplings really do something: y is far from a per-coordinate rescaling of permuted x
    assert (y - x[:, model.perm] * model.log_scale.exp()).abs().max().item() > 0.1


@pytest.mark.parametrize("dim", [8, 7])
def test_log_likelihood_matches_brute_force_change_of_variables(dim):
    model = small_nice(dim, seed=1)
    x = torch.randn(5, dim, dtype=torch.float64)
    ll = model.log_likelihood(x)
    assert ll.shape == (5,)
    for i in range(5):
        jac = torch.autograd.functional.jacobian(lambda v: model(v[None])[0], x[i])
        _, logabsdet = torch.linalg.slogdet(jac)
        y = model(x[i][None])[0]
        log_normal = -0.5 * y.pow(2).sum() - 0.5 * dim * math.log(2 * math.pi)
        assert abs((log_normal + logabsdet - ll[i]).item()) < 1e-10
        # the Jacobian determinant of every coupling is 1: log|det| is Σ s, independent of x
        assert abs(logabsdet.item() - model.log_scale.sum().item()) < 1e-10
        # score by autograd = −Jᵀ y (the log-det term does not depend on x)
        xi = x[i].clone().requires_grad_(True)
        (score,) = torch.autograd.grad(model.log_density(xi[None]).sum(), xi)
        assert (score + jac.T @ y).abs().max().item() < 1e-10
    assert torch.equal(model.log_density(x), ll)


def test_density_integrates_to_one_in_2d():
    model = small_nice(2, seed=3)
    with torch.no_grad():
        model.log_scale.copy_(torch.tensor([0.4, -0.2], dtype=torch.float64))
        grid = torch.linspace(-12.0, 12.0, 801, dtype=torch.float64)
        xx, yy = torch.meshgrid(grid, grid, indexing="ij")
        pts = torch.stack([xx.flatten(), yy.flatten()], dim=1)
        mass = model.log_likelihood(pts).exp().sum().item() * (grid[1] - grid[0]).item() ** 2
    assert abs(mass - 1.0) < 1e-4


def test_sample_shape_finite_and_consistent_with_inverse():
    model = small_nice(8, seed=4)
    s = model.sample(64, generator=torch.Generator().manual_seed(7))
    assert s.shape == (64, 8) and s.dtype == torch.float64 and torch.isfinite(s).all()
    assert not s.requires_grad
    y = torch.randn(64, 8, generator=torch.Generator().manual_seed(7), dtype=torch.float64)
    assert (model(s) - y).abs().max().item() < 1e-12
    # samples are distributed as the model says: their mean log-likelihood ≈ −entropy of the model,
    # which for a flow equals E_y[log N(y)] + Σ s = −D/2 (1 + log 2π) + Σ s
    big = model.sample(20000, generator=torch.Generator().manual_seed(8))
    expected = -0.5 * 8 * (1 + math.log(2 * math.pi)) + model.log_scale.sum().item()
    assert abs(model.log_likelihood(big).mean().item() - expected) < 0.1


def test_image_shaped_input_is_flattened():
    torch.manual_seed(0)
    model = NICE(dim=784, hidden=8, mlp_layers=2)
    x = torch.randn(3, 1, 28, 28)
    assert torch.equal(model(x), model(x.flatten(1)))
    assert model.log_likelihood(x).shape == (3,)
    assert model.inverse(model(x)).shape == (3, 784)
    assert (model.inverse(model(x)) - x.flatten(1)).abs().max().item() < 1e-5
    with pytest.raises(ValueError, match="expects inputs"):
        model(torch.randn(3, 10))


def test_default_architecture_is_the_papers():
    model = NICE()
    assert len(model.couplings) == 4
    linears = [m for m in model.couplings[0] if isinstance(m, nn.Linear)]
    assert [(m.in_features, m.out_features) for m in linears] == [(392, 1000)] + [(1000, 1000)] * 3 + [(1000, 392)]
    assert sum(isinstance(m, nn.Softplus) for m in model.couplings[0]) == 4
    per_coupling = 392 * 1000 + 1000 + 3 * (1000 * 1000 + 1000) + 1000 * 392 + 392
    assert sum(p.numel() for p in model.parameters()) == 4 * per_coupling + 784  # 15.15 M
    assert torch.equal(model.log_scale, torch.zeros(784))
    # the permutation is an index buffer, not a parameter, and not in the state dict
    assert model.perm[:3].tolist() == [0, 2, 4] and model.perm[392:395].tolist() == [1, 3, 5]
    assert set(model.state_dict()) == {k for k, _ in model.named_parameters()}


def test_custom_coupling_factory_gets_the_half_sizes_and_pickles():
    calls = []

    class Factory:
        def __call__(self, i, o):
            calls.append((i, o))
            return nn.Sequential(nn.Linear(i, 5), nn.Tanh(), nn.Linear(5, o))

    model = NICE(dim=7, n_couplings=3, coupling_net=Factory()).double()
    assert calls == [(4, 3), (3, 4), (4, 3)]
    x = torch.randn(4, 7, dtype=torch.float64)
    assert (model.inverse(model(x)) - x).abs().max().item() < 1e-12
    clone = pickle.loads(pickle.dumps(small_nice(6)))
    assert torch.equal(clone.perm, torch.tensor([0, 2, 4, 1, 3, 5]))


def test_deq_factory_is_picklable():
    f = deq_coupling_factory(12, DEQConfig(tol=1e-6), n_layers=2)
    assert isinstance(f, DEQCouplingFactory)
    g = pickle.loads(pickle.dumps(f))
    assert (g.width, g.n_layers, g.deq_config) == (12, 2, DEQConfig(tol=1e-6))


def test_deq_factory_wiring_with_a_stand_in_block(monkeypatch):
    """The factory builds DEQNet(injection → DenseDEQBlock(in, width, n_layers, injection, config, name,
    activation) → Linear(width, out)) with the announced src.deq API (a stand-in block here), handing every block
    the one parsed setting."""
    import types

    class DenseDEQBlock(nn.Module):
        def __init__(self, in_dim, width, n_layers=1, injection=None, config=None, name="deq", activation="softplus"):
            super().__init__()
            self.args = (in_dim, width, n_layers, config, name, activation)
            self.injection = injection

        def forward(self, x):
            return self.injection(x)

    monkeypatch.setattr("src.models.deq_net.blocks", types.SimpleNamespace(DenseDEQBlock=DenseDEQBlock))
    setting = DEQConfig(tol=1e-9)
    model = NICE(dim=9, coupling_net=deq_coupling_factory(6, setting, n_layers=2)).double()
    assert [m.block.args for m in model.couplings] == [
        (5, 6, 2, setting, "nice.coupling.0", "softplus"), (4, 6, 2, setting, "nice.coupling.1", "softplus"),
        (5, 6, 2, setting, "nice.coupling.2", "softplus"), (4, 6, 2, setting, "nice.coupling.3", "softplus"),
    ]
    first = model.couplings[0]
    assert type(first.block.injection).__name__ == "Linear"  # NICE default: g = Ux + c (linear injection)
    assert (first.readout.in_features, first.readout.out_features) == (6, 4) and first.skip is None
    soft = deq_coupling_factory(6, DEQConfig(injection="softplus"))(5, 4)
    assert [type(m).__name__ for m in soft.block.injection] == ["Linear", "Softplus"]
    x = torch.randn(3, 9, dtype=torch.float64)
    assert (model.inverse(model(x)) - x).abs().max().item() < 1e-12


def test_nice_with_deq_couplings_is_exactly_invertible():
    torch.manual_seed(0)
    cfg = {"solver": "picard", "tol": 1e-13, "max_iter": 1000, "phantom_steps": 2, "warm_start": True,
           "norm_lambda": 2.0, "backward": "phantom"}
    model = NICE(dim=8, coupling_net=deq_coupling_factory(16, DEQConfig(**cfg))).double()
    assert all(type(m.block).__name__ == "DenseDEQBlock" for m in model.couplings)
    x = torch.randn(16, 8, dtype=torch.float64)
    y = model(x)
    assert (model.inverse(y) - x).abs().max().item() < 1e-10
    ll = model.log_likelihood(x[:2])
    jac = torch.autograd.functional.jacobian(lambda v: model(v[None])[0], x[0])
    assert abs(torch.linalg.slogdet(jac)[1].item()) < 1e-8  # log_scale = 0: volume preserving
    y0 = model(x[:1])[0]
    assert abs((-0.5 * y0.pow(2).sum() - 4 * math.log(2 * math.pi) - ll[0]).item()) < 1e-10
    pickle.loads(pickle.dumps(model))


def test_mle_on_mnist_through_a_lightning_trainer(mnist_root):
    """Integration: the data module feeds a NICE trained by maximum likelihood; the held-out LL rises."""
    import lightning.pytorch as L

    from src.data.mnist import MNISTDataModule

    class MLE(L.LightningModule):
        def __init__(self):
            super().__init__()
            self.net = NICE(hidden=64, mlp_layers=2)

        def training_step(self, batch, batch_idx):
            assert batch.shape == (64, 784) and batch.dtype == torch.float32
            return -self.net.log_likelihood(batch).mean()

        def configure_optimizers(self):
            return torch.optim.Adam(self.parameters(), lr=1e-3)

    L.seed_everything(0, verbose=False)
    dm = MNISTDataModule(mnist_root, batch_size=64, download=False, limit=3000)
    model = MLE()
    dm.setup()
    with torch.no_grad():
        before = model.net.log_likelihood(dm.val_data).mean().item()
    trainer = L.Trainer(max_steps=40, logger=False, enable_checkpointing=False, enable_progress_bar=False,
                        enable_model_summary=False, limit_val_batches=0, accelerator="cpu", devices=1)
    trainer.fit(model, datamodule=dm)
    with torch.no_grad():
        after = model.net.log_likelihood(dm.val_data).mean().item()
        bpd = dm.bits_per_dim(model.net.log_likelihood(dm.val_data), dm.val_data).mean().item()
    assert trainer.global_step == 40
    assert after > before + 5000, (before, after)  # nats per image, in logit space
    assert 1.0 < bpd < 7.0  # better than uniform over pixels (8 bits/dim), finite
