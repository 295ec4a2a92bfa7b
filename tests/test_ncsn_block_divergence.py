"""The w variants of benchmarks/studies/ncsn_block_divergence.py: σ̂ against an FFT reference, the w formulas."""

from __future__ import annotations

import pytest
import torch

from benchmarks.studies.ncsn_block_divergence import operator_norm, use_w_variant
from src.deq import DEQConfig
from src.deq.block import NormalizedResidualDEQBlock

pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py


def lattice_norm(kernel: torch.Tensor, n: int = 16) -> float:
    """max over the n × n frequency lattice of ‖K̂(ω)‖₂: the circular convolution's operator norm."""
    padded = torch.nn.functional.pad(kernel, (0, n - kernel.shape[-1], 0, n - kernel.shape[-2]))
    return torch.linalg.matrix_norm(torch.fft.fft2(padded).permute(2, 3, 0, 1), ord=2).max().item()


def test_operator_norm_matches_the_fft_lattice_norm():
    torch.manual_seed(0)
    k = torch.randn(3, 3, 3, 3, dtype=torch.float64)
    u = torch.randn(1, 3, 16, 16, dtype=torch.float64)
    u /= u.norm()
    for _ in range(2000):
        operator_norm(k, u, update=True)
    assert operator_norm(k, u, update=False).item() == pytest.approx(lattice_norm(k), rel=1e-8)


@pytest.mark.parametrize("variant", ["spectral", "spectral_k2"])
def test_w_variants_divide_by_the_operator_norms(variant):
    torch.manual_seed(0)
    block = NormalizedResidualDEQBlock(3, 3, config=DEQConfig()).double()
    frobenius_inv_w = block.map_params(torch.zeros(1, 3, 8, 8, dtype=torch.float64))[-1].item()
    use_w_variant(block, variant)
    for _ in range(300):  # training-mode calls: one power step each (these kernels' top singular values are
        # close, so σ̂ is 6e-5 below the lattice norm after 300 steps and barely closer after 2000)
        block.map_params(torch.zeros(1, 3, 8, 8, dtype=torch.float64))
    inv_w = block.map_params(torch.zeros(1, 3, 8, 8, dtype=torch.float64))[-1].item()
    s1, s2 = lattice_norm(block.kernel1.detach()), lattice_norm(block.kernel2.detach())
    expected = 8.0 * s1 * s2 if variant == "spectral" else 9.0 * s2
    assert 1.0 / inv_w == pytest.approx(expected, rel=2e-4)
    assert abs(1.0 / inv_w - 1.0 / frobenius_inv_w) > 1e-3  # not the authors' w


def test_unknown_w_variant_is_refused():
    block = NormalizedResidualDEQBlock(2, 3, config=DEQConfig())
    with pytest.raises(ValueError, match="unknown w variant"):
        use_w_variant(block, "frobenius")
