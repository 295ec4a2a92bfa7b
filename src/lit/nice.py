"""LightningModule for NICE on MNIST (paper §4.3, Table 4): any objective, exact likelihood for evaluation.

Test metrics: exact SM loss on a fixed test subset (``evaluation.test_sm_points``; exact SM at D = 784
costs 784 backward passes per batch, so it is capped), test log-likelihood in logit space (as the reference
code reports it), bits/dim in 8-bit pixel space with every Jacobian included, and a PNG grid of samples
(also logged to W&B when that logger is on).
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path

import torch

from src.lit.base import ScoreMatchingModule, as_plain
from src.models.nice import NICE, deq_coupling_factory


class NICELitModule(ScoreMatchingModule):
    def __init__(
        self,
        input_dim: int,
        loss: Mapping,
        deq: Mapping | None = None,
        depth: int | None = None,
        n_couplings: int = 4,
        hidden: int = 1000,
        deq_width: int = 1000,
        optimizer: Mapping | None = None,
        evaluation: Mapping | None = None,
        n_samples_grid: int = 64,
    ):
        # plain containers, so the checkpoint's hyper_parameters hold no OmegaConf objects
        loss, deq, optimizer, evaluation = (as_plain(c) for c in (loss, deq, optimizer, evaluation))
        super().__init__(loss=loss, optimizer=optimizer, evaluation=evaluation)
        self.save_hyperparameters()
        deq = deq or {}
        enabled = bool(deq.get("enabled", False))
        if depth is not None and (int(depth) != depth or depth < 1):
            raise ValueError(f"depth={depth} is invalid: it must be a positive integer")
        if enabled:
            factory = deq_coupling_factory(deq_width, deq, n_layers=int(depth or 1))
            self.net = NICE(input_dim, n_couplings=n_couplings, coupling_net=factory)
        else:
            self.net = NICE(input_dim, n_couplings=n_couplings, hidden=hidden, mlp_layers=int(depth or 5))
        self.n_samples_grid = n_samples_grid

    def test_log_likelihood(self, x_test: torch.Tensor) -> dict[str, float]:
        dm = self._datamodule()
        lls, bpds = [], []
        with torch.no_grad():
            for chunk in x_test.split(1024):
                ll = self.net.log_likelihood(chunk)
                lls.append(ll.cpu())
                if dm is not None and hasattr(dm, "bits_per_dim"):
                    bpds.append(dm.bits_per_dim(ll, chunk).cpu())
        out = {"test/log_likelihood": torch.cat(lls).mean().item()}
        if bpds:
            out["test/bits_per_dim"] = torch.cat(bpds).mean().item()
        return out

    def on_test_end(self) -> None:
        self.save_sample_grid()

    def save_sample_grid(self) -> Path | None:
        dm = self._datamodule()
        if dm is None or not hasattr(dm, "to_pixels") or self.trainer is None:
            return None
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        with torch.no_grad():
            y = self.net.sample(self.n_samples_grid, generator=torch.Generator().manual_seed(0))
        images = dm.to_pixels(y.cpu()).squeeze(1).numpy()
        n = int(len(images) ** 0.5)
        fig, axes = plt.subplots(n, n, figsize=(n, n))
        for ax, img in zip(axes.flat, images):
            ax.imshow(img, cmap="gray", vmin=0, vmax=1)
            ax.axis("off")
        fig.subplots_adjust(wspace=0.05, hspace=0.05)
        path = Path(self.trainer.default_root_dir) / "samples.png"
        path.parent.mkdir(parents=True, exist_ok=True)
        fig.savefig(path, dpi=80)
        plt.close(fig)
        for lg in self.trainer.loggers:
            if hasattr(lg, "log_image"):
                lg.log_image(key="samples", images=[str(path)])
        return path
