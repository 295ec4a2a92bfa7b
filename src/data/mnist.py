"""MNIST for the NICE experiment (paper §4.3): download and LightningDataModule.

No torchvision: the four original IDX files are read directly. They are looked for in ``<root>/mnist/``,
``<root>/MNIST/raw/`` (torchvision's layout) and ``<root>/``, gzipped or not. When missing and
``download=True`` the downloader of :mod:`src.data.download` fetches them (torchvision's mirror first,
then yann.lecun.com), md5-checked, into ``<root>/mnist/`` atomically.

The IDX reader is :mod:`src.data.idx_format`; the dequantisation and logit transforms, with the densities
and bits/dim they imply, are :mod:`src.data.logit_transforms`.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from pathlib import Path

import torch
from torch.utils.data import DataLoader, Dataset

from src.data.contract import ScoreDataModule, check_split
from src.data.download import RemoteFile, ensure_file
from src.data.idx_format import IDXFormatError, read_idx
from src.data.logit_transforms import (
    DequantizeLogit,
    bits_per_dim,
    check_squash,
    dequantize,
    from_logit,
    to_logit,
)
from src.data.resumable import KeyedItems, ResumableLoader, ResumableSampler, eval_generator

# ---------------------------------------------------------------------------------------------- files
FILES = {
    "train_images": "train-images-idx3-ubyte",
    "train_labels": "train-labels-idx1-ubyte",
    "test_images": "t10k-images-idx3-ubyte",
    "test_labels": "t10k-labels-idx1-ubyte",
}
MD5 = {  # of the .gz files, as torchvision checks them
    "train-images-idx3-ubyte": "f68b3c2dcbeaaa9fbdd348bbdeb94873",
    "train-labels-idx1-ubyte": "d53e105ee54ea40749a09fcbcd1e9432",
    "t10k-images-idx3-ubyte": "9fb629c4189551a2d022fa330f9573f3",
    "t10k-labels-idx1-ubyte": "ec29112dd5afa0611ce80d1b7f02629c",
}
MIRRORS = (
    "https://ossci-datasets.s3.amazonaws.com/mnist/",  # torchvision's mirror
    "http://yann.lecun.com/exdb/mnist/",  # the original
)


SUBDIR, EXTRA_DIRS = "mnist", ("MNIST/raw",)


def remote_file(name: str) -> RemoteFile:
    """The download spec of MNIST file ``name`` (e.g. ``train-images-idx3-ubyte``): ``<name>.gz`` (or the
    uncompressed ``<name>``) looked for in ``<root>/mnist``, ``<root>/MNIST/raw`` and ``<root>``, downloaded
    from every mirror of :data:`MIRRORS` in turn, md5-checked."""
    urls = [f"{mirror}{name}.gz" for mirror in MIRRORS]
    return RemoteFile(f"{name}.gz", SUBDIR, urls[0], md5=MD5[name], mirrors=tuple(urls[1:]),
                      extra_dirs=EXTRA_DIRS, alt_names=(name,))


def locate_mnist(root: str | os.PathLike, download: bool = True) -> dict[str, Path]:
    """Paths of the four MNIST files under ``root``, downloading the missing ones when ``download``.

    Raises FileNotFoundError naming the missing file, the places searched and the mirrors tried."""
    return {key: ensure_file(remote_file(name), root, download=download) for key, name in FILES.items()}


def load_mnist(root: str | os.PathLike, download: bool = True) -> dict[str, torch.Tensor]:
    """The four MNIST arrays: ``train_images`` [60000, 28, 28] uint8, ``train_labels`` [60000] uint8, ``test_*``."""
    paths = locate_mnist(root, download=download)
    arrays = {key: read_idx(path) for key, path in paths.items()}
    for split in ("train", "test"):
        images, labels = arrays[f"{split}_images"], arrays[f"{split}_labels"]
        if images.dim() != 3 or tuple(images.shape[1:]) != (28, 28) or images.dtype != torch.uint8:
            raise IDXFormatError(f"{paths[f'{split}_images']}: expected uint8 images [N, 28, 28], "
                                 f"got {images.dtype} {tuple(images.shape)}")
        if labels.dim() != 1 or labels.shape[0] != images.shape[0]:
            raise IDXFormatError(f"{paths[f'{split}_labels']}: {tuple(labels.shape)} labels for "
                                 f"{images.shape[0]} images in {paths[f'{split}_images']}")
    return arrays


# --------------------------------------------------------------------------------------- datamodule
class _Rows(Dataset):
    def __init__(self, data: torch.Tensor):
        self.data = data

    def __len__(self) -> int:
        return self.data.shape[0]

    def __getitem__(self, i):
        return self.data[i]


class MNISTDataModule(ScoreDataModule):
    """MNIST in logit space, flat ``[B, 784]`` float32 batches (paper §4.3).

    Contract: ``data_shape = (784,)``; ``split_tensor`` gives the fixed-noise logit splits; ``is_image``
    (``to_pixels`` maps logit samples back to ``[B, 1, 28, 28]`` images in [0, 1]); ``has_bits_per_dim``
    (pixel-space bits/dim with every Jacobian of dequantisation, squash and logit).

    - ``split=(0.7, 0.2, 0.1)``: fractions of all 70 000 images (train + t10k pooled, as the paper does):
      49 000 / 14 000 / 7 000, from a permutation seeded by ``seed`` (global RNG untouched).
      ``split="reference"``: the reference code's 90/10 split of the 60 000 training images, test = t10k.
    - ``limit``: keep only the first ``limit`` images of the seeded permutation, then split (quick runs;
      with ``split="reference"``: ``limit // 10`` t10k images for test, the rest from the training file).
    - Training batches (shuffled; the last incomplete one dropped) get fresh dequantisation noise each time
      (in the collate, counter-based: seeded by the run's seed and the item's key, so a run resumes on the
      same noise, :mod:`src.data.resumable`); the validation and test
      sets are dequantised once with a noise seeded from ``seed``, so evaluation is deterministic.
    - ``train_data`` / ``val_data`` / ``test_data``: the whole splits as float32 ``[N, 784]`` logit tensors
      with that fixed noise (computed on first use); ``*_bytes``: the uint8 ``[N, 784]`` pixels;
      ``*_labels``: the digits.
    """

    dim = 784
    is_image = True
    has_bits_per_dim = True

    def __init__(
        self,
        root: str | os.PathLike = "data",
        batch_size: int = 128,
        eval_batch_size: int = 512,
        download: bool = True,
        split: Sequence[float] | str = (0.7, 0.2, 0.1),
        seed: int = 2019,
        dequantize: bool = True,
        logit_eps: float = 1e-3,
        squash: str = "affine",
        num_workers: int = 0,
        limit: int | None = None,
        dim: int = 784,
    ):
        super().__init__()
        if int(dim) != 784:
            raise ValueError(f"MNIST images have 784 pixels; data.dim={dim} does not match (leave it at 784)")
        check_squash(squash, logit_eps)
        if isinstance(split, str):
            if split != "reference":
                raise ValueError(f"split must be three fractions or 'reference', got {split!r}")
        else:
            split = tuple(float(f) for f in split)
            if len(split) != 3 or min(split) < 0 or abs(sum(split) - 1.0) > 1e-6 or split[0] <= 0:
                raise ValueError(f"split must be three non-negative fractions summing to 1 (train > 0), got {split}")
        if limit is not None and int(limit) < 3:
            raise ValueError(f"limit must be None or >= 3, got {limit}")
        self.root = Path(root).expanduser()
        self.batch_size = int(batch_size)
        self.eval_batch_size = int(eval_batch_size)
        self.download = bool(download)
        self.split = split
        self.seed = int(seed)
        self.dequantize = bool(dequantize)
        self.logit_eps = float(logit_eps)
        self.squash = squash
        self.num_workers = int(num_workers)
        self.limit = None if limit is None else int(limit)
        self.split_indices: dict[str, torch.Tensor] | None = None
        self._bytes: dict[str, torch.Tensor] = {}
        self._labels: dict[str, torch.Tensor] = {}
        self._fixed: dict[str, torch.Tensor] = {}

    # ------------------------------------------------------------------ lightning hooks
    def prepare_data(self) -> None:
        locate_mnist(self.root, download=self.download)  # downloads once (local rank 0)

    def setup(self, stage: str | None = None) -> None:
        if self._bytes:
            return
        arrays = load_mnist(self.root, download=self.download)
        images = torch.cat([arrays["train_images"], arrays["test_images"]]).flatten(1)
        labels = torch.cat([arrays["train_labels"], arrays["test_labels"]])
        n_train_file = arrays["train_images"].shape[0]
        g = torch.Generator().manual_seed(self.seed)
        if self.split == "reference":
            perm = torch.randperm(n_train_file, generator=g)
            test_idx = torch.arange(n_train_file, images.shape[0])
            if self.limit is not None:
                perm = perm[: self.limit - max(1, self.limit // 10)]
                test_idx = test_idx[: max(1, self.limit // 10)]
            n_val = max(1, round(0.1 * perm.numel()))
            idx = {"train": perm[n_val:], "val": perm[:n_val], "test": test_idx}
        else:
            perm = torch.randperm(images.shape[0], generator=g)
            if self.limit is not None:
                perm = perm[: self.limit]
            n = perm.numel()
            n_train = round(self.split[0] * n)
            n_val = round(self.split[1] * n)
            idx = {"train": perm[:n_train], "val": perm[n_train : n_train + n_val], "test": perm[n_train + n_val :]}
        self.split_indices = idx
        for name, i in idx.items():
            self._bytes[name] = images[i].contiguous()
            self._labels[name] = labels[i].long()

    def _require(self, name: str) -> torch.Tensor:
        if not self._bytes:
            raise RuntimeError("MNISTDataModule: call setup() first")
        return self._bytes[name]

    # ------------------------------------------------------------------ data
    @property
    def train_bytes(self) -> torch.Tensor:
        return self._require("train")

    @property
    def val_bytes(self) -> torch.Tensor:
        return self._require("val")

    @property
    def test_bytes(self) -> torch.Tensor:
        return self._require("test")

    @property
    def train_labels(self) -> torch.Tensor:
        self._require("train")
        return self._labels["train"]

    @property
    def val_labels(self) -> torch.Tensor:
        self._require("val")
        return self._labels["val"]

    @property
    def test_labels(self) -> torch.Tensor:
        self._require("test")
        return self._labels["test"]

    def fixed_logit(self, name: str) -> torch.Tensor:
        """Split ``name`` in logit space with a dequantisation noise seeded by (seed, split): deterministic."""
        if name not in self._fixed:
            v = self._require(name)
            offset = {"train": 1, "val": 2, "test": 3}[name]
            g = torch.Generator().manual_seed(self.seed * 10 + offset)
            x = dequantize(v, generator=g, noise=self.dequantize)
            self._fixed[name] = to_logit(x, self.logit_eps, self.squash)
        return self._fixed[name]

    @property
    def train_data(self) -> torch.Tensor:
        return self.fixed_logit("train")

    @property
    def val_data(self) -> torch.Tensor:
        return self.fixed_logit("val")

    @property
    def test_data(self) -> torch.Tensor:
        return self.fixed_logit("test")

    # ------------------------------------------------------------------ loaders
    def train_dataloader(self) -> DataLoader:
        sampler = ResumableSampler(self.train_bytes.shape[0], shuffle=True, keyed=True)
        return ResumableLoader(
            # equal-sized steps (memory and time per step comparable), unless that would leave no batch
            KeyedItems(_Rows(self.train_bytes)), sampler=sampler, batch_size=self.batch_size,
            drop_last=self.train_bytes.shape[0] >= self.batch_size,
            collate_fn=DequantizeLogit(self.dequantize, self.logit_eps, self.squash, seed=sampler.seed),
            num_workers=self.num_workers, persistent_workers=self.num_workers > 0,
        )

    def _eval_loader(self, name: str) -> DataLoader:
        return DataLoader(_Rows(self.fixed_logit(name)), batch_size=self.eval_batch_size, shuffle=False,
                          num_workers=self.num_workers, persistent_workers=self.num_workers > 0,
                          generator=eval_generator())

    def val_dataloader(self) -> DataLoader:
        return self._eval_loader("val")

    def test_dataloader(self) -> DataLoader:
        return self._eval_loader("test")

    # ------------------------------------------------------------------ contract
    @property
    def data_shape(self) -> tuple[int, ...]:
        return (784,)

    @property
    def image_shape(self) -> tuple[int, int, int]:
        return (1, 28, 28)

    def split_tensor(self, split: str, n: int | None = None) -> torch.Tensor:
        """The first ``n`` rows of ``split`` in logit space, float32 ``[n, 784]``, with the fixed noise."""
        data = self.fixed_logit(check_split(split))
        return data if n is None else data[: int(n)]

    def to_pixels(self, y: torch.Tensor) -> torch.Tensor:
        """Logit-space samples ``[B, 784]`` → images ``[B, 1, 28, 28]`` in [0, 1] (y's dtype and device)."""
        x = from_logit(y.reshape(-1, *self.image_shape), self.logit_eps, self.squash)
        return x.clamp(0.0, 1.0)

    def bits_per_dim(self, log_p_logit: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        """Pixel-space bits/dim ``[B]`` from the model's log p(y) ``[B]`` on logit-space batches y."""
        return bits_per_dim(log_p_logit, y, self.logit_eps, self.squash)
