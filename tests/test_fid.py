"""FID: torchmetrics' estimator against an independent Fréchet distance, the shipped MNIST feature network,
its checksum, and the TorchScript Inception route."""

from __future__ import annotations

import shutil
import subprocess
import sys
from types import SimpleNamespace

import numpy as np
import pytest
import scipy.linalg
import scipy.stats
import torch
from torch import nn

from src.metrics.fid import (
    INCEPTION_FILE,
    INCEPTION_URL,
    InceptionWeightsError,
    TorchScriptFeatureExtractor,
    bootstrap_fid_sd,
    build_fid,
    fid_between,
    fid_of_features,
    images_to_uint8,
)
from src.metrics.mnist_classifier import (
    CHECKSUMS_NAME,
    DEFAULT_WEIGHTS,
    MissingWeightsError,
    WeightsError,
    accuracy,
    load_mnist_classifier,
    load_mnist_feature_extractor,
    read_checksums,
    sha256_file,
    to_unit,
)
from tests.conftest import REPO_ROOT


class Identity(nn.Module):
    """The "feature network" of the Gaussian tests: the inputs are the features."""

    def __init__(self, d: int):
        super().__init__()
        self.num_features = d

    def forward(self, x):
        return x


class MeanPool(nn.Module):
    """A small deterministic image "feature network" (4x4 average pools of 28x28 images: 49 features) that counts
    its calls."""

    num_features = 49

    def __init__(self):
        super().__init__()
        self.calls = 0

    def forward(self, x):
        self.calls += 1
        return nn.functional.avg_pool2d(x.float(), 4).flatten(1)


def frechet(mu1, s1, mu2, s2) -> float:
    """‖μ1 − μ2‖² + tr(Σ1 + Σ2 − 2 (Σ1 Σ2)^½) with scipy's sqrtm, float64."""
    covmean = scipy.linalg.sqrtm(s1 @ s2)
    return float(np.sum((mu1 - mu2) ** 2) + np.trace(s1) + np.trace(s2) - 2 * np.trace(covmean).real)


def sample_stats(x: np.ndarray):
    return x.mean(0), np.cov(x, rowvar=False, ddof=1)


def gaussian(mu, cov, n, seed):
    return np.random.default_rng(seed).multivariate_normal(mu, cov, size=n)


def test_fid_equals_sample_frechet_distance_and_hand_closed_form(one_thread):
    # Commuting (diagonal) covariances: FID = ‖Δμ‖² + Σ_i (σ1_i − σ2_i)² = 6 + (1 + 1 + 4 + 0.25) = 12.25
    mu1, mu2 = np.zeros(4), np.array([1.0, 2.0, 0.0, -1.0])
    v1, v2 = np.array([1.0, 4.0, 9.0, 0.25]), np.array([4.0, 1.0, 1.0, 1.0])
    population = 12.25
    assert population == pytest.approx(frechet(mu1, np.diag(v1), mu2, np.diag(v2)), rel=1e-12)
    n = 200_000
    x1, x2 = gaussian(mu1, np.diag(v1), n, 1), gaussian(mu2, np.diag(v2), n, 2)
    fid = fid_between(torch.from_numpy(x1), torch.from_numpy(x2), Identity(4), batch_size=30_000)
    # 1) torchmetrics (float64 Σx, Σxxᵀ accumulated over 6 batches, eigvals) = scipy on the sample moments
    assert fid == pytest.approx(frechet(*sample_stats(x1), *sample_stats(x2)), rel=1e-6)
    # 2) ... and close to the population value. Delta method (Gaussian data): the sample means and variances
    # are independent with Var(x̄_i) = v_i/n, Var(s²_i) = 2v_i²/(n−1); off-diagonal sample covariances enter
    # tr(S1 S2)^½ only at second order when Σ1, Σ2 are diagonal. With Δ = μ1 − μ2,
    #   Var(FID) ≈ Σ_i [4Δ_i²(v1_i + v2_i) + 2 v1_i (√v1_i − √v2_i)² + 2 v2_i (√v2_i − √v1_i)²] / n,
    # and the estimator's bias is second order, O(tr(Σ1 + Σ2)/n) (the mean term's is exactly that).
    # Tolerance: 5 standard deviations + 3 × that bias scale.
    d2 = (np.sqrt(v1) - np.sqrt(v2)) ** 2
    std = np.sqrt(np.sum(4 * (mu1 - mu2) ** 2 * (v1 + v2) + 2 * v1 * d2 + 2 * v2 * d2) / n)
    tol = 5 * std + 3 * np.sum(v1 + v2) / n
    assert tol < 0.03 * population  # a tight check, not a vacuous one
    assert abs(fid - population) < tol, (fid, population, tol)


def test_fid_general_covariances_against_sampling_distribution(one_thread):
    rng = np.random.default_rng(0)
    a, b = rng.normal(size=(5, 5)), rng.normal(size=(5, 5))
    s1, s2 = a @ a.T / 5 + 0.5 * np.eye(5), b @ b.T / 5 + 0.2 * np.eye(5)  # non-commuting SPD
    mu1, mu2 = rng.normal(size=5), rng.normal(size=5)
    population = frechet(mu1, s1, mu2, s2)
    n = 200_000
    x1, x2 = gaussian(mu1, s1, n, 3), gaussian(mu2, s2, n, 4)
    metric = build_fid("mnist", feature=Identity(5))  # the metric the LightningModules use, own features
    metric.update(torch.from_numpy(x1), real=True)
    metric.update(torch.from_numpy(x2), real=False)
    fid = float(metric.compute())
    assert fid == pytest.approx(frechet(*sample_stats(x1), *sample_stats(x2)), rel=1e-6)
    # Float64 accumulation: shifting both sets by 100 leaves the FID unchanged (Σxxᵀ − nμμᵀ cancellation)
    shifted = fid_between(torch.from_numpy(x1 + 100), torch.from_numpy(x2 + 100), Identity(5), batch_size=50_000)
    assert shifted == pytest.approx(fid, rel=1e-6)
    # Sampling tolerance from the exact sampling distribution of Gaussian sample moments:
    # x̄ ~ N(μ, Σ/n), (n − 1) S ~ Wishart(n − 1, Σ), independent. 300 draws give the estimator's mean and std.
    reps = []
    for seed in range(300):
        r = np.random.default_rng(1000 + seed)
        m1, m2 = r.multivariate_normal(mu1, s1 / n), r.multivariate_normal(mu2, s2 / n)
        c1 = scipy.stats.wishart.rvs(n - 1, s1 / (n - 1), random_state=r)
        c2 = scipy.stats.wishart.rvs(n - 1, s2 / (n - 1), random_state=r)
        reps.append(frechet(m1, c1, m2, c2))
    bias, std = np.mean(reps) - population, np.std(reps, ddof=1)
    tol = abs(bias) + 5 * std
    assert tol < 0.03 * population
    assert abs(fid - population) < tol, (fid, population, bias, std)


def test_fid_of_features_is_the_metrics_fid(one_thread):
    """The in-memory formula the bootstrap uses = the torchmetrics metric on the same features."""
    x1, x2 = gaussian(np.zeros(6), np.eye(6), 300, 5), gaussian(np.full(6, 0.3), 1.5 * np.eye(6), 250, 6)
    metric = build_fid("mnist", feature=Identity(6))
    metric.update(torch.from_numpy(x1), real=True)
    metric.update(torch.from_numpy(x2), real=False)
    ours = float(fid_of_features(torch.from_numpy(x1), torch.from_numpy(x2)))
    assert ours == pytest.approx(float(metric.compute()), rel=1e-6)
    assert ours == pytest.approx(frechet(*sample_stats(x1), *sample_stats(x2)), rel=1e-6)


class ImageData:
    """The datamodule side of the FID metric: its test images, already pixels."""

    is_image = True

    def __init__(self, images: torch.Tensor):
        self.images = images

    def split_tensor(self, split, n):
        return self.images[:n]

    def to_pixels(self, x):
        return x


class OneProcessSampler:
    """The module side of the FID metric, in one process: ``sample(k, seed)`` draws its generated images."""

    trainer = SimpleNamespace(world_size=1, global_rank=0)
    device = torch.device("cpu")

    def __init__(self, sample):
        self.sample_pixels = sample


def test_fid_metric_reports_the_same_fid_with_and_without_its_bootstrap(one_thread):
    """model.metrics.fid.bootstrap keeps the features and computes the FID from them (each image through the
    feature network once): the same test/fid as the streamed torchmetrics sums, for the same samples."""
    from src.metrics.fid import FID

    gen = torch.Generator().manual_seed(0)
    data = ImageData(torch.rand(60, 1, 28, 28, generator=gen))
    module = OneProcessSampler(
        lambda k, seed: torch.rand(k, 1, 28, 28, generator=torch.Generator().manual_seed(seed)) ** 2)
    extractor = MeanPool()
    results = {}
    for boot in (0, 20):
        metric = FID(n_samples=50, batch_size=16, bootstrap=boot)
        object.__setattr__(metric, "_fid", build_fid("mnist", feature=extractor))
        metric.setup(module, data)
        extractor.calls = 0
        results[boot] = metric.compute(module, "test")
        assert extractor.calls == 8  # 4 batches of real and 4 of generated images, each extracted once
    assert results[20]["test/fid"] == pytest.approx(results[0]["test/fid"], rel=1e-5)
    assert results[20]["test/fid_bootstrap_sd"] > 0 and "test/fid_bootstrap_sd" not in results[0]


def test_bootstrap_sd_matches_the_fids_sampling_distribution(one_thread):
    """Ground truth: the sd of the FID over 300 independent redraws of both sample sets (n = 400 each, 6-d
    Gaussians). The bootstrap sd of single draws (200 replicates each) averages within 20 % of it, and each
    one within a factor 1.6."""
    mu1, mu2, cov1, cov2 = np.zeros(6), np.full(6, 0.25), np.eye(6), np.diag([1.0, 1.5, 2.0, 0.7, 1.0, 1.2])
    n = 400

    def draw(seed):
        return (torch.from_numpy(gaussian(mu1, cov1, n, 2 * seed)), torch.from_numpy(gaussian(mu2, cov2, n, 2 * seed + 1)))

    truth = float(torch.tensor([float(fid_of_features(*draw(s))) for s in range(300)]).std())
    boot = [bootstrap_fid_sd(*draw(1000 + s), 200, torch.Generator().manual_seed(s)) for s in range(8)]
    assert all(truth / 1.6 < b < truth * 1.6 for b in boot), (truth, boot)
    assert abs(np.mean(boot) / truth - 1) < 0.2, (truth, boot)
    with pytest.raises(ValueError, match="at least 2 replicates"):
        bootstrap_fid_sd(*draw(0), 1)


# ------------------------------------------------------------------------------------------------- MNIST
@pytest.fixture(scope="module")
def mnist():
    """MNIST, read once for this module and released after it (an lru_cache held it for the whole session)."""
    from src.data.mnist import load_mnist
    from tests.conftest import require_mnist

    return load_mnist(str(require_mnist()), download=False)


@pytest.fixture(scope="module")
def extractor():
    return load_mnist_feature_extractor()


def test_shipped_weights_are_small_and_recorded():
    assert DEFAULT_WEIGHTS.is_file() and DEFAULT_WEIGHTS.stat().st_size < 2_000_000
    assert read_checksums(DEFAULT_WEIGHTS.parent)[DEFAULT_WEIGHTS.name] == sha256_file(DEFAULT_WEIGHTS)


def test_classifier_test_accuracy(mnist, one_thread):
    model = load_mnist_classifier()
    assert not model.training
    acc = accuracy(model, mnist["test_images"], mnist["test_labels"], batch_size=2000)
    assert acc >= 0.99, acc


def test_mnist_fid_real_vs_real_far_below_real_vs_noise(mnist, extractor, one_thread):
    test = to_unit(mnist["test_images"][:1000])
    train = to_unit(mnist["train_images"][:1000])
    noise = torch.rand(1000, 1, 28, 28, generator=torch.Generator().manual_seed(0))
    # Digits with their pixels shuffled keep the intensity histogram but not the strokes: in between
    perm = torch.randperm(784, generator=torch.Generator().manual_seed(0))
    shuffled = train.flatten(1)[:, perm].view_as(train)
    metric = build_fid("mnist", feature=extractor, reset_real_features=False)  # real statistics computed once
    for i in range(0, 1000, 500):
        metric.update(test[i : i + 500], real=True)
    fids = {}
    for name, fake in (("train", train), ("shuffled", shuffled), ("noise", noise)):
        metric.reset()
        for i in range(0, 1000, 500):
            metric.update(fake[i : i + 500], real=False)
        fids[name] = float(metric.compute())
    assert int(metric.real_features_num_samples) == 1000
    assert 0 < fids["train"] < 0.05 * fids["shuffled"], fids
    assert fids["train"] < 0.02 * fids["noise"], fids
    assert extractor.num_features == 128 and extractor(test[:3]).shape == (3, 128)


def test_feature_extractor_stays_in_eval_mode(extractor):
    metric = build_fid("mnist")
    metric.train()
    assert not metric.inception.training
    assert all(not m.training for m in metric.inception.modules())
    assert not any(p.requires_grad for p in metric.inception.parameters())
    assert metric.inception.num_features == 128
    with pytest.raises(ValueError, match=r"\[B, 1, 28, 28\]"):
        extractor(torch.rand(2, 3, 28, 28))


# ------------------------------------------------------------------------------------- weights handling
def _copy_weights(tmp_path):
    path = tmp_path / DEFAULT_WEIGHTS.name
    shutil.copy(DEFAULT_WEIGHTS, path)
    shutil.copy(DEFAULT_WEIGHTS.parent / CHECKSUMS_NAME, tmp_path / CHECKSUMS_NAME)
    return path


def test_checksum_mismatch_and_missing_weights_name_the_file(tmp_path):
    path = _copy_weights(tmp_path)
    assert load_mnist_feature_extractor(path).num_features == 128
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0xFF
    path.write_bytes(bytes(data))
    with pytest.raises(WeightsError, match="checksum mismatch") as err:
        load_mnist_feature_extractor(path)
    assert str(path) in str(err.value) and "python -m src.metrics.mnist_classifier" in str(err.value)
    with pytest.raises(WeightsError, match="checksum mismatch"):
        build_fid("mnist", weights=path)
    with pytest.raises(WeightsError, match="checksum mismatch"):  # an explicit digest is checked too
        load_mnist_classifier(DEFAULT_WEIGHTS, sha256="0" * 64)
    path.unlink()
    with pytest.raises(MissingWeightsError) as err:
        load_mnist_feature_extractor(path)
    assert isinstance(err.value, FileNotFoundError) and str(path) in str(err.value)
    assert "--out" in str(err.value)
    unrecorded = tmp_path / "other.pt"
    shutil.copy(DEFAULT_WEIGHTS, unrecorded)
    with pytest.raises(WeightsError, match="no sha256 recorded") as err:
        load_mnist_feature_extractor(unrecorded)
    assert str(unrecorded) in str(err.value)


def test_missing_inception_weights_give_the_clear_error(tmp_path):
    for weights in (None, ""):
        with pytest.raises(InceptionWeightsError) as err:
            build_fid("inception", weights=weights)
        msg = str(err.value)
        assert INCEPTION_FILE in msg and INCEPTION_URL in msg and "metrics.fid.weights=" in msg
    missing = tmp_path / INCEPTION_FILE
    with pytest.raises(InceptionWeightsError, match="not found") as err:
        build_fid("inception", weights=missing)
    assert str(missing) in str(err.value)
    not_script = tmp_path / "state_dict.pth"
    torch.save({"w": torch.zeros(2)}, not_script)
    with pytest.raises(ValueError, match="not a TorchScript module"):
        build_fid("inception", weights=not_script)
    with pytest.raises(ValueError, match="unknown FID kind"):
        build_fid("cifar")


class _TinyInception(nn.Module):
    """Stands in for NVIDIA's export: uint8 [N, 3, H, W] → features with ``return_features=True``."""

    def __init__(self):
        super().__init__()
        self.proj = nn.Linear(3 * 4 * 4, 16)
        self.logits = nn.Linear(16, 5)

    def forward(self, x: torch.Tensor, return_features: bool = False) -> torch.Tensor:
        if x.dtype != torch.uint8:
            raise ValueError("expects uint8 images")
        h = torch.nn.functional.adaptive_avg_pool2d(x.float() / 255.0, 4).flatten(1)
        f = self.proj(h)
        return f if return_features else self.logits(f)


class _NoKwargNet(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x.float().mean(dim=(2, 3))


def test_torchscript_inception_route(tmp_path, one_thread):
    torch.manual_seed(0)
    net = _TinyInception()
    path = tmp_path / INCEPTION_FILE
    torch.jit.script(net).save(str(path))
    metric = build_fid("inception", weights=path)
    ext = metric.inception
    assert isinstance(ext, TorchScriptFeatureExtractor) and ext.num_features == 16 and not ext.training
    rgb = torch.rand(6, 3, 32, 32, generator=torch.Generator().manual_seed(1))
    grey = torch.rand(6, 1, 32, 32, generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        assert torch.equal(ext(rgb), net(images_to_uint8(rgb), return_features=True))
        assert torch.equal(ext(grey), net(images_to_uint8(grey).repeat(1, 3, 1, 1), return_features=True))
    u8 = images_to_uint8(torch.tensor([0.0, 0.4 / 255, 0.49, 1.0, 1.3, -0.1, float("nan")]))
    assert u8.tolist() == [0, 0, 125, 255, 255, 0, 0]  # floor(255·x + ½), clamped, NaN → 0
    fid = fid_between(rgb, grey, ext, batch_size=4)
    assert np.isfinite(fid) and fid > 0
    with pytest.raises(ValueError):
        ext(torch.rand(2, 2, 8, 8))
    plain = tmp_path / "plain.pt"
    torch.jit.script(_NoKwargNet()).save(str(plain))
    assert build_fid("inception", weights=plain).inception.num_features == 3


def test_importing_the_metrics_does_not_import_torchvision():
    code = ("import sys, src.metrics.fid, src.callbacks.samples, src.sampling.grids; "
            "sys.exit(int('torchvision' in sys.modules or 'torch_fidelity' in sys.modules))")
    proc = subprocess.run([sys.executable, "-c", code], cwd=REPO_ROOT, timeout=300, check=False)
    assert proc.returncode == 0


def test_fid_metric_reports_the_white_out_of_generated_and_real_images(one_thread):
    """test/white_fraction counts the generated pixels above 0.99 (the white-out of young score networks),
    test/white_fraction_real the real ones: exact counts on images built with a known number of white pixels."""
    from src.metrics.fid import FID

    real_images = torch.zeros(40, 1, 28, 28)
    real_images.view(40, -1)[:, :49] = 1.0  # 49 of 784 pixels white: 1/16
    real_images.view(40, -1)[:, 49:60] = 0.99  # not above the threshold

    def half_white(k, seed):
        x = torch.full((k, 1, 28, 28), 0.5)
        x.view(k, -1)[:, :392] = 0.995  # half of every generated image white
        return x

    data, module = ImageData(real_images), OneProcessSampler(half_white)
    for boot in (0, 10):
        metric = FID(n_samples=30, batch_size=8, bootstrap=boot)
        object.__setattr__(metric, "_fid", build_fid("mnist", feature=MeanPool()))
        metric.setup(module, data)
        out = metric.compute(module, "test")
        assert out["test/white_fraction"] == pytest.approx(0.5, abs=1e-12)
        assert out["test/white_fraction_real"] == pytest.approx(1 / 16, abs=1e-12)


def test_fid_metric_saves_the_generated_images_it_scored_as_uint8(one_thread, tmp_path):
    """model.metrics.fid.samples_file: the generated images behind test/fid, as one uint8 tensor that a weights-only
    load reads; the FID of those (quantised) images is the reported one to within the quantisation."""
    from src.metrics.fid import FID, fid_between, images_to_uint8

    gen = torch.Generator().manual_seed(0)
    data = ImageData(torch.rand(60, 1, 28, 28, generator=gen))

    def sample(k, seed):
        return torch.rand(k, 1, 28, 28, generator=torch.Generator().manual_seed(seed)) ** 2

    module = OneProcessSampler(sample)
    path = tmp_path / "run" / "fid_samples.pt"
    metric = FID(n_samples=50, batch_size=16, bootstrap=0, samples_file=str(path))
    object.__setattr__(metric, "_fid", build_fid("mnist", feature=MeanPool()))
    metric.setup(module, data)
    out = metric.compute(module, "test")
    saved = torch.load(path, weights_only=True)
    assert saved.dtype == torch.uint8 and saved.shape == (50, 1, 28, 28)
    expected = torch.cat([sample(min(16, 50 - s), seed=s) for s in range(0, 50, 16)])  # the metric's seeds
    assert torch.equal(saved, images_to_uint8(expected))
    assert not list(path.parent.glob(".*.tmp"))
    again = fid_between(data.split_tensor("test", 50), saved.float() / 255, MeanPool())
    assert again == pytest.approx(out["test/fid"], rel=1e-3)
