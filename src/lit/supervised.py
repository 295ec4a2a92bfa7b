"""Supervised (regression) training of DEQs and explicit MLPs for the studies of *Separation and Bias of Deep
Equilibrium Models on Expressivity and Learning Dynamics* (NeurIPS 2024).

Training step = loss (``mse``, or ``half_sse`` = ½‖f(X) − y‖², Theorem 3's); validation logs ``val/mse`` and
``val/linf``; the test epoch gathers every prediction and sets ``self.test_results`` (``test/mse``, ``test/linf``,
``test/n_params``, ``test/weight_inf_norm``, ``test/deq_iterations``, ``test/flops_per_forward``) plus whatever
the study's analysis (:mod:`src.separation.analysis`, ``analysis=<name>``) measures; the analysis writes its
figure into the run directory (``trainer.default_root_dir``).
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np
import torch

from src.config.values import plain
from src.deq.lookup import blocks_of
from src.lit.base import DeqsmModule
from src.lit.optimizers import optimizer_argument, optimizer_class
from src.models.supervised import DiagonalLinearDEQ, build_supervised_net, forward_flops

LOSSES = ("mse", "half_sse")


class SupervisedLitModule(DeqsmModule):
    """Regression family on the shared base: the optimiser (and schedule) from ``model.optimizer`` (``model.scheduler``)
    as every family; its own validation/test hooks, because its metrics need every prediction at once
    (L∞ error, region counts, the study analyses)."""

    family = "supervised"

    def __init__(self, input_dim: int, output_dim: int = 1, arch: str = "auto", deq: Mapping | None = None,
                 depth: int | None = None, width: int = 16, hidden: int | None = None, match: str | None = None,
                 activation: str = "relu", bias: bool = True, beta0: float = 1.0, alpha: float = 0.1,
                 construction: str | None = None, loss: str = "mse", optimizer: Any = None, scheduler: Any = None,
                 analysis: str | None = None, analysis_kwargs: Mapping | None = None):
        deq = plain(deq)
        # model.arch=deq is a DEQ whatever deq.enabled says: its keys are parsed all the same
        super().__init__(optimizer=optimizer, scheduler=scheduler, deq=deq,
                         deq_enabled=True if arch == "deq" else None)
        if loss not in LOSSES:
            raise ValueError(f"model.loss={loss!r} is unknown; valid: {', '.join(LOSSES)}")
        self.save_hyperparameters(ignore=["optimizer", "scheduler"])  # partials: not hyper-parameters
        self.net = build_supervised_net(int(input_dim), int(output_dim), arch=arch, deq=self.deq, depth=depth,
                                        width=width, hidden=hidden, match=match, activation=activation, bias=bias,
                                        beta0=beta0, alpha=alpha)
        if construction == "theorem1":  # the hand-built DEQ of Theorem 1; an MLP (deq=false) ignores it
            from src.models.supervised import DEQNet
            from src.separation.regions import load_theorem1

            if isinstance(self.net, DEQNet):
                load_theorem1(self.net)
                self.net.requires_grad_(False)  # checked, not trained: the construction is exact already
        elif construction not in (None, "none"):
            raise ValueError(f"model.construction={construction!r} is unknown; valid: theorem1, none")
        self.loss_name = loss
        self.analysis = analysis
        self.analysis_kwargs = dict(plain(analysis_kwargs) or {})
        self.gd_v: torch.Tensor | None = None  # Σ lr·r_k along full-batch GD (Theorem 3's v(t))
        self._test: list = []
        self._iters: list[float] = []

    def forward(self, x):
        return self.net(x)

    def _loss(self, pred, y):
        if self.loss_name == "half_sse":
            return 0.5 * (pred - y).pow(2).sum()
        return (pred - y).pow(2).mean()

    def _world_size(self) -> int:
        trainer = getattr(self, "_trainer", None)
        return trainer.world_size if trainer is not None else 1

    def training_step(self, batch, batch_idx):
        x, y = batch
        with self.deq_forwards() as infos:
            pred = self.net(x)
        loss = self._loss(pred, y)
        world = self._world_size()
        if self.loss_name == "half_sse" and world > 1:
            # a sum over the batch, and DDP averages the ranks' gradients: scaled by the world size, each step is
            # one process's step on the global batch (mse, a mean over equal shards, needs nothing)
            loss = loss * world
        loss = self.with_deq_penalty(loss, x.shape[0], infos)
        if not any(p.requires_grad for p in self.parameters()):  # a frozen construction: evaluate only
            self.log("train/loss", loss.detach(), on_step=False, on_epoch=True, batch_size=x.shape[0])
            return None
        self.check_finite(loss)
        sgd = optimizer_class(self.optimizer_factories["main"]) is torch.optim.SGD
        if isinstance(self.net, DiagonalLinearDEQ) and sgd:
            r = (pred - y).detach().reshape(-1).double()
            if world > 1:  # every rank's residuals, in the split's row order (rank w holds rows w, w + W, …)
                r = self.all_gather(r).t().reshape(-1)
            lr = float(optimizer_argument(self.optimizer_factories["main"], "lr"))
            self.gd_v = r * lr if self.gd_v is None or self.gd_v.shape != r.shape else self.gd_v + lr * r
        self.log("train/loss", loss, on_step=False, on_epoch=True, prog_bar=True, batch_size=x.shape[0],
                 sync_dist=True)
        return loss

    def on_validation_epoch_start(self):  # its own metrics, logged per batch (none from model.metrics)
        pass

    def on_validation_epoch_end(self):
        pass

    def validation_step(self, batch, batch_idx):
        x, y = batch
        with torch.no_grad():
            err = self.net(x) - y
        # under DDP reduced over the ranks' shards (mean, max), so every rank monitors the same value
        self.log("val/mse", err.pow(2).mean(), on_epoch=True, prog_bar=True, batch_size=x.shape[0], sync_dist=True)
        self.log("val/linf", err.abs().max(), on_epoch=True, reduce_fx="max", batch_size=x.shape[0],
                 sync_dist=True)

    def on_test_epoch_start(self):
        self._test, self._iters, self.test_results = [], [], {}

    def test_step(self, batch, batch_idx):
        x, y = batch
        with torch.no_grad():
            pred = self.net(x)
        for _, b in blocks_of(self.net):
            self._iters.append(float(b.last_stats.get("iterations", 0)))
        self._test.append((x.cpu(), y.cpu(), pred.cpu()))

    def on_test_epoch_end(self):
        x, y, pred = (gather_rows(self, torch.cat(t)).double().numpy() for t in zip(*self._test))
        err = pred - y
        iters = float(np.mean(self._iters)) if self._iters else 0.0
        if self._world_size() > 1:
            iters = float(self.all_gather(torch.tensor(iters, dtype=torch.float64, device=self.device)).mean())
        res = {"test/mse": float(np.mean(err ** 2)), "test/linf": float(np.abs(err).max()),
               "test/n_params": float(sum(p.numel() for p in self.net.parameters())),
               "test/weight_inf_norm": effective_weight_inf_norm(self.net),
               "test/deq_iterations": iters, "test/flops_per_forward": forward_flops(self.net, iters)}
        trainer = getattr(self, "_trainer", None)
        if self.analysis and (trainer is None or trainer.is_global_zero):  # one figure writer under DDP
            from src.separation.analysis import ANALYSES

            out_dir = Path(getattr(trainer, "default_root_dir", None) or ".")
            dm = getattr(trainer, "datamodule", None) if trainer is not None else None
            res.update(ANALYSES[self.analysis](self, dm, out_dir, x=x, y=y, pred=pred, **self.analysis_kwargs))
        for k, v in res.items():
            self.log(k, v)
        self.test_results = res

    def on_save_checkpoint(self, checkpoint: dict) -> None:
        super().on_save_checkpoint(checkpoint)
        checkpoint["gd_v"] = self.gd_v  # v(t) belongs to the weights it was accumulated with

    def on_load_checkpoint(self, checkpoint: dict) -> None:
        super().on_load_checkpoint(checkpoint)
        self.gd_v = checkpoint.get("gd_v")


def gather_rows(module: DeqsmModule, t: torch.Tensor) -> torch.Tensor:
    """Under DDP, every rank's rows of the test split in the split's order: Lightning's distributed sampler
    gives rank w the rows w, w + W, … of the split padded (with its head) to a multiple of W; this interleaves
    the ranks' rows back and drops the padding. In one process, ``t`` itself (on the CPU)."""
    trainer = getattr(module, "_trainer", None)
    if trainer is None or trainer.world_size == 1:
        return t.cpu()
    gathered = module.all_gather(t.to(module.device))  # [W, n_local, ...]
    rows = gathered.transpose(0, 1).reshape(-1, *t.shape[1:])
    loaders = trainer.test_dataloaders
    n = len((loaders[0] if isinstance(loaders, (list, tuple)) else loaders).dataset)
    return rows[:n].cpu()


def effective_weight_inf_norm(net: torch.nn.Module) -> float:
    """max |θ| over the weights the forward uses (a DEQ's W after its normalisation), biases included."""
    from src.models.supervised import DEQNet

    vals = []
    if isinstance(net, DEQNet):
        b = net.block
        with torch.no_grad():
            params = b.map_params(torch.zeros(1, b.in_dim, dtype=b.weights[0].dtype))
        vals += [p.abs().max().item() for p in params[1:]]
        vals += [p.abs().max().item() for p in b.injection.parameters()]
        vals += [p.abs().max().item() for p in net.readout.parameters()]
    else:
        vals += [p.detach().abs().max().item() for p in net.parameters()]
    return float(max(vals)) if vals else 0.0
