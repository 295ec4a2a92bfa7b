"""benchmarks/studies/ncsn_deq_cost.py reads the DEQ's phases from a torch.profiler trace of the core's own spans
(no attribute of the core replaced): every level of a second-order implicit step is found, and the saved bytes
attributed to the phases add up to the bytes autograd saved."""

from __future__ import annotations

import torch
from torch.profiler import ProfilerActivity, profile, record_function

from benchmarks.studies.ncsn_deq_cost import OUTSIDE, SAVED, phase_of_label, phases_of_trace
from src.deq import DenseDEQBlock, DEQConfig


def test_the_trace_gives_every_level_and_all_saved_bytes():
    torch.manual_seed(0)
    block = DenseDEQBlock(3, 6, config=DEQConfig(backward="implicit", tol=1e-10)).double()
    x = torch.randn(4, 3, dtype=torch.float64, requires_grad=True)
    seen, total = set(), [0]

    def pack(t):
        storage = t.untyped_storage()
        if storage.data_ptr() not in seen:
            seen.add(storage.data_ptr())
            total[0] += storage.nbytes()
            with record_function(f"{SAVED}{storage.nbytes()}"):
                pass
        return t

    with profile(activities=[ProfilerActivity.CPU]) as prof, torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        z = block(x)
        (g,) = torch.autograd.grad(z.pow(2).sum(), x, create_graph=True)  # level-1 adjoint
        g.pow(2).sum().backward()  # level-2 adjoint, to the parameters
    seconds, saved = phases_of_trace(prof.events())
    assert set(seconds) == {"forward solve (level 0)", "adjoint solve, level 1", "adjoint solve, level 2",
                            "backward of level 0 (VJP in p, nested solves)",
                            "backward of level 1 (VJP in p, nested solves)"}
    assert all(s > 0 for s in seconds.values())
    assert seconds["backward of level 0 (VJP in p, nested solves)"] >= seconds["adjoint solve, level 1"]
    assert sum(saved.values()) == total[0] > 0
    assert saved.get(OUTSIDE, 0) > 0 and saved["backward of level 0 (VJP in p, nested solves)"] > 0
    assert phase_of_label("deq.phantom_steps") is None and phase_of_label("deq.solve") == "forward solve (level 0)"
