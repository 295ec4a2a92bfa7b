"""MNIST without torchvision: IDX reader, file search and download through src.data.download (network
monkeypatched), transforms, splits, and the data contract of the logit-space module."""

from __future__ import annotations

import gzip
import hashlib
import io
import math
import pickle
import urllib.error
from pathlib import Path

import pytest
import torch

from src.data import download as dl
from src.data import idx_format as IDX
from src.data import logit_transforms as LT
from src.data import mnist as M
from src.data.contract import DataContractError, ScoreDataModule


def fake_mnist(folder: Path, n_train: int = 60, n_test: int = 40, seed: int = 0) -> dict[str, torch.Tensor]:
    """Write four small IDX gz files with random pixels and labels; return the arrays."""
    folder.mkdir(parents=True, exist_ok=True)
    g = torch.Generator().manual_seed(seed)
    arrays = {
        "train_images": torch.randint(0, 256, (n_train, 28, 28), generator=g, dtype=torch.uint8),
        "train_labels": torch.randint(0, 10, (n_train,), generator=g, dtype=torch.uint8),
        "test_images": torch.randint(0, 256, (n_test, 28, 28), generator=g, dtype=torch.uint8),
        "test_labels": torch.randint(0, 10, (n_test,), generator=g, dtype=torch.uint8),
    }
    for key, name in M.FILES.items():
        IDX.write_idx(folder / f"{name}.gz", arrays[key])
    return arrays


# ------------------------------------------------------------------------------------------ IDX files
def test_read_idx_on_the_real_files(mnist_root):
    files = M.locate_mnist(mnist_root, download=False)
    train = IDX.read_idx(files["train_images"])
    assert train.shape == (60000, 28, 28) and train.dtype == torch.uint8
    labels = IDX.read_idx(files["test_labels"])
    assert labels.shape == (10000,)
    # published class counts of the MNIST test set, and the first test digits 7, 2, 1, 0, 4
    assert torch.bincount(labels.long()).tolist() == [980, 1135, 1032, 1010, 982, 892, 958, 1028, 974, 1009]
    assert labels[:5].tolist() == [7, 2, 1, 0, 4]
    assert IDX.read_idx(files["train_labels"])[:3].tolist() == [5, 0, 4]
    assert train.max().item() == 255 and 0.80 < (train[:1000] == 0).float().mean().item() < 0.82


@pytest.mark.parametrize("dtype", [torch.uint8, torch.int8, torch.int16, torch.int32, torch.float32, torch.float64])
def test_idx_round_trip_every_type(tmp_path, dtype):
    a = (torch.arange(24).reshape(2, 3, 4) - 5).to(dtype)
    for name in ("a.idx", "a.idx.gz"):
        back = IDX.read_idx(IDX.write_idx(tmp_path / name, a))
        assert back.dtype == dtype and torch.equal(back, a)


def test_corrupt_files_are_named_in_the_error(tmp_path):
    good = IDX.write_idx(tmp_path / "x.gz", torch.zeros(10, 28, 28, dtype=torch.uint8))
    truncated_gz = tmp_path / "truncated-idx3-ubyte.gz"
    truncated_gz.write_bytes(good.read_bytes()[:-20])
    with pytest.raises(IDX.IDXFormatError, match=r"truncated-idx3-ubyte\.gz: corrupt or truncated gzip"):
        IDX.read_idx(truncated_gz)

    short = tmp_path / "short-idx3-ubyte.gz"  # valid gzip, payload shorter than the header says
    short.write_bytes(gzip.compress(gzip.decompress(good.read_bytes())[:-100]))
    with pytest.raises(IDX.IDXFormatError, match=r"short-idx3-ubyte\.gz: truncated or corrupt IDX file.*\(10, 28, 28\)"):
        IDX.read_idx(short)

    bad_magic = tmp_path / "html-error-page.gz"
    bad_magic.write_bytes(gzip.compress(b"<html>403 Forbidden</html>"))
    with pytest.raises(IDX.IDXFormatError, match=r"html-error-page\.gz: not an IDX file \(magic number 3c68746d"):
        IDX.read_idx(bad_magic)


def test_files_are_found_in_every_layout(tmp_path):
    for name, sub in (("a", "mnist"), ("b", "MNIST/raw"), ("c", "")):
        fake_mnist(tmp_path / name / sub, n_train=3, n_test=2)
        arrays = M.load_mnist(tmp_path / name, download=False)
        assert arrays["train_images"].shape == (3, 28, 28) and arrays["test_labels"].shape == (2,)
    # uncompressed files (torchvision's extracted layout) are read too
    raw = tmp_path / "raw_root" / "MNIST" / "raw"
    raw.mkdir(parents=True)
    for key, name in M.FILES.items():
        IDX.write_idx(raw / name, torch.zeros((4, 28, 28) if "images" in key else (4,), dtype=torch.uint8))
    assert M.load_mnist(tmp_path / "raw_root", download=False)["train_images"].shape == (4, 28, 28)


def test_missing_files_error_says_where_and_how(tmp_path):
    with pytest.raises(FileNotFoundError) as info:
        M.load_mnist(tmp_path, download=False)
    msg = str(info.value)
    assert "'train-images-idx3-ubyte.gz' not found" in msg
    for searched in (tmp_path / "mnist", tmp_path / "MNIST" / "raw", tmp_path):
        assert str(searched / "train-images-idx3-ubyte.gz") in msg and str(searched / "train-images-idx3-ubyte") in msg
    assert "download=False" in msg and "data.root" in msg
    assert all(f"{m}train-images-idx3-ubyte.gz" in msg for m in M.MIRRORS)


# ------------------------------------------------------------------------------------------ download
class FakeWeb:
    """Stands in for urllib.request.urlopen: serves bytes per URL, or raises; records the URLs asked for."""

    def __init__(self, pages: dict[str, bytes | Exception]):
        self.pages = pages
        self.asked: list[str] = []

    def __call__(self, url, timeout=None):
        self.asked.append(url)
        page = self.pages.get(url, urllib.error.HTTPError(url, 404, "Not Found", {}, None))
        if isinstance(page, Exception):
            raise page
        return io.BytesIO(page)


def test_download_checks_md5_and_falls_back_to_the_second_mirror(tmp_path, monkeypatch):
    src = tmp_path / "server"
    arrays = fake_mnist(src, n_train=5, n_test=3)
    blobs = {name: (src / f"{name}.gz").read_bytes() for name in M.FILES.values()}
    monkeypatch.setattr(M, "MD5", {name: hashlib.md5(b).hexdigest() for name, b in blobs.items()})
    first, second = M.MIRRORS
    pages: dict[str, bytes | Exception] = {f"{first}{n}.gz": urllib.error.URLError("no route to host") for n in blobs}
    pages.update({f"{second}{n}.gz": b for n, b in blobs.items()})
    web = FakeWeb(pages)
    monkeypatch.setattr(dl, "_urlopen", web)

    root = tmp_path / "data"
    loaded = M.load_mnist(root, download=True)
    assert torch.equal(loaded["train_images"], arrays["train_images"])
    assert sorted(p.name for p in (root / "mnist").iterdir()) == sorted(f"{n}.gz" for n in blobs)  # no .part left
    assert web.asked[:2] == [f"{first}train-images-idx3-ubyte.gz", f"{second}train-images-idx3-ubyte.gz"]
    web.asked.clear()
    M.load_mnist(root, download=True)  # present now: no network
    assert web.asked == []


def test_download_with_wrong_md5_fails_clearly_and_leaves_nothing(tmp_path, monkeypatch):
    web = FakeWeb({f"{m}{n}.gz": b"corrupted bytes" for m in M.MIRRORS for n in M.FILES.values()})
    monkeypatch.setattr(dl, "_urlopen", web)
    with pytest.raises(FileNotFoundError) as info:
        M.load_mnist(tmp_path, download=True)
    msg = str(info.value)
    bad = hashlib.md5(b"corrupted bytes").hexdigest()
    for m in M.MIRRORS:  # both mirrors tried, each failure named
        url = f"{m}train-images-idx3-ubyte.gz"
        assert f"md5 mismatch for {url}: expected f68b3c2dcbeaaa9fbdd348bbdeb94873, got {bad}" in msg
    assert web.asked == [f"{m}train-images-idx3-ubyte.gz" for m in M.MIRRORS]
    assert "data.root" in msg
    assert list((tmp_path / "mnist").iterdir()) == []


# ------------------------------------------------------------------------------------------ transforms
@pytest.mark.parametrize("squash", ["affine", "clamp"])
def test_logit_round_trip(squash):
    g = torch.Generator().manual_seed(0)
    x64 = torch.rand(1000, 784, generator=g, dtype=torch.float64)
    if squash == "clamp":  # invertible only inside [λ, 1 − λ]
        x64 = 1e-3 + (1 - 2e-3) * x64
    assert (LT.from_logit(LT.to_logit(x64, squash=squash), squash=squash) - x64).abs().max().item() < 1e-12
    x32 = x64.float()
    assert (LT.from_logit(LT.to_logit(x32, squash=squash), squash=squash) - x32).abs().max().item() < 1e-6
    y = LT.to_logit(torch.tensor([0.0, 1.0], dtype=torch.float64), eps=1e-3, squash=squash)
    assert torch.allclose(y, torch.tensor([-math.log(999.0), math.log(999.0)], dtype=torch.float64))


@pytest.mark.parametrize("squash", ["affine", "clamp"])
def test_log_det_jacobian_matches_autograd(squash):
    g = torch.Generator().manual_seed(1)
    x = 0.002 + 0.996 * torch.rand(3, 1, 4, 4, generator=g, dtype=torch.float64)  # inside the clamp range
    ldj = LT.logit_log_det_jacobian(x, squash=squash)
    assert ldj.shape == (3,)
    for i in range(3):
        jac = torch.autograd.functional.jacobian(lambda v: LT.to_logit(v, squash=squash).flatten(), x[i].flatten())
        assert abs(torch.linalg.slogdet(jac)[1].item() - ldj[i].item()) < 1e-10
    y = LT.to_logit(x, squash=squash)
    assert (LT.logit_log_det_jacobian_from_logit(y, squash=squash) - ldj).abs().max().item() < 1e-9


def test_bits_per_dim_of_a_uniform_pixel_model_is_8():
    # a model uniform over [0, 1)^D in pixel space has p_Y(y) = |dx/dy|: bits/dim must be exactly 8
    g = torch.Generator().manual_seed(2)
    v = torch.randint(0, 256, (5, 784), generator=g)
    x = LT.dequantize(v, generator=g).double()
    y = LT.to_logit(x)
    log_p_y = -LT.logit_log_det_jacobian(x)
    assert (LT.bits_per_dim(log_p_y, y) - 8.0).abs().max().item() < 1e-9


def test_dequantization_stays_in_the_pixels_bin():
    v = torch.arange(256, dtype=torch.uint8).repeat(40)
    x = LT.dequantize(v, generator=torch.Generator().manual_seed(3))
    assert torch.equal(torch.floor(x * 256).long(), v.long())
    assert abs((x * 256 - v).mean().item() - 0.5) < 0.02  # U(0, 1) offsets: mean ½
    assert torch.equal(LT.dequantize(v, noise=False) * 256, v.float() + 0.5)


# ------------------------------------------------------------------------------------------ datamodule
def assert_in_bins(y: torch.Tensor, v: torch.Tensor) -> None:
    """Logit-space values y lie in their bytes' bins [v, v + 1)/256 (to float32 round-off)."""
    offset = LT.from_logit(y.double()) * 256 - v.double()
    assert offset.min().item() > -1e-3 and offset.max().item() < 1 + 1e-3
    assert offset.std().item() > 0.2  # spread over the bin (U(0, 1) has std 0.29), not at its centre


def test_paper_split_sizes_and_determinism(mnist_root):
    dm = M.MNISTDataModule(mnist_root, download=False)
    dm.setup("fit")
    assert {k: len(v) for k, v in dm.split_indices.items()} == {"train": 49000, "val": 14000, "test": 7000}
    everything = torch.cat(list(dm.split_indices.values()))
    assert torch.equal(everything.sort().values, torch.arange(70000))  # disjoint, covers train + t10k
    assert dm.train_bytes.shape == (49000, 784) and dm.test_labels.shape == (7000,)
    first = dm.split_indices["test"][:5].clone()
    dm.setup("test")  # idempotent
    assert torch.equal(dm.split_indices["test"][:5], first)
    again = M.MNISTDataModule(mnist_root, download=False, limit=700, seed=2019)
    again.setup()
    assert {k: len(v) for k, v in again.split_indices.items()} == {"train": 490, "val": 140, "test": 70}
    assert torch.equal(again.split_indices["train"], dm.split_indices["train"][:490])
    other = M.MNISTDataModule(mnist_root, download=False, limit=700, seed=1)
    other.setup()
    assert not torch.equal(other.split_indices["train"], again.split_indices["train"])


def test_datamodule_batches(tmp_path):
    arrays = fake_mnist(tmp_path / "mnist", n_train=60, n_test=40)
    dm = M.MNISTDataModule(tmp_path, batch_size=16, eval_batch_size=32, download=False)
    assert dm.dim == 784 and dm.image_shape == (1, 28, 28)
    dm.setup()
    assert [len(dm.split_indices[k]) for k in ("train", "val", "test")] == [70, 20, 10]
    pool = torch.cat([arrays["train_images"], arrays["test_images"]]).flatten(1)
    assert torch.equal(dm.train_bytes, pool[dm.split_indices["train"]])

    batch = next(iter(dm.train_dataloader()))
    assert batch.shape == (16, 784) and batch.dtype == torch.float32
    # every value is its pixel's bin after undoing the logit; fresh noise on each collation
    collate = pickle.loads(pickle.dumps(dm.train_dataloader().collate_fn))
    rows = [dm.train_bytes[i] for i in range(8)]
    b1, b2 = collate(rows), collate(rows)
    for b in (b1, b2):
        assert_in_bins(b, dm.train_bytes[:8])
    assert (b1 - b2).abs().mean().item() > 1e-3  # fresh noise, not a fixed one

    # evaluation sets: fixed noise, deterministic across calls and data modules
    val = torch.cat(list(dm.val_dataloader()))
    assert val.shape == (20, 784) and torch.equal(val, dm.val_data)
    dm2 = M.MNISTDataModule(tmp_path, download=False)
    dm2.setup()
    assert torch.equal(dm2.test_data, dm.test_data)
    assert_in_bins(dm.test_data, dm.test_bytes)

    pix = dm.to_pixels(dm.test_data[:4])
    assert pix.shape == (4, 1, 28, 28) and pix.min() >= 0 and pix.max() <= 1
    assert (pix.flatten(1) * 256 - dm.test_bytes[:4].float()).abs().max().item() <= 1.0 + 1e-4


def test_reference_split_and_no_dequantization(tmp_path):
    fake_mnist(tmp_path / "mnist", n_train=60, n_test=40)
    dm = M.MNISTDataModule(tmp_path, split="reference", dequantize=False, squash="clamp", download=False)
    dm.setup()
    assert [len(dm.split_indices[k]) for k in ("train", "val", "test")] == [54, 6, 40]
    assert torch.equal(dm.split_indices["test"], torch.arange(60, 100))
    expected = LT.to_logit((dm.test_bytes.float() + 0.5) / 256, squash="clamp")
    assert torch.equal(dm.test_data, expected)
    with pytest.raises(ValueError, match="split"):
        M.MNISTDataModule(tmp_path, split=(0.5, 0.6, 0.1))


def test_logit_module_follows_the_data_contract(tmp_path):
    fake_mnist(tmp_path / "mnist", n_train=60, n_test=40)
    dm = M.MNISTDataModule(tmp_path, download=False, limit=50)
    assert isinstance(dm, ScoreDataModule)
    assert dm.data_shape == (784,) and dm.data_dim == 784 and dm.image_shape == (1, 28, 28)
    assert dm.is_image and dm.has_bits_per_dim and not dm.has_ground_truth
    with pytest.raises(RuntimeError, match="setup"):
        dm.split_tensor("val")
    dm.setup()
    val = dm.split_tensor("val", 4)
    assert val.shape == (4, 784) and val.dtype == torch.float32 and torch.equal(val, dm.val_data[:4])
    assert torch.equal(dm.split_tensor("test"), dm.test_data) and dm.split_tensor("train").shape == (35, 784)
    other = M.MNISTDataModule(tmp_path, download=False, limit=50)
    other.setup()
    assert torch.equal(other.split_tensor("train", 10), dm.split_tensor("train", 10))
    with pytest.raises(ValueError, match="split='dev'"):
        dm.split_tensor("dev")
    # to_pixels and bits_per_dim follow float64 inputs; the pixels are the bytes' bins
    y64 = val.double()
    pix = dm.to_pixels(y64)
    assert pix.dtype == torch.float64 and pix.shape == (4, 1, 28, 28)
    assert torch.equal(torch.floor(pix.flatten(1) * 256).clamp(max=255).long(), dm.val_bytes[:4].long())
    log_p = -LT.logit_log_det_jacobian(LT.from_logit(y64))  # uniform pixel model: 8 bits/dim
    bpd = dm.bits_per_dim(log_p, y64)
    assert bpd.dtype == torch.float64 and (bpd - 8.0).abs().max().item() < 1e-6
    with pytest.raises(DataContractError):
        dm.true_score(y64)
