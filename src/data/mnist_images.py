"""MNIST as images for score models: float32 batches ``[B, 1, 28, 28]`` (``data=mnist_images``).

The four IDX files are located, downloaded and read by :mod:`src.data.mnist` (the same files as the
logit-space NICE data). Pixels, noise, flips and splits are those of :mod:`src.data.images`: by default
NCSN-style uniform dequantisation x = v/256 + U(0, 1)/256 in [0, 1) (fresh per training batch, fixed and
seeded for evaluation), no flip, and the official split (60 000 training images, a seeded ``val_fraction``
of them held out for validation, the 10 000 t10k images for test). ``binarize=True`` gives the dynamically
binarised MNIST of VAE training: every training batch re-samples x ~ Bernoulli(v/255), the evaluation
splits are binarised once with a fixed seed.
"""

from __future__ import annotations

import torch

from src.data.images import ImageDataModule, ImageSource, TensorImages
from src.data.mnist import load_mnist, locate_mnist


class MNISTImageDataModule(ImageDataModule):
    """MNIST images ``[B, 1, 28, 28]``; options as :class:`~src.data.images.ImageDataModule`."""

    image_shape = (1, 28, 28)

    def prepare_data(self) -> None:
        locate_mnist(self.root, download=self.download)  # downloads once (local rank 0)

    def _load(self) -> tuple[ImageSource, dict[str, torch.Tensor | None]]:
        arrays = load_mnist(self.root, download=self.download)
        n_train, n_test = arrays["train_images"].shape[0], arrays["test_images"].shape[0]
        images = torch.cat([arrays["train_images"], arrays["test_images"]]).unsqueeze(1).contiguous()
        official = {"train": torch.arange(n_train), "val": None, "test": torch.arange(n_train, n_train + n_test)}
        return TensorImages(images), official
