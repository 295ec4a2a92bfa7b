"""Synthetic supervised data for the DEQ-vs-feed-forward studies: one data module over the tasks of
:mod:`src.separation.tasks` (theorem1, steep, regression, gotu, signal). A batch is an ``(x, y)`` tuple,
x [B, d], y [B, 1]; ``split_tensor`` gives x as the data contract asks.

``full_batch=true`` makes every training batch the whole training split (gradient descent, not SGD) and an
epoch ``steps_per_epoch`` such steps, so a long GD run is a few Lightning epochs. Under DDP each rank takes its
share of the rows at every step, so a step is still one full-batch step (:class:`_Repeat`).
"""

from __future__ import annotations

from collections.abc import Mapping

import torch
import torch.distributed as dist
from torch.utils.data import DataLoader, Dataset, TensorDataset

from src.data.contract import ScoreDataModule, check_split
from src.data.resumable import ResumableLoader, ResumableSampler, eval_generator
from src.separation.tasks import TASKS


class _Repeat(Dataset):
    """The full-batch "epoch": ``n`` steps on the whole split. Under DDP with W ranks it holds n·W items, item i
    being the rows ``i mod W, i mod W + W, …``; the (unshuffled) distributed sampler gives rank r the items
    r, r + W, …, i.e. its own rows at each of the n steps, so each step's global batch is the whole split and
    the all-reduced mean gradient is one process's full-batch gradient (equal shards: N a multiple of W)."""

    def __init__(self, x, y, n, shards: int = 1):
        self.x, self.y, self.n, self.shards = x, y, int(n), int(shards)
        if x.shape[0] % self.shards:
            raise ValueError(f"data.full_batch=true under DDP splits the {x.shape[0]} training rows evenly over "
                             f"{self.shards} ranks: give a number of training points that is a multiple of "
                             f"{self.shards}, or data.full_batch=false")

    def __len__(self):
        return self.n * self.shards

    def __getitem__(self, i):
        r = int(i) % self.shards
        return self.x[r::self.shards], self.y[r::self.shards]


class SupervisedDataModule(ScoreDataModule):
    def __init__(self, task: str, dim: int = 1, task_kwargs: Mapping | None = None, batch_size: int = 256,
                 eval_batch_size: int = 4096, full_batch: bool = False, steps_per_epoch: int = 1, seed: int = 0,
                 dtype: str = "float32"):
        super().__init__()
        if task not in TASKS:
            raise ValueError(f"data.task={task!r} is unknown; valid: {', '.join(TASKS)}")
        if dtype not in ("float32", "float64"):
            raise ValueError(f"data.dtype={dtype!r}: float32 or float64")
        self.task, self.seed, self.dim = task, int(seed), int(dim)
        self.task_kwargs = dict(task_kwargs or {})
        self.batch_size, self.eval_batch_size = int(batch_size), int(eval_batch_size)
        self.full_batch, self.steps_per_epoch = bool(full_batch), int(steps_per_epoch)
        self.dtype = getattr(torch, dtype)
        self.meta: dict = {}
        self._splits: dict | None = None

    def setup(self, stage: str | None = None) -> None:
        if self._splits is not None:
            return
        raw = TASKS[self.task](seed=self.seed, dim=self.dim, **self.task_kwargs)
        if raw["train"][0].shape[1] != self.dim:
            raise ValueError(f"data.dim={self.dim} but task {self.task!r} has inputs of dimension "
                             f"{raw['train'][0].shape[1]}: set data.dim to it")
        self.meta = raw["meta"]
        self._splits = {k: tuple(torch.as_tensor(a, dtype=self.dtype) for a in raw[k]) for k in ("train", "val", "test")}
        for k, (x, _) in self._splits.items():
            setattr(self, f"{k}_data", x)

    @property
    def data_shape(self) -> tuple[int, ...]:
        self.setup()
        return tuple(self._splits["train"][0].shape[1:])

    def split_tensor(self, split: str, n: int | None = None) -> torch.Tensor:
        self.setup()
        x = self._splits[check_split(split)][0]
        return x if n is None else x[: int(n)]

    def targets(self, split: str) -> torch.Tensor:
        self.setup()
        return self._splits[check_split(split)][1]

    def train_dataloader(self) -> DataLoader:
        self.setup()
        x, y = self._splits["train"]
        # resumable mid-epoch, in a seeded order (src.data.resumable)
        if self.full_batch:
            world = dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1
            return ResumableLoader(_Repeat(x, y, self.steps_per_epoch, world),
                                   ResumableSampler(self.steps_per_epoch * world, shuffle=False), batch_size=None)
        return ResumableLoader(TensorDataset(x, y), ResumableSampler(x.shape[0], shuffle=True),
                               batch_size=self.batch_size)

    def _eval(self, split):
        self.setup()
        return DataLoader(TensorDataset(*self._splits[split]), batch_size=self.eval_batch_size, shuffle=False,
                          generator=eval_generator())

    def val_dataloader(self) -> DataLoader:
        return self._eval("val")

    def test_dataloader(self) -> DataLoader:
        return self._eval("test")
