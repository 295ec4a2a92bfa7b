"""Shared test helpers: config composition exactly as users and outside tools do it."""

from __future__ import annotations

import ctypes
import gc
import os

# One intra-op thread in the tests and in the training subprocesses they start: the tensors are tiny, and with
# two threads on a busy 2-core machine torch's thread pool slowed the suite 5-20x (measured: a NICE fast_dev_run
# at 2 threads beside one other busy process took minutes instead of seconds).
os.environ.setdefault("OMP_NUM_THREADS", "1")

from pathlib import Path

import pytest
import torch

torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))
from hydra import compose, initialize_config_dir
from hydra.core.global_hydra import GlobalHydra

REPO_ROOT = Path(__file__).resolve().parents[1]
CONF_DIR = REPO_ROOT / "conf"
SHARED_DATA = REPO_ROOT.parent / "shared" / "data"

# Small, fast settings every composed test run starts from (a test may add more overrides).
FAST_MODEL = [
    "logger=none",
    "callbacks=minimal",
    "model.net.n_inducing=16",
    "model.alpha_refit_points=48",
    "model.metrics.log_likelihood.samples=2000",
]
SMALL_GAUSSIAN = ["data.n_train=96", "data.n_val=32", "data.n_test=32", "data.batch_size=16"]
FAST = [*FAST_MODEL, *SMALL_GAUSSIAN]


def compose_train(overrides: list[str], output_dir: Path | None = None):
    """``hydra.compose`` of conf/train.yaml with the given overrides (and a tmp output dir)."""
    GlobalHydra.instance().clear()
    extra = [f"paths.output_dir={output_dir}"] if output_dir is not None else []
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        return compose(config_name="train", overrides=[*overrides, *extra])


def require_data(*specs) -> Path:
    """``SHARED_DATA`` when it holds every file of ``specs`` (:class:`src.data.download.RemoteFile`, looked for as
    the data modules look: ``find_file``); else the test is skipped with one line naming the first missing file.

    The tests never download a data set (a fresh clone has no ``../shared`` and may have no network; a download
    would also write into a folder the tests do not own): where the files are absent, the tests that read them
    skip, and the rest of the suite runs. CI, which has ``../shared/data``, runs them all."""
    from src.data.download import find_file

    for spec in specs:
        if find_file(spec, SHARED_DATA) is None:
            pytest.skip(f"data file {spec.subdir}/{spec.filename} not found under ../shared/data "
                        "(the tests do not download it)")
    return SHARED_DATA


def require_mnist() -> Path:
    """The data root holding the four MNIST files (``src.data.mnist``), or a skip naming the missing one."""
    from src.data.mnist import FILES, remote_file

    return require_data(*(remote_file(name) for name in FILES.values()))


def require_uci(*names: str) -> Path:
    """The data root holding the UCI files of ``names`` (all three data sets when none is named), or a skip
    naming the missing one."""
    from src.data.uci import DATASETS

    return require_data(*(DATASETS[n].file for n in (names or DATASETS)))


@pytest.fixture
def mnist_root() -> Path:
    """The data root holding MNIST (:func:`require_mnist`)."""
    return require_mnist()


@pytest.fixture
def uci_root() -> Path:
    """The data root holding the three UCI data sets (:func:`require_uci`)."""
    return require_uci()


@pytest.fixture
def one_thread():
    """Tiny tensors: with 2 threads on a busy CPU these tests ran 200× slower (thread contention)."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


def release_memory() -> None:
    """Collect garbage, then hand freed heap pages back to the OS (glibc's ``malloc_trim``): torch's CPU
    tensors come from malloc, and without a trim the freed arenas of one test module stay resident through
    the rest of the session."""
    gc.collect()
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):  # not glibc (macOS, musl): nothing to trim
        pass


@pytest.fixture(autouse=True, scope="module")
def _release_memory_after_module():
    """The suite's peak RSS (issue 40): each module's leftovers are freed before the next module starts."""
    yield
    release_memory()

