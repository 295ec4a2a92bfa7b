"""CelebA for image score models: float32 batches ``[B, 3, S, S]``, S = ``image_size`` (``data=celeba``).

Files, under ``<root>/celeba/`` or ``<root>/``: the folder ``img_align_celeba/`` of the 202 599 aligned
and cropped JPEGs (178×218; the nested ``img_align_celeba/img_align_celeba/`` of some unzipped copies is
accepted) and ``list_eval_partition.txt`` (lines ``<file name> <0|1|2>``: train, val, test). There is no
programmatic download (the files are on Google Drive): a missing file raises a FileNotFoundError naming
both files, the places searched and the official page :data:`PAGE`.

Images are read lazily, one JPEG per item, in the DataLoader's workers: the data set is never held in
memory. Each is converted to RGB, centre-cropped to 140×140 (offsets round((W − 140)/2),
round((H − 140)/2), as torchvision's CenterCrop) and resized to S×S with Pillow's bilinear filter
(antialiased when shrinking) — the preprocessing of NCSN. Pixels, noise, flips and splits are those of
:mod:`src.data.images`; defaults: uniform dequantisation, random horizontal flips of training images and
the official partition (CelebA has its own validation part); ``limit`` keeps a seeded subset for quick runs.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from pathlib import Path

import numpy as np
import torch
from PIL import Image

from src.data.download import RemoteFile, find_file
from src.data.images import ImageDataModule, ImageSource

PAGE = "https://mmlab.ie.cuhk.edu.hk/projects/CelebA.html"
IMAGE_DIR = "img_align_celeba"
PARTITION = RemoteFile("list_eval_partition.txt", "celeba", None, page=PAGE)
CROP = 140
PARTS = {0: "train", 1: "val", 2: "test"}


def image_dirs(root: str | os.PathLike) -> list[Path]:
    """The folders searched for the JPEGs, in order."""
    root = Path(root).expanduser()
    return [base / IMAGE_DIR / sub for base in (root / "celeba", root) for sub in ("", IMAGE_DIR)]


def _missing(root: str | os.PathLike, what: str) -> FileNotFoundError:
    searched = ", ".join(str(p) for p in PARTITION.candidates(root)) + "; " + ", ".join(
        str(d) for d in image_dirs(root))
    return FileNotFoundError(
        f"CelebA not found: {what} (searched: {searched}). CelebA needs the folder {IMAGE_DIR}/ of aligned "
        f"JPEGs (unzip {IMAGE_DIR}.zip) and {PARTITION.filename}; it has no programmatic download: get both "
        f"from the official page {PAGE} and put them in {Path(root).expanduser() / 'celeba'} (or set data.root "
        "to the folder that holds them)."
    )


def read_partition(path: str | os.PathLike) -> tuple[list[str], torch.Tensor]:
    """``list_eval_partition.txt`` → (file names, partition codes 0/1/2 as int64), in file order."""
    names, codes = [], []
    for n, line in enumerate(Path(path).read_text().splitlines(), 1):
        fields = line.split()
        if not fields:
            continue
        if len(fields) != 2 or fields[1] not in ("0", "1", "2"):
            raise ValueError(f"{path}, line {n}: expected '<file name> <0|1|2>', got {line!r}")
        names.append(fields[0])
        codes.append(int(fields[1]))
    if not names:
        raise ValueError(f"{path}: no images listed")
    return names, torch.tensor(codes, dtype=torch.int64)


def locate_celeba(root: str | os.PathLike) -> tuple[Path, Path]:
    """(the JPEG folder, the partition file) under ``root``; FileNotFoundError naming both when missing."""
    partition = find_file(PARTITION, root)
    folder = next((d for d in image_dirs(root) if d.is_dir() and any(d.glob("*.jpg"))), None)
    if partition is None or folder is None:
        missing = [f for f, p in ((PARTITION.filename, partition), (f"{IMAGE_DIR}/*.jpg", folder)) if p is None]
        raise _missing(root, f"no {' and no '.join(missing)}")
    return folder, partition


def load_image(path: str | os.PathLike, image_size: int) -> np.ndarray:
    """One CelebA JPEG → uint8 ``[3, S, S]``: RGB, centre crop 140, bilinear (antialiased) resize to S."""
    with Image.open(path) as img:
        img = img.convert("RGB")
        w, h = img.size
        if w < CROP or h < CROP:
            raise ValueError(f"{path}: a {w}×{h} image is smaller than the {CROP}×{CROP} centre crop")
        left, top = round((w - CROP) / 2), round((h - CROP) / 2)
        img = img.crop((left, top, left + CROP, top + CROP))
        if image_size != CROP:
            img = img.resize((image_size, image_size), Image.Resampling.BILINEAR)
        return np.asarray(img, dtype=np.uint8).transpose(2, 0, 1)


class JpegImages(ImageSource):
    """JPEG files decoded on demand (one per item), centre-cropped and resized."""

    def __init__(self, folder: Path, names: Sequence[str], image_size: int):
        self.folder = Path(folder)
        self.names = list(names)
        self.image_size = int(image_size)

    def __len__(self) -> int:
        return len(self.names)

    def get(self, indices: torch.Tensor) -> torch.Tensor:
        out = np.empty((len(indices), 3, self.image_size, self.image_size), dtype=np.uint8)
        for j, i in enumerate(indices.tolist()):
            path = self.folder / self.names[i]
            try:
                out[j] = load_image(path, self.image_size)
            except FileNotFoundError as exc:
                raise FileNotFoundError(
                    f"CelebA image {path} (listed in {PARTITION.filename}) is missing: is {self.folder} "
                    f"the complete unzipped {IMAGE_DIR}.zip from {PAGE}?"
                ) from exc
        return torch.from_numpy(out)


class CelebADataModule(ImageDataModule):
    """CelebA images ``[B, 3, image_size, image_size]``; options as :class:`~src.data.images.ImageDataModule`
    (``val_fraction`` is unused by the official split: CelebA has its own validation part)."""

    default_flip = True

    def __init__(self, root: str | os.PathLike = "data", image_size: int = 64, **options):
        if isinstance(image_size, bool) or int(image_size) != image_size or not 1 <= int(image_size) <= CROP:
            raise ValueError(f"image_size={image_size!r} is invalid: it must be an integer in [1, {CROP}] "
                             "(32 and 64 are the usual)")
        self.image_size = int(image_size)
        super().__init__(root, **options)

    @property
    def image_shape(self) -> tuple[int, int, int]:
        return (3, self.image_size, self.image_size)

    def prepare_data(self) -> None:
        locate_celeba(self.root)  # nothing can be downloaded: fail early with the remedy

    def _load(self) -> tuple[ImageSource, dict[str, torch.Tensor | None]]:
        folder, partition = locate_celeba(self.root)
        names, codes = read_partition(partition)
        official = {split: torch.nonzero(codes == code).flatten() for code, split in PARTS.items()}
        empty = [s for s, idx in official.items() if idx.numel() == 0]
        if empty and self.split == "official":
            raise ValueError(f"{partition}: the official {', '.join(empty)} part is empty")
        return JpegImages(folder, names, self.image_size), official
