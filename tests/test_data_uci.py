"""UCI data: parsers, preprocessing (dequantise, shuffle, split, whiten, noise), file location/download,
and the UCIDataModule. The network is never used: the URL opener is monkeypatched."""

from __future__ import annotations

import hashlib
import io
import urllib.error
from pathlib import Path

import numpy as np
import pytest
import torch

from src.data import download as dl
from src.data.contract import DataContractError, ScoreDataModule
from src.data.datamodules import UCIDataModule
from src.data.preprocessing import (
    dequantize,
    fit_whitening,
    median_gaps,
    preprocess,
    shuffle_rows,
    split_sizes,
)
from src.data.uci import DATASETS, drop_correlated_columns, parse_parkinsons, parse_wine

RED = ("wine-quality", "winequality-red.csv")
PARKINSONS_COLUMNS = [
    "test_time",
    "motor_UPDRS",
    "total_UPDRS",
    "Jitter(Abs)",
    "Jitter:PPQ5",
    "Jitter:DDP",
    "Shimmer(dB)",
    "Shimmer:APQ5",
    "Shimmer:APQ11",
    "Shimmer:DDA",
    "NHR",
    "HNR",
    "RPDE",
    "DFA",
    "PPE",
]
WINE_HEADER = [
    "fixed acidity",
    "volatile acidity",
    "citric acid",
    "residual sugar",
    "chlorides",
    "free sulfur dioxide",
    "total sulfur dioxide",
    "density",
    "pH",
    "sulphates",
    "alcohol",
    "quality",
]


@pytest.fixture
def shared(uci_root) -> Path:
    return uci_root


def write_wine(
    path: Path, n: int = 300, delimiter: str = ";", quoted: bool = True, index: bool = False, seed: int = 0
) -> np.ndarray:
    """A small wine-quality-like file (quantised values); returns its 11 feature columns."""
    rng = np.random.default_rng(seed)
    x = np.round(rng.normal(size=(n, 11)) @ rng.normal(size=(11, 11)) + 10, 1)
    quality = rng.integers(3, 9, size=(n, 1))
    names = [f'"{h}"' if quoted else h for h in WINE_HEADER]
    lines = [delimiter.join(([""] if index else []) + names)]
    for i, row in enumerate(np.hstack([x, quality])):
        lines.append(delimiter.join(([str(i)] if index else []) + [f"{v:g}" for v in row]))
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("\n".join(lines) + "\n")
    return x


class FakeResponse(io.BytesIO):
    """What urlopen returns, enough for shutil.copyfileobj; optionally fails after the first read."""

    def __init__(self, payload: bytes, fail_after_first_read: bool = False, watch: Path | None = None):
        super().__init__(payload)
        self.fail = fail_after_first_read
        self.reads = 0
        self.watch = watch
        self.dest_existed_during_read = False

    def read(self, *args):
        self.reads += 1
        if self.watch is not None and self.watch.exists():
            self.dest_existed_during_read = True
        if self.fail and self.reads > 1:
            raise ConnectionResetError("connection reset mid-transfer")
        return super().read(16)


# ---------------------------------------------------------------------------------------------- parsers
def test_shared_files_give_the_paper_dimensions(shared):
    red, red_names = parse_wine(shared / "wine-quality" / "winequality-red.csv")
    white, _ = parse_wine(shared / "wine-quality" / "winequality-white.csv")
    park, park_names = parse_parkinsons(shared / "parkinsons-telemonitoring" / "parkinsons_updrs.data")
    assert red.shape == (1599, 11) and white.shape == (4898, 11) and park.shape == (5875, 15)
    assert red_names == WINE_HEADER[:-1]
    assert park_names == PARKINSONS_COLUMNS
    np.testing.assert_allclose(red[0], [7.4, 0.7, 0, 1.9, 0.076, 11, 34, 0.9978, 3.51, 0.56, 9.4])
    assert park[0, 3] == pytest.approx(3.38e-5)  # "3.38e-005" in the file


@pytest.mark.parametrize(
    "delimiter, quoted, index", [(";", True, False), (",", False, False), (",", False, True)]
)
def test_wine_parser_accepts_original_and_resaved_files(tmp_path, delimiter, quoted, index):
    x = write_wine(tmp_path / "w.csv", n=50, delimiter=delimiter, quoted=quoted, index=index)
    values, names = parse_wine(tmp_path / "w.csv")
    assert values.shape == (50, 11) and names == WINE_HEADER[:-1]
    np.testing.assert_allclose(values, x)


def test_wine_parser_rejects_non_wine_files(tmp_path):
    (tmp_path / "a.csv").write_text("a;b\n1;2\n")
    with pytest.raises(ValueError, match="quality"):
        parse_wine(tmp_path / "a.csv")
    (tmp_path / "b.csv").write_text("<html><body>Not Found</body></html>\n<p>x</p>\n")
    with pytest.raises(ValueError, match="not a numeric"):
        parse_wine(tmp_path / "b.csv")


def test_drop_correlated_columns_removes_the_first_of_each_pair():
    rng = np.random.default_rng(0)
    a, b, c = rng.normal(size=(3, 500))
    data = np.stack([a, b, -a + 1e-3 * c, c, 2 * b + 5], axis=1)  # col 0 ~ col 2 (negatively), 1 ~ 4
    out, names = drop_correlated_columns(data, ["a", "b", "-a", "c", "2b"])
    assert names == ["-a", "c", "2b"]
    np.testing.assert_array_equal(out, data[:, [2, 3, 4]])


# ---------------------------------------------------------------------------------------------- preprocessing
def test_split_sizes_both_modes():
    assert split_sizes(1599, "paper") == (1121, 319, 159)
    assert split_sizes(4898, "paper") == (3430, 979, 489)
    assert split_sizes(5875, "paper") == (4113, 1175, 587)
    assert split_sizes(1599, "reference") == (1296, 144, 159)
    assert split_sizes(4898, "reference") == (3969, 440, 489)
    assert split_sizes(5875, "reference") == (4760, 528, 587)
    assert split_sizes(30000, "reference") == (28000, 1000, 1000)  # both capped at 1000
    with pytest.raises(ValueError, match="paper, reference"):
        split_sizes(100, "70/20/10")
    with pytest.raises(ValueError, match="too few"):
        split_sizes(5, "paper")


def test_median_gaps_and_dequantization_bounds():
    data = np.array([[0.0, 5.0], [1.0, 5.0], [2.0, 5.0], [4.0, 5.0], [4.0, 5.0]])
    np.testing.assert_array_equal(median_gaps(data), [1.0, 0.0])  # diffs 1,1,2 -> 1; one value -> 0
    rng = np.random.default_rng(0)
    steps = np.array([0.01, 1.0, 0.001, 10.0])  # quantisation step of each column
    x = np.round(rng.normal(size=(2000, 4)) * [1, 10, 0.1, 100] / steps) * steps
    gaps = median_gaps(x)
    np.testing.assert_allclose(gaps, steps, rtol=1e-6)
    before = x.copy()
    y = dequantize(x, 0)
    np.testing.assert_array_equal(x, before)  # input untouched
    delta = np.abs(y - x)
    assert np.all(delta <= gaps + 1e-12)
    assert np.all(delta.max(axis=0) > 0.9 * gaps)  # the noise spans (almost) the whole ±gap
    np.testing.assert_array_equal(dequantize(x, 0), y)


def test_shuffle_is_the_reference_permutation_and_leaves_global_rngs_alone():
    data = np.arange(40.0).reshape(20, 2)
    np_state, torch_state = np.random.get_state(), torch.get_rng_state()
    shuffled, perm = shuffle_rows(data, 2019)
    assert np.array_equal(np.random.get_state()[1], np_state[1]) and torch.equal(
        torch.get_rng_state(), torch_state
    )
    ref = data.copy()
    np.random.seed(2019)
    np.random.shuffle(ref)  # what dkef_runner.load_and_whiten does
    np.random.set_state(np_state)
    np.testing.assert_array_equal(shuffled, ref)
    np.testing.assert_array_equal(data[perm], ref)


def _correlated(n=1000, d=6, seed=0):
    rng = np.random.default_rng(seed)
    return rng.normal(size=(n, d)) @ rng.normal(size=(d, d)) * np.logspace(-4, 2, d) + np.arange(d) * 7


@pytest.mark.parametrize("whiten_on", ["train", "all"])
def test_whitened_data_have_zero_mean_identity_covariance(whiten_on):
    data = _correlated()
    out = preprocess(data, whiten_on=whiten_on, noise_std=0.0)
    assert out.train.dtype == np.float32 and out.sizes == (700, 200, 100)
    fit = out.train if whiten_on == "train" else np.concatenate([out.train, out.val, out.test])
    fit = fit.astype(np.float64)
    np.testing.assert_allclose(fit.mean(0), 0, atol=1e-5)
    np.testing.assert_allclose(np.cov(fit, rowvar=False, bias=True), np.eye(6), atol=1e-5)
    # the fitted map goes back to the data: rows are data[permutation]
    back = out.whitening.inverse(np.concatenate([out.train, out.val, out.test]))
    scale = data.std(axis=0)
    assert np.abs((back - data[out.permutation]) / scale).max() < 1e-5
    assert out.whitening.log_abs_det == pytest.approx(
        -0.5
        * np.linalg.slogdet(
            np.cov(data[out.permutation[:700]] if whiten_on == "train" else data, rowvar=False, bias=True)
        )[1]
    )


def test_whitening_on_train_does_not_see_the_test_rows():
    data = _correlated()
    base = preprocess(data, whiten_on="train", noise_std=0.05)
    changed = data.copy()
    changed[base.permutation[-100:]] *= 50.0  # the rows that become the test split
    for whiten_on, same in (("train", True), ("all", False)):
        a = preprocess(data, whiten_on=whiten_on, noise_std=0.05)
        b = preprocess(changed, whiten_on=whiten_on, noise_std=0.05)
        assert np.array_equal(a.train, b.train) is same and np.array_equal(a.val, b.val) is same
        assert not np.array_equal(a.test, b.test)


def test_rank_deficient_data_cannot_be_whitened():
    data = _correlated()
    data[:, 2] = 3.0
    with pytest.raises(ValueError, match="cannot whiten"):
        fit_whitening(data)


def test_noise_is_added_once_per_split_with_the_requested_std():
    data = _correlated(n=4000)
    clean = preprocess(data, noise_std=0.0)
    noisy = preprocess(data, noise_std=0.05)
    for c, n in zip((clean.train, clean.val, clean.test), (noisy.train, noisy.val, noisy.test), strict=True):
        eps = n.astype(np.float64) - c
        assert abs(eps.std() - 0.05) < 0.003 and abs(eps.mean()) < 0.003
    assert not np.allclose(noisy.train[:100] - clean.train[:100], noisy.val[:100] - clean.val[:100])


def test_preprocess_is_deterministic_for_a_seed_and_differs_across_seeds():
    data = np.round(_correlated(), 6)  # quantised, so dequantisation has work to do
    a = preprocess(data, dequantize_data=True, seed=2019)
    b = preprocess(data, dequantize_data=True, seed=2019)
    c = preprocess(data, dequantize_data=True, seed=2020)
    for x, y in zip((a.train, a.val, a.test), (b.train, b.val, b.test), strict=True):
        np.testing.assert_array_equal(x, y)
    assert not np.array_equal(a.permutation, c.permutation)


@pytest.mark.parametrize(
    "kwargs, msg",
    [({"split": "x"}, "split"), ({"whiten_on": "test"}, "whiten_on"), ({"noise_std": -1.0}, "noise_std")],
)
def test_preprocess_rejects_bad_options(kwargs, msg):
    with pytest.raises(ValueError, match=msg):
        preprocess(_correlated(), **kwargs)


# ---------------------------------------------------------------------------------------------- files
def test_missing_file_without_download_names_file_path_url_and_remedy(tmp_path):
    root = tmp_path / "nowhere"
    with pytest.raises(FileNotFoundError) as info:
        UCIDataModule("redwine", str(root), download=False).prepare_data()
    msg = str(info.value)
    assert "winequality-red.csv" in msg
    assert str(root / "wine-quality" / "winequality-red.csv") in msg
    assert DATASETS["redwine"].file.url in msg
    assert "download=False" in msg and "data.root" in msg
    assert not root.exists()


def test_failed_download_raises_file_not_found_and_leaves_nothing(tmp_path, monkeypatch):
    def offline(url, timeout=None):
        raise urllib.error.URLError("no route to host")

    monkeypatch.setattr(dl, "_urlopen", offline)
    with pytest.raises(FileNotFoundError) as info:
        UCIDataModule("parkinsons", str(tmp_path), download=True).prepare_data()
    msg = str(info.value)
    assert "parkinsons_updrs.data" in msg and str(tmp_path) in msg and "no route to host" in msg
    assert "https://archive.ics.uci.edu/ml/machine-learning-databases/parkinsons/telemonitoring/" in msg
    assert "data.root" in msg
    assert [p for p in tmp_path.rglob("*") if p.is_file()] == []


def test_download_is_atomic(tmp_path, monkeypatch):
    payload = b"0123456789" * 10
    dest = tmp_path / "sub" / "file.csv"
    responses = []

    def serve(url, timeout=None):
        responses.append(FakeResponse(payload, watch=dest))
        return responses[-1]

    monkeypatch.setattr(dl, "_urlopen", serve)
    assert dl.download_file("https://example.invalid/file.csv", dest) == dest
    assert dest.read_bytes() == payload
    assert responses[0].reads > 2 and not responses[0].dest_existed_during_read  # streamed to a temp file
    assert sorted(p.name for p in dest.parent.iterdir()) == ["file.csv"]

    # a transfer that breaks mid-way leaves neither the file nor a temp file
    dest2 = tmp_path / "sub" / "other.csv"
    monkeypatch.setattr(
        dl, "_urlopen", lambda url, timeout=None: FakeResponse(payload, fail_after_first_read=True)
    )
    with pytest.raises(ConnectionResetError):
        dl.download_file("https://example.invalid/other.csv", dest2)
    assert sorted(p.name for p in dest.parent.iterdir()) == ["file.csv"]

    # a checksum mismatch (e.g. an HTML error page) is not kept either
    monkeypatch.setattr(dl, "_urlopen", lambda url, timeout=None: FakeResponse(b"<html>error</html>"))
    with pytest.raises(OSError, match="md5 mismatch"):
        dl.download_file("https://example.invalid/other.csv", dest2, md5="0" * 32)
    assert sorted(p.name for p in dest.parent.iterdir()) == ["file.csv"]


def test_datamodule_downloads_into_the_shared_layout(tmp_path, monkeypatch, shared):
    payload = (shared / RED[0] / RED[1]).read_bytes()
    urls = []

    def serve(url, timeout=None):
        urls.append(url)
        return FakeResponse(payload)

    monkeypatch.setattr(dl, "_urlopen", serve)
    dm = UCIDataModule("redwine", str(tmp_path), download=True)
    dm.prepare_data()
    assert urls == [DATASETS["redwine"].file.url]
    assert (tmp_path / RED[0] / RED[1]).read_bytes() == payload
    dm.prepare_data()  # present now: no second download
    dm.setup("fit")
    assert urls == [DATASETS["redwine"].file.url] and dm.dim == 11 and dm.n_total == 1599


# ---------------------------------------------------------------------------------------------- datamodule
@pytest.mark.parametrize(
    "name, n, d, paper, reference",
    [
        ("redwine", 1599, 11, (1121, 319, 159), (1296, 144, 159)),
        ("whitewine", 4898, 11, (3430, 979, 489), (3969, 440, 489)),
        ("parkinsons", 5875, 15, (4113, 1175, 587), (4760, 528, 587)),
    ],
)
def test_datamodule_on_shared_files(shared, name, n, d, paper, reference):
    for split, sizes in (("paper", paper), ("reference", reference)):
        dm = UCIDataModule(name, str(shared), download=False, split=split, dim=d)
        dm.prepare_data()
        dm.setup("fit")
        assert dm.n_total == n and dm.dim == d and not dm.has_ground_truth
        got = tuple(t.shape[0] for t in (dm.train_data, dm.val_data, dm.test_data))
        assert got == sizes
        for t in (dm.train_data, dm.val_data, dm.test_data):
            assert t.dtype == torch.float32 and t.shape[1] == d and torch.isfinite(t).all()
    # whitened on train: train mean ~ 0 and covariance ~ I up to the N(0, 0.05²) noise
    x = dm.train_data.double()
    assert x.mean(0).abs().max() < 0.01
    cov = torch.cov(x.T, correction=0)
    assert (cov - (1 + 0.05**2) * torch.eye(d)).abs().max() < 0.02


def test_datamodule_shared_parkinsons_no_noise_is_exactly_white(shared):
    dm = UCIDataModule("parkinsons", str(shared), download=False, noise_std=0.0)
    dm.setup()
    x = dm.train_data.double()
    assert x.mean(0).abs().max() < 1e-5
    assert (torch.cov(x.T, correction=0) - torch.eye(15)).abs().max() < 1e-5


def test_datamodule_reads_a_file_directly_in_root_and_batches_plain_tensors(tmp_path):
    write_wine(tmp_path / "winequality-white.csv", n=300)
    dm = UCIDataModule("WhiteWine", str(tmp_path), download=False, batch_size=64, eval_batch_size=50)
    dm.prepare_data()
    dm.setup("fit")
    assert dm.dim == 11 and (len(dm.train_data), len(dm.val_data), len(dm.test_data)) == (210, 60, 30)
    batches = list(dm.train_dataloader())
    assert all(torch.is_tensor(b) and b.dtype == torch.float32 and b.shape[1] == 11 for b in batches)
    assert [b.shape[0] for b in batches] == [64, 64, 64, 18]  # drop_last=False
    assert not torch.equal(torch.cat(batches), dm.train_data)  # shuffled ...
    assert torch.equal(torch.cat(batches).sort(0).values, dm.train_data.sort(0).values)  # ... the same rows
    assert torch.equal(torch.cat(list(dm.val_dataloader())), dm.val_data)  # in order
    assert torch.equal(torch.cat(list(dm.test_dataloader())), dm.test_data)


def test_datamodule_setup_is_idempotent_and_deterministic(tmp_path):
    write_wine(tmp_path / "wine-quality" / "winequality-red.csv", n=200)
    dm = UCIDataModule("redwine", str(tmp_path), download=False)
    dm.setup("fit")
    first = dm.train_data
    dm.setup("test")
    dm.setup("fit")
    assert dm.train_data is first
    other = UCIDataModule("redwine", str(tmp_path), download=False)
    other.setup("fit")
    assert torch.equal(other.train_data, first) and torch.equal(other.test_data, dm.test_data)
    reseeded = UCIDataModule("redwine", str(tmp_path), download=False, seed=7)
    reseeded.setup()
    assert not torch.equal(reseeded.train_data, first)


def test_datamodule_validates_name_and_dim(tmp_path):
    with pytest.raises(ValueError, match="redwine, whitewine, parkinsons"):
        UCIDataModule("boston", str(tmp_path))
    write_wine(tmp_path / "winequality-red.csv", n=100)
    dm = UCIDataModule("redwine", str(tmp_path), download=False, dim=15)
    with pytest.raises(ValueError, match=r"data\.dim=15 does not match .* D=11"):
        dm.setup()
    for bad in ({"split": "random"}, {"whiten_on": "test"}, {"batch_size": 0}):
        with pytest.raises(ValueError):
            UCIDataModule("redwine", str(tmp_path), **bad)


def test_mirrors_are_tried_in_order_and_a_manual_file_names_its_page(tmp_path, monkeypatch):
    payload = b"a,b\n1,2\n"
    spec = dl.RemoteFile("t.csv", "sub", "https://first.invalid/t.csv", md5=hashlib.md5(payload).hexdigest(),
                         mirrors=("https://second.invalid/t.csv", "https://third.invalid/t.csv"))
    asked = []

    def serve(url, timeout=None):
        asked.append(url)
        if "first" in url:
            raise urllib.error.URLError("no route to host")
        return FakeResponse(b"<html>wrong</html>" if "second" in url else payload)

    monkeypatch.setattr(dl, "_urlopen", serve)
    assert dl.ensure_file(spec, tmp_path) == tmp_path / "sub" / "t.csv"
    assert asked == list(spec.urls) and (tmp_path / "sub" / "t.csv").read_bytes() == payload
    assert sorted(p.name for p in (tmp_path / "sub").iterdir()) == ["t.csv"]  # the bad copy was not kept
    assert dl.ensure_file(spec, tmp_path, download=False) == tmp_path / "sub" / "t.csv"

    manual = dl.RemoteFile("list.txt", "set", None, page="https://example.invalid/page.html")
    with pytest.raises(FileNotFoundError) as info:
        dl.ensure_file(manual, tmp_path, download=True)
    msg = str(info.value)
    assert "'list.txt' not found" in msg and str(tmp_path / "set" / "list.txt") in msg
    assert "no programmatic download" in msg and "https://example.invalid/page.html" in msg
    assert asked == list(spec.urls)  # no network for a file that has no URL


def test_uci_module_follows_the_data_contract(tmp_path):
    write_wine(tmp_path / "winequality-red.csv", n=100)
    dm = UCIDataModule("redwine", str(tmp_path), download=False)
    assert isinstance(dm, ScoreDataModule) and not (dm.has_ground_truth or dm.is_image or dm.has_bits_per_dim)
    with pytest.raises(RuntimeError, match="setup"):
        _ = dm.data_shape
    dm.setup()
    assert dm.data_shape == (11,) and dm.data_dim == 11 and dm.dim == 11
    assert UCIDataModule("redwine", str(tmp_path), dim=11).data_shape == (11,)
    val = dm.split_tensor("val", 5)
    assert val.dtype == torch.float32 and torch.equal(val, dm.val_data[:5])
    assert torch.equal(dm.split_tensor("test"), dm.test_data)
    with pytest.raises(DataContractError, match="ground-truth"):
        dm.true_score(val)
    with pytest.raises(DataContractError, match="no images"):
        dm.to_pixels(val)
