"""Training logic shared by every score-matching model: objective, optimiser, evaluation.

A subclass provides ``self.net`` (an ``nn.Module`` exposing ``log_density(x)`` and/or ``score(x)``) and may
override ``training_objective`` (e.g. DKEF fits α on half the batch) and ``test_log_likelihood``.

Evaluation always computes the *exact* SM loss (eq. 1, per sample, not divided by D) — the common yardstick
of the paper and the reference code — under ``torch.enable_grad()``, because a score needs autograd even at
test time (docs/deq.md §8: run the Trainer with ``inference_mode=False``).
"""

from __future__ import annotations

import math
import random
from collections.abc import Mapping
from typing import Any

import lightning.pytorch as L
import numpy as np
import torch

from src.objectives.base import ObjectiveOutput, compute_score
from src.objectives.registry import get_objective
from src.objectives.sm import sm as exact_sm


def as_plain(cfg: Any) -> Any:
    """OmegaConf containers -> plain dicts/lists (so hparams pickle and print cleanly)."""
    try:
        from omegaconf import DictConfig, ListConfig, OmegaConf

        if isinstance(cfg, (DictConfig, ListConfig)):
            return OmegaConf.to_container(cfg, resolve=True)
    except ImportError:  # pragma: no cover
        pass
    return cfg


def batch_tensor(batch: Any) -> torch.Tensor:
    """The data tensor of a batch (plain tensor, or the first element of a tuple/list)."""
    return batch[0] if isinstance(batch, (tuple, list)) else batch


class NonFiniteLossError(FloatingPointError):
    pass


def capture_rng_states() -> dict:
    states = {"python": random.getstate(), "numpy": np.random.get_state(), "torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        states["cuda"] = torch.cuda.get_rng_state_all()
    return states


def restore_rng_states(states: dict) -> None:
    random.setstate(states["python"])
    np.random.set_state(states["numpy"])
    torch.set_rng_state(states["torch"])
    if "cuda" in states and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(states["cuda"])


class ScoreMatchingModule(L.LightningModule):
    net: torch.nn.Module

    def __init__(self, loss: Mapping, optimizer: Mapping | None = None, evaluation: Mapping | None = None):
        super().__init__()
        loss = dict(as_plain(loss) or {"name": "sm"})
        self.loss_name = loss.pop("name")
        self.loss_kwargs = loss
        self.objective = get_objective(self.loss_name, **loss)
        self.optimizer_cfg = dict(as_plain(optimizer) or {})
        self.evaluation_cfg = dict(as_plain(evaluation) or {})
        self.test_results: dict[str, float] = {}
        self._test_sm: list[torch.Tensor] = []
        self._test_fisher: list[torch.Tensor] = []
        self._test_true_ll: list[torch.Tensor] = []

    # ------------------------------------------------------------------ hooks for subclasses
    def training_objective(self, x: torch.Tensor) -> ObjectiveOutput:
        return self.objective(self.net, x)

    def eval_model(self):
        """The object evaluation differentiates (exposes log_density and/or score)."""
        return self.net

    def test_log_likelihood(self, x_test: torch.Tensor) -> dict[str, float]:
        """Test log-likelihood metrics; models without a tractable or estimable likelihood return {}."""
        return {}

    # ------------------------------------------------------------------ training
    def training_step(self, batch, batch_idx):
        x = batch_tensor(batch)
        out = self.training_objective(x)
        if not torch.isfinite(out.loss):
            raise NonFiniteLossError(
                f"non-finite training loss ({out.loss.item()}) at global step {self.global_step} "
                f"(loss={self.loss_name}). Checkpoints written so far are kept. Try a smaller "
                "model.optimizer.lr, a larger deq.norm_lambda, or gradient clipping (trainer.gradient_clip_val)."
            )
        self.log("train/loss", out.loss, prog_bar=True, on_step=True, on_epoch=True, batch_size=x.shape[0])
        for name, value in out.parts.items():
            self.log(f"train/{name}", value, on_step=False, on_epoch=True, batch_size=x.shape[0])
        return out.loss

    def configure_optimizers(self):
        lr = float(self.optimizer_cfg.get("lr", 1e-3))
        wd = float(self.optimizer_cfg.get("weight_decay", 0.0))
        return torch.optim.Adam(self.parameters(), lr=lr, weight_decay=wd)

    # ------------------------------------------------------------------ evaluation
    def _exact_sm(self, x: torch.Tensor) -> torch.Tensor:
        with torch.enable_grad():
            return exact_sm(self.eval_model(), x, create_graph=False).per_sample.detach()

    def validation_step(self, batch, batch_idx):
        x = batch_tensor(batch)
        limit = self.evaluation_cfg.get("val_sm_points")  # exact SM costs D backward passes: cap it for big D
        if limit is not None:
            x = x[: int(limit)]
        per_sample = self._exact_sm(x)
        self.log("val/sm_loss", per_sample.mean(), prog_bar=True, on_epoch=True, batch_size=x.shape[0], sync_dist=True)

    def on_test_epoch_start(self):
        self._test_sm, self._test_fisher, self._test_true_ll = [], [], []
        self.test_results = {}

    def test_step(self, batch, batch_idx):
        x = batch_tensor(batch)
        limit = self.evaluation_cfg.get("test_sm_points")
        seen = sum(t.numel() for t in self._test_sm)
        if limit is None or seen < limit:
            xs = x if limit is None else x[: max(0, int(limit) - seen)]
            self._test_sm.append(self._exact_sm(xs).cpu())
        dm = self._datamodule()
        if dm is not None and getattr(dm, "has_ground_truth", False):
            with torch.enable_grad():
                s = compute_score(self.eval_model(), x, create_graph=False).detach()
            s_true = dm.true_score(x)
            self._test_fisher.append((0.5 * (s - s_true).flatten(1).pow(2).sum(-1)).cpu())
            self._test_true_ll.append(dm.true_log_density(x).detach().cpu())

    def on_test_epoch_end(self):
        results: dict[str, float] = {}
        if self._test_sm:
            sm_all = torch.cat(self._test_sm)
            results["test/sm_loss"] = sm_all.mean().item()
            results["test/sm_loss_stderr"] = (sm_all.std() / math.sqrt(max(1, sm_all.numel()))).item()
        if self._test_fisher:
            results["test/fisher_divergence"] = torch.cat(self._test_fisher).mean().item()
            results["test/true_log_likelihood"] = torch.cat(self._test_true_ll).mean().item()
        dm = self._datamodule()
        if dm is not None and getattr(dm, "test_data", None) is not None:
            results.update(self.test_log_likelihood(dm.test_data.to(self.device)))
        for key, value in results.items():
            self.log(key, value)
        self.test_results = results

    # ------------------------------------------------------------------ exact resume
    def _deq_blocks(self):
        from src.deq.block import DEQBlock

        return [(name, m) for name, m in self.named_modules() if isinstance(m, DEQBlock)]

    def on_save_checkpoint(self, checkpoint: dict) -> None:
        """Also save RNG states and DEQ warm-start fixed points, so a resumed run continues exactly."""
        checkpoint["deqsm_rng_states"] = capture_rng_states()
        checkpoint["deqsm_warm_start"] = {name: m.warm_start_state() for name, m in self._deq_blocks()}

    def on_load_checkpoint(self, checkpoint: dict) -> None:
        if "deqsm_rng_states" in checkpoint:
            restore_rng_states(checkpoint["deqsm_rng_states"])
        states = checkpoint.get("deqsm_warm_start", {})
        for name, m in self._deq_blocks():
            if name in states:
                m.load_warm_start_state(states[name])

    # ------------------------------------------------------------------ helpers
    def _datamodule(self):
        trainer = getattr(self, "_trainer", None)
        return getattr(trainer, "datamodule", None) if trainer is not None else None

    def _train_data(self) -> torch.Tensor:
        dm = self._datamodule()
        data = getattr(dm, "train_data", None) if dm is not None else None
        if data is None:
            raise RuntimeError(
                f"{type(self).__name__} needs the training data for evaluation: pass a datamodule with a "
                "`train_data` tensor (every datamodule in src/data has one) to trainer.fit/test"
            )
        return data
