"""The shared DEQ contraction check (src.lit.base): every family with a DEQ block logs the learned map's
contraction rate at validation and warns when the phantom backward truncates a loss that differentiates through
the DEQ (the failure measured on the DEQ-NCSN, benchmarks/results/ncsn_phantom_bias.md)."""

from __future__ import annotations

import warnings

import pytest
import torch

from src.deq.lookup import blocks_of
from src.runs.build import build
from tests.conftest import compose_train
from tests.test_train import NICE_FAST

pytestmark = pytest.mark.usefixtures("one_thread")


def nice_module(tmp_path, *overrides):
    """The NICE module of the config (built only: no data set is read)."""
    cfg = compose_train([*NICE_FAST, "deq=true", *overrides], tmp_path)
    torch.manual_seed(0)
    module = build(cfg.model)
    module.net.double()
    return module


def test_rate_is_the_largest_singular_value_of_the_map_jacobian_at_the_training_inputs_fixed_point(
        tmp_path):
    """After a training forward, each DEQ block's rate is ‖∂f/∂z‖₂ at the fixed point of the input it last saw:
    against the dense per-sample Jacobians (autograd) at a fixed point found by 500 plain iterations, in float64
    (the logged rate comes from 30 power iterations: a lower bound, within 3 % here).
    Forwards in eval mode and after ``on_fit_end`` are not kept."""
    module = nice_module(tmp_path, "loss=ssm")
    x = torch.rand(12, 784, dtype=torch.float64)
    module.on_fit_start()
    module.net.train()
    module.training_objective(x)
    blocks = dict(blocks_of(module))
    rates = module.deq_contraction_rates()
    assert len(rates) == len(blocks) >= 2 and set(rates) == set(blocks)
    for name, block in blocks.items():
        inputs = module._deq_inputs[name]
        assert inputs[0].shape[0] == 12 and not inputs[0].requires_grad
        phi = block.fixed_point_map(*inputs)
        z = torch.zeros(block.state_shape(inputs[0]), dtype=torch.float64)
        for _ in range(500):
            z = phi(z)
        jac = torch.autograd.functional.jacobian(phi, z)  # [B, w, B, w]; samples do not interact
        per_sample = torch.stack([jac[i, :, i, :] for i in range(z.shape[0])])
        reference = torch.linalg.matrix_norm(per_sample, ord=2).max().item()
        assert 0 < reference < 1
        # the operator: a long power iteration on JᵀJ gives σ_max (to 1e-3: the rate is taken at the solver's
        # fixed point, accurate to its tolerance); the logged rate (30 iterations) comes from below, within 3 %
        # on these untrained maps whose samples' top singular values lie close together
        assert block.contraction_rate(*inputs, iters=400) == pytest.approx(reference, rel=1e-3), name
        assert reference * (1 - 3e-2) < rates[name] <= reference * (1 + 1e-9), name
    kept = {k: v[0].clone() for k, v in module._deq_inputs.items()}
    module.net.eval()
    module.training_objective(torch.rand(12, 784, dtype=torch.float64))
    module.net.train()
    module.on_fit_end()
    module.training_objective(torch.rand(12, 784, dtype=torch.float64))
    for k, v in module._deq_inputs.items():
        assert torch.equal(v[0], kept[k]), k


def test_phantom_truncation_warns_only_where_the_loss_differentiates_through_the_deq(tmp_path):
    """ρᴷ/(1 − ρ) > 5 % warns for a score-matching loss with the phantom backward; MLE (unit-determinant
    couplings: no derivative through the DEQ), the implicit backward and a small bound do not."""
    module = nice_module(tmp_path, "loss=ssm", "deq.phantom_steps=2")
    block = blocks_of(module)[-1][1]
    with pytest.warns(RuntimeWarning, match="deq.backward=implicit") as caught:
        assert module.check_phantom_truncation(0.383, block) == pytest.approx(0.383**2 / 0.617)
    assert f"'{block.name}'" in str(caught[0].message) and "K = 2" in str(caught[0].message)
    assert module.check_phantom_truncation(0.383) is None  # several blocks: which one must be said
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert module.check_phantom_truncation(0.1, block) == pytest.approx(0.01 / 0.9)
        mle = nice_module(tmp_path, "loss=mle", "deq.phantom_steps=2")
        assert mle.check_phantom_truncation(0.9, blocks_of(mle)[-1][1]) is None
        implicit = nice_module(tmp_path, "loss=ssm", "deq.backward=implicit")
        assert implicit.check_phantom_truncation(0.9, blocks_of(implicit)[-1][1]) is None


@pytest.mark.parametrize("family, loss, through", [("nice", "ssm", True), ("nice", "dsm", True), ("nice", "mle", False),
                                                   ("ncsn", "ssm_vr", True), ("ncsn", "dsm", False),
                                                   ("vae", "ssm", True), ("vae", "dsm", False)])
def test_which_losses_differentiate_through_the_deq(family, loss, through):
    """An energy's score is ∇ₓ log p through the DEQ (every score-matching loss, even DSM; not MLE); a score
    network's output is differentiated only by a divergence (SSM / SSM-VR), not by DSM."""
    from src.lit.base import DeqsmModule
    from src.lit.ncsn import NCSNLitModule
    from src.lit.nice import NICELitModule
    from src.lit.vae import VAELitModule

    cls = {"nice": NICELitModule, "ncsn": NCSNLitModule, "vae": VAELitModule}[family]
    module = cls.__new__(cls)  # the rule reads the family and the loss name only
    module.loss_name = loss
    assert DeqsmModule.loss_differentiates_through_deq(module) is through
