"""A small MNIST classifier whose penultimate layer is the feature space of MNIST FID.

Inception-v3 features mean little on 28×28 grey digits, so MNIST FID (``src.metrics.fid``, ``kind="mnist"``)
uses a CNN trained on MNIST itself: the 128-d input of its last linear layer.

Network (278,762 parameters, 1.1 MB of float32 weights), input [B, 1, 28, 28] in [0, 1]:

    (x − 0.1307)/0.3081 → [conv3×3 → BN → ReLU] 32 → maxpool → 64 → 64 → maxpool → 128 → maxpool (3×3)
    → flatten 1152 → linear 128 → ReLU  (= the 128-d features)  → dropout 0.3 → linear 10 (logits)

Training (``python -m src.metrics.mnist_classifier``): the 60,000 images of the MNIST training file, seed 0,
5 epochs of AdamW (lr 2e-3, weight decay 1e-4, one-cycle schedule, batch 128), each batch shifted by up to
2 pixels in x and y (zero padding). No model selection: the t10k file is used once, for the reported accuracy.
The shipped weights ``weights/mnist_classifier.pt`` were made with

    OMP_NUM_THREADS=2 python -m src.metrics.mnist_classifier --root <data root> \\
        --out src/metrics/weights/mnist_classifier.pt --threads 2

and reach a test accuracy of 99.62 % (9,962 / 10,000 on t10k; 99.71 % on the first 10,000 training images).
Training took 37.7 min on 2 CPU cores shared with other busy jobs (about 1 min per epoch on 2 idle cores).
The command also writes the file's sha256 into ``weights/CHECKSUMS``, which :func:`load_mnist_classifier`
checks before loading (a rebuilt file differs in its last bits between machines and thread counts, hence
in its checksum: rebuilding rewrites the entry).
"""

from __future__ import annotations

import argparse
import hashlib
import math
import os
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from src.runtime.atomic import atomic_file

WEIGHTS_DIR = Path(__file__).resolve().parent / "weights"
DEFAULT_WEIGHTS = WEIGHTS_DIR / "mnist_classifier.pt"
CHECKSUMS_NAME = "CHECKSUMS"
MNIST_MEAN, MNIST_STD = 0.1307, 0.3081
NUM_FEATURES = 128
REBUILD_COMMAND = "python -m src.metrics.mnist_classifier --root <data root> --out {path}"


class WeightsError(RuntimeError):
    """A weights file is missing, has no recorded checksum, or does not match it."""


class MissingWeightsError(WeightsError, FileNotFoundError):
    """The weights file does not exist."""


# ------------------------------------------------------------------------------------------------ model
def _conv_bn_relu(c_in: int, c_out: int) -> list[nn.Module]:
    return [nn.Conv2d(c_in, c_out, 3, padding=1, bias=False), nn.BatchNorm2d(c_out), nn.ReLU(inplace=True)]


class MNISTClassifier(nn.Module):
    """CNN for [B, 1, 28, 28] images in [0, 1]: ``features(x)`` [B, 128], ``forward(x)`` logits [B, 10]."""

    num_features = NUM_FEATURES

    def __init__(self, dropout: float = 0.3):
        super().__init__()
        self.body = nn.Sequential(
            *_conv_bn_relu(1, 32), nn.MaxPool2d(2),  # 14×14
            *_conv_bn_relu(32, 64), *_conv_bn_relu(64, 64), nn.MaxPool2d(2),  # 7×7
            *_conv_bn_relu(64, 128), nn.MaxPool2d(2),  # 3×3
            nn.Flatten(),
            nn.Linear(128 * 3 * 3, NUM_FEATURES), nn.ReLU(inplace=True),
        )
        self.dropout = nn.Dropout(dropout)
        self.head = nn.Linear(NUM_FEATURES, 10)

    def features(self, x: torch.Tensor) -> torch.Tensor:
        return self.body((x - MNIST_MEAN) / MNIST_STD)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.dropout(self.features(x)))


class MNISTFeatureExtractor(nn.Module):
    """The classifier's penultimate features as an FID feature network.

    Maps [B, 1, 28, 28] images in [0, 1] (any float dtype) to float32 features [B, ``num_features``]. It never
    leaves eval mode (``train()`` is a no-op, so a LightningModule that holds an FID metric cannot switch its
    BatchNorm to batch statistics), and its parameters do not require grad.
    """

    def __init__(self, classifier: MNISTClassifier):
        super().__init__()
        self.classifier = classifier
        self.num_features = classifier.num_features
        self.requires_grad_(False)
        super().train(False)

    def train(self, mode: bool = True) -> MNISTFeatureExtractor:
        return super().train(False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dim() != 4 or tuple(x.shape[1:]) != (1, 28, 28):
            raise ValueError(f"expected MNIST images [B, 1, 28, 28] in [0, 1], got {tuple(x.shape)}")
        if not x.is_floating_point():
            raise TypeError(f"expected float images in [0, 1], got dtype {x.dtype}")
        w = self.classifier.head.weight
        return self.classifier.features(x.to(device=w.device, dtype=w.dtype))


# -------------------------------------------------------------------------------------------- checksums
def sha256_file(path: str | os.PathLike) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as fh:
        for chunk in iter(lambda: fh.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def read_checksums(folder: str | os.PathLike) -> dict[str, str]:
    """``{file name: sha256}`` from ``<folder>/CHECKSUMS`` (``sha256sum`` format); {} when absent."""
    path = Path(folder) / CHECKSUMS_NAME
    if not path.is_file():
        return {}
    out = {}
    for line in path.read_text().splitlines():
        parts = line.split()
        if len(parts) == 2 and not line.startswith("#"):
            out[parts[1].lstrip("*")] = parts[0].lower()
    return out


def write_checksum(path: str | os.PathLike) -> str:
    """Record ``path``'s sha256 in ``CHECKSUMS`` next to it (other entries kept); returns the digest."""
    path = Path(path)
    digest = sha256_file(path)
    entries = read_checksums(path.parent)
    entries[path.name] = digest
    text = "".join(f"{d}  {name}\n" for name, d in sorted(entries.items()))
    with atomic_file(path.parent / CHECKSUMS_NAME) as fh:
        fh.write(text.encode())
    return digest


def verify_weights(path: str | os.PathLike, sha256: str | None = None) -> Path:
    """Check that ``path`` exists and matches ``sha256`` (default: its ``CHECKSUMS`` entry); return it."""
    path = Path(path)
    rebuild = f"Rebuild it with `{REBUILD_COMMAND.format(path=path)}`."
    if not path.is_file():
        raise MissingWeightsError(f"MNIST classifier weights not found: {path}. {rebuild}")
    expected = sha256 or read_checksums(path.parent).get(path.name)
    if expected is None:
        raise WeightsError(f"no sha256 recorded for {path} in {path.parent / CHECKSUMS_NAME}. {rebuild}")
    actual = sha256_file(path)
    if actual != expected.lower():
        raise WeightsError(
            f"checksum mismatch for MNIST classifier weights {path}: sha256 {actual}, expected {expected} "
            f"(a truncated download, a Git LFS pointer or a modified file). {rebuild}"
        )
    return path


def load_mnist_classifier(weights: str | os.PathLike | None = None, sha256: str | None = None) -> MNISTClassifier:
    """The trained classifier (checksum-verified, CPU, eval mode); ``weights`` defaults to the shipped file."""
    path = verify_weights(DEFAULT_WEIGHTS if weights is None else weights, sha256)
    model = MNISTClassifier()
    model.load_state_dict(torch.load(path, map_location="cpu", weights_only=True))
    return model.eval()


def load_mnist_feature_extractor(
    weights: str | os.PathLike | None = None, sha256: str | None = None
) -> MNISTFeatureExtractor:
    """[B, 1, 28, 28] images in [0, 1] → 128-d penultimate features (eval mode, ``num_features`` = 128)."""
    return MNISTFeatureExtractor(load_mnist_classifier(weights, sha256))


# ------------------------------------------------------------------------------------------- training
def to_unit(images: torch.Tensor) -> torch.Tensor:
    """uint8 [N, 28, 28] → float32 [N, 1, 28, 28] in [0, 1]."""
    return images.unsqueeze(1).float().div_(255.0)


def random_shift(x: torch.Tensor, max_shift: int, generator: torch.Generator) -> torch.Tensor:
    """Shift each image by independent integer offsets in [−max_shift, max_shift]² (zeros enter)."""
    if max_shift == 0:
        return x
    b, _, h, w = x.shape
    padded = F.pad(x, (max_shift,) * 4)
    oy = torch.randint(0, 2 * max_shift + 1, (b, 1), generator=generator)
    ox = torch.randint(0, 2 * max_shift + 1, (b, 1), generator=generator)
    rows = (oy + torch.arange(h))[:, :, None]  # [B, H, 1]
    cols = (ox + torch.arange(w))[:, None, :]  # [B, 1, W]
    return padded[torch.arange(b)[:, None, None], 0, rows, cols].unsqueeze(1)


@torch.no_grad()
def accuracy(model: nn.Module, images: torch.Tensor, labels: torch.Tensor, batch_size: int = 1000) -> float:
    """Fraction of uint8 [N, 28, 28] ``images`` whose argmax logit equals ``labels`` (model in eval mode)."""
    was_training = model.training
    model.eval()
    correct = 0
    for i in range(0, len(images), batch_size):
        logits = model(to_unit(images[i : i + batch_size]))
        correct += int((logits.argmax(1) == labels[i : i + batch_size].long()).sum())
    model.train(was_training)
    return correct / len(images)


def train(
    root: str | os.PathLike,
    epochs: int = 5,
    batch_size: int = 128,
    lr: float = 2e-3,
    weight_decay: float = 1e-4,
    max_shift: int = 2,
    seed: int = 0,
    log_every: int = 100,
) -> tuple[MNISTClassifier, dict]:
    """Train on the MNIST training file; returns (model in eval mode, {'test_accuracy', 'train_seconds', ...})."""
    from src.data.mnist import load_mnist

    data = load_mnist(root, download=False)
    x_train, y_train = data["train_images"], data["train_labels"].long()
    torch.manual_seed(seed)
    gen = torch.Generator().manual_seed(seed)
    model = MNISTClassifier()
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=weight_decay)
    steps_per_epoch = math.ceil(len(x_train) / batch_size)
    sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=lr, total_steps=epochs * steps_per_epoch)
    t0 = time.perf_counter()
    model.train()
    for epoch in range(epochs):
        perm = torch.randperm(len(x_train), generator=gen)
        running = 0.0
        for step in range(steps_per_epoch):
            idx = perm[step * batch_size : (step + 1) * batch_size]
            x = random_shift(to_unit(x_train[idx]), max_shift, gen)
            loss = F.cross_entropy(model(x), y_train[idx])
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            sched.step()
            running += loss.item()
            if log_every and (step + 1) % log_every == 0:
                print(f"epoch {epoch + 1}/{epochs} step {step + 1}/{steps_per_epoch} "
                      f"loss {running / log_every:.4f} ({time.perf_counter() - t0:.0f} s)", flush=True)
                running = 0.0
    seconds = time.perf_counter() - t0
    model.eval()
    test_acc = accuracy(model, data["test_images"], data["test_labels"])
    train_acc = accuracy(model, x_train[:10000], y_train[:10000])
    return model, {"test_accuracy": test_acc, "train_accuracy_first_10k": train_acc, "train_seconds": seconds}


def save_weights(model: MNISTClassifier, out: str | os.PathLike) -> str:
    """Write the state dict to ``out`` atomically and record its sha256 in CHECKSUMS; returns the digest."""
    with atomic_file(out) as fh:
        torch.save({k: v.detach().clone() for k, v in model.state_dict().items()}, fh)
    return write_checksum(Path(out))


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--root", required=True, help="data root holding the MNIST IDX files (mnist/*-ubyte.gz)")
    p.add_argument("--out", default=str(DEFAULT_WEIGHTS), help="weights file to write (+ CHECKSUMS beside it)")
    p.add_argument("--epochs", type=int, default=5)
    p.add_argument("--batch-size", type=int, default=128)
    p.add_argument("--lr", type=float, default=2e-3)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=None, help="torch CPU threads (default: torch's choice)")
    args = p.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    model, stats = train(args.root, epochs=args.epochs, batch_size=args.batch_size, lr=args.lr, seed=args.seed)
    digest = save_weights(model, args.out)
    size = Path(args.out).stat().st_size
    print(f"test accuracy (t10k): {stats['test_accuracy']:.4f}  "
          f"train accuracy (first 10k): {stats['train_accuracy_first_10k']:.4f}  "
          f"training time: {stats['train_seconds'] / 60:.1f} min")
    print(f"wrote {args.out} ({size / 1e6:.2f} MB), sha256 {digest}")
    return {**stats, "sha256": digest, "bytes": size}


if __name__ == "__main__":
    main()
