"""LightningDataModules for the DKEF experiments: UCI (Parkinsons, RedWine, WhiteWine) and N(0, I_D).

Both are :class:`~src.data.contract.ScoreDataModule` s with ``data_shape = (D,)``. They hold whole splits
in memory as float32 tensors ``train_data``, ``val_data``, ``test_data`` [N, D] (available after
:meth:`setup`; ``split_tensor(split, n)`` gives their first ``n`` rows) and give batches as plain tensors
[B, D]. The Gaussian also offers its ground truth (``has_ground_truth``: ``true_log_density``,
``true_score``, in the dtype and device of their argument). The training loader reshuffles
every epoch in a seeded order (every row, unless the last batch would hold a single row: a DKEF step needs
two) and resumes mid-epoch (:mod:`src.data.resumable`); the
val/test loaders keep the order. :meth:`setup` is idempotent: the
data are built once per module and never re-randomised.
"""

from __future__ import annotations

import logging

import numpy as np
import torch
from torch.utils.data import DataLoader, Dataset

from src.data import gaussian
from src.data.contract import ScoreDataModule
from src.data.preprocessing import SPLITS, WHITEN_ON, PreprocessedSplits, Whitening, preprocess
from src.data.resumable import ResumableLoader, ResumableSampler, eval_generator
from src.data.uci import DATASETS, get_dataset, locate_uci

log = logging.getLogger(__name__)


class RowDataset(Dataset):
    """Rows of a tensor [N, D]; item i is the row tensor itself (so the default collate gives [B, D])."""

    def __init__(self, data: torch.Tensor):
        self.data = data

    def __len__(self) -> int:
        return self.data.shape[0]

    def __getitem__(self, idx: int) -> torch.Tensor:
        return self.data[idx]

    def __getitems__(self, indices: list[int]) -> torch.Tensor:  # batched fetch: one indexing op per batch
        return self.data[torch.as_tensor(indices, dtype=torch.long)]


def _stack(batch) -> torch.Tensor:
    return batch if torch.is_tensor(batch) else torch.stack(list(batch))


def positive_int(label: str, value) -> int:
    if isinstance(value, bool) or int(value) != value or int(value) < 1:
        raise ValueError(f"{label}={value!r} is invalid: it must be an integer >= 1")
    return int(value)


class _InMemoryDataModule(ScoreDataModule):
    def __init__(self, batch_size: int, eval_batch_size: int, num_workers: int):
        super().__init__()
        self.batch_size = positive_int("batch_size", batch_size)
        self.eval_batch_size = positive_int("eval_batch_size", eval_batch_size)
        if int(num_workers) < 0:
            raise ValueError(f"num_workers={num_workers!r} is invalid: it must be >= 0")
        self.num_workers = int(num_workers)
        self.train_data: torch.Tensor | None = None
        self.val_data: torch.Tensor | None = None
        self.test_data: torch.Tensor | None = None

    dim: int | None

    @property
    def data_shape(self) -> tuple[int, ...]:
        if self.dim is None:
            raise RuntimeError(f"{type(self).__name__}: the dimension is known after setup() (or pass dim=)")
        return (int(self.dim),)

    def _loader(self, data: torch.Tensor | None, batch_size: int, train: bool) -> DataLoader:
        if data is None:
            raise RuntimeError(f"{type(self).__name__}: call setup() before asking for a dataloader")
        options = {"batch_size": batch_size, "drop_last": False, "num_workers": self.num_workers,
                   "persistent_workers": self.num_workers > 0, "collate_fn": _stack}
        if train:  # resumable, seeded order (src.data.resumable)
            sampler = ResumableSampler(data.shape[0], shuffle=True)
            # A DKEF step fits α on one half of its batch and takes the loss on the other, so it needs two rows:
            # an epoch whose last batch would hold one row (k·B + 1 rows on this replica, e.g. WhiteWine's
            # reference split, 3 969 = 31·128 + 1) drops that row. Any other size keeps every row, as before.
            options["drop_last"] = len(sampler) % batch_size == 1
            return ResumableLoader(RowDataset(data), sampler, **options)
        return DataLoader(RowDataset(data), shuffle=False, generator=eval_generator(), **options)

    def train_dataloader(self) -> DataLoader:
        return self._loader(self.train_data, self.batch_size, train=True)

    def val_dataloader(self) -> DataLoader:
        return self._loader(self.val_data, self.eval_batch_size, train=False)

    def test_dataloader(self) -> DataLoader:
        return self._loader(self.test_data, self.eval_batch_size, train=False)


class UCIDataModule(_InMemoryDataModule):
    """Parkinsons / RedWine / WhiteWine, preprocessed as in docs/data.md §1 (see :mod:`src.data.preprocessing`).

    Files are read from ``root`` (``root/wine-quality/winequality-red.csv``,
    ``root/parkinsons-telemonitoring/parkinsons_updrs.data``, or the file directly in ``root``) and
    downloaded from UCI into that layout when missing and ``download=True``. ``whiten_on="train"``
    (default) fits the whitening on the training rows only, so no test information leaks into training;
    ``"all"`` reproduces the reference code (fit on every row, test included). After :meth:`setup`,
    ``whitening`` holds the fitted map (``whitening.inverse(z)`` maps back to data units) and ``columns``
    the feature names.
    """

    def __init__(
        self,
        name: str,
        root: str,
        batch_size: int = 128,
        eval_batch_size: int = 512,
        download: bool = True,
        noise_std: float = 0.05,
        split: str = "paper",
        whiten_on: str = "train",
        seed: int = 2019,
        num_workers: int = 0,
        dim: int | None = None,
    ):
        super().__init__(batch_size, eval_batch_size, num_workers)
        key = str(name).lower()
        if key not in DATASETS:
            raise ValueError(f"unknown UCI data set {name!r}: valid names are {', '.join(DATASETS)}")
        if split not in SPLITS:
            raise ValueError(f"split={split!r} is invalid: choose one of {', '.join(SPLITS)}")
        if whiten_on not in WHITEN_ON:
            raise ValueError(f"whiten_on={whiten_on!r} is invalid: choose one of {', '.join(WHITEN_ON)}")
        if not (float(noise_std) >= 0 and np.isfinite(float(noise_std))):
            raise ValueError(f"noise_std={noise_std!r} is invalid: it must be a finite number >= 0")
        self.name = key
        self.root = str(root)
        self.download = bool(download)
        self.noise_std = float(noise_std)
        self.split = split
        self.whiten_on = whiten_on
        self.seed = int(seed)
        self.expected_dim = None if dim is None else int(dim)
        self.dim: int | None = self.expected_dim
        self.whitening: Whitening | None = None
        self.columns: list[str] | None = None
        self.n_total: int | None = None
        self._splits: PreprocessedSplits | None = None

    def prepare_data(self) -> None:
        """Check the data file is there, downloading it when missing (``download=True``)."""
        locate_uci(self.name, self.root, download=self.download)

    def setup(self, stage: str | None = None) -> None:
        if self._splits is not None:
            return
        ds = get_dataset(self.name)
        raw, columns = ds.parser(locate_uci(self.name, self.root, download=self.download))
        if self.expected_dim is not None and raw.shape[1] != self.expected_dim:
            raise ValueError(
                f"data.dim={self.expected_dim} does not match the {self.name} data, which have "
                f"D={raw.shape[1]} "
                f"columns after preprocessing ({', '.join(columns)}); set data.dim={raw.shape[1]} "
                "(the model's input_dim follows data.dim)"
            )
        splits = preprocess(
            raw,
            dequantize_data=ds.dequantize,
            seed=self.seed,
            split=self.split,
            whiten_on=self.whiten_on,
            noise_std=self.noise_std,
        )
        self._splits = splits
        self.train_data, self.val_data, self.test_data = (
            torch.from_numpy(a) for a in (splits.train, splits.val, splits.test)
        )
        self.whitening, self.columns, self.n_total, self.dim = splits.whitening, columns, len(raw), splits.dim
        log.info(
            "%s: N=%d, D=%d, train/val/test = %d/%d/%d (split=%s, whitened on %s, noise_std=%g)",
            self.name,
            len(raw),
            self.dim,
            *splits.sizes,
            self.split,
            self.whiten_on,
            self.noise_std,
        )


class GaussianDataModule(_InMemoryDataModule):
    """i.i.d. samples of N(0, I_dim) with a known log-density and score (see :mod:`src.data.gaussian`)."""

    def __init__(
        self,
        dim: int = 10,
        n_train: int = gaussian.DEFAULT_SIZES[0],
        n_val: int = gaussian.DEFAULT_SIZES[1],
        n_test: int = gaussian.DEFAULT_SIZES[2],
        batch_size: int = 128,
        eval_batch_size: int = 512,
        seed: int = 0,
        num_workers: int = 0,
    ):
        super().__init__(batch_size, eval_batch_size, num_workers)
        self.dim = gaussian._check_dim(dim)
        self.n_train = positive_int("n_train", n_train)
        self.n_val = positive_int("n_val", n_val)
        self.n_test = positive_int("n_test", n_test)
        self.seed = int(seed)

    has_ground_truth = True

    def prepare_data(self) -> None:  # nothing to fetch
        pass

    def setup(self, stage: str | None = None) -> None:
        if self.train_data is not None:
            return
        parts = gaussian.gaussian_splits(self.dim, self.n_train, self.n_val, self.n_test, seed=self.seed)
        self.train_data, self.val_data, self.test_data = (torch.from_numpy(a) for a in parts)

    def true_log_density(self, x: torch.Tensor) -> torch.Tensor:
        """log N(x; 0, I) per row of ``x`` [B, D] → [B], in x's dtype and device."""
        return gaussian.true_log_density(x)

    def true_score(self, x: torch.Tensor) -> torch.Tensor:
        """∇ₓ log N(x; 0, I) = −x, [B, D], in x's dtype and device."""
        return gaussian.true_score(x)
