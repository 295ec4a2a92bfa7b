"""Resumable training loaders (src.data.resumable): the data of a run are a function of (seed, epoch, batch)
only — the same with or without workers, untouched by the global RNG, resumed mid-epoch on exactly the
remaining batches, sharded disjointly across DDP ranks."""

from __future__ import annotations

import pytest
import torch

from src.data.resumable import ResumableLoader, ResumableSampler, decode
from tests.conftest import require_mnist


def mnist_images(**options):
    from src.data.mnist_images import MNISTImageDataModule

    dm = MNISTImageDataModule(root=require_mnist(), limit=120, batch_size=8, binarize=True, **options)
    dm.setup("fit")
    return dm


def epoch(loader, n_epoch=0):
    loader.sampler.set_epoch(n_epoch)
    return [b.clone() for b in loader]


def test_workers_and_global_rng_do_not_change_the_data():
    torch.manual_seed(5)
    plain = epoch(mnist_images().train_dataloader(), 1)
    torch.manual_seed(5)
    workers = epoch(mnist_images(num_workers=2).train_dataloader(), 1)
    assert len(plain) == len(workers) > 3
    assert all(torch.equal(a, b) for a, b in zip(plain, workers))
    torch.manual_seed(5)
    state = torch.get_rng_state()
    again = epoch(mnist_images().train_dataloader(), 1)
    assert torch.equal(torch.get_rng_state(), state)  # iterating the loader drew nothing from the global RNG
    torch.manual_seed(6)  # another global state, same run seed in the loader: the same data
    loader = mnist_images().train_dataloader()
    loader.load_state_dict({"seed": 5, "epoch": 1, "batches": 0})
    assert all(torch.equal(a, b) for a, b in zip(again, [b.clone() for b in loader]))
    other_epoch = epoch(mnist_images().train_dataloader(), 2)
    assert not torch.equal(plain[0], other_epoch[0])  # fresh order and binarisation every epoch


def test_resume_mid_epoch_yields_exactly_the_remaining_batches():
    torch.manual_seed(3)
    loader = mnist_images().train_dataloader()
    loader.sampler.set_epoch(2)
    full, it = [], iter(loader)
    for _ in range(3):
        full.append(next(it))
    state = loader.state_dict()
    assert state == {"seed": 3, "epoch": 2, "batches": 3}
    full += list(it)
    resumed = mnist_images().train_dataloader()
    resumed.load_state_dict(state)
    resumed.sampler.set_epoch(2)  # what Lightning does next: the same epoch keeps the position
    rest = list(resumed)
    assert len(rest) == len(full) - 3 and all(torch.equal(a, b) for a, b in zip(full[3:], rest))
    assert resumed.state_dict()["batches"] == len(full)


def test_ranks_share_each_epoch_disjointly():
    n = 10
    shards = [list(ResumableSampler(n, num_replicas=3, rank=r, seed=1)) for r in range(3)]
    assert [len(s) for s in shards] == [4, 4, 4]  # padded to 12, as DistributedSampler(drop_last=False)
    flat = [i for s in shards for i in s]
    assert sorted(set(flat)) == list(range(n)) and len(flat) == 12
    keyed = [list(ResumableSampler(n, num_replicas=3, rank=r, seed=1, keyed=True)) for r in range(3)]
    assert [decode(torch.tensor(k), n).tolist() for k in keyed] == shards
    assert len({k for s in keyed for k in s}) == 12  # every item of the epoch (padding included) has its own noise key


def test_loader_refuses_another_sampler():
    with pytest.raises(TypeError, match="needs a ResumableSampler"):
        ResumableLoader(list(range(4)), torch.utils.data.SequentialSampler(range(4)))
