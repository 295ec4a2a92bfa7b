"""SSM-VAE LightningModule (``model=vae``): implicit encoder, decoder, score estimator s(z|x), trained by
alternating manual updates (paper §4.1, App. D.3, Tables 1, 6, 7).

Each training step, on a batch x (binarised MNIST, or CIFAR-10/CelebA in [−1, 1]):

1. ``score_steps`` updates of the score estimator (optimiser ``score``) with the configured objective
   (default ``loss=ssm_vr`` with Gaussian projections, the SSM reference code's ``sliced_score_estimation_vr``;
   ``ssm``, eq. 3; ``dsm``) on z ~ q(z|x), drawn afresh and detached each time;
2. one update of encoder and decoder (optimiser ``vae``) on the surrogate negative ELBO
   −log p(x|z) − log p(z) + ⟨stop-grad(s(z|x)), z⟩, whose encoder gradient is, in expectation, that of
   the true negative ELBO (:func:`src.models.vae.entropy_surrogate`).

Both go through :meth:`DeqsmModule.manual_update` (clipping as ``trainer.gradient_clip_val`` says).
Metrics: ``model.metrics.vae`` (:mod:`src.metrics.vae`: score estimator's SSM loss, reconstruction error),
``log_likelihood`` (AIS of log p(x), :mod:`src.metrics.ais`: ``test_points``, ``seed``, the sampler's ``ais.*``), ``fid``
(prior samples through the decoder, :meth:`sample`).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, ClassVar

import torch

from src.config.values import plain
from src.lit.base import DeqsmModule, batch_tensor
from src.metrics.ais import ais_log_likelihood
from src.metrics.distributed import rank_share
from src.metrics.registry import metric_options
from src.models.vae import ConditionalScore, build_vae_networks, surrogate_negative_elbo
from src.objectives.ssm import ssm
from src.runtime import progress

# model.metrics.log_likelihood: AIS on the first test_points test points, its sampler's settings under ais
AIS_DEFAULTS = {"n_steps": 1000, "n_chains": 16, "leapfrog": 10, "step_size": 0.05, "target_accept": 0.65,
                "schedule": "sigmoid"}
LOG_LIKELIHOOD_DEFAULTS = {"test_points": 1000, "seed": 0, "ais": AIS_DEFAULTS}


class VAELitModule(DeqsmModule):
    """See the module docstring. ``image_shape`` is ``data.shape``; ``net`` (``model.net``) a partial
    :func:`src.models.vae.build_vae_networks` (the sizes: ``arch`` ``mlp`` (MNIST, as the SSM reference) or ``conv``
    (Table 6), ``channels`` m of the score estimator, ``enc_channels`` of encoder and decoder, …; the module adds
    ``image_shape``, the parsed ``deq`` setting and ``depth``, the score estimator's pre-processing: SSM VAE,
    Aug(k), DEQ); ``projection``
    (``gaussian``, the SSM reference's for the VAE, or ``null`` to keep ``loss.projection``) replaces the
    projection of ``loss=ssm|ssm_vr`` and is the one of the reported test SSM loss."""

    family = "vae"
    default_net = build_vae_networks
    outputs_score = True  # the score estimator s(z|x)
    # model.loss of the score estimator, the references' (the VAE's own ELBO is not configurable)
    default_loss = "ssm_vr"
    # DDP: a training step runs two backward passes (score loss -> score_net; surrogate ELBO -> encoder and
    # decoder), each reaching only its optimiser's parameters, while DDP's reducer expects every parameter it
    # wraps to get a gradient in each backward. src.runs.training.follow_ddp_needs therefore runs this module under
    # Lightning's ``ddp_find_unused_parameters_true``: each backward all-reduces (averages) the gradients it
    # produced and leaves the other optimiser's parameters untouched. Chosen by measurement (2 CPU ranks):
    # plain ``ddp`` stops at the first step; Lightning's ``toggle_optimizer`` (requires_grad off for the other
    # optimiser) stops the same way, DDP having registered every parameter when it wrapped the module; turning
    # DDP's reducer off and all-reducing each optimiser's gradients by hand ends with the same parameters but
    # must undo Lightning re-arming the reducer every step, for no gain: experiment=vae_mnist deq=false, 2 ranks
    # x 64 images, 150 iterations on a busy 2-core CPU, 0.36-0.42 s per iteration against 0.29 s here, and
    # bit-identical parameters after them (tests/test_ddp.py checks each update's gradient is the ranks' mean).
    ddp_find_unused_parameters = True
    # model.optimizer.score updates the score estimator, model.optimizer.vae the encoder and decoder
    optimized_modules: ClassVar[Mapping[str, tuple[str, ...]]] = {"score": ("score_net",), "vae": ("encoder", "decoder")}

    def __init__(
        self,
        image_shape: Sequence[int],
        loss: Mapping,
        net: Any = None,
        deq: Mapping | None = None,
        depth: int | None = None,
        score_steps: int = 1,
        entropy_weight: float = 1.0,
        projection: str | None = "gaussian",
        optimizer: Any = None, scheduler: Any = None,
        metrics: Mapping | None = None,
        monitor: str | None = "val/recon_error",
        monitor_mode: str | None = "min",
        n_samples_grid: int = 64,
    ):
        loss, deq, metrics = (plain(c) for c in (loss, deq, metrics))
        image_shape = [int(s) for s in plain(image_shape)]
        super().__init__(optimizer=optimizer, scheduler=scheduler, metrics=metrics, monitor=monitor,
                         monitor_mode=monitor_mode, loss=loss, loss_bound={"projection": projection}, deq=deq)
        self.save_hyperparameters(ignore=["optimizer", "scheduler", "net"])  # partials: not hyper-parameters
        self.automatic_optimization = False
        self.score_steps, self.n_samples_grid = int(score_steps), n_samples_grid
        if self.score_steps < 1:
            raise ValueError(f"model.score_steps must be >= 1, got {score_steps}")
        self.entropy_weight = float(entropy_weight)
        if not self.entropy_weight >= 0:
            raise ValueError(f"model.entropy_weight must be >= 0 (1: the ELBO, 0: no entropy term), got {entropy_weight}")
        self.encoder, self.decoder, self.score_net = self.build_net(net, image_shape=image_shape, deq=self.deq,
                                                                    depth=depth)
        self.net = self.score_net
        self.latent_dim = self.decoder.latent_dim
        self.projection = projection or self.loss_kwargs.get("projection", "rademacher")
        ll = metric_options(metrics, "log_likelihood", LOG_LIKELIHOOD_DEFAULTS) or LOG_LIKELIHOOD_DEFAULTS
        self.ais_points, self.ais_seed, self.ais_cfg = int(ll["test_points"]), int(ll["seed"]), dict(ll["ais"])
        self._ais_seen = 0
        self._ais_batches = 0

    # ------------------------------------------------------------------ training
    def training_step(self, batch, batch_idx):
        x = batch_tensor(batch)
        for _ in range(self.score_steps):
            with torch.no_grad():
                z = self.encoder(x)
            with self.deq_forwards() as infos:
                out = self.objective(ConditionalScore(self.score_net, x), z)
            self.manual_update("score", self.with_deq_penalty(out.loss, x.shape[0], infos))
        z = self.encoder(x)
        with torch.no_grad():
            s = self.score_net(z.detach(), x)
        total, rec, prior = surrogate_negative_elbo(self.decoder, x, z, s, self.entropy_weight)
        loss = total.mean()
        self.manual_update("vae", loss)
        b = x.shape[0]
        self.log("train/loss", loss.detach(), prog_bar=True, on_step=True, on_epoch=True, batch_size=b)
        self.log("train/score_loss", out.loss.detach(), prog_bar=True, on_step=True, on_epoch=True, batch_size=b)
        self.log("train/recon_error", rec.mean().detach(), on_step=False, on_epoch=True, batch_size=b)
        self.log("train/prior_nll", prior.mean().detach(), on_step=False, on_epoch=True, batch_size=b)

    # ------------------------------------------------------------------ evaluation
    def eval_model(self):
        raise ValueError("model=vae: the score estimator is conditional, s(z|x); use model.metrics.vae (its SSM "
                         "loss) rather than exact_sm / ground_truth / noise_conditional")

    def vae_eval_terms(self, x: torch.Tensor, generator: torch.Generator | None = None) -> dict[str, torch.Tensor]:
        """Per point: the score estimator's SSM loss (eq. 3) at z ~ q(z|x), and −log p(x|z) at that z."""
        with torch.no_grad():
            z = self.encoder(x, generator=generator)
            rec = -self.decoder.log_prob(x, z)
        out = ssm(ConditionalScore(self.score_net, x), z, projection=self.projection, create_graph=False,
                  generator=generator)
        return {"score_ssm_loss": out.per_sample.detach(), "recon_error": rec}

    def on_test_epoch_start(self):
        self._ais_seen, self._ais_batches = 0, 0
        super().on_test_epoch_start()

    def log_likelihood_metrics(self, x: torch.Tensor) -> dict[str, torch.Tensor]:
        """AIS log p(x) (nats) of the first ``model.metrics.log_likelihood.test_points`` test points. Under DDP rank r
        tests the points r, r + W, … (Lightning's distributed sampler), so it takes its share of those first
        points, and the ranks together take the same points as one process."""
        c = self.ais_cfg
        x = x[: max(0, rank_share(self, self.ais_points) - self._ais_seen)]
        self._ais_batches += 1
        if x.shape[0] == 0:
            return {}
        self._ais_seen += x.shape[0]
        g = torch.Generator(device=x.device).manual_seed(self.ais_seed + 1_000_003 * self._ais_batches)
        with progress.phase(self, f"AIS log p(x) of {x.shape[0]} test points (annealing steps)",
                            int(c["n_steps"])) as advance:
            ll = ais_log_likelihood(self.decoder.log_prob, x, self.latent_dim, n_steps=int(c["n_steps"]),
                                    n_chains=int(c["n_chains"]), leapfrog=int(c["leapfrog"]),
                                    step_size=float(c["step_size"]), target_accept=float(c["target_accept"]),
                                    schedule=str(c["schedule"]), generator=g, progress=advance)
        return {"log_likelihood": ll}

    def log_likelihood_constants(self) -> dict[str, float]:
        c = self.ais_cfg
        seen = torch.tensor(float(self._ais_seen), dtype=torch.float64, device=self.device)
        trainer = getattr(self, "_trainer", None)
        if trainer is not None and trainer.world_size > 1:  # the points of all ranks
            seen = trainer.strategy.reduce(seen, reduce_op="sum")
        return {"test/ais_points": float(seen), "test/ais_steps": float(c["n_steps"]),
                "test/ais_chains": float(c["n_chains"])}

    # ------------------------------------------------------------------ samples
    @torch.no_grad()
    def sample(self, n: int, generator: torch.Generator | None = None) -> torch.Tensor:
        """Decoder means E[x|z] of prior samples z ~ N(0, I), in the data's model space."""
        z = torch.randn(n, self.latent_dim, device=self.device, dtype=self.dtype, generator=generator)
        return self.decoder.mean(z)

