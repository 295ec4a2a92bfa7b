"""Sample grids: the PNG writer's layout and pixel values, logger hand-off, and the Lightning callback."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import lightning.pytorch as L
import numpy as np
import pytest
import torch
from PIL import Image
from torch.utils.data import DataLoader, TensorDataset

from src.callbacks.samples import SampleGridCallback
from src.sampling.grids import log_image, make_grid_array, save_image_grid


def _read(path: Path) -> tuple[str, np.ndarray]:
    with Image.open(path) as im:
        return im.mode, np.asarray(im).copy()


def test_grid_layout_and_pixel_values(tmp_path):
    # 5 grey 3×4 images, 3 per row, padding 2 → 2 rows: (2·(3+2)+2) × (3·(4+2)+2) = 12 × 20 pixels
    values = [0.0, 0.25, 0.5, 1.0, 0.75]
    images = torch.stack([torch.full((1, 3, 4), v) for v in values])
    images[0, 0] = torch.arange(12, dtype=torch.float32).view(3, 4) * 10 / 255  # orientation check: 0, 10, …, 110
    images[4, 0, 0, 0], images[4, 0, 0, 1] = 1.7, -0.3  # clamped
    path = save_image_grid(images, tmp_path / "sub" / "grid.png", nrow=3, padding=2)
    assert path == tmp_path / "sub" / "grid.png"
    mode, a = _read(path)
    assert mode == "L" and a.shape == (12, 20)
    expected = [None, 64, 128, 255, 191]  # floor(255·v + ½)
    for k in range(5):
        r, q = divmod(k, 3)
        cell = a[2 + r * 5 : 2 + r * 5 + 3, 2 + q * 6 : 2 + q * 6 + 4]
        if k == 0:
            np.testing.assert_array_equal(cell, np.arange(12).reshape(3, 4) * 10)
        elif k == 4:
            assert cell[0, 0] == 255 and cell[0, 1] == 0 and (cell.flat[2:] == 191).all()
        else:
            assert (cell == expected[k]).all(), (k, cell)
    # padding rows/columns and the empty 6th cell are 0
    assert (a[:2] == 0).all() and (a[:, :2] == 0).all() and (a[5:7] == 0).all() and (a[:, 6:8] == 0).all()
    assert (a[7:10, 14:18] == 0).all()
    assert a.sum() == sum(np.arange(12) * 10) + 64 * 12 + 128 * 12 + 255 * 12 + 191 * 10 + 255
    assert [p.name for p in path.parent.iterdir()] == ["grid.png"]  # no temporary file left behind


def test_grid_rgb_default_nrow_and_overwrite(tmp_path):
    images = torch.zeros(10, 3, 5, 6)
    images[:, 0] = 1.0  # red
    images[3, 2] = 0.5  # image 3: red + half blue
    path = tmp_path / "rgb.png"
    path.write_bytes(b"old contents")
    save_image_grid(images, path, padding=1)  # nrow = ceil(sqrt(10)) = 4 → 3 rows
    mode, a = _read(path)
    assert mode == "RGB" and a.shape == (3 * 6 + 1, 4 * 7 + 1, 3)
    np.testing.assert_array_equal(a[1, 1], [255, 0, 0])
    np.testing.assert_array_equal(a[1 + 5, 1 + 3 * 7 + 2], [0, 0, 0])  # padding row between grid rows
    np.testing.assert_array_equal(a[1 + 2, 1 + 3 * 7 + 2], [255, 0, 128])
    assert make_grid_array(torch.rand(64, 1, 28, 28)).shape == (8 * 30 + 2, 8 * 30 + 2, 1)


@pytest.mark.parametrize("bad", [torch.rand(2, 28, 28), torch.rand(2, 2, 8, 8), torch.rand(0, 1, 8, 8)])
def test_grid_rejects_bad_shapes(tmp_path, bad):
    with pytest.raises(ValueError):
        save_image_grid(bad, tmp_path / "x.png")
    assert not (tmp_path / "x.png").exists()


class _ImageLogger:  # W&B-like: has log_image
    def __init__(self):
        self.calls = []

    def log_image(self, key, images, step=None):
        self.calls.append((key, images, step))


class _Writer:  # TensorBoard SummaryWriter-like
    def __init__(self):
        self.calls = []

    def add_image(self, tag, img, global_step=None, dataformats="CHW"):
        self.calls.append((tag, np.asarray(img), global_step, dataformats))


def test_log_image_routes_to_wandb_and_tensorboard(tmp_path):
    path = save_image_grid(torch.full((4, 1, 2, 2), 0.5), tmp_path / "g.png", padding=0)
    wandb_like, tb_like, csv_like = _ImageLogger(), SimpleNamespace(experiment=_Writer()), SimpleNamespace()
    trainer = SimpleNamespace(loggers=[wandb_like, tb_like, csv_like], global_step=7)
    assert log_image(trainer, "samples", path) == 2
    assert wandb_like.calls == [("samples", [str(path)], 7)]
    ((tag, img, step, fmt),) = tb_like.experiment.calls
    assert (tag, step, fmt, img.shape) == ("samples", 7, "HW", (4, 4)) and (img == 128).all()
    assert log_image(SimpleNamespace(loggers=[], global_step=0), "samples", path) == 0


class _TinyGenerator(L.LightningModule):
    """Fits a line; ``sample_pixels`` returns seeded random grey 6×5 images (or None)."""

    def __init__(self, generates: bool = True):
        super().__init__()
        self.lin = torch.nn.Linear(2, 1)
        self.generates = generates
        self.sample_modes: list[bool] = []

    def training_step(self, batch, batch_idx):
        x, y = batch
        return torch.nn.functional.mse_loss(self.lin(x), y)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)

    def train_dataloader(self):
        g = torch.Generator().manual_seed(0)
        return DataLoader(TensorDataset(torch.randn(8, 2, generator=g), torch.randn(8, 1, generator=g)), batch_size=2)

    def sample_pixels(self, n):
        self.sample_modes.append(self.training)
        return torch.rand(n, 1, 6, 5) if self.generates else None


def _fit(module, root, cb):
    trainer = L.Trainer(max_steps=2, logger=False, enable_checkpointing=False, enable_progress_bar=False,
                        enable_model_summary=False, default_root_dir=str(root), callbacks=[cb],
                        accelerator="cpu", devices=1)
    trainer.fit(module)
    return trainer


def test_callback_writes_grids_during_and_after_fit(tmp_path, one_thread):
    module = _TinyGenerator()
    cb = SampleGridCallback(every_n_steps=1, n=6, at_end=True)
    _fit(module, tmp_path, cb)
    step1, step2, final = tmp_path / "samples/step_0000001.png", tmp_path / "samples/step_0000002.png", \
        tmp_path / "samples.png"
    assert cb.written == [step1, step2, final]
    assert sorted(p.name for p in (tmp_path / "samples").iterdir()) == [step1.name, step2.name]
    assert module.sample_modes == [False, False, False]  # sampled in eval mode
    assert module.training  # ... and the mode restored
    torch.manual_seed(0)  # the callback's seed: every grid shows exactly these images
    expected = make_grid_array(torch.rand(6, 1, 6, 5))[:, :, 0]
    for path in (step1, step2, final):
        mode, a = _read(path)
        assert mode == "L" and a.shape == (2 * 8 + 2, 3 * 7 + 2)
        np.testing.assert_array_equal(a, expected)


def test_callback_end_only_and_non_generating_module(tmp_path, one_thread):
    cb = SampleGridCallback(every_n_steps=None, n=4)
    _fit(_TinyGenerator(), tmp_path / "a", cb)
    assert cb.written == [tmp_path / "a" / "samples.png"] and not (tmp_path / "a" / "samples").exists()
    cb = SampleGridCallback(every_n_steps=1, n=4)
    _fit(_TinyGenerator(generates=False), tmp_path / "b", cb)
    assert cb.written == [] and not (tmp_path / "b" / "samples").exists()
    assert not (tmp_path / "b" / "samples.png").exists()


def test_callback_keeps_training_rng_and_rank_zero_only(tmp_path):
    module, cb = _TinyGenerator(), SampleGridCallback(n=3, seed=5)
    torch.manual_seed(123)
    state = torch.get_rng_state()
    a, b = cb._sample(module), cb._sample(module)
    assert torch.equal(torch.get_rng_state(), state)  # training's random stream untouched
    torch.manual_seed(5)
    assert torch.equal(a, b) and torch.equal(a, torch.rand(3, 1, 6, 5))
    other_rank = SimpleNamespace(is_global_zero=False, loggers=[], global_step=1)
    assert cb.write(other_rank, module, tmp_path / "x.png") is None and not (tmp_path / "x.png").exists()
