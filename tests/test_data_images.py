"""Image data modules (MNIST images, CIFAR-10, CelebA) and their shared pixel/split helpers: shapes, dtypes,
ranges, dequantisation bins, binarisation, flips, splits, file round trips and errors (no network)."""

from __future__ import annotations

import dataclasses
import hashlib
import io
import pickle
import tarfile
import urllib.error
from pathlib import Path

import numpy as np
import pytest
import torch
from hydra.errors import InstantiationException
from hydra.utils import instantiate
from PIL import Image

from src.data import celeba as CA
from src.data import cifar10 as C10
from src.data import download as dl
from src.data import images as I
from src.data.contract import DataContractError, ScoreDataModule
from src.data.idx_format import read_idx
from src.data.mnist import locate_mnist
from src.data.mnist_images import MNISTImageDataModule
from tests.conftest import compose_train


# ---------------------------------------------------------------------------------------------- pixels
def test_dequantized_pixels_stay_in_their_bytes_bin_and_map_back():
    v = torch.arange(256, dtype=torch.uint8).repeat(30).reshape(30, 1, 16, 16)
    torch.manual_seed(0)
    x = I.PixelTransform(dequantize=True).train(v)
    assert x.dtype == torch.float32 and x.shape == v.shape
    assert torch.equal(torch.floor(x * 256).long(), v.long())  # x ∈ [v/256, (v+1)/256)
    assert abs((x * 256 - v).mean().item() - 0.5) < 0.01 and abs((x * 256 - v).std().item() - 0.2887) < 0.01
    assert not torch.equal(x, I.PixelTransform(dequantize=True).train(v))  # fresh noise per batch
    assert torch.equal(I.PixelTransform(dequantize=False).train(v), v.float() / 255)  # exactly v/255
    # symmetric range: 2x − 1, and to_unit maps back (clamped)
    sym = I.PixelTransform(dequantize=False, pixel_range="symmetric").train(v)
    assert sym.min().item() == -1.0 and sym.max().item() == 1.0
    torch.testing.assert_close(I.to_unit(sym, "symmetric"), v.float() / 255, rtol=0, atol=1e-7)
    assert I.to_unit(torch.tensor([-3.0, 2.0]), "symmetric").tolist() == [0.0, 1.0]
    assert I.to_unit(torch.tensor([-0.5, 0.25, 1.5], dtype=torch.float64), "unit").tolist() == [0.0, 0.25, 1.0]
    # fixed evaluation noise: the same for the same seeds, whatever the batch it sits in
    t = I.PixelTransform(dequantize=True)
    a = t.fixed(v[:4], [11, 12, 13, 14])
    assert torch.equal(a, t.fixed(v[:4], [11, 12, 13, 14])) and torch.equal(a[2:], t.fixed(v[2:4], [13, 14]))
    assert not torch.equal(a[0], t.fixed(v[:1], [99])[0])
    assert torch.equal(torch.floor(a * 256).long(), v[:4].long())
    with pytest.raises(ValueError, match="pixel_range"):
        I.PixelTransform(pixel_range="centered")


def test_binarization_is_bernoulli_of_the_intensity():
    g = torch.Generator().manual_seed(1)
    v = torch.randint(0, 256, (400, 1, 28, 28), generator=g, dtype=torch.uint8)
    torch.manual_seed(2)
    b = I.PixelTransform(binarize=True).train(v)
    assert set(b.unique().tolist()) == {0.0, 1.0} and b.dtype == torch.float32
    assert abs(b.mean().item() - v.float().mean().item() / 255) < 0.005  # 313 600 Bernoulli draws
    assert b[v == 0].max().item() == 0.0 and b[v == 255].min().item() == 1.0
    assert not torch.equal(b, I.PixelTransform(binarize=True).train(v))  # re-sampled every batch
    fixed = I.PixelTransform(binarize=True).fixed(v[:5], range(5))
    assert torch.equal(fixed, I.PixelTransform(binarize=True).fixed(v[:5], range(5)))


def test_flip_mirrors_whole_training_images_only():
    v = torch.randint(0, 256, (200, 3, 4, 5), generator=torch.Generator().manual_seed(3), dtype=torch.uint8)
    torch.manual_seed(4)
    x = I.PixelTransform(dequantize=False, flip=True).train(v)
    plain, mirrored = v.float() / 255, v.flip(-1).float() / 255
    same = (x == plain).flatten(1).all(1)
    flipped = (x == mirrored).flatten(1).all(1)
    assert torch.all(same | flipped) and 60 < flipped.sum().item() < 140
    assert torch.equal(I.PixelTransform(dequantize=False, flip=True).fixed(v, range(200)), plain)  # eval: never


# ---------------------------------------------------------------------------------------------- splits
def test_split_indices_official_fractions_limit_and_determinism():
    official = {"train": torch.arange(600), "val": None, "test": torch.arange(600, 700)}
    idx = I.split_indices(official, "official", val_fraction=0.1, seed=5)
    assert [idx[k].numel() for k in ("train", "val", "test")] == [540, 60, 100]
    assert torch.equal(torch.cat([idx["train"], idx["val"]]).sort().values, torch.arange(600))
    assert torch.equal(idx["test"], torch.arange(600, 700))
    again = I.split_indices(official, "official", val_fraction=0.1, seed=5)
    assert all(torch.equal(idx[k], again[k]) for k in idx)
    assert not torch.equal(I.split_indices(official, "official", seed=6)["val"], idx["val"])

    pooled = I.split_indices(official, (0.7, 0.2, 0.1), seed=5)
    assert [pooled[k].numel() for k in ("train", "val", "test")] == [490, 140, 70]
    assert torch.equal(torch.cat(list(pooled.values())).sort().values, torch.arange(700))
    assert pooled["test"].min() < 600 and pooled["train"].max() >= 600  # pooled, not the official parts

    small = I.split_indices(official, "official", limit=70, seed=5)  # in proportion to each part
    assert [small[k].numel() for k in ("train", "val", "test")] == [54, 6, 10]
    assert set(small["val"].tolist()) <= set(idx["val"].tolist())
    with_val = {"train": torch.arange(8), "val": torch.arange(8, 10), "test": torch.arange(10, 12)}
    assert I.split_indices(with_val, "official")["val"].tolist() == [8, 9]  # the data set's own val
    with pytest.raises(ValueError, match="empty"):
        I.split_indices(official, (0.7, 0.2, 0.1), limit=2)
    with pytest.raises(ValueError, match="split"):
        I.parse_split([0.5, 0.6, 0.1])
    with pytest.raises(ValueError, match="split"):
        I.parse_split("paper")


# ---------------------------------------------------------------------------------------------- MNIST
def test_mnist_images_from_the_verified_files(mnist_root):
    files = locate_mnist(mnist_root, download=False)
    dm = MNISTImageDataModule(mnist_root, download=False, batch_size=32, eval_batch_size=100, dim=784,
                              shape=[1, 28, 28])
    assert isinstance(dm, ScoreDataModule) and dm.is_image and not (dm.has_ground_truth or dm.has_bits_per_dim)
    assert dm.data_shape == dm.image_shape == (1, 28, 28) and dm.dim == dm.data_dim == 784
    dm.setup()
    assert {k: v.numel() for k, v in dm.split_indices.items()} == {"train": 54000, "val": 6000, "test": 10000}
    assert torch.equal(dm.split_indices["test"], torch.arange(60000, 70000))
    assert not set(dm.split_indices["train"].tolist()) & set(dm.split_indices["val"].tolist())

    batch = next(iter(dm.train_dataloader()))
    assert batch.shape == (32, 1, 28, 28) and batch.dtype == torch.float32
    assert 0.0 <= batch.min().item() and batch.max().item() < 1.0
    # the test split is t10k in file order, each value in its byte's bin; fixed noise across modules
    t10k = read_idx(files["test_images"])[:300].unsqueeze(1)
    test = dm.split_tensor("test", 300)
    assert test.shape == (300, 1, 28, 28) and test.dtype == torch.float32
    assert torch.equal(torch.floor(test * 256).long(), t10k.long())
    assert torch.equal(torch.cat(list(dm.test_dataloader()))[:300], test)  # loaders = split_tensor
    other = MNISTImageDataModule(mnist_root, download=False, eval_batch_size=7)
    other.setup()
    assert torch.equal(other.split_tensor("test", 300), test) and torch.equal(
        other.split_tensor("val", 50), dm.split_tensor("val", 50))
    pix = dm.to_pixels(test.double().flatten(1))
    assert pix.shape == (300, 1, 28, 28) and pix.dtype == torch.float64 and torch.equal(pix, test.double())
    with pytest.raises(DataContractError):
        dm.bits_per_dim(torch.zeros(3), test[:3])

    paper = MNISTImageDataModule(mnist_root, download=False, split=[0.7, 0.2, 0.1], binarize=True,
                                 pixel_range="symmetric", batch_size=256)
    paper.setup()
    assert {k: v.numel() for k, v in paper.split_indices.items()} == {"train": 49000, "val": 14000, "test": 7000}
    assert torch.equal(torch.cat(list(paper.split_indices.values())).sort().values, torch.arange(70000))
    torch.manual_seed(0)
    b = next(iter(paper.train_dataloader()))
    assert set(b.unique().tolist()) == {-1.0, 1.0}
    val = paper.split_tensor("val", 200)
    assert set(val.unique().tolist()) == {-1.0, 1.0} and torch.equal(val, paper.split_tensor("val", 200))
    # the binarised pixels' mean is the intensities' mean (over 156 800 Bernoulli draws)
    vbytes = torch.cat([read_idx(files["train_images"]),
                        read_idx(files["test_images"])])
    intensity = vbytes[paper.split_indices["val"][:200]].float().mean().item() / 255
    assert abs(paper.to_pixels(val).mean().item() - intensity) < 0.01


# ---------------------------------------------------------------------------------------------- CIFAR-10
def write_cifar(folder: Path, n_per_batch: int = 6, seed: int = 0) -> dict[str, np.ndarray]:
    """The six python-version batches (protocol-2 pickles of dicts with b'data' uint8 [N, 3072] R,G,B planes
    and b'labels'); returns the images as [N, 32, 32, 3] arrays (HWC, as one would draw them)."""
    rng = np.random.default_rng(seed)
    folder.mkdir(parents=True, exist_ok=True)
    hwc = {}
    for name in (*C10.TRAIN_BATCHES, C10.TEST_BATCH):
        imgs = rng.integers(0, 256, size=(n_per_batch, 32, 32, 3), dtype=np.uint8)
        data = np.stack([np.concatenate([img[:, :, c].reshape(-1) for c in range(3)]) for img in imgs])
        labels = rng.integers(0, 10, size=n_per_batch).tolist()
        with open(folder / name, "wb") as f:
            pickle.dump({b"batch_label": name.encode(), b"labels": labels, b"data": data}, f, protocol=2)
        hwc[name] = imgs
    return hwc


def make_archive(batches: Path, archive: Path) -> bytes:
    archive.parent.mkdir(parents=True, exist_ok=True)
    with tarfile.open(archive, "w:gz") as tar:
        tar.add(batches, arcname=C10.BATCH_DIR)
    return archive.read_bytes()


def test_cifar10_round_trip_from_the_archive(tmp_path):
    hwc = write_cifar(tmp_path / "src" / C10.BATCH_DIR)
    make_archive(tmp_path / "src" / C10.BATCH_DIR, tmp_path / "root" / "cifar10" / C10.ARCHIVE.filename)
    dm = C10.CIFAR10DataModule(tmp_path / "root", download=False, dequantize=False, flip=False, val_fraction=0.2,
                               batch_size=8, dim=3072, shape=[3, 32, 32])
    assert dm.data_shape == (3, 32, 32) and not dm.transform.flip
    dm.prepare_data()  # extracts next to the archive
    assert sorted(p.name for p in (tmp_path / "root" / "cifar10" / C10.BATCH_DIR).iterdir()) == sorted(hwc)
    assert sorted(p.name for p in (tmp_path / "root" / "cifar10").iterdir()) == [C10.BATCH_DIR, C10.ARCHIVE.filename]
    dm.setup()
    assert {k: v.numel() for k, v in dm.split_indices.items()} == {"train": 24, "val": 6, "test": 6}
    expected = torch.from_numpy(np.concatenate([hwc[n] for n in (*C10.TRAIN_BATCHES, C10.TEST_BATCH)]))
    expected = expected.permute(0, 3, 1, 2).float() / 255  # [N, 3, 32, 32]
    for split in ("train", "val", "test"):
        x = dm.split_tensor(split)
        assert x.dtype == torch.float32 and x.shape == (dm.split_indices[split].numel(), 3, 32, 32)
        assert torch.equal(x, expected[dm.split_indices[split]])
    assert torch.equal(dm.split_tensor("test"), expected[30:])  # test_batch, in order
    batch = next(iter(dm.train_dataloader()))
    assert batch.shape == (8, 3, 32, 32) and batch.dtype == torch.float32

    # the extracted folder is found directly at root/cifar-10-batches-py too; symmetric range, flips
    write_cifar(tmp_path / "flat" / C10.BATCH_DIR)
    sym = C10.CIFAR10DataModule(tmp_path / "flat", download=False, dequantize=False, pixel_range="symmetric",
                                batch_size=24)
    assert sym.transform.flip  # CIFAR-10's default
    sym.setup()
    x = sym.split_tensor("train")
    assert x.min().item() == -1.0 and x.max().item() == 1.0
    torch.testing.assert_close(sym.to_pixels(x), expected[sym.split_indices["train"]], rtol=0, atol=1e-7)
    torch.manual_seed(1)
    batches = [b for _ in range(4) for b in sym.train_dataloader()]
    rows = {tuple(r.flatten()[:64].tolist()) for b in batches for r in b}
    flipped = {tuple(r.flip(-1).flatten()[:64].tolist()) for r in x}
    assert rows & flipped and rows - flipped  # both orientations appear across epochs


def test_cifar10_missing_files_and_failed_downloads_leave_nothing(tmp_path, monkeypatch):
    with pytest.raises(FileNotFoundError) as info:
        C10.CIFAR10DataModule(tmp_path, download=False).prepare_data()
    msg = str(info.value)
    assert "cifar-10-python.tar.gz" in msg and C10.ARCHIVE.url in msg and "download=False" in msg
    for place in (tmp_path / C10.BATCH_DIR, tmp_path / "cifar10" / C10.BATCH_DIR,
                  tmp_path / "cifar10" / "cifar-10-python.tar.gz", tmp_path / "cifar-10-python.tar.gz"):
        assert str(place) in msg

    asked = []

    def wrong_bytes(url, timeout=None):
        asked.append(url)
        return io.BytesIO(b"<html>503 Service Unavailable</html>")

    monkeypatch.setattr(dl, "_urlopen", wrong_bytes)
    with pytest.raises(FileNotFoundError, match="md5 mismatch .* expected c58f30108f718f92721af3b95e74349a"):
        C10.CIFAR10DataModule(tmp_path, download=True).prepare_data()
    assert asked == [C10.ARCHIVE.url]
    assert [p for p in tmp_path.rglob("*") if p.is_file()] == []  # no archive, no temporary file


def test_cifar10_download_then_extract(tmp_path, monkeypatch):
    hwc = write_cifar(tmp_path / "server" / C10.BATCH_DIR, n_per_batch=2)
    blob = make_archive(tmp_path / "server" / C10.BATCH_DIR, tmp_path / "server" / "a.tar.gz")
    monkeypatch.setattr(C10, "ARCHIVE", dataclasses.replace(C10.ARCHIVE, md5=hashlib.md5(blob).hexdigest()))
    asked = []

    def serve(url, timeout=None):
        asked.append(url)
        if url != C10.ARCHIVE.url:
            raise urllib.error.URLError("unknown host")
        return io.BytesIO(blob)

    monkeypatch.setattr(dl, "_urlopen", serve)
    root = tmp_path / "data"
    dm = C10.CIFAR10DataModule(root, download=True, dequantize=False, split=[0.5, 0.25, 0.25])
    dm.prepare_data()
    dm.setup()
    assert asked == [C10.ARCHIVE.url] and (root / "cifar10" / C10.ARCHIVE.filename).read_bytes() == blob
    assert {k: v.numel() for k, v in dm.split_indices.items()} == {"train": 6, "val": 3, "test": 3}
    expected = np.concatenate([hwc[n] for n in (*C10.TRAIN_BATCHES, C10.TEST_BATCH)])
    expected = torch.from_numpy(expected).permute(0, 3, 1, 2).float() / 255
    for split in ("train", "val", "test"):  # the pooled 70/20/10-style split reads the same pixels
        assert torch.equal(dm.split_tensor(split), expected[dm.split_indices[split]])


def test_cifar10_rejects_unsafe_archives_and_foreign_pickles(tmp_path):
    evil = tmp_path / "root" / "cifar-10-python.tar.gz"
    evil.parent.mkdir(parents=True)
    with tarfile.open(evil, "w:gz") as tar:
        info = tarfile.TarInfo("../escaped.txt")
        info.size = 2
        tar.addfile(info, io.BytesIO(b"hi"))
    with pytest.raises(C10.CIFARFormatError, match=r"refusing to extract member '\.\./escaped\.txt'"):
        C10.load_cifar10(tmp_path / "root", download=False)
    assert not (tmp_path / "escaped.txt").exists() and not (tmp_path / "root" / C10.BATCH_DIR).exists()

    class Boom:
        def __reduce__(self):
            return (print, ("code ran",))

    with pytest.raises(C10.CIFARFormatError, match=r"batch\.bin: not a CIFAR-10 python batch .*builtins\.print"):
        C10.parse_batch(pickle.dumps({b"data": Boom()}), "batch.bin")
    bad = pickle.dumps({b"data": np.zeros((2, 100), np.uint8), b"labels": [0, 1]}, protocol=2)
    with pytest.raises(C10.CIFARFormatError, match=r"x: expected uint8 data \[N, 3072\]"):
        C10.parse_batch(bad, "x")


# ---------------------------------------------------------------------------------------------- CelebA
def write_celeba(root: Path, parts: list[int], size=(178, 218)) -> dict[str, np.ndarray]:
    """Smooth RGB JPEGs (quality 100, no chroma subsampling) and list_eval_partition.txt; returns the pixels."""
    folder = root / "celeba" / CA.IMAGE_DIR
    folder.mkdir(parents=True)
    w, h = size
    yy, xx = np.mgrid[0:h, 0:w].astype(np.float64)
    written, lines = {}, []
    for i, part in enumerate(parts):
        name = f"{i + 1:06d}.jpg"
        rgb = np.stack([127 + 120 * np.sin(xx / (9 + i) + c) * np.cos(yy / (13 + c)) for c in range(3)], axis=-1)
        rgb = rgb.round().astype(np.uint8)
        Image.fromarray(rgb).save(folder / name, quality=100, subsampling=0)
        written[name] = rgb
        lines.append(f"{name} {part}")
    (root / "celeba" / "list_eval_partition.txt").write_text("\n".join(lines) + "\n")
    return written


def test_celeba_round_trip_crop_resize_and_splits(tmp_path):
    written = write_celeba(tmp_path, [0, 0, 0, 0, 0, 1, 1, 2, 0, 2])
    dm = CA.CelebADataModule(tmp_path, image_size=32, dequantize=False, flip=False, dim=3072, shape=[3, 32, 32])
    assert dm.data_shape == (3, 32, 32) and dm.dim == 3072
    dm.setup()
    assert {k: v.tolist() for k, v in dm.split_indices.items()} == {
        "train": [0, 1, 2, 3, 4, 8], "val": [5, 6], "test": [7, 9]}
    x = dm.split_tensor("train")
    assert x.shape == (6, 3, 32, 32) and x.dtype == torch.float32
    for row, i in zip(x, dm.split_indices["train"].tolist()):
        path = tmp_path / "celeba" / CA.IMAGE_DIR / f"{i + 1:06d}.jpg"
        with Image.open(path) as img:  # Pillow's own decode + crop (19, 39) + bilinear resize
            ref = np.asarray(img.convert("RGB").crop((19, 39, 159, 179)).resize((32, 32), Image.Resampling.BILINEAR))
        assert torch.equal((row * 255).round().to(torch.uint8), torch.from_numpy(ref.transpose(2, 0, 1).copy()))
    # at the crop's size (no resize) the pixels are the written ones, to JPEG quality 100
    full = CA.CelebADataModule(tmp_path, image_size=140, dequantize=False, split=[0.6, 0.2, 0.2], seed=3)
    full.setup()
    assert [full.split_indices[k].numel() for k in ("train", "val", "test")] == [6, 2, 2]
    assert torch.equal(torch.cat(list(full.split_indices.values())).sort().values, torch.arange(10))
    got = full.split_tensor("test")
    for row, i in zip(got, full.split_indices["test"].tolist()):
        crop = written[f"{i + 1:06d}.jpg"][39:179, 19:159].transpose(2, 0, 1) / 255
        err = (row.double() - torch.from_numpy(crop)).abs()
        assert err.mean().item() < 1.5 / 255 and err.max().item() < 12 / 255
    # 64×64, dequantised and symmetric: every value within its byte's bin of the clean image
    clean = CA.CelebADataModule(tmp_path, image_size=64, dequantize=False)
    noisy = CA.CelebADataModule(tmp_path, image_size=64, pixel_range="symmetric")
    clean.setup()
    noisy.setup()
    v = (clean.split_tensor("val") * 255).round().long()
    n = noisy.to_pixels(noisy.split_tensor("val"))
    assert n.shape == (2, 3, 64, 64) and noisy.to_pixels(noisy.split_tensor("val")).dtype == torch.float32
    offset = n.double() * 256 - v  # in [0, 1) up to the float32 round-off of 2x − 1 and back
    assert offset.min().item() > -1e-3 and offset.max().item() < 1 + 1e-3 and offset.std().item() > 0.2
    limited = CA.CelebADataModule(tmp_path, image_size=32, limit=5)
    limited.setup()
    assert [limited.split_indices[k].numel() for k in ("train", "val", "test")] == [3, 1, 1]  # 5 of 6/2/2


def test_celeba_reads_lazily_and_names_missing_files(tmp_path):
    with pytest.raises(FileNotFoundError) as info:
        CA.CelebADataModule(tmp_path).prepare_data()
    msg = str(info.value)
    assert "list_eval_partition.txt" in msg and "img_align_celeba" in msg and CA.PAGE in msg
    assert str(tmp_path / "celeba" / "list_eval_partition.txt") in msg
    assert str(tmp_path / "celeba" / "img_align_celeba") in msg

    write_celeba(tmp_path, [0, 0, 1, 2])
    (tmp_path / "celeba" / CA.IMAGE_DIR / "000002.jpg").unlink()
    dm = CA.CelebADataModule(tmp_path, image_size=32, flip=False, batch_size=1)
    dm.setup()  # no image is read here
    assert dm.split_tensor("val").shape == (1, 3, 32, 32)
    with pytest.raises(FileNotFoundError, match=r"000002\.jpg \(listed in list_eval_partition\.txt\) is missing"):
        dm.split_tensor("train")
    (tmp_path / "celeba" / "list_eval_partition.txt").write_text("000001.jpg 7\n")
    with pytest.raises(ValueError, match=r"line 1: expected '<file name> <0\|1\|2>'"):
        CA.CelebADataModule(tmp_path, image_size=32).setup()
    with pytest.raises(ValueError, match="image_size"):
        CA.CelebADataModule(tmp_path, image_size=256)


# ---------------------------------------------------------------------------------------------- configs
@pytest.mark.parametrize(
    "name, overrides, shape",
    [("mnist_images", [], (1, 28, 28)), ("cifar10", [], (3, 32, 32)),
     ("celeba", ["data.image_size=32", "data.dim=3072"], (3, 32, 32))],
)
def test_configs_compose_and_declare_the_shape(tmp_path, name, overrides, shape):
    cfg = compose_train([f"data={name}", f"data.root={tmp_path}", *overrides])
    assert tuple(cfg.data.shape) == shape and cfg.data.dim == int(np.prod(shape))
    dm = instantiate(cfg.data)
    assert isinstance(dm, I.ImageDataModule) and dm.data_shape == shape and dm.dim == cfg.data.dim
    with pytest.raises(InstantiationException, match=rf"data\.dim=5 does not match .* set data\.dim={int(np.prod(shape))}"):
        instantiate(cfg.data, dim=5)
