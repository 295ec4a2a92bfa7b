"""The N(0, I_D) data of the DKEF scalability experiment and its ground truth."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from src.data import gaussian
from src.data.contract import DataContractError, ScoreDataModule
from src.data.datamodules import GaussianDataModule


def test_default_sizes_dtype_and_moments():
    dm = GaussianDataModule(dim=100)
    dm.prepare_data()
    dm.setup("fit")
    assert dm.has_ground_truth and dm.dim == 100
    assert [tuple(t.shape) for t in (dm.train_data, dm.val_data, dm.test_data)] == [
        (4860, 100),
        (600, 100),
        (540, 100),
    ]
    x = torch.cat([dm.train_data, dm.val_data, dm.test_data]).double()
    assert all(t.dtype == torch.float32 for t in (dm.train_data, dm.val_data, dm.test_data))
    # 6000 samples: mean ± 4/√6000 ≈ 0.052, variance ± ~0.08 per coordinate
    assert x.mean(0).abs().max() < 0.06
    assert (x.var(0) - 1).abs().max() < 0.1
    assert (torch.cov(x.T) - torch.eye(100)).abs().max() < 0.1


def test_configurable_sizes_and_independent_splits():
    small = GaussianDataModule(dim=3, n_train=10, n_val=4, n_test=5, seed=1)
    big = GaussianDataModule(dim=3, n_train=20, n_val=4, n_test=5, seed=1)
    small.setup()
    big.setup()
    assert [len(t) for t in (small.train_data, small.val_data, small.test_data)] == [10, 4, 5]
    assert torch.equal(big.train_data[:10], small.train_data)  # one stream per split
    assert torch.equal(big.val_data, small.val_data) and torch.equal(big.test_data, small.test_data)
    assert not torch.equal(small.val_data, small.test_data[:4])


def test_seeded_deterministic_and_setup_idempotent():
    np_state, torch_state = np.random.get_state(), torch.get_rng_state()
    a, b, c = (
        GaussianDataModule(dim=5, seed=3),
        GaussianDataModule(dim=5, seed=3),
        GaussianDataModule(dim=5, seed=4),
    )
    for dm in (a, b, c):
        dm.setup("fit")
    assert np.array_equal(np.random.get_state()[1], np_state[1]) and torch.equal(
        torch.get_rng_state(), torch_state
    )
    assert torch.equal(a.train_data, b.train_data) and torch.equal(a.test_data, b.test_data)
    assert not torch.equal(a.train_data, c.train_data)
    first = a.train_data
    a.setup("validate")
    a.setup("test")
    assert a.train_data is first


def test_true_score_is_minus_x_and_the_gradient_of_the_log_density():
    x = torch.randn(7, 4, dtype=torch.float64, requires_grad=True)
    dm = GaussianDataModule(dim=4)
    s = dm.true_score(x)
    assert torch.equal(s, -x)
    (grad,) = torch.autograd.grad(dm.true_log_density(x).sum(), x)
    torch.testing.assert_close(grad, s)


def test_true_log_density_matches_the_closed_form():
    torch.manual_seed(0)
    d = 200
    x = torch.randn(16, d, dtype=torch.float64)
    expected = -0.5 * (x**2).sum(1) - 0.5 * d * math.log(2 * math.pi)
    torch.testing.assert_close(gaussian.true_log_density(x), expected)
    ref = torch.distributions.Normal(0.0, 1.0).log_prob(x).sum(1)
    torch.testing.assert_close(GaussianDataModule(dim=d).true_log_density(x), ref)
    assert gaussian.true_log_density(torch.zeros(1, 10)).item() == pytest.approx(-5 * math.log(2 * math.pi))
    assert gaussian.true_log_density(torch.zeros(3, 2, 10, dtype=torch.float32)).shape == (3, 2)


@pytest.mark.parametrize("dim", [0, -3, 2.5, True])
def test_dim_must_be_a_positive_integer(dim):
    with pytest.raises(ValueError, match="dim"):
        GaussianDataModule(dim=dim)
    with pytest.raises(ValueError, match="dim"):
        gaussian.sample_gaussian(5, dim)


@pytest.mark.parametrize("kwargs", [{"n_train": 0}, {"n_val": -1}, {"n_test": 0}, {"batch_size": 0}])
def test_sizes_must_be_positive(kwargs):
    with pytest.raises(ValueError, match=next(iter(kwargs))):
        GaussianDataModule(dim=2, **kwargs)


def test_batches_are_plain_tensors():
    dm = GaussianDataModule(dim=6, n_train=100, n_val=30, n_test=20, batch_size=32, eval_batch_size=25)
    dm.setup()
    train = list(dm.train_dataloader())
    assert [b.shape for b in train] == [torch.Size([32, 6])] * 3 + [torch.Size([4, 6])]
    assert torch.equal(torch.cat(train).sort(0).values, dm.train_data.sort(0).values)
    assert torch.equal(torch.cat(list(dm.val_dataloader())), dm.val_data)
    assert [b.shape[0] for b in dm.test_dataloader()] == [20]


def test_gaussian_follows_the_data_contract_in_float64():
    dm = GaussianDataModule(dim=3, n_train=10, n_val=4, n_test=5, seed=2)
    assert isinstance(dm, ScoreDataModule) and dm.has_ground_truth and not dm.is_image
    assert dm.data_shape == (3,) and dm.data_dim == 3
    dm.setup()
    x32 = dm.split_tensor("test", 3)
    assert x32.dtype == torch.float32 and torch.equal(x32, dm.test_data[:3])
    x = torch.tensor([[0.5, -1.0, 2.0], [1e-9, 0.0, -3.0]], dtype=torch.float64)
    score, logp = dm.true_score(x), dm.true_log_density(x)
    assert score.dtype == torch.float64 and logp.dtype == torch.float64
    assert score.tolist() == [[-0.5, 1.0, -2.0], [-1e-9, 0.0, 3.0]]  # exact in float64 (1e-9 is not in float32)
    assert logp[0].item() == pytest.approx(-0.5 * 5.25 - 1.5 * math.log(2 * math.pi), abs=1e-14)
    assert dm.true_log_density(x32).dtype == torch.float32
    with pytest.raises(DataContractError):
        dm.bits_per_dim(logp, x)


@pytest.mark.parametrize("n_train, sizes", [(9, [4, 4]), (10, [4, 4, 2]), (8, [4, 4]), (5, [4])])
def test_training_loader_drops_only_a_last_batch_of_one_row(n_train, sizes):
    """A DKEF step splits its batch into an α-fit half and a loss half, so a batch of one row cannot train:
    k·B + 1 training rows drop the last row of each epoch (a different row each epoch: the order is reshuffled);
    any other count keeps every row."""
    dm = GaussianDataModule(dim=3, n_train=n_train, n_val=4, n_test=4, batch_size=4)
    dm.setup("fit")
    loader = dm.train_dataloader()
    seen = []
    for epoch in range(3):
        loader.sampler.set_epoch(epoch)
        batches = list(loader)
        assert [b.shape[0] for b in batches] == sizes
        seen.append({tuple(r.tolist()) for b in batches for r in b})
    if n_train % 4 == 1:
        assert len(set.union(*seen)) > sum(sizes)  # not always the same row left out
    else:
        assert all(len(s) == n_train for s in seen)
