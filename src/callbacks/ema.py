"""Exponential moving average (EMA) of the weights: Lightning's ``EMAWeightAveraging``, fitted to deqsm.

Switched on per run with the ``ema`` config group (``python -m src.train ema=true``). The averaging itself is
Lightning's (``torch.optim.swa_utils.AveragedModel`` with ``get_ema_avg_fn(decay)``, updated after every
``update_every_n_steps``-th optimizer step): W_ema <- decay * W_ema + (1 - decay) * W, the first update a copy.
What Lightning does with it:

- validation runs on the averaged weights (swapped in at ``on_validation_epoch_start``, before the model's own
  hook, so DKEF refits its α on the averaged weights; swapped back at the end of validation), so the checkpoint
  callback ranks checkpoints by the averaged model's metric;
- a checkpoint's ``state_dict`` holds the averaged weights; the trained ones go to ``current_model_state`` and
  the averaging state (``n_averaged``) to ``averaging_state``; resuming from it restores all three, so the
  average continues exactly;
- at the end of ``fit`` the averaged weights are copied into the model.

Adjustments made here:

1. ``use_buffers=False`` by default: buffers are not averaged but copied from the trained model at every update.
   Our buffers are state, not statistics: DKEF's fitted ``alpha`` and ``alpha_fitted`` flag, the spectral
   normalisation's power-iteration vectors ``sn_u*`` and NICE's integer permutations (an EMA of an integer
   buffer is written back truncated, which would corrupt a permutation).
2. Outside ``fit`` (``trainer.test(ckpt_path=...)``, ``trainer.validate``) the checkpoint is left as Lightning
   loaded it. Lightning 2.6 calls a callback's ``on_load_checkpoint`` at test time too, and when the callback
   still holds the averaged model of a preceding ``fit`` on the same Trainer (``src.train`` tests the best
   checkpoint that way), ``EMAWeightAveraging`` would reload the *trained* weights from
   ``current_model_state``: the test would silently run on the raw weights.
3. The averaged model follows the trained model onto its device at ``on_fit_start`` (Lightning builds it in
   ``setup``, before the strategy moves the model to the GPU, which would keep it on the CPU and copy every
   parameter to the host after each step), unless ``device`` is given.
4. ... and into its dtype: built in ``setup``, before the precision plugin converts the model, the average of a
   ``trainer.precision=64-true`` run would otherwise stay float32 (rounding every update and every resumed
   average); on resume it is converted before the checkpoint's averages are loaded into it.
5. The trained weights come back at ``on_validation_end``, not at ``on_validation_epoch_end``: Lightning calls
   the callbacks' epoch-end hooks before the module's, so with the swap there the module's own end of
   validation — every metric's ``compute``, the DEQ blocks' recurrence share and contraction rate — ran on the
   trained weights while the steps ran on the average (measured on an NCSN run with EMA 0.999 and 0.99: the same
   validation share to seven digits). ``on_validation_end`` runs after the module's epoch end and, as Lightning
   orders checkpoint callbacks last, before any checkpoint is written, which must see the trained weights.

The DEQ blocks' warm-start caches are not parameters or buffers: they are neither averaged nor swapped. During
validation the model solves its fixed points from the cache of the trained weights (a starting guess only).
"""

from __future__ import annotations

from typing import Any

import lightning.pytorch as L
import torch
from lightning.pytorch.callbacks import EMAWeightAveraging, WeightAveraging
from lightning.pytorch.trainer.states import TrainerFn


class EMA(EMAWeightAveraging):
    """EMA of the weights for validation, test and sampling (see the module docstring)."""

    def __init__(self, decay: float = 0.999, update_every_n_steps: int = 1,
                 update_starting_at_step: int | None = None, use_buffers: bool = False,
                 device: torch.device | str | int | None = None, **kwargs: Any):
        if not 0.0 <= float(decay) <= 1.0:
            raise ValueError(f"ema decay={decay} is invalid: it must be in [0, 1] (e.g. 0.999)")
        if int(update_every_n_steps) < 1:
            raise ValueError(f"ema update_every_n_steps={update_every_n_steps} is invalid: it must be >= 1")
        super().__init__(device=device, use_buffers=use_buffers, decay=float(decay),
                         update_every_n_steps=int(update_every_n_steps),
                         update_starting_at_step=update_starting_at_step, **kwargs)
        self.decay = float(decay)

    def on_fit_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if self._average_model is not None:  # the model's dtype (adjustment 4); its device unless one is given
            self._average_model.to(dtype=pl_module.dtype)
            if self._device is None:
                self._average_model.to(pl_module.device)

    def on_validation_epoch_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        """Nothing yet: the trained weights come back at :meth:`on_validation_end` (adjustment 5)."""

    def on_validation_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if self._average_model is not None:
            self._swap_models(pl_module)  # the trained weights back, before any checkpoint is written

    def on_load_checkpoint(self, trainer: L.Trainer, pl_module: L.LightningModule,
                           checkpoint: dict[str, Any]) -> None:
        if trainer.state.fn != TrainerFn.FITTING:
            return  # the state_dict Lightning loaded already holds the averaged weights: keep them
        if self._average_model is not None:  # float64 averages must not pass through float32 (adjustment 4)
            trainer.precision_plugin.convert_module(self._average_model)
        super().on_load_checkpoint(trainer, pl_module, checkpoint)


def check_resume(checkpoint: dict[str, Any], callbacks: list, path: Any = None) -> None:
    """Refuse to resume a checkpoint written with EMA in a run without it: its ``state_dict`` holds the averaged
    weights, so training would go on from the average instead of from the trained weights."""
    has_ema = any(isinstance(cb, WeightAveraging) for cb in callbacks)
    if "current_model_state" in checkpoint and "averaging_state" in checkpoint and not has_ema:
        raise ValueError(
            "this checkpoint was written with ema=true (its state_dict holds the averaged weights, the trained ones "
            "are in current_model_state): resume it with ema=true, so that training continues from the trained "
            "weights and the average goes on; for test metrics of the averaged weights use src.evaluate"
        )
