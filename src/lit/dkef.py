"""LightningModule for DKEF (paper §4.2): α fitted in closed form per batch, loss on the other half.

Training step (reference protocol, ``update_alpha``): the batch is split in two halves X_t and X_v; α is
fitted on X_t by the closed form matching the objective (``src/models/dkef.py``), and the objective is
computed on X_v with that α, so gradients flow through α into every parameter. Before validation and test,
α is refitted on ``alpha_refit_points`` training points (exact fit) and stored in the model. With
``final_refit`` set, the test instead follows the reference's final stage (``finalize``): α on every training
point, then log10 λ alone trained by Adam on the validation set's exact SM loss (feature networks fixed), as the
reference code does before it reports its test figures (off by default; ``model.final_refit={lambda_steps:1000,
lr:1e-3}`` switches it on, ``run_grid.py --eval-final-refit`` applies it to finished runs).
Test log-likelihood (``model.metrics.log_likelihood``): importance sampling of log Z with ``samples`` draws
from the proposal N(0, ``proposal_std``² I), as the reference code.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from src.config.values import plain
from src.lit.base import ScoreMatchingModule
from src.metrics.registry import metric_options
from src.models.dkef import ALPHA_FIT_MODES, DKEF
from src.objectives.base import ObjectiveOutput
from src.objectives.sm import sm_from_score_and_trace

# Which closed-form α fit goes with which objective (reference code: exact for SM, sliced for SSM(-VR),
# the denoising form for DSM; CP uses the cheap unbiased sliced fit).
AUTO_ALPHA_FIT = {"sm": "exact", "ssm": "sliced", "ssm_vr": "sliced", "cp": "sliced", "dsm": "dsm"}
# model.metrics.log_likelihood: importance samples of Z and the proposal's standard deviation
LOG_LIKELIHOOD_DEFAULTS = {"samples": 100_000, "proposal_std": 2.0}
# model.final_refit: Adam steps and learning rate of the λ refit (reference ``finalize``: 1000 steps at 1e-3)
FINAL_REFIT_KEYS = ("lambda_steps", "lr")


class DKEFLitModule(ScoreMatchingModule):
    """See the module docstring. ``net``: ``model.net``, a partial :class:`src.models.dkef.DKEF` (its sizes; the module
    adds ``input_dim`` = ``data.dim``, the parsed ``deq`` setting and ``depth``)."""

    family = "dkef"
    default_net = DKEF

    def __init__(
        self,
        input_dim: int,
        loss: Mapping,
        net: Any = None,
        deq: Mapping | None = None,
        depth: int | None = None,
        alpha_fit: str = "auto",
        alpha_refit_points: int = 1000,
        final_refit: Mapping | None = None,
        optimizer: Any = None, scheduler: Any = None,
        metrics: Mapping | None = None,
    ):
        # plain containers, so the checkpoint's hyper_parameters hold no OmegaConf objects
        loss, deq, metrics, final_refit = (plain(c) for c in (loss, deq, metrics, final_refit))
        if loss and loss.get("name") == "mle":
            raise ValueError(
                "loss=mle needs a model with a tractable likelihood (model=nice); DKEF's normaliser is "
                "intractable. Use loss=sm|ssm|ssm_vr|dsm|cp with model=dkef."
            )
        super().__init__(loss=loss, optimizer=optimizer, scheduler=scheduler, metrics=metrics, deq=deq)
        self.save_hyperparameters(ignore=["optimizer", "scheduler", "net"])  # partials: not hyper-parameters
        self.alpha_refit_points = int(alpha_refit_points)
        self.final_refit = self._checked_final_refit(final_refit)
        self._final_refit_results: dict[str, float] = {}
        self.log_likelihood_options = metric_options(metrics, "log_likelihood", LOG_LIKELIHOOD_DEFAULTS)
        if alpha_fit == "auto":
            alpha_fit = AUTO_ALPHA_FIT.get(self.loss_name, "exact")
        if alpha_fit not in ALPHA_FIT_MODES:
            raise ValueError(f"model.alpha_fit={alpha_fit!r} is invalid; valid: auto, {', '.join(ALPHA_FIT_MODES)}")
        self.alpha_fit = alpha_fit
        self.net = self.build_net(net, input_dim=input_dim, deq=self.deq, depth=depth)

    @staticmethod
    def _checked_final_refit(spec: Mapping | None) -> dict | None:
        if spec is None:
            return None
        unknown = sorted(set(spec) - set(FINAL_REFIT_KEYS))
        missing = [k for k in FINAL_REFIT_KEYS if k not in spec]
        if unknown or missing:
            raise ValueError(
                f"model.final_refit needs exactly the keys {', '.join(FINAL_REFIT_KEYS)} "
                f"(unknown: {unknown or 'none'}, missing: {missing or 'none'}); e.g. "
                "model.final_refit={lambda_steps:1000,lr:1e-3}, or model.final_refit=null to switch it off")
        steps, lr = int(spec["lambda_steps"]), float(spec["lr"])
        if steps < 0 or not lr > 0:
            raise ValueError(f"model.final_refit needs lambda_steps >= 0 and lr > 0, got {steps} and {lr}")
        return {"lambda_steps": steps, "lr": lr}

    def _alpha_kwargs(self) -> dict:
        if self.alpha_fit == "dsm":
            return {"sigma": float(self.loss_kwargs.get("sigma", 0.1))}
        if self.alpha_fit == "sliced":
            return {"n_projections": int(self.loss_kwargs.get("n_projections", 1))}
        return {}

    def setup(self, stage: str) -> None:
        # Inducing points start at random training points (reference: M random training points). A resumed
        # checkpoint overwrites them afterwards.
        if stage == "fit":
            data = self.datamodule().split_tensor("train")
            g = torch.Generator().manual_seed(0)
            idx = torch.randint(0, data.shape[0], (self.net.inducing.shape[0],), generator=g)
            with torch.no_grad():
                self.net.inducing.copy_(data[idx].to(self.net.inducing))

    def training_objective(self, x: torch.Tensor) -> ObjectiveOutput:
        if x.shape[0] < 2:
            raise ValueError("DKEF training needs batches of at least 2 points (α fit half + loss half)")
        half = x.shape[0] // 2
        x_fit, x_loss = x[:half], x[half:]
        with self.net.shared_inducing_features():  # φ(inducing points) once for the fit and the loss
            if self._fused_exact_sm(x):  # the same numbers, both halves' feature jets in one pass
                s, tr = self.net.fit_and_exact_sm(x_fit, x_loss)
                return sm_from_score_and_trace(s, tr)
            alpha = self.net.fit_alpha(x_fit, self.alpha_fit, **self._alpha_kwargs())
            return self.objective(self.net.with_alpha(alpha), x_loss)

    def _fused_exact_sm(self, x: torch.Tensor) -> bool:
        """Exact SM with the exact α fit on the jet route (what ``trace_route="auto"`` would pick for the loss)."""
        return (self.loss_name == "sm" and self.alpha_fit == "exact"
                and self.loss_kwargs.get("trace_route", "auto") == "auto" and self.net.own_trace_route(x))

    def refit_alpha(self) -> None:
        """Exact α on (up to) ``alpha_refit_points`` training points, stored in the model for evaluation."""
        data = self.split_tensor("train")
        n = self.alpha_refit_points
        if data.shape[0] > n:
            g = torch.Generator().manual_seed(1234)
            data = data[torch.randperm(data.shape[0], generator=g)[:n].to(data.device)]
        self.net.fit_alpha_on(data, "exact")

    def on_validation_epoch_start(self):
        self.refit_alpha()
        super().on_validation_epoch_start()

    def final_refit_alpha_lambda(self) -> dict[str, float]:
        """The reference's final stage (module docstring): α on every training point, λ refitted on validation."""
        spec = self.final_refit
        return self.net.refit_lambda(self.split_tensor("train"), self.split_tensor("val"),
                                     steps=spec["lambda_steps"], lr=spec["lr"])

    def on_test_epoch_start(self):
        if self.final_refit is None:
            self.refit_alpha()
            self._final_refit_results = {}
        else:
            self._final_refit_results = {f"test/final_refit/{k}": v for k, v in self.final_refit_alpha_lambda().items()}
        options = self.log_likelihood_options
        if options is not None:  # log Z only for the log-likelihood metric
            g = torch.Generator().manual_seed(0)  # the same estimate on every rank and in every re-evaluation
            self._log_z = self.net.log_normalizer(n_samples=int(options["samples"]),
                                                  proposal_std=float(options["proposal_std"]), generator=g)
        super().on_test_epoch_start()

    def on_test_epoch_end(self):
        super().on_test_epoch_end()
        for key, value in self._final_refit_results.items():
            self.log(key, value, rank_zero_only=False)
        self.test_results.update(self._final_refit_results)

    def log_likelihood_metrics(self, x: torch.Tensor) -> dict[str, torch.Tensor]:
        """log p̃(x) − log Ẑ per test point, Ẑ by importance sampling (computed once per test epoch)."""
        return {"log_likelihood": self.net.log_density(x) - self._log_z}

    def log_likelihood_constants(self) -> dict[str, float]:
        return {"test/log_normalizer": float(self._log_z)}
