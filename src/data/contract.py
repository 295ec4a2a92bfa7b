"""The one contract between data and models: what a deqsm data module offers.

Every data module of the project subclasses :class:`ScoreDataModule` (itself a ``LightningDataModule``).
The LightningModules of ``src/lit`` talk to data only through the members below, never by probing for
attributes. A new data set implements the abstract members and overrides the optional ones it supports.

Required
    ``data_shape``              the shape of one sample as the model sees it: ``(D,)`` for vectors,
                                ``(C, H, W)`` for images.
    ``train_dataloader`` …      Lightning's loaders; a batch is a float tensor ``[B, *data_shape]`` (or a
                                tuple/list whose first element is that tensor).
    ``split_tensor(split, n)``  up to ``n`` samples of ``"train" | "val" | "test"`` as one float32 tensor
                                ``[n, *data_shape]``, deterministic (fixed noise and order) so evaluations
                                repeat exactly. Callers move it to the model's dtype and device.

Optional (each with a flag, so a caller asks before it uses)
    ``has_ground_truth``        ``true_log_density(x)`` [B] and ``true_score(x)`` [B, *data_shape] of the
                                distribution the data were drawn from (synthetic data).
    ``is_image``                ``to_pixels(x)``: model-space samples -> images ``[B, C, H, W]`` in [0, 1]
                                (sample grids, FID); ``image_shape``.
    ``has_bits_per_dim``        ``bits_per_dim(log_p, x)`` [B]: pixel-space bits/dim of a model log-density
                                given in model space, every Jacobian of the data transform included.

Methods that take model tensors follow their dtype and device (float64 runs stay float64).
"""

from __future__ import annotations

import math

import lightning.pytorch as L
import torch

SPLITS = ("train", "val", "test")


class DataContractError(NotImplementedError):
    """A model asked a data module for something it does not offer (e.g. a true score of real data)."""


class ScoreDataModule(L.LightningDataModule):
    """Base class of every deqsm data module: see the module docstring for the contract."""

    has_ground_truth: bool = False
    is_image: bool = False
    has_bits_per_dim: bool = False

    # ------------------------------------------------------------------ required
    @property
    def data_shape(self) -> tuple[int, ...]:
        raise NotImplementedError(f"{type(self).__name__} must define data_shape")

    @property
    def data_dim(self) -> int:
        """Number of entries of one sample (D of the objectives)."""
        return math.prod(self.data_shape)

    def split_tensor(self, split: str, n: int | None = None) -> torch.Tensor:
        """Up to ``n`` samples of ``split`` ([n, *data_shape], float32, deterministic). Default: the first ``n``
        rows of the in-memory ``<split>_data`` tensor that subclasses holding whole splits provide."""
        check_split(split)
        data = getattr(self, f"{split}_data", None)
        if data is None:
            raise RuntimeError(f"{type(self).__name__}: call setup() before asking for the {split} split")
        return data if n is None else data[: int(n)]

    # ------------------------------------------------------------------ optional
    def true_log_density(self, x: torch.Tensor) -> torch.Tensor:
        raise DataContractError(f"{type(self).__name__} has no ground-truth density (has_ground_truth=False)")

    def true_score(self, x: torch.Tensor) -> torch.Tensor:
        raise DataContractError(f"{type(self).__name__} has no ground-truth score (has_ground_truth=False)")

    @property
    def image_shape(self) -> tuple[int, int, int]:
        raise DataContractError(f"{type(self).__name__} holds no images (is_image=False)")

    def to_pixels(self, x: torch.Tensor) -> torch.Tensor:
        raise DataContractError(f"{type(self).__name__} holds no images (is_image=False)")

    def bits_per_dim(self, log_p: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        raise DataContractError(f"{type(self).__name__} has no pixel space for bits/dim (has_bits_per_dim=False)")


def check_split(split: str) -> str:
    if split not in SPLITS:
        raise ValueError(f"split={split!r} is invalid: choose one of {', '.join(SPLITS)}")
    return split


def require_contract(datamodule, who: str) -> ScoreDataModule:
    """``datamodule`` if it follows the contract, else a clear error naming ``who`` needs it."""
    if not isinstance(datamodule, ScoreDataModule):
        raise TypeError(
            f"{who} needs a deqsm data module (a subclass of src.data.contract.ScoreDataModule), got "
            f"{type(datamodule).__name__}: pass one of src/data's modules to trainer.fit/test"
        )
    return datamodule
