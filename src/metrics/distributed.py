"""Evaluation under DDP: how many points this rank holds, how many the test loop sees, rows gathered from
every rank. Lightning's distributed sampler gives rank r the points r, r + W, …; it pads a split whose size
is not a multiple of the world size by repeating a few samples.
"""

from __future__ import annotations

import torch


def test_points_available(module) -> int | None:
    """How many test points the run's test loop will see (dataset size, capped by ``limit_test_batches``), for
    progress totals; None when unknown (outside a Trainer)."""
    trainer = getattr(module, "_trainer", None)
    try:
        loaders = trainer.test_dataloaders
        loaders = loaders if isinstance(loaders, (list, tuple)) else [loaders]
        n_batches = trainer.num_test_batches
        n_batches = n_batches if isinstance(n_batches, (list, tuple)) else [n_batches]
        total = 0
        for dl, nb in zip(loaders, n_batches):
            size = len(dl.dataset)
            total += size if nb == float("inf") else min(size, int(nb) * int(dl.batch_size or size))
        return total // max(1, trainer.world_size)
    except (AttributeError, TypeError):
        return None


def rank_share(module, n: int) -> int:
    """How many of the first ``n`` evaluation points this rank holds: under DDP Lightning's distributed sampler
    gives rank r the points r, r + W, …, so a cap of ``n`` test points takes, over all ranks together, the
    same points as one process. ``n`` in one process."""
    trainer = getattr(module, "_trainer", None)
    if trainer is None or trainer.world_size <= 1:
        return n
    return len(range(trainer.global_rank, n, trainer.world_size))


def cap_points(points: int | None, available: int | None) -> int | None:
    if points is None:
        return available
    return points if available is None else min(points, available)


def gathered_rows(module, x: torch.Tensor) -> torch.Tensor:
    """The rows [n_rank, F] of every DDP rank, concatenated in rank order (shares may differ in length by one)."""
    trainer = module.trainer
    if max(1, trainer.world_size) == 1:
        return x
    counts = module.all_gather(torch.tensor([x.shape[0]], device=x.device)).flatten().tolist()
    padded = torch.cat([x, x.new_zeros(max(counts) - x.shape[0], x.shape[1])])
    rows = module.all_gather(padded)  # [world, max_count, F]
    return torch.cat([rows[r, :c] for r, c in enumerate(counts)])
