"""Fréchet distance between real and generated images (FID) for every generative model.

    FID = ‖μ_r − μ_g‖² + tr(Σ_r + Σ_g − 2 (Σ_r Σ_g)^½)

of the mean and covariance of a feature network's outputs on real and generated images. The statistics
and the distance are torchmetrics' :class:`~torchmetrics.image.fid.FrechetInceptionDistance`; this module
chooses the feature network:

- ``kind="mnist"``: the 128-d penultimate features of the small MNIST classifier shipped in this package
  (:mod:`src.metrics.mnist_classifier`, checksum-verified). Images [B, 1, 28, 28] in [0, 1].
- ``kind="inception"`` (CIFAR-10, CelebA, …): Inception-v3 pool features (2048-d) from a TorchScript
  file the user supplies (``metrics.fid.weights=PATH``), normally ``inception-2015-12-05.pt``, NVIDIA's
  TorchScript export of the TensorFlow FID network (the one the StyleGAN2-ADA/StyleGAN3 metrics use,
  published with StyleGAN2-ADA-PyTorch at :data:`INCEPTION_URL`). It takes uint8 [N, 3, H, W] images,
  resizes them to 299×299 itself and, called with ``return_features=True``, returns [N, 2048]
  features. :class:`TorchScriptFeatureExtractor` feeds it images in [0, 1] as uint8 ``floor(255·x + ½)`` and
  repeats a single channel to three. Nothing is downloaded: without the file the error says where it
  comes from.

  torchmetrics' own Inception (``feature=2048``, ``feature_extractor_weights_path=``) is not offered: it
  needs torch-fidelity, whose package ``__init__`` imports ``torchvision`` (torch-fidelity's datasets),
  and torchvision breaks ``import lightning`` next to the CPU torch this project pins.

How torchmetrics 1.9 treats a custom feature module (``feature=<nn.Module>``), which this module relies on:
images go to the module unchanged (``normalize`` only matters for torchmetrics' Inception and for the dummy
image used to guess the feature size when the module has no ``num_features``; both extractors here set
``num_features``, so no dummy pass is made). Features are cast to float64 and accumulated as Σx and Σxxᵀ in
float64; ``compute`` forms the unbiased covariances (Σxxᵀ − n μμᵀ)/(n − 1) and tr (Σ_r Σ_g)^½ as the sum of
the square roots of the eigenvalues of Σ_r Σ_g, and returns the result in the features' dtype (float32
here). The metric holds the extractor as a submodule (``metric.inception``): moving the metric moves it,
and both extractors here stay in eval mode whatever ``train()`` is called with.

The FID's own sampling error: :func:`fid_of_features` (the same formula on two feature sets held in memory)
and :func:`bootstrap_fid_sd` (its standard deviation over resamplings of both sets with replacement), which the
FID metric reports as ``test/fid_bootstrap_sd`` when ``model.metrics.fid.bootstrap`` > 0.

For LightningModules and benchmarks: :func:`fid_between` (two image tensors → FID, in batches). Keep the
extractor or metric out of a module's registered attributes (or in a plain dict/list) if it must not land
in checkpoints: a registered metric's submodule weights are part of ``state_dict``.
"""

from __future__ import annotations

import os
from pathlib import Path

import torch
from torch import nn
from torchmetrics.image.fid import FrechetInceptionDistance, _compute_fid

from src.metrics.base import EvalMetric
from src.metrics.distributed import gathered_rows
from src.metrics.mnist_classifier import load_mnist_feature_extractor, sha256_file
from src.runtime import progress

KINDS = ("mnist", "inception")
INCEPTION_FILE = "inception-2015-12-05.pt"
WHITE = 0.99  # a pixel above this (images in [0, 1]) counts as white in test/white_fraction
INCEPTION_URL = "https://nvlabs-fi-cdn.nvidia.com/stylegan2-ada-pytorch/pretrained/metrics/" + INCEPTION_FILE


class InceptionWeightsError(FileNotFoundError):
    """No usable TorchScript Inception file was given for ``kind="inception"``."""


def _inception_help() -> str:
    return (
        f"FID with kind='inception' needs the TorchScript FID Inception-v3 file {INCEPTION_FILE} "
        f"(NVIDIA's export of the TensorFlow FID network, published with StyleGAN2-ADA-PyTorch at "
        f"{INCEPTION_URL}). Download it yourself and pass its path, e.g. "
        f"metrics.fid.weights=/path/to/{INCEPTION_FILE}; nothing is downloaded automatically."
    )


def images_to_uint8(images: torch.Tensor) -> torch.Tensor:
    """Float images in [0, 1] → uint8 floor(255·x + ½) (clamped; NaN → 0): the quantisation
    ``src.sampling.grids.save_image_grid`` applies, so FID sees the pixels a saved PNG holds."""
    x = torch.nan_to_num(images.float(), nan=0.0).clamp(0.0, 1.0)
    return x.mul(255.0).add(0.5).floor().to(torch.uint8)


class TorchScriptFeatureExtractor(nn.Module):
    """A TorchScript feature network taking uint8 [N, 3, H, W], fed float images in [0, 1].

    ``x`` [N, C, H, W] (C = 1 or 3) → uint8 ``floor(255·x + ½)``, a single channel repeated to three → the
    scripted module (with ``return_features=True`` when its ``forward`` has that argument, as NVIDIA's
    Inception export does) → float32 features [N, ``num_features``]. ``num_features`` is read from one
    forward pass of a ``probe_size``×``probe_size`` grey image at load. The wrapper never leaves eval mode.
    """

    def __init__(self, scripted: torch.jit.ScriptModule, probe_size: int = 299):
        super().__init__()
        self.net = scripted
        try:
            arg_names = [a.name for a in scripted.forward.schema.arguments]
        except (AttributeError, RuntimeError):
            arg_names = []
        self._kwargs = {"return_features": True} if "return_features" in arg_names else {}
        self.requires_grad_(False)
        super().train(False)
        with torch.no_grad():
            probe = self.net(torch.full((1, 3, probe_size, probe_size), 128, dtype=torch.uint8), **self._kwargs)
        if probe.dim() != 2 or probe.shape[0] != 1:
            raise ValueError(f"the TorchScript feature network returned {tuple(probe.shape)} for one image; "
                             "expected [1, num_features]")
        self.num_features = int(probe.shape[1])

    def train(self, mode: bool = True) -> TorchScriptFeatureExtractor:
        return super().train(False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dim() != 4 or x.shape[1] not in (1, 3):
            raise ValueError(f"expected images [N, 1 or 3, H, W] in [0, 1], got {tuple(x.shape)}")
        if not x.is_floating_point():
            raise TypeError(f"expected float images in [0, 1], got dtype {x.dtype}")
        u8 = images_to_uint8(x)
        if u8.shape[1] == 1:
            u8 = u8.expand(-1, 3, -1, -1)
        return self.net(u8.contiguous(), **self._kwargs).float()


def load_inception_feature_extractor(
    weights: str | os.PathLike | None, sha256: str | None = None, probe_size: int = 299
) -> TorchScriptFeatureExtractor:
    """Load a TorchScript FID Inception file (see the module docstring); a clear error when absent."""
    if weights is None or str(weights) == "":
        raise InceptionWeightsError(_inception_help())
    path = Path(weights).expanduser()
    if not path.is_file():
        raise InceptionWeightsError(f"Inception weights file not found: {path}. " + _inception_help())
    if sha256 is not None and sha256_file(path) != sha256.lower():
        raise ValueError(f"checksum mismatch for Inception weights {path}: sha256 {sha256_file(path)}, "
                         f"expected {sha256}")
    try:
        scripted = torch.jit.load(str(path), map_location="cpu")
    except (RuntimeError, ValueError) as exc:
        raise ValueError(
            f"{path} is not a TorchScript module ({str(exc).splitlines()[0]}). kind='inception' expects a "
            f"TorchScript export such as {INCEPTION_FILE} from {INCEPTION_URL}; a state dict (e.g. "
            "torch-fidelity's or pytorch-fid's .pth) would need the network's code, which this package does "
            "not carry."
        ) from exc
    return TorchScriptFeatureExtractor(scripted.eval(), probe_size=probe_size)


def build_feature_extractor(kind: str, weights: str | os.PathLike | None = None, sha256: str | None = None) -> nn.Module:
    """The FID feature network: ``"mnist"`` (shipped classifier; ``weights`` overrides its file) or
    ``"inception"`` (the TorchScript file ``weights``, required)."""
    if kind == "mnist":
        return load_mnist_feature_extractor(weights, sha256)
    if kind == "inception":
        return load_inception_feature_extractor(weights, sha256)
    raise ValueError(f"unknown FID kind {kind!r}; expected one of {KINDS}")


def build_fid(
    kind: str,
    weights: str | os.PathLike | None = None,
    sha256: str | None = None,
    reset_real_features: bool = True,
    feature: nn.Module | None = None,
) -> FrechetInceptionDistance:
    """A torchmetrics FID metric on the ``kind`` feature network (or the given ``feature`` module).

    Update it with float images in [0, 1] (``metric.update(images, real=True/False)``), then ``compute()``.
    ``reset_real_features=False`` keeps the real statistics across ``reset()`` (compute them once).
    """
    extractor = feature if feature is not None else build_feature_extractor(kind, weights, sha256)
    return FrechetInceptionDistance(feature=extractor, reset_real_features=reset_real_features, normalize=True)


@torch.no_grad()
def fid_between(
    real: torch.Tensor,
    fake: torch.Tensor,
    extractor: nn.Module,
    batch_size: int = 500,
    device: str | torch.device | None = None,
) -> float:
    """FID between two image tensors (float [N, C, H, W] in [0, 1]), fed through ``extractor`` in batches.

    ``device`` (default: where the extractor's parameters are, else CPU) runs the extractor; batches are
    moved there one at a time, so ``real`` and ``fake`` may stay on the CPU. Both sets need ≥ 2 images;
    for a stable estimate use at least a few times ``num_features`` images in each.
    """
    if len(real) < 2 or len(fake) < 2:
        raise ValueError(f"FID needs at least 2 images in each set, got {len(real)} real and {len(fake)} fake")
    if device is None:
        param = next(iter(extractor.parameters()), None)
        device = param.device if param is not None else torch.device("cpu")
    metric = FrechetInceptionDistance(feature=extractor, normalize=True).to(device)
    for images, is_real in ((real, True), (fake, False)):
        for i in range(0, len(images), batch_size):
            metric.update(images[i : i + batch_size].to(device), real=is_real)
    return float(metric.compute())


def fid_of_features(real: torch.Tensor, fake: torch.Tensor) -> torch.Tensor:
    """FID of two feature sets [N, F] in float64: torchmetrics' distance (``_compute_fid``, the eigenvalue form of
    tr (Σ_r Σ_g)^½) of their means and unbiased covariances, as :func:`build_fid` computes it from its sums."""
    real, fake = real.double(), fake.double()
    return _compute_fid(fake.mean(0), torch.cov(fake.T), real.mean(0), torch.cov(real.T))


def bootstrap_fid_sd(real: torch.Tensor, fake: torch.Tensor, n_boot: int,
                     generator: torch.Generator | None = None) -> float:
    """Standard deviation of the FID over ``n_boot`` bootstrap replicates (each set resampled with replacement,
    at its own size): the sampling error of one FID of these sample sizes, to set beside a seed spread.
    (The replicates' mean is biased upwards by the duplicated rows; only their spread is used.)"""
    if n_boot < 2:
        raise ValueError(f"a bootstrap needs at least 2 replicates, got {n_boot}")
    values = []
    for _ in range(int(n_boot)):
        i = torch.randint(0, real.shape[0], (real.shape[0],), generator=generator)
        j = torch.randint(0, fake.shape[0], (fake.shape[0],), generator=generator)
        values.append(float(fid_of_features(real[i], fake[j])))
    return float(torch.tensor(values, dtype=torch.float64).std())


class FID(EvalMetric):
    """FID of ``n_samples`` generated images against ``n_samples`` real test images (:mod:`src.metrics.fid`).

    ``kind``: ``mnist`` (the project's shipped MNIST classifier features) or ``inception`` (Inception-v3
    from ``weights``, a file the user gives — CIFAR-10, CelebA). Samples come from ``module.sample_pixels``
    (EMA weights when EMA is on), real images from the data contract's ``split_tensor("test")`` through
    ``to_pixels``. Under DDP each rank draws its share of both sets and torchmetrics sums the feature
    statistics across ranks. Computed once per test epoch, at its end, with a progress task over the images
    (the sampler may show its own, e.g. Langevin levels × steps); ``test/fid_n_samples`` records the count.
    With ``bootstrap`` > 0 every image's features are kept (gathered across ranks) instead of summed, and both the
    FID (:func:`src.metrics.fid.fid_of_features`: the same distance as torchmetrics' sums) and its bootstrap sd
    come from them: each image goes through the feature network once.

    ``samples_file``: also write the generated images behind the FID there, as one uint8 tensor [N, C, H, W]
    (``floor(255·x + ½)``, :func:`images_to_uint8`; rank order under DDP) by ``torch.save`` — a file
    ``torch.load(path, weights_only=True)`` reads without running code — so the FID can be recomputed with other
    features (1000 MNIST samples: 784 KB). Written once the FID is computed, atomically.

    ``test/white_fraction``: the share of the generated images' pixels above :data:`WHITE` (0.99), the
    "white-out" of young score networks whose Langevin chains saturate; ``test/white_fraction_real`` the same
    share of the real images it is compared with (0.041 for the first 500 test digits of experiment=ncsn_mnist).
    """

    name = "fid"
    stages = ("test",)

    def __init__(self, kind: str = "mnist", n_samples: int = 1000, weights: str | None = None,
                 sha256: str | None = None, batch_size: int = 250, seed: int = 0, bootstrap: int = 0,
                 samples_file: str | None = None):
        super().__init__()
        self.samples_file = str(samples_file) if samples_file else None
        self.kind, self.n_samples, self.weights, self.sha256 = kind, int(n_samples), weights, sha256
        self.batch_size, self.seed, self.bootstrap = int(batch_size), int(seed), int(bootstrap)
        if self.n_samples < 2:
            raise ValueError(f"model.metrics.fid.n_samples={n_samples}: FID needs at least 2 samples")
        if self.bootstrap == 1 or self.bootstrap < 0:
            raise ValueError(f"model.metrics.fid.bootstrap={bootstrap}: 0 (off) or the number of bootstrap "
                             "replicates (>= 2; e.g. 100) of the FID's sampling error")
        self._fid = None

    def setup(self, module, datamodule):
        if not datamodule.is_image:
            raise ValueError(f"model.metrics.fid needs image data; {type(datamodule).__name__} holds none")
        if self._fid is None:
            from src.metrics.fid import build_fid

            # kept out of the module tree: the feature network's weights must not enter checkpoints/optimisers
            object.__setattr__(self, "_fid", build_fid(self.kind, self.weights, self.sha256))
        self._dm = datamodule

    def update(self, module, x, stage):
        pass  # everything happens at the end of the epoch

    def compute(self, module, stage):
        trainer = module.trainer
        world, rank = max(1, trainer.world_size), trainer.global_rank
        share = range(rank, self.n_samples, world)  # this rank's indices of the n samples
        fid = self._fid.to(module.device)
        fid.reset()
        real = self._dm.split_tensor("test", self.n_samples)
        if real.shape[0] < self.n_samples:
            raise ValueError(f"model.metrics.fid.n_samples={self.n_samples} exceeds the {real.shape[0]} test "
                             "images: lower it")
        real = self._dm.to_pixels(real[list(share)])
        n_fake = len(share)
        features = {True: [], False: []}  # kept only for the bootstrap
        kept = []  # the generated images as uint8, with samples_file
        white = torch.zeros(4, dtype=torch.float64)  # pixels > WHITE and pixels seen: generated, then real

        def add(images: torch.Tensor, is_real: bool) -> None:
            images = images.to(module.device).float()
            at = 2 if is_real else 0
            white[at] += float((images > WHITE).sum())
            white[at + 1] += images.numel()
            if self.bootstrap:  # features kept (extracted once): the FID and its bootstrap are computed from them
                with torch.no_grad():
                    features[is_real].append(fid.inception(images).double())
            else:  # streamed into torchmetrics' running sums
                fid.update(images, real=is_real)

        with progress.phase(module, f"FID ({self.kind} features): real + generated images",
                            real.shape[0] + n_fake) as advance:
            for start in range(0, max(real.shape[0], n_fake), self.batch_size):
                if start < real.shape[0]:
                    batch = real[start:start + self.batch_size]
                    add(batch, True)
                    advance(batch.shape[0])
                if start < n_fake:
                    k = min(self.batch_size, n_fake - start)
                    fake = module.sample_pixels(k, seed=self.seed + 104729 * rank + start)
                    if fake is None:
                        raise ValueError(f"model.metrics.fid: {type(module).__name__} does not generate samples")
                    if self.samples_file:
                        kept.append(images_to_uint8(fake.detach().float().cpu()))
                    add(fake, False)
                    advance(k)
        if world > 1:  # every rank's counts summed
            white = module.all_gather(white.to(module.device)).reshape(-1, 4).sum(0).cpu()
        whites = {"test/white_fraction": float(white[0] / white[1]),
                  "test/white_fraction_real": float(white[2] / white[3])}
        if self.samples_file:
            self._write_samples(module, torch.cat(kept))
        if not self.bootstrap:
            return {"test/fid": float(fid.compute()), "test/fid_n_samples": float(self.n_samples), **whites}

        real_f, fake_f = (gathered_rows(module, torch.cat(features[flag])).cpu() for flag in (True, False))
        g = torch.Generator().manual_seed(self.seed)  # the same replicates on every rank
        return {"test/fid": float(fid_of_features(real_f, fake_f)), "test/fid_n_samples": float(self.n_samples),
                "test/fid_bootstrap_sd": bootstrap_fid_sd(real_f, fake_f, self.bootstrap, g), **whites}

    def _write_samples(self, module, images: torch.Tensor) -> None:
        """Every rank's uint8 images, in rank order, to ``samples_file`` (rank 0 writes; tmp file, then rename)."""
        shape = images.shape[1:]
        rows = gathered_rows(module, images.reshape(images.shape[0], -1).to(module.device)).cpu()
        if getattr(module.trainer, "global_rank", 0) != 0:
            return
        path = Path(self.samples_file)
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f".{path.name}.tmp")
        torch.save(rows.reshape(-1, *shape).contiguous(), tmp)
        os.replace(tmp, path)
