"""Ground-truth metrics of synthetic data (Fisher divergence, true log-likelihood): ``model.metrics.ground_truth``."""

from __future__ import annotations

import torch

from src.metrics.base import EvalMetric, MeanAndStderr
from src.objectives.base import compute_score


class GroundTruthMetrics(EvalMetric):
    """Fisher divergence ½E‖s_θ(x) − ∇log p(x)‖² and the true log-likelihood, on data with a known density.

    ``required=False`` (default): on data without a known density the metric does nothing; ``True``: it
    refuses such data with a clear error.
    """

    name = "ground_truth"
    stages = ("test",)

    def __init__(self, required: bool = False):
        super().__init__()
        self.required = bool(required)
        self.fisher = MeanAndStderr()
        self.true_ll = MeanAndStderr()
        self._dm = None

    def setup(self, module, datamodule):
        if not datamodule.has_ground_truth and self.required:
            raise ValueError(f"model.metrics.ground_truth.required=true needs data with a known density; "
                             f"{type(datamodule).__name__} has none (switch the metric off: "
                             "model.metrics.ground_truth=null)")
        self._dm = datamodule if datamodule.has_ground_truth else None

    def update(self, module, x, stage):
        if self._dm is None:
            return
        with torch.enable_grad():
            s = compute_score(module.eval_model(), x, create_graph=False).detach()
        s_true = self._dm.true_score(x)
        self.fisher.update(0.5 * (s - s_true).flatten(1).pow(2).sum(-1))
        self.true_ll.update(self._dm.true_log_density(x))

    def compute(self, module, stage):
        if self._dm is None:
            return {}
        return {"test/fisher_divergence": self.fisher.compute()[0],
                "test/true_log_likelihood": self.true_ll.compute()[0]}
