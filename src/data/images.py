"""Image data for score models: the part shared by the MNIST, CIFAR-10 and CelebA data modules.

:class:`ImageDataModule` is a :class:`~src.data.contract.ScoreDataModule` whose batches are float32 images
``[B, C, H, W]``. A subclass only says where its 8-bit images come from (:meth:`ImageDataModule._load`:
an :class:`ImageSource` plus the data set's own train/val/test parts); everything else is here.

Pixels (bytes v ∈ {0, …, 255}; all maps per entry)
    ``dequantize=True``   x = v/256 + u/256, u ~ U(0, 1)   (NCSN's ``x·255/256 + U(0,1)/256`` with x = v/255),
                          so x lies in v's bin [v/256, (v+1)/256) ⊂ [0, 1);
    ``dequantize=False``  x = v/255 ∈ [0, 1];
    ``binarize=True``     x ~ Bernoulli(v/255) ∈ {0, 1} (dynamic binarisation; replaces dequantisation).
    ``pixel_range``       ``"unit"``: x as above; ``"symmetric"``: 2x − 1 ∈ [−1, 1].
    ``flip=True``         each training image is mirrored left-right with probability ½.
    :meth:`ImageDataModule.to_pixels` maps model-space images back to [0, 1] (clamped).

Randomness
    Training batches draw fresh noise, binarisation and flips per image from a generator seeded by the run's
    seed and the image's key in the resumable training loader (epoch, position, index: see
    :mod:`src.data.resumable`), never from the global RNG: the same data whatever the number of workers, and a
    run interrupted mid-epoch resumes on the very batches it would have seen. The validation and test
    loaders and :meth:`ImageDataModule.split_tensor` never flip, and draw the noise of the k-th image of a
    split from a generator seeded by (``seed``, split, k): every evaluation sees the same tensors, whatever
    the batch size, the number of workers or ``n``.

Splits (``split``)
    ``"official"``  the data set's own parts; where it has no validation part (MNIST, CIFAR-10) a seeded
                    ``val_fraction`` of its training part is held out.
    ``[a, b, c]``   fractions of all images pooled (the paper's ``[0.7, 0.2, 0.1]``), from a seeded
                    permutation.
    ``limit``       at most this many images in all (quick runs): with fractions, the first ``limit`` of
                    the permutation; with the official split, a seeded subset of each part in proportion to
                    its size. Split indices never touch the global RNG.
"""

from __future__ import annotations

import math
import os
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import torch
from torch.utils.data import DataLoader, Dataset

from src.data.contract import SPLITS, ScoreDataModule, check_split
from src.data.datamodules import positive_int
from src.data.resumable import KeyedItems, ResumableLoader, ResumableSampler, eval_generator, item_generator

PIXEL_RANGES = ("unit", "symmetric")
_SPLIT_CODES = {"train": 1, "val": 2, "test": 3}


# ---------------------------------------------------------------------------------------------- pixels
def check_pixel_range(pixel_range: str) -> str:
    if pixel_range not in PIXEL_RANGES:
        raise ValueError(f"pixel_range={pixel_range!r} is invalid: choose one of {', '.join(PIXEL_RANGES)}")
    return pixel_range


def from_unit(x: torch.Tensor, pixel_range: str) -> torch.Tensor:
    """[0, 1] → model space: x (``unit``) or 2x − 1 (``symmetric``)."""
    return x if check_pixel_range(pixel_range) == "unit" else 2.0 * x - 1.0


def to_unit(x: torch.Tensor, pixel_range: str) -> torch.Tensor:
    """Model space → [0, 1], clamped (the inverse of :func:`from_unit` on its range)."""
    x = x if check_pixel_range(pixel_range) == "unit" else (x + 1.0) / 2.0
    return x.clamp(0.0, 1.0)


@dataclass(frozen=True)
class PixelTransform:
    """uint8 images ``[B, C, H, W]`` → float32 model-space images (see the module docstring). Picklable."""

    dequantize: bool = True
    binarize: bool = False
    pixel_range: str = "unit"
    flip: bool = False

    def __post_init__(self) -> None:
        check_pixel_range(self.pixel_range)

    def _unit(self, v: torch.Tensor, generator: torch.Generator | None) -> torch.Tensor:
        x = v.to(torch.float32)
        if self.binarize:
            return torch.bernoulli(x / 255.0, generator=generator)
        if self.dequantize:
            return (x + torch.rand(x.shape, generator=generator)) / 256.0
        return x / 255.0

    def train(self, v: torch.Tensor, generators: Sequence[torch.Generator] | None = None) -> torch.Tensor:
        """A training batch: fresh noise / binarisation, then a random flip, of image i from ``generators[i]``
        (the resumable loader's counter-based ones), or from the global torch RNG when None."""
        if generators is None:
            x = self._unit(v, None)
            mirror = torch.rand(x.shape[0]) < 0.5 if self.flip else None
        else:
            x = torch.stack([self._unit(img, g) for img, g in zip(v, generators)]) if len(v) else v.float()
            mirror = torch.cat([torch.rand(1, generator=g) for g in generators]) < 0.5 if self.flip else None
        if mirror is not None:
            x = torch.where(mirror[:, None, None, None], x.flip(-1), x)
        return from_unit(x, self.pixel_range)

    def fixed(self, v: torch.Tensor, seeds: Sequence[int]) -> torch.Tensor:
        """An evaluation batch: image i's noise from a generator seeded by ``seeds[i]``; no flip."""
        if not (self.binarize or self.dequantize):
            return from_unit(v.to(torch.float32) / 255.0, self.pixel_range)
        g = torch.Generator()
        out = []
        for img, s in zip(v, seeds):
            g.manual_seed(int(s))
            out.append(self._unit(img, g))
        return from_unit(torch.stack(out), self.pixel_range)


def item_seed(seed: int, split: str, k: int) -> int:
    """The seed of the fixed noise of the k-th image of ``split``."""
    return ((int(seed) * 1_000_003 + _SPLIT_CODES[split]) * 10_000_019 + int(k)) % (2**63)


# ---------------------------------------------------------------------------------------------- sources
class ImageSource:
    """8-bit images by index: ``get(indices)`` → uint8 ``[n, C, H, W]``."""

    def __len__(self) -> int:
        raise NotImplementedError

    def get(self, indices: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError


class TensorImages(ImageSource):
    """Images held in memory as one uint8 tensor ``[N, C, H, W]`` (MNIST, CIFAR-10)."""

    def __init__(self, images: torch.Tensor):
        if images.dtype != torch.uint8 or images.dim() != 4:
            raise ValueError(f"expected uint8 images [N, C, H, W], got {images.dtype} {tuple(images.shape)}")
        self.images = images

    def __len__(self) -> int:
        return self.images.shape[0]

    def get(self, indices: torch.Tensor) -> torch.Tensor:
        return self.images[indices]


class SplitImages(Dataset):
    """The images ``indices`` of a source. Item k is the uint8 image, or ``(image, k)`` with ``positions``
    (for the fixed evaluation noise); a batch is fetched with one ``source.get`` call."""

    def __init__(self, source: ImageSource, indices: torch.Tensor, positions: bool = False):
        self.source = source
        self.indices = indices
        self.positions = positions

    def __len__(self) -> int:
        return self.indices.shape[0]

    def __getitem__(self, k: int):
        img = self.source.get(self.indices[k : k + 1])[0]
        return (img, k) if self.positions else img

    def __getitems__(self, ks: list[int]):
        ks_t = torch.as_tensor(ks, dtype=torch.long)
        imgs = self.source.get(self.indices[ks_t])
        return (imgs, ks_t) if self.positions else imgs


def _stack_images(batch) -> torch.Tensor:
    return batch if torch.is_tensor(batch) else torch.stack(list(batch))


class TrainCollate:
    """Collate of the training loader: ``(uint8 batch, keys)`` → fresh-noise, flipped model-space images, image
    i's randomness from :func:`src.data.resumable.item_generator` (``seed``, key i). A plain uint8 batch
    (without keys) draws from the global torch RNG."""

    def __init__(self, transform: PixelTransform, seed: int = 0):
        self.transform = transform
        self.seed = int(seed)

    def __call__(self, batch) -> torch.Tensor:
        if isinstance(batch, tuple) and len(batch) == 2 and torch.is_tensor(batch[1]):
            images, keys = batch
            return self.transform.train(_stack_images(images),
                                        [item_generator(self.seed, int(k)) for k in keys.tolist()])
        return self.transform.train(_stack_images(batch))


class EvalCollate:
    """Collate of the evaluation loaders: ``(uint8 batch, positions)`` → fixed-noise model-space images."""

    def __init__(self, transform: PixelTransform, seed: int, split: str):
        self.transform = transform
        self.seed = int(seed)
        self.split = check_split(split)

    def __call__(self, batch) -> torch.Tensor:
        if isinstance(batch, tuple) and len(batch) == 2 and torch.is_tensor(batch[0]):
            images, positions = batch
        else:  # a list of (image, k) items
            images, positions = torch.stack([b[0] for b in batch]), [b[1] for b in batch]
        seeds = [item_seed(self.seed, self.split, int(k)) for k in positions]
        return self.transform.fixed(images, seeds)


# ---------------------------------------------------------------------------------------------- splits
def parse_split(split) -> str | tuple[float, float, float]:
    """``"official"`` or three positive fractions summing to 1 (a list from the config)."""
    if isinstance(split, str):
        if split != "official":
            raise ValueError(f"split={split!r} is invalid: use 'official' or three fractions, e.g. [0.7, 0.2, 0.1]")
        return split
    fractions = tuple(float(f) for f in split)
    if len(fractions) != 3 or min(fractions) <= 0 or abs(sum(fractions) - 1.0) > 1e-6:
        raise ValueError(f"split={list(fractions)} is invalid: it must be three positive fractions summing to 1")
    return fractions


def _subset(part: torch.Tensor, n: int, g: torch.Generator) -> torch.Tensor:
    """A seeded subset of ``n`` entries of ``part``, kept in ``part``'s order."""
    if n >= part.numel():
        return part
    return part[torch.randperm(part.numel(), generator=g)[:n].sort().values]


def split_indices(
    official: dict[str, torch.Tensor | None],
    split: str | tuple[float, float, float] = "official",
    val_fraction: float = 0.1,
    limit: int | None = None,
    seed: int = 0,
) -> dict[str, torch.Tensor]:
    """Indices of the train/val/test images (module docstring, "Splits"); ``official`` holds the data set's
    own ``train`` and ``test`` parts (index tensors) and its ``val`` part or None."""
    g = torch.Generator().manual_seed(int(seed))
    parts = {k: official[k] for k in SPLITS if official.get(k) is not None}
    total = sum(p.numel() for p in parts.values())
    if split == "official":
        train = official["train"]
        if official.get("val") is None:
            if not 0.0 < val_fraction < 1.0:
                raise ValueError(f"val_fraction={val_fraction} is invalid: it must be in (0, 1)")
            perm = train[torch.randperm(train.numel(), generator=g)]
            n_val = max(1, round(val_fraction * train.numel()))
            parts = {"train": perm[n_val:].sort().values, "val": perm[:n_val].sort().values, "test": official["test"]}
        if limit is not None:
            parts = {k: _subset(p, max(1, round(limit * p.numel() / total)), g) for k, p in parts.items()}
        idx = {k: parts[k] for k in SPLITS}
    else:
        pool = torch.cat([parts[k] for k in SPLITS if k in parts])
        perm = pool[torch.randperm(pool.numel(), generator=g)]
        if limit is not None:
            perm = perm[:limit]
        n_train, n_val = round(split[0] * perm.numel()), round(split[1] * perm.numel())
        idx = {"train": perm[:n_train], "val": perm[n_train : n_train + n_val], "test": perm[n_train + n_val :]}
    empty = [k for k, v in idx.items() if v.numel() == 0]
    if empty:
        raise ValueError(f"the {', '.join(empty)} split would be empty: raise limit (now {limit})")
    return idx


# ---------------------------------------------------------------------------------------------- module
class ImageDataModule(ScoreDataModule):
    """Base of the image data modules: options, splits, loaders and the contract (module docstring).

    Subclasses set :attr:`image_shape` and implement :meth:`_load` (and :meth:`prepare_data` when files
    can be downloaded). After :meth:`setup`, ``split_indices`` holds the indices of each split into the
    source, and ``source`` the images.
    """

    is_image = True
    default_flip = False  # ``flip=None``: the data set's convention (natural images flip, digits do not)

    def __init__(
        self,
        root: str | os.PathLike = "data",
        batch_size: int = 128,
        eval_batch_size: int = 512,
        num_workers: int = 0,
        seed: int = 2019,
        download: bool = True,
        split: str | Sequence[float] = "official",
        val_fraction: float = 0.1,
        limit: int | None = None,
        pixel_range: str = "unit",
        flip: bool | None = None,
        dequantize: bool = True,
        binarize: bool = False,
        dim: int | None = None,
        shape: Sequence[int] | None = None,
    ):
        super().__init__()
        self.root = Path(root).expanduser()
        self.batch_size = positive_int("batch_size", batch_size)
        self.eval_batch_size = positive_int("eval_batch_size", eval_batch_size)
        if isinstance(num_workers, bool) or int(num_workers) < 0:
            raise ValueError(f"num_workers={num_workers!r} is invalid: it must be >= 0")
        self.num_workers = int(num_workers)
        self.seed = int(seed)
        self.download = bool(download)
        self.split = parse_split(split)
        self.val_fraction = float(val_fraction)
        if self.split == "official" and not 0.0 < self.val_fraction < 1.0:
            raise ValueError(f"val_fraction={val_fraction} is invalid: it must be in (0, 1)")
        self.limit = None if limit is None else positive_int("limit", limit)
        self.transform = PixelTransform(bool(dequantize), bool(binarize), check_pixel_range(pixel_range),
                                        self.default_flip if flip is None else bool(flip))
        self._check_declared_shape(dim, shape)
        self.source: ImageSource | None = None
        self.split_indices: dict[str, torch.Tensor] | None = None

    def _check_declared_shape(self, dim, shape) -> None:
        """The config's ``dim``/``shape`` (which models read) must be this data's."""
        actual = tuple(self.image_shape)
        if shape is not None and tuple(int(s) for s in shape) != actual:
            raise ValueError(f"data.shape={list(shape)} does not match the images, which are {list(actual)}: "
                             f"set data.shape={list(actual)}")
        if dim is not None and int(dim) != math.prod(actual):
            raise ValueError(f"data.dim={dim} does not match the images {list(actual)}, which have "
                             f"{math.prod(actual)} entries: set data.dim={math.prod(actual)}")

    # ------------------------------------------------------------------ subclass hooks
    def _load(self) -> tuple[ImageSource, dict[str, torch.Tensor | None]]:
        """The images and the data set's own parts: ``{"train": idx, "val": idx or None, "test": idx}``."""
        raise NotImplementedError

    # ------------------------------------------------------------------ contract
    @property
    def data_shape(self) -> tuple[int, ...]:
        return tuple(self.image_shape)

    @property
    def dim(self) -> int:
        return math.prod(self.image_shape)

    @property
    def pixel_range(self) -> str:
        return self.transform.pixel_range

    def setup(self, stage: str | None = None) -> None:
        if self.split_indices is not None:
            return
        source, official = self._load()
        self.split_indices = split_indices(official, self.split, self.val_fraction, self.limit, self.seed)
        self.source = source

    def _indices(self, split: str) -> torch.Tensor:
        check_split(split)
        if self.split_indices is None:
            raise RuntimeError(f"{type(self).__name__}: call setup() before asking for the {split} split")
        return self.split_indices[split]

    def split_tensor(self, split: str, n: int | None = None) -> torch.Tensor:
        """The first ``n`` images of ``split`` (all when None), float32 ``[n, C, H, W]``, with the fixed
        evaluation noise and no flip: the same tensor on every call and across modules of equal options."""
        idx = self._indices(split)
        if n is not None:
            idx = idx[: int(n)]
        if idx.numel() == 0:
            return torch.empty(0, *self.image_shape)
        return torch.cat(list(self._eval_loader(split, idx, persistent=False)))

    def to_pixels(self, x: torch.Tensor) -> torch.Tensor:
        """Model-space images (or flat samples) → ``[B, C, H, W]`` in [0, 1], clamped; x's dtype and device."""
        return to_unit(x.reshape(-1, *self.image_shape), self.pixel_range)

    # ------------------------------------------------------------------ loaders
    def _workers(self, persistent: bool = True) -> dict:
        return {"num_workers": self.num_workers, "persistent_workers": persistent and self.num_workers > 0}

    def train_dataloader(self) -> DataLoader:
        idx = self._indices("train")
        sampler = ResumableSampler(idx.numel(), shuffle=True, keyed=True)  # resumable, counter-based noise
        return ResumableLoader(
            KeyedItems(SplitImages(self.source, idx)), sampler=sampler, batch_size=self.batch_size,
            # equal-sized steps, unless that would leave no batch
            drop_last=idx.numel() >= self.batch_size, collate_fn=TrainCollate(self.transform, sampler.seed),
            **self._workers(),
        )

    def _eval_loader(self, split: str, idx: torch.Tensor | None = None, persistent: bool = True) -> DataLoader:
        idx = self._indices(split) if idx is None else idx
        return DataLoader(
            SplitImages(self.source, idx, positions=True), batch_size=self.eval_batch_size, shuffle=False,
            collate_fn=EvalCollate(self.transform, self.seed, split), generator=eval_generator(),
            **self._workers(persistent),
        )

    def val_dataloader(self) -> DataLoader:
        return self._eval_loader("val")

    def test_dataloader(self) -> DataLoader:
        return self._eval_loader("test")
