"""The log-likelihood metric's per-test-point values (``test/log_likelihood_per_point`` in metrics.json): the
points in test-set order, their mean the metric's own, cleared by ``reset``."""

from __future__ import annotations

import math

import torch

from src.metrics.log_likelihood import LogLikelihood


class _Family:
    """A stand-in family: log p(x) = −‖x‖² per point."""

    def log_likelihood_metrics(self, x):
        return {"log_likelihood": -x.pow(2).sum(1)}

    def log_likelihood_constants(self):
        return {}


def test_points_are_kept_in_order_and_average_to_the_metric():
    metric, family = LogLikelihood(), _Family()
    batches = [torch.tensor([[1.0, 0.0], [0.0, 2.0]]), torch.tensor([[3.0, 1.0]])]
    for x in batches:
        metric.update(family, x, "test")
    points = metric.point_values()["test/log_likelihood_per_point"]
    assert points == [-1.0, -4.0, -10.0]
    out = metric.compute(family, "test")
    assert math.isclose(out["test/log_likelihood"], sum(points) / 3)
    assert math.isclose(out["test/log_likelihood_stderr"], math.sqrt(21.0 / 3))  # sample variance 21, 3 points
    metric.reset()
    assert metric.point_values() == {}
