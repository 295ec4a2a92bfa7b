"""Per-step memory, time and DEQ-solver profiling (the quantities the paper is about).

For every training step it records:
- ``saved_bytes``: bytes of the tensors autograd saves for backward during the step (forward and the
  create_graph backward passes of the objective), counted once per storage, via
  ``torch.autograd.graph.saved_tensors_hooks``. Deterministic and device-independent: the headline memory
  figure on a CPU.
- ``peak_cuda_bytes`` (on a GPU): ``torch.cuda.max_memory_allocated`` with the peak reset per step.
- ``peak_rss_bytes`` (Linux): the process's peak resident set size (VmHWM), reset per step where allowed.
- ``step_time_s``: wall time of the whole step (forward, backward, optimiser), CUDA-synchronised.
- DEQ solver iterations and final residual of every DEQ block call during the step.

It also keeps ``train_time_s``, the summed wall time of all training steps so far (no validation, test or
start-up), in its ``state_dict``: it is saved in every checkpoint and continued on resume, so a checkpoint
says how much training time produced it (``benchmarks/tools/training_curves.py`` plots metrics against it).

Figures are logged (``profile/*``) and summarised in :attr:`summary` (means over steps, skipping the first
``warmup_steps`` for time), which ``src.train`` writes into metrics.json.
"""

from __future__ import annotations

import time
from statistics import mean

import lightning.pytorch as L
import torch

from src.deq.lookup import blocks_of


def _storage_key(t: torch.Tensor):
    try:
        return (t.device.type, t.untyped_storage().data_ptr())
    except (RuntimeError, NotImplementedError):  # tensors without storage (e.g. some wrappers)
        return (t.device.type, id(t))


class SavedTensorsMeter:
    """Context manager: sums the bytes of distinct storages autograd saves for backward while active."""

    def __init__(self):
        self.bytes = 0
        self._seen: set = set()
        self._ctx = None

    def _pack(self, t: torch.Tensor):
        key = _storage_key(t)
        if key not in self._seen:
            self._seen.add(key)
            try:
                self.bytes += t.untyped_storage().nbytes()
            except (RuntimeError, NotImplementedError):
                self.bytes += t.numel() * t.element_size()
        # Keep a detached alias, never ``t`` itself: ``t`` carries its grad_fn, and for a tensor saved as an
        # output of its own node (the implicit DEQ's fixed point and adjoints) that node would then own a
        # reference to itself — a cycle through C++ that gc cannot break for graphs never backpropagated
        # (the implicit backward's adjoint nodes): every implicit-mode step leaked its graph (≈ 70 MB per
        # DEQ-NCSN step). Lossless: autograd re-attaches the grad_fn on unpack (PyTorch's saved-tensors-hooks
        # notes detach in the pack hook for this reason). tests/test_profiling.py
        return t.detach()

    @staticmethod
    def _unpack(t):
        return t

    def __enter__(self):
        self.bytes, self._seen = 0, set()
        self._ctx = torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack)
        self._ctx.__enter__()
        return self

    def __exit__(self, *exc):
        self._ctx.__exit__(*exc)
        self._ctx = None
        self._seen = set()
        return False


def _read_vm_hwm() -> int | None:
    try:
        with open("/proc/self/status") as fh:
            for line in fh:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None


def _reset_vm_hwm() -> None:
    try:
        with open("/proc/self/clear_refs", "w") as fh:
            fh.write("5")
    except OSError:
        pass


class ProfilingCallback(L.Callback):
    def __init__(self, saved_tensors: bool = True, warmup_steps: int = 1):
        self.saved_tensors = saved_tensors
        self.warmup_steps = warmup_steps
        self.records: list[dict[str, float]] = []
        self._meter: SavedTensorsMeter | None = None
        self._t0 = 0.0
        self._deq_calls: list[dict] = []
        self._blocks: list = []
        self._hooks: list = []
        self._collecting = False
        self.train_time_s = 0.0

    def state_dict(self) -> dict:
        return {"train_time_s": self.train_time_s}

    def load_state_dict(self, state_dict: dict) -> None:
        self.train_time_s = float(state_dict.get("train_time_s", 0.0))

    # -- DEQ statistics: a forward hook on every DEQ block collects each call's stats
    def _deq_hook(self, module, inputs, output):
        stats = getattr(module, "last_stats", None)
        if self._collecting and stats:
            self._deq_calls.append(dict(stats))

    def on_fit_start(self, trainer, pl_module):
        self._blocks = [m for _, m in blocks_of(pl_module)]
        self._hooks = [m.register_forward_hook(self._deq_hook) for m in self._blocks]

    def on_fit_end(self, trainer, pl_module):
        for h in self._hooks:
            h.remove()
        self._hooks = []

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        self._deq_calls = []
        self._collecting = True
        if torch.cuda.is_available() and pl_module.device.type == "cuda":
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats(pl_module.device)
        _reset_vm_hwm()
        if self.saved_tensors:
            self._meter = SavedTensorsMeter().__enter__()
        self._t0 = time.perf_counter()

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        cuda = torch.cuda.is_available() and pl_module.device.type == "cuda"
        if cuda:
            torch.cuda.synchronize()
        rec: dict[str, float] = {"step_time_s": time.perf_counter() - self._t0}
        self.train_time_s += rec["step_time_s"]
        if self._meter is not None:
            self._meter.__exit__(None, None, None)
            rec["saved_bytes"] = float(self._meter.bytes)
            self._meter = None
        self._collecting = False
        if cuda:
            rec["peak_cuda_bytes"] = float(torch.cuda.max_memory_allocated(pl_module.device))
        rss = _read_vm_hwm()
        if rss is not None:
            rec["peak_rss_bytes"] = float(rss)
        if self._deq_calls:
            rec["deq_iterations"] = mean(c["iterations"] for c in self._deq_calls)
            rec["deq_residual"] = max(float(c["residual"]) for c in self._deq_calls)
            rec["deq_hit_cap"] = float(sum(bool(c.get("hit_cap", False)) for c in self._deq_calls))
        # the implicit backward's adjoint solves of this step (the block resets them at each forward solve): the
        # most iterations of any level, and whether one ran to deq.max_iter
        adjoint = [b.last_backward_stats for b in self._blocks if getattr(b, "last_backward_stats", None)]
        if self._deq_calls and adjoint:
            rec["deq_adjoint_iterations"] = float(max(a["iterations"] for a in adjoint))
            rec["deq_adjoint_hit_cap"] = float(any(a.get("hit_cap", False) for a in adjoint))
        self.records.append(rec)
        pl_module.log_dict({f"profile/{k}": v for k, v in rec.items()}, on_step=True, on_epoch=False)

    @property
    def summary(self) -> dict[str, float]:
        if not self.records:
            return {}
        timed = self.records[self.warmup_steps :] or self.records
        out = {"profile/time_per_step_s": mean(r["step_time_s"] for r in timed), "profile/steps": len(self.records),
               "profile/train_time_s": self.train_time_s}
        for key in ("saved_bytes", "peak_cuda_bytes", "peak_rss_bytes", "deq_iterations", "deq_residual",
                    "deq_hit_cap", "deq_adjoint_iterations", "deq_adjoint_hit_cap"):
            vals = [r[key] for r in self.records if key in r]
            if vals:
                out[f"profile/{key}_mean"] = mean(vals)
                out[f"profile/{key}_max"] = max(vals)
        hits = [r["deq_hit_cap"] for r in self.records if "deq_hit_cap" in r]
        if hits:  # forward solves of the training steps that ran to deq.max_iter without meeting deq.tol
            out["profile/deq_hit_cap_count"] = float(sum(hits))
        return out
