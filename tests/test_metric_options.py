"""One ``model.metrics`` tree for every evaluation setting (issue 24): the keys reach the modules with their
defaults, and an unknown option is refused in one line."""

from __future__ import annotations

import pytest

from src.runs.build import build
from tests.conftest import compose_train


def test_the_metric_keys_reach_the_modules_with_their_defaults():
    dkef = build(compose_train(["model=dkef", "data.dim=2"]).model)
    assert dkef.alpha_refit_points == 1000
    assert dkef.log_likelihood_options == {"samples": 100_000, "proposal_std": 2.0}
    dkef = build(compose_train(["experiment=dkef_gaussian", "data.dim=2", "model.n_inducing=4"]).model)
    assert dkef.alpha_refit_points == 500 and dkef.log_likelihood_options["samples"] == 1_000_000
    dkef = build(compose_train(["model=dkef", "data.dim=2", "model.metrics.log_likelihood=null"]).model)
    assert dkef.log_likelihood_options is None  # switched off: no log Z is estimated
    vae = build(compose_train(["experiment=vae_mnist", "model.hidden=8", "model.channels=4"]).model)
    assert (vae.ais_points, vae.ais_seed) == (100, 0)  # the experiment's 100 test images
    assert vae.ais_cfg == {"n_steps": 1000, "n_chains": 16, "leapfrog": 10, "step_size": 0.05,
                           "target_accept": 0.65, "schedule": "sigmoid"}


@pytest.mark.parametrize("overrides, expected", [
    (["model=dkef", "++model.metrics.log_likelihood.sample=5"],
     "model.metrics.log_likelihood: unknown key(s) ['sample']; valid: samples, proposal_std"),
    (["experiment=vae_mnist", "++model.metrics.log_likelihood.ais.steps=5"],
     ("model.metrics.log_likelihood.ais: unknown key(s) ['steps']; valid: n_steps, n_chains, leapfrog, step_size, "
      "target_accept, schedule")),
    (["model=nice", "data=mnist", "++model.metrics.log_likelihood.samples=5"],
     "model.metrics.log_likelihood: unknown key(s) ['samples']; valid: none"),
])
def test_unknown_log_likelihood_option_is_one_line(overrides, expected):
    with pytest.raises(ValueError) as info:
        build(compose_train(overrides).model)
    assert str(info.value) == expected
