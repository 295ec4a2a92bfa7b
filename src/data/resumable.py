"""Resumable training data: a run killed mid-epoch resumes on exactly the batches it would have seen.

Every training loader of the project is a :class:`ResumableLoader` over a :class:`ResumableSampler`. Their
randomness is counter-based, never drawn from the process's global RNG:

- the order of epoch ``e`` is a permutation drawn from a generator seeded by (``seed``, ``e``);
- a loader of noisy data (images: dequantisation, binarisation, flips; NICE's MNIST: dequantisation) gets,
  per item, a *key* (:func:`decode` gives the data index back) that is unique over the whole run — epoch,
  position in the epoch's order and index — and its collate draws that item's noise from a generator seeded by
  (``seed``, key);
- ``seed`` is the run's seed (``torch.initial_seed()`` when the loader is built: ``seed_everything(cfg.seed)``).

So the data of a run are a function of (``seed``, epoch, batch) only: not of the global RNG state, of the
number of workers, of whether validation ran, or of where the run was interrupted. The loader's state is three
integers (``seed``, ``epoch``, batches consumed in the epoch); Lightning saves it in every checkpoint
(``loops/fit_loop/state_dict/combined_loader``: it calls ``state_dict`` / ``load_state_dict`` of a loader that
has them) and restores it on resume, and the sampler then starts the epoch's order after the consumed batches.

Why not torchdata's ``StatefulDataLoader`` (``torchdata`` 0.11 installs without pulling another torch: it
requires only ``torch>=2``, ``requests``, ``urllib3``): it restores the sampler position and the workers'
RNG states, but our per-batch noise would still come from the global RNG in the main process or from the
per-worker RNGs, so a resume would also depend on when the RNG states were captured relative to the batches
already fetched (Lightning's loops fetch before the checkpoint of a step is written; a worker prefetches
several batches) and on the worker count. Counter-based noise makes the position the whole state, with no
extra dependency, and the same sampler shards the order across DDP ranks (it is a ``DistributedSampler``,
so Lightning does not replace it).
"""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.distributed as dist
from torch.utils.data import DataLoader, Dataset, DistributedSampler


def _replicas(num_replicas: int | None, rank: int | None) -> tuple[int, int]:
    if num_replicas is not None and rank is not None:
        return int(num_replicas), int(rank)
    if dist.is_available() and dist.is_initialized():
        return dist.get_world_size(), dist.get_rank()
    return 1, 0


def mix_seed(*parts: int) -> int:
    """One 63-bit seed from integers (seed, epoch / key …); distinct parts give distinct seeds in practice."""
    h = 0x9E3779B97F4A7C15
    for p in parts:
        h = ((h ^ (int(p) & 0xFFFFFFFFFFFFFFFF)) * 0xBF58476D1CE4E5B9 + 0x94D049BB133111EB) & 0xFFFFFFFFFFFFFFFF
        h ^= h >> 31
    return h & 0x7FFFFFFFFFFFFFFF


def item_generator(seed: int, key: int) -> torch.Generator:
    """The generator of the noise of the training item with ``key`` (module docstring)."""
    return torch.Generator().manual_seed(mix_seed(seed, key))


class ResumableSampler(DistributedSampler):
    """Indices (or keys, ``keyed=True``) of one epoch in a counter-based order, this rank's share of it,
    starting after the items a resumed run already consumed (module docstring). Without DDP it is one
    replica's sampler; ``drop_last=False`` semantics of ``DistributedSampler`` (the order is padded with its
    head so that every rank gets ``ceil(n / replicas)`` items)."""

    def __init__(self, n: int, shuffle: bool = True, keyed: bool = False, seed: int | None = None,
                 num_replicas: int | None = None, rank: int | None = None):
        num_replicas, rank = _replicas(num_replicas, rank)
        super().__init__(range(int(n)), num_replicas=num_replicas, rank=rank, shuffle=bool(shuffle), drop_last=False)
        self.n = int(n)
        self.keyed = bool(keyed)
        self.seed = int(torch.initial_seed() if seed is None else seed)
        self.epoch = 0
        self.skip = 0  # items of this epoch to pass over at the next iteration (set by a resume)

    def set_epoch(self, epoch: int) -> None:
        if int(epoch) != self.epoch:
            self.epoch, self.skip = int(epoch), 0

    def order(self) -> torch.Tensor:
        """This epoch's order of all ``n`` indices, padded to ``total_size``."""
        if self.shuffle:
            perm = torch.randperm(self.n, generator=torch.Generator().manual_seed(mix_seed(self.seed, self.epoch)))
        else:
            perm = torch.arange(self.n)
        if self.total_size > self.n:
            perm = torch.cat([perm, perm.repeat(math.ceil(self.total_size / self.n))[: self.total_size - self.n]])
        return perm

    def __iter__(self):
        perm = self.order().tolist()
        skip, self.skip = self.skip, 0
        for j in range(self.rank + skip * self.num_replicas, self.total_size, self.num_replicas):
            yield (self.epoch * self.total_size + j) * self.n + perm[j] if self.keyed else perm[j]


def decode(keys: torch.Tensor, n: int) -> torch.Tensor:
    """Data indices of ``keyed`` sampler keys."""
    return keys % int(n)


class KeyedItems(Dataset):
    """``dataset`` read by sampler keys: a batch is ``(items, keys)`` — the items as ``dataset`` gives a batch
    (its ``__getitems__``, else the stacked items) and the keys [B] that seed their noise."""

    def __init__(self, dataset: Dataset):
        self.dataset = dataset
        self.n = len(dataset)

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, key: int):
        return self.dataset[int(key) % self.n], int(key)

    def __getitems__(self, keys: list[int]):
        keys_t = torch.as_tensor(keys, dtype=torch.long)
        idx = decode(keys_t, self.n).tolist()
        getitems = getattr(self.dataset, "__getitems__", None)
        items = getitems(idx) if getitems is not None else torch.stack([self.dataset[i] for i in idx])
        return items, keys_t


class ResumableLoader(DataLoader):
    """A training ``DataLoader`` whose position Lightning saves and restores (``state_dict`` /
    ``load_state_dict``; module docstring). ``sampler`` must be a :class:`ResumableSampler`; a ``collate_fn``
    with a ``seed`` attribute (the noisy loaders') follows the loader's seed. Iterating creates the underlying
    iterator lazily, at the first batch, so a resumed or re-epoched sampler is read after Lightning set it up."""

    def __init__(self, dataset: Dataset, sampler: ResumableSampler, **kwargs: Any):
        if not isinstance(sampler, ResumableSampler):
            raise TypeError(f"ResumableLoader needs a ResumableSampler, got {type(sampler).__name__}")
        # the workers' base seed from the loader's own generator, never from the global RNG
        kwargs.setdefault("generator", torch.Generator().manual_seed(sampler.seed))
        super().__init__(dataset, sampler=sampler, **kwargs)
        self._consumed = 0
        self._count_epoch = sampler.epoch

    def _per_batch(self) -> int:
        return self.batch_size or 1

    def __iter__(self):
        return self._batches()

    def _batches(self):
        sampler = self.sampler
        self._count_epoch, self._consumed = sampler.epoch, sampler.skip // self._per_batch()
        for batch in DataLoader.__iter__(self):
            self._consumed += 1
            yield batch

    def state_dict(self) -> dict[str, int]:
        sampler = self.sampler
        consumed = self._consumed if self._count_epoch == sampler.epoch else 0
        return {"seed": int(sampler.seed), "epoch": int(sampler.epoch), "batches": int(consumed)}

    def load_state_dict(self, state: dict[str, int]) -> None:
        sampler = self.sampler
        sampler.seed, sampler.epoch = int(state["seed"]), int(state["epoch"])
        sampler.skip = int(state["batches"]) * self._per_batch()
        self._count_epoch, self._consumed = sampler.epoch, int(state["batches"])
        if hasattr(self.collate_fn, "seed"):
            self.collate_fn.seed = sampler.seed


def eval_generator() -> torch.Generator:
    """For evaluation loaders: their iterator's base seed is drawn from it, not from the global RNG, so an
    evaluation leaves the training RNG untouched (their data are fixed: no randomness is used)."""
    return torch.Generator().manual_seed(0)
