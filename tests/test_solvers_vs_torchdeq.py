"""benchmarks/studies/solvers_vs_torchdeq.py: a block's map written to a tensors-only file and read back
weights-only is the same map, and the same-work comparison evaluates f exactly the asked number of times."""

from __future__ import annotations

import torch

from benchmarks.studies.solvers_vs_torchdeq import OURS, Side, describe_map, load_map
from src.deq import DenseDEQBlock, DEQConfig, NormalizedResidualDEQBlock


def _write(block, x, path):
    with torch.no_grad():
        params = [p.detach() for p in block.map_params(x)]
    torch.save({"phi": describe_map(block.phi), "params": params, "state": list(block.state_shape(x))}, path)
    return {"key": "m", "file": str(path), "evals": 4}


def test_map_file_round_trip_gives_the_blocks_map(tmp_path):
    torch.manual_seed(0)
    cases = [(NormalizedResidualDEQBlock(4, config=DEQConfig(block="normalized_residual")), torch.randn(3, 4, 6, 6)),
             (DenseDEQBlock(5, 7, n_layers=2, config=DEQConfig(norm="spectral", norm_lambda=1.2)), torch.randn(9, 5))]
    for i, (block, x) in enumerate(cases):
        block.eval()
        f, z0 = load_map(_write(block, x, tmp_path / f"map{i}.pt"))
        assert z0.shape == torch.Size(block.state_shape(x)) and not z0.any()
        z = torch.randn(z0.shape)
        with torch.no_grad():
            assert torch.equal(f(z), block.fixed_point_map(x)(z))


def test_same_work_limit_counts_exactly_the_evaluations(tmp_path):
    torch.manual_seed(0)
    block = DenseDEQBlock(5, 7, config=DEQConfig(norm="spectral", norm_lambda=1.2)).eval()
    f, z0 = load_map(_write(block, torch.randn(9, 5), tmp_path / "map.pt"))
    side = Side("ours")
    for name in OURS:  # Anderson and Broyden evaluate f once more than their limit when they do not converge
        limit, got = side._same_work_limit(name, f, z0, 6)
        assert got == 6 and side._counted(name, f, z0, limit, 0.0) == 6
        expected = 6 if name == "picard" else 5
        assert limit == expected, (name, limit)
