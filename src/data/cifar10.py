"""CIFAR-10 for image score models: float32 batches ``[B, 3, 32, 32]`` (``data=cifar10``).

Files: the python version of the data set, the pickled batches ``data_batch_1`` … ``data_batch_5`` (50 000
training images) and ``test_batch`` (10 000), each a dict with ``b"data"`` (uint8 ``[10000, 3072]``, each
row the R, G and B planes of a 32×32 image in row-major order) and ``b"labels"``. They are read from the
folder ``cifar-10-batches-py`` in ``<root>/`` or ``<root>/cifar10/``. When that folder is missing, the
official archive ``cifar-10-python.tar.gz`` (looked for in ``<root>/cifar10/`` and ``<root>/``, downloaded
into ``<root>/cifar10/`` with its md5 by :mod:`src.data.download` when missing and the network allows) is
extracted next to itself, after checking that every member is a plain file or folder inside
``cifar-10-batches-py`` (no absolute paths, no ``..``, no links); where that folder cannot be written the
batches are read from the archive directly.

The batches are unpickled with an unpickler that only builds numpy arrays, lists and dicts: a substituted
file cannot run code.

Pixels, noise, flips and splits are those of :mod:`src.data.images`; defaults: uniform dequantisation,
random horizontal flips of training images, the official split with a seeded 10 % of the training
images held out for validation.
"""

from __future__ import annotations

import io
import logging
import os
import pickle
import shutil
import tarfile
import tempfile
from collections.abc import Callable
from pathlib import Path, PurePosixPath

import numpy as np
import torch

from src.data.download import RemoteFile, ensure_file
from src.data.images import ImageDataModule, ImageSource, TensorImages

log = logging.getLogger(__name__)

BATCH_DIR = "cifar-10-batches-py"
TRAIN_BATCHES = tuple(f"data_batch_{i}" for i in range(1, 6))
TEST_BATCH = "test_batch"
ARCHIVE = RemoteFile(
    "cifar-10-python.tar.gz",
    "cifar10",
    "https://www.cs.toronto.edu/~kriz/cifar-10-python.tar.gz",
    md5="c58f30108f718f92721af3b95e74349a",
)


class CIFARFormatError(ValueError):
    """A CIFAR-10 batch file that is not one (the message names the file)."""


def batch_dirs(root: str | os.PathLike) -> list[Path]:
    """The folders searched for the extracted batches: ``<root>/cifar-10-batches-py``, then
    ``<root>/cifar10/cifar-10-batches-py``."""
    root = Path(root).expanduser()
    return [root / BATCH_DIR, root / "cifar10" / BATCH_DIR]


def find_batches(root: str | os.PathLike) -> Path | None:
    """The first folder of :func:`batch_dirs` holding all six batch files, or None."""
    for folder in batch_dirs(root):
        if all((folder / name).is_file() for name in (*TRAIN_BATCHES, TEST_BATCH)):
            return folder
    return None


# ---------------------------------------------------------------------------------------------- reading
class _ArrayUnpickler(pickle.Unpickler):
    """Builds only what the CIFAR batches hold: numpy arrays (and dicts, lists, bytes, numbers)."""

    _ALLOWED = {
        (f"numpy.{core}.{module}", name)
        for core in ("core", "_core")
        for module, name in (("multiarray", "_reconstruct"), ("multiarray", "scalar"), ("numeric", "_frombuffer"))
    } | {("numpy", "ndarray"), ("numpy", "dtype"), ("_codecs", "encode")}

    def find_class(self, module: str, name: str):
        if (module, name) not in self._ALLOWED:
            raise pickle.UnpicklingError(f"refusing to load {module}.{name} from a CIFAR-10 batch")
        return super().find_class(module, name)


def parse_batch(raw: bytes, name: str) -> tuple[torch.Tensor, torch.Tensor]:
    """The bytes of one pickled batch → (uint8 images ``[N, 3, 32, 32]``, int64 labels ``[N]``).

    Raises :class:`CIFARFormatError` naming ``name`` when the content is not a CIFAR-10 batch."""
    try:
        batch = _ArrayUnpickler(io.BytesIO(raw), encoding="bytes").load()
    except Exception as exc:  # any unpickling failure means: not a batch file
        raise CIFARFormatError(f"{name}: not a CIFAR-10 python batch ({type(exc).__name__}: {exc})") from exc
    if not isinstance(batch, dict):
        raise CIFARFormatError(f"{name}: not a CIFAR-10 python batch (a {type(batch).__name__}, not a dict)")
    batch = {k.decode() if isinstance(k, bytes) else k: v for k, v in batch.items()}
    if "data" not in batch or "labels" not in batch:
        raise CIFARFormatError(f"{name}: a CIFAR-10 batch needs the keys 'data' and 'labels', got {sorted(batch)}")
    data = np.asarray(batch["data"])
    labels = np.asarray(batch["labels"], dtype=np.int64)
    if data.dtype != np.uint8 or data.ndim != 2 or data.shape[1] != 3 * 32 * 32:
        raise CIFARFormatError(f"{name}: expected uint8 data [N, 3072], got {data.dtype} {data.shape}")
    if labels.shape != (data.shape[0],):
        raise CIFARFormatError(f"{name}: {labels.shape} labels for {data.shape[0]} images")
    images = torch.from_numpy(data.reshape(-1, 3, 32, 32).copy())
    return images, torch.from_numpy(labels)


def read_batches(read: Callable[[str], bytes], where: str) -> dict[str, torch.Tensor]:
    """``train_images`` [50000, 3, 32, 32], ``train_labels``, ``test_images``, ``test_labels`` from the six
    batches, ``read(name)`` giving the bytes of batch ``name`` (``where`` names their place in errors)."""
    parts = [parse_batch(read(name), f"{where}/{name}") for name in TRAIN_BATCHES]
    test_images, test_labels = parse_batch(read(TEST_BATCH), f"{where}/{TEST_BATCH}")
    return {
        "train_images": torch.cat([p[0] for p in parts]), "train_labels": torch.cat([p[1] for p in parts]),
        "test_images": test_images, "test_labels": test_labels,
    }


def _safe_members(tar: tarfile.TarFile, archive: Path) -> list[tarfile.TarInfo]:
    members = tar.getmembers()
    for m in members:
        path = PurePosixPath(m.name)
        if path.is_absolute() or ".." in path.parts or not (m.isfile() or m.isdir()) or path.parts[0] != BATCH_DIR:
            raise CIFARFormatError(
                f"{archive}: refusing to extract member {m.name!r}: the archive must hold only plain files and "
                f"folders under {BATCH_DIR}/ (is it the official {ARCHIVE.filename}?)"
            )
    return members


def extract_archive(archive: str | os.PathLike) -> Path:
    """Extract the official archive next to itself (``<folder>/cifar-10-batches-py``), safely: members are
    checked first, extracted into a temporary folder, and moved into place only when complete."""
    archive = Path(archive)
    dest = archive.parent / BATCH_DIR
    tmp = Path(tempfile.mkdtemp(dir=archive.parent, prefix=".cifar-10-extract-"))
    try:
        with tarfile.open(archive, "r:gz") as tar:
            members = _safe_members(tar, archive)
            if hasattr(tarfile, "data_filter"):
                tar.extractall(tmp, members=members, filter="data")
            else:  # Python < 3.10.12: the members were checked above
                tar.extractall(tmp, members=members)
        os.replace(tmp / BATCH_DIR, dest)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    log.info("extracted %s -> %s", archive, dest)
    return dest


def read_archive(archive: str | os.PathLike) -> dict[str, torch.Tensor]:
    """The arrays of :func:`read_batches`, read from the archive without extracting it."""
    archive = Path(archive)
    with tarfile.open(archive, "r:gz") as tar:
        members = {m.name: m for m in _safe_members(tar, archive)}

        def read(name: str) -> bytes:
            member = members.get(f"{BATCH_DIR}/{name}")
            if member is None or not member.isfile():
                raise CIFARFormatError(f"{archive}: no member {BATCH_DIR}/{name} (is it the official archive?)")
            return tar.extractfile(member).read()

        return read_batches(read, str(archive))


def locate_cifar10(root: str | os.PathLike, download: bool = True) -> Path:
    """The batch folder, or else the archive (downloaded when missing and ``download``), under ``root``.

    Raises FileNotFoundError naming the batch folders and archive paths searched and the source."""
    folder = find_batches(root)
    if folder is not None:
        return folder
    try:
        return ensure_file(ARCHIVE, root, download=download)
    except FileNotFoundError as exc:
        searched = ", ".join(str(d) for d in batch_dirs(root))
        raise FileNotFoundError(
            f"CIFAR-10 not found: no folder {BATCH_DIR} with {', '.join(TRAIN_BATCHES)} and {TEST_BATCH} "
            f"(searched: {searched}), and no archive: {exc}"
        ) from exc


def load_cifar10(root: str | os.PathLike, download: bool = True) -> dict[str, torch.Tensor]:
    """The CIFAR-10 arrays (see :func:`read_batches`), extracting the archive first when only it is there."""
    found = locate_cifar10(root, download)
    if found.is_file():  # the archive
        try:
            found = extract_archive(found)
        except OSError as exc:  # a read-only folder, or a partial cifar-10-batches-py in the way
            log.warning("could not extract %s (%s); reading the batches from the archive", found, exc)
            return read_archive(found)
    return read_batches(lambda name: (found / name).read_bytes(), str(found))


class CIFAR10DataModule(ImageDataModule):
    """CIFAR-10 images ``[B, 3, 32, 32]``; options as :class:`~src.data.images.ImageDataModule`."""

    image_shape = (3, 32, 32)
    default_flip = True

    def prepare_data(self) -> None:
        """Download and extract once (local rank 0); :meth:`setup` then finds the batch folder."""
        found = locate_cifar10(self.root, download=self.download)
        if found.is_file():
            try:
                extract_archive(found)
            except OSError as exc:  # setup() reads the archive itself
                log.warning("could not extract %s (%s)", found, exc)

    def _load(self) -> tuple[ImageSource, dict[str, torch.Tensor | None]]:
        arrays = load_cifar10(self.root, download=self.download)
        n_train, n_test = arrays["train_images"].shape[0], arrays["test_images"].shape[0]
        images = torch.cat([arrays["train_images"], arrays["test_images"]])
        official = {"train": torch.arange(n_train), "val": None, "test": torch.arange(n_train, n_train + n_test)}
        return TensorImages(images), official
