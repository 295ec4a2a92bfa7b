"""A memory estimate before the first training step, with a warning naming the keys to lower when it will not fit.

An image model's step can need tens of GB at the paper's sizes (DEQ-NCSN with SSM-VR at batch 128, ngf 64 grew
past 10 GB of RSS within two minutes on a CPU), and nothing said so before the machine started swapping or the
process was killed. :class:`MemoryEstimate` (``callbacks.memory_estimate`` of conf/callbacks/default.yaml and
minimal.yaml; ``callbacks.memory_estimate=null`` switches it off)
runs, at the start of fit, two *probe steps* of the family's own ``training_step`` on the first 2 and 4
training points and counts the bytes autograd saves for backward in each (the profiler's meter,
:class:`src.callbacks.profiling.SavedTensorsMeter`). Saved bytes are affine in the batch size, so the two
probes give bytes per sample and a fixed part; at the run's batch size B

    step bytes ≈ PEAK_FACTOR × (fixed + B × per sample) + 3 × parameter bytes (gradients, Adam's two moments)

on top of what the process holds already. PEAK_FACTOR covers the temporaries of backward that are not saved
tensors; measured on the CPU for a DEQ-NCSN SSM-VR step (ngf 16, batch 32, one thread): the peak RSS grew by
0.53 GB for 0.33 GB of saved tensors (1.6×). At the paper's NCSN sizes (ngf 64, batch 128) the probes give
42.7 MB per sample, an estimate of 8.6 GB on top of 1.2 GB held, where the issue's run grew past 10 GB. The
estimate is logged; when it exceeds the free memory (the CUDA device's free memory on a GPU, else MemAvailable and the cgroup's limit) a warning gives
the figure and the keys that lower it: ``data.batch_size``, the family's width keys (``model.net.ngf``,
``model.net.channels``, …) and the DEQ backward (``deq.backward=implicit``: saved bytes independent of the solver;
``deq.phantom_steps``).

The probes change nothing: parameters are not stepped (gradients are dropped; a manually optimised family's
updates are replaced by a plain backward), logging is muted, and the RNG states and DEQ warm-start caches are
put back. Families whose step cannot run outside the loop simply get no estimate (logged at debug level).
"""

from __future__ import annotations

import contextlib
import logging
from pathlib import Path

import lightning.pytorch as L
import torch

from src.callbacks.profiling import SavedTensorsMeter
from src.deq.lookup import blocks_of
from src.runtime.rng import seeded_rng

log = logging.getLogger(__name__)

PEAK_FACTOR = 1.6  # peak RSS growth of a step / its saved bytes, measured (module docstring)
PROBE_SIZES = (2, 4)
WIDTH_KEYS = ("ngf", "channels", "enc_channels", "hidden", "deq_width")
GB = 1024**3


def free_bytes(device: torch.device) -> int | None:
    """Free memory for the run: the CUDA device's free bytes, else the smaller of MemAvailable and the cgroup's
    remaining limit (containers); None when unknown."""
    if device.type == "cuda":
        return int(torch.cuda.mem_get_info(device)[0])
    free = None
    with contextlib.suppress(OSError, ValueError):
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                free = int(line.split()[1]) * 1024
    with contextlib.suppress(OSError, ValueError):
        limit = Path("/sys/fs/cgroup/memory.max").read_text().strip()
        if limit != "max":
            left = int(limit) - int(Path("/sys/fs/cgroup/memory.current").read_text())
            free = left if free is None else min(free, left)
    return free


def rss_bytes() -> int:
    with contextlib.suppress(OSError, ValueError):
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    return 0


@contextlib.contextmanager
def _side_effect_free(module: L.LightningModule):
    """Mute logging, turn manual updates into a plain backward, keep RNG and DEQ warm starts as they were."""
    warm = [(b, b.warm_start_state()) for _, b in blocks_of(module)]
    # DEQ blocks' buffers too: a training forward steps deq.norm=spectral's power-iteration vectors
    buffers = [(t, t.detach().clone()) for _, b in blocks_of(module) for t in b.buffers()]
    saved = {name: module.__dict__.get(name) for name in ("log", "log_dict", "manual_update")}
    module.log = lambda *a, **k: None
    module.log_dict = lambda *a, **k: None
    module.manual_update = lambda name, loss: loss.backward()
    try:
        with seeded_rng(None, module.device):  # the probes' draws leave the RNG states as they were
            yield
    finally:
        for name, value in saved.items():
            if value is None:
                module.__dict__.pop(name, None)
            else:
                module.__dict__[name] = value
        for block, state in warm:
            block.load_warm_start_state(state)
        with torch.no_grad():
            for tensor, value in buffers:
                tensor.copy_(value)
        for p in module.parameters():
            p.grad = None


def probe_saved_bytes(module: L.LightningModule, x: torch.Tensor, sizes=PROBE_SIZES) -> dict[int, int]:
    """{batch size: bytes saved for backward by one training step of ``module`` on ``x[:size]``}."""
    out = {}
    was_training = module.training
    module.train()
    try:
        for b in sizes:
            with _side_effect_free(module), SavedTensorsMeter() as meter:
                result = module.training_step(x[:b], 0)
                loss = result["loss"] if isinstance(result, dict) else result
                if module.automatic_optimization and torch.is_tensor(loss) and loss.requires_grad:
                    loss.backward()
            out[b] = meter.bytes
    finally:
        module.train(was_training)
    return out


def estimate_step_bytes(probes: dict[int, int], batch_size: int, param_bytes: int) -> tuple[float, float]:
    """(estimated extra bytes of one step at ``batch_size``, saved bytes per sample) from two probes."""
    (b1, s1), (b2, s2) = sorted(probes.items())[:2]
    per_sample = max(0.0, (s2 - s1) / (b2 - b1))
    fixed = max(0.0, s1 - b1 * per_sample)
    return PEAK_FACTOR * (fixed + batch_size * per_sample) + 3 * param_bytes, per_sample


def lowering_hints(hparams, deq, batch_size: int) -> str:
    """The keys that lower a step's memory, with their values in this run; ``hparams``: the module's saved
    hyper-parameters (its ``model.*`` keys, the network's under ``net``); ``deq``: its DEQ setting (a ``DEQConfig``, or None for explicit layers)."""
    hints = [f"data.batch_size (now {batch_size})"]
    net = (hparams.get("net") if hparams is not None else None) or {}  # model.net's sizes (src.lit.nets)
    for key in WIDTH_KEYS:
        where, value = (f"model.net.{key}", net[key]) if key in net else (
            f"model.{key}", hparams.get(key) if hparams is not None else None)
        if isinstance(value, int) and not isinstance(value, bool):
            hints.append(f"{where} (now {value})")
    if deq is not None and deq.backward == "phantom":
        hints.append(f"deq.backward=implicit or fewer deq.phantom_steps (now {deq.phantom_steps})")
    return ", ".join(hints)


class MemoryEstimate(L.Callback):
    """Probe, estimate, log, and warn before the first training step (see the module docstring)."""

    def __init__(self, batch_size: int | None):
        """``batch_size``: the run's training batch (``${data.batch_size}``), the size the probes extrapolate to."""
        self.batch_size = batch_size
        self.result: dict | None = None

    def on_fit_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if not self.batch_size or trainer.global_step > 0:  # nothing to extrapolate to, or a resumed run
            return
        if trainer.world_size > 1:
            # under DDP the probes' backward passes reach DDP's gradient reducer outside a training step: the VAE
            # (find_unused_parameters) then stopped at its first real step, with or without no_sync
            log.info("memory estimate skipped under DDP (world size %d)", trainer.world_size)
            return
        try:
            x = pl_module.split_tensor("train", max(PROBE_SIZES))
            if x.shape[0] < max(PROBE_SIZES):
                return
            probes = probe_saved_bytes(pl_module, x)
        except Exception as exc:  # noqa: BLE001  an estimate is advice: never stop a run for it
            log.debug("memory estimate skipped: %s", exc)
            return
        param_bytes = sum(p.numel() * p.element_size() for p in pl_module.parameters())
        step, per_sample = estimate_step_bytes(probes, int(self.batch_size), param_bytes)
        free = free_bytes(pl_module.device)
        held = 0 if pl_module.device.type == "cuda" else rss_bytes()
        self.result = {"step_bytes": step, "per_sample_bytes": per_sample, "free_bytes": free, "rss_bytes": held}
        where = "GPU memory" if pl_module.device.type == "cuda" else "memory"
        log.info("memory estimate: %.2f GB for a training step at batch %d (%.1f MB saved for backward per sample, "
                 "probe steps at batch %s) on top of %.2f GB held; %s GB of %s free", step / GB, self.batch_size,
                 per_sample / 1024**2, "/".join(map(str, sorted(probes))), held / GB,
                 "?" if free is None else f"{free / GB:.1f}", where)
        if free is not None and step > free and trainer.is_global_zero:
            log.warning(
                "memory estimate: a training step at data.batch_size=%d needs about %.1f GB but only %.1f GB of "
                "%s is free: the run may swap or be killed. Lower %s.", self.batch_size, step / GB, free / GB,
                where, lowering_hints(getattr(pl_module, "hparams", None), getattr(pl_module, "deq", None), int(self.batch_size)))
