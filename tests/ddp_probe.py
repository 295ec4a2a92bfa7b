"""A callback for the DDP tests (tests/test_ddp.py): what one rank saw and did in its first training batch.

Added to a run as ``+callbacks.ddp_probe._target_=tests.ddp_probe.GradientProbe +callbacks.ddp_probe.path=DIR``;
writes ``DIR/rank<r>.pt`` with the batch, the global torch RNG state before the step, the rank's intra-op thread
count, and for each optimiser step of that batch the module's state before the update and the gradients the
optimiser was given (under DDP: after the all-reduce). :func:`replay_gradients` recomputes one rank's
gradients of optimiser step ``k`` in one process from what the probe saved.
"""

from __future__ import annotations

import warnings
from pathlib import Path

import torch
from lightning.pytorch.callbacks import Callback

from src.deq.lookup import blocks_of


def _cpu(obj):
    if torch.is_tensor(obj):
        return obj.detach().cpu().clone()
    if isinstance(obj, (list, tuple)):
        return type(obj)(_cpu(o) for o in obj)
    if isinstance(obj, dict):
        return {k: _cpu(v) for k, v in obj.items()}
    return obj


class GradientProbe(Callback):
    def __init__(self, path: str):
        self.path = Path(path)
        self.record: dict | None = None
        self.done = False

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        if self.record is None:
            self.record = {"batch": _cpu(batch), "rng": torch.get_rng_state(), "steps": [],
                           "world_size": trainer.world_size, "rank": trainer.global_rank,
                           "threads": torch.get_num_threads(),
                           "warm_start": _warm_starts(pl_module)}

    def on_before_optimizer_step(self, trainer, pl_module, optimizer):
        if self.record is not None and not self.done:
            grads = {n: p.grad.detach().clone() for n, p in pl_module.named_parameters() if p.grad is not None}
            self.record["steps"].append({"state": _cpu(pl_module.state_dict()), "grads": _cpu(grads)})

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        if self.record is not None and not self.done:
            self.done = True
            self.path.mkdir(parents=True, exist_ok=True)
            torch.save(self.record, self.path / f"rank{trainer.global_rank}.pt")


def _warm_starts(module) -> dict:
    """The DEQ blocks' cached fixed points (a solve starts from them: they change its result at the tolerance)."""
    return {name: m.warm_start_state() for name, m in blocks_of(module)}


def load_records(path: Path) -> list[dict]:
    records = [torch.load(f, map_location="cpu", weights_only=False) for f in sorted(Path(path).glob("rank*.pt"))]
    return sorted(records, key=lambda r: r["rank"])


def replay_gradients(module, record: dict, k: int) -> dict[str, torch.Tensor]:
    """The gradients of optimiser step ``k`` of ``record``'s batch, computed in this process by the module's own
    ``training_step`` (from the module state before that step, the rank's RNG state before the batch and its DEQ
    warm starts).

    Automatic optimisation: the gradient of the returned loss. Manual (the VAE's alternating updates): the
    ``k``-th ``manual_update`` call's loss, differentiated w.r.t. the parameters it reaches; earlier updates
    are not applied (the state before step ``k`` already holds them) but draw from the RNG as in the run."""
    module.load_state_dict(record["steps"][k]["state"])
    for name, m in blocks_of(module):  # start every solve where the rank's did
        m.load_warm_start_state(record["warm_start"].get(name, {}))
    params = dict(module.named_parameters())
    torch.set_rng_state(record["rng"])

    def grads_of(loss):
        names = [n for n, p in params.items() if p.requires_grad]
        gs = torch.autograd.grad(loss, [params[n] for n in names], allow_unused=True)
        return {n: g for n, g in zip(names, gs) if g is not None}

    with warnings.catch_warnings():  # training_step logs; outside a Trainer Lightning warns and drops it
        warnings.filterwarnings("ignore", message=".*self.log.*")
        return _replay(module, record, k, grads_of)


def _replay(module, record, k, grads_of):
    if module.automatic_optimization:
        return grads_of(module.training_step(record["batch"], 0))
    calls: list = []
    captured: dict = {}

    def capture(name, loss):
        if len(calls) == k:
            captured.update(grads_of(loss))
        calls.append(name)

    module.manual_update = capture
    try:
        module.training_step(record["batch"], 0)
    finally:
        del module.manual_update
    return captured
