"""Progress of the long non-epoch phases (src/runtime/progress.py): Langevin sampling and AIS report every step through
the run's progress bar, and nothing is shown with trainer.enable_progress_bar=false."""

from __future__ import annotations

import io
import logging

import lightning.pytorch as L
import pytest
import torch
from lightning.pytorch.callbacks import RichProgressBar
from lightning.pytorch.callbacks.progress.rich_progress import CustomProgress
from rich.console import Console

from src.runs.build import build
from src.runtime import progress
from tests.conftest import compose_train

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture
def advances(monkeypatch):
    """Every Phase opened: [description, total, sum of its advances]."""
    opened: list[list] = []
    init, advance = progress.Phase.__init__, progress.Phase.advance

    def spy_init(self, owner, description, total, force=False):
        init(self, owner, description, total, force=force)
        self._record = [description, total, 0]
        opened.append(self._record)

    def spy_advance(self, n=1):
        self._record[2] += n
        advance(self, n)

    monkeypatch.setattr(progress.Phase, "__init__", spy_init)
    monkeypatch.setattr(progress.Phase, "advance", spy_advance)
    return opened


def _attach(module, progress_bar: bool):
    trainer = L.Trainer(accelerator="cpu", logger=False, enable_progress_bar=progress_bar,
                        enable_model_summary=False, enable_checkpointing=False)
    module.trainer = trainer
    return module


def test_langevin_sampling_reports_levels_times_steps(advances):
    cfg = compose_train(["model=ncsn", "data=mnist_images", "loss=ssm_vr",
                         "model.ngf=4", "model.noise.num_classes=3", "model.sampling.n_steps_each=4"])
    module = _attach(build(cfg.model), progress_bar=True)
    x = module.sample(2, generator=torch.Generator().manual_seed(0))
    assert x.shape == (2, 1, 28, 28)
    [(description, total, done)] = advances
    assert "Langevin" in description and total == done == 3 * 4  # L levels x T steps, every one reported
    _attach(module, progress_bar=False)
    module.sample(2, generator=torch.Generator().manual_seed(0))
    assert advances[-1][2] == 0  # enable_progress_bar=false: silent


def test_ais_reports_every_annealing_step(advances):
    cfg = compose_train(["experiment=vae_mnist", "model.latent_dim=2", "model.hidden=8",
                         "model.channels=4", "model.metrics.log_likelihood.ais.n_steps=7",
                         "model.metrics.log_likelihood.ais.n_chains=2", "model.metrics.log_likelihood.ais.leapfrog=1"])
    module = _attach(build(cfg.model), progress_bar=True)
    x = torch.bernoulli(torch.full((3, 1, 28, 28), 0.3))
    ll = module.log_likelihood_metrics(x)["log_likelihood"]
    assert ll.shape == (3,) and torch.isfinite(ll).all()
    [(description, total, done)] = advances
    assert "AIS" in description and total == done == 7


def test_phase_joins_a_live_rich_progress_bar_and_leaves_it(monkeypatch):
    """Inside Lightning's live Rich bar the phase is one more task, removed at its end."""
    monkeypatch.setattr(progress, "_interactive", lambda: True)  # a terminal
    bar = RichProgressBar()
    bar.progress = CustomProgress(console=Console(file=io.StringIO(), force_terminal=True))
    bar.progress.start()
    bar._progress_stopped = False

    class FakeTrainer:
        progress_bar_callback = bar
        is_global_zero = True

    try:
        with progress.phase(FakeTrainer(), "FID", total=5) as advance:
            [task] = bar.progress.tasks
            for _ in range(5):
                advance(1)
            assert task.description == "FID" and task.completed == 5 and task.total == 5
        assert bar.progress.tasks == []
    finally:
        bar.progress.stop()


def test_phase_logs_tenths_when_stderr_is_a_file(caplog):
    """In a log file (nohup, CI) a bar prints nothing useful: start, each tenth with the time left, end."""
    with caplog.at_level(logging.INFO, logger="src.runtime.progress"), \
            progress.phase(None, "AIS", total=40, force=True) as advance:
        for _ in range(40):
            advance(1)
    lines = [r.getMessage() for r in caplog.records]
    assert lines[0] == "AIS: started (40 in all)" and lines[-1].startswith("AIS: done (40) in ")
    assert [line.split(":")[1].split("%")[0].strip() for line in lines[1:-1]] == [str(10 * k) for k in range(1, 10)]
    assert all("s left" in line for line in lines[1:-1])


def test_phase_is_silent_without_a_trainer_or_on_other_ranks(capsys, monkeypatch):
    monkeypatch.setattr(progress, "_interactive", lambda: True)
    class Rank1:
        progress_bar_callback = object()
        is_global_zero = False

    for owner in (None, torch.nn.Linear(1, 1), Rank1()):
        with progress.phase(owner, "quiet", total=3) as advance:
            advance(3)
    assert capsys.readouterr().err == ""
    with progress.phase(None, "shown", total=3, force=True) as advance:  # scripts may ask for a bar
        advance(3)
    assert "shown" in capsys.readouterr().err
    with progress.outside_a_trainer():  # a benchmark calling module.sample: the module's phases show
        with progress.phase(torch.nn.Linear(1, 1), "a module's phase", total=3) as advance:
            advance(3)
        with progress.phase(Rank1(), "rank 1 stays quiet", total=3) as advance:  # a Trainer decides for itself
            advance(3)
    err = capsys.readouterr().err
    assert "a module's phase" in err and "rank 1" not in err
    with progress.phase(None, "quiet again", total=3) as advance:  # only inside the block
        advance(3)
    assert capsys.readouterr().err == ""


def test_an_unconfigured_process_still_gets_the_log_lines_on_stderr():
    """``python -m src.evaluate`` configures no logging (no Hydra job): ensure_log_lines routes the phases' lines to
    stderr, so a 30-minute FID in a log file shows its tenths."""
    import subprocess
    import sys

    code = ("from src.runtime import progress\n"
            "progress.ensure_log_lines()\n"
            "with progress.phase(None, 'FID', total=10, force=True) as advance:\n"
            "    [advance(1) for _ in range(10)]\n")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True)
    lines = [line for line in done.stderr.splitlines() if "src.runtime.progress" in line]
    assert "FID: started (10 in all)" in lines[0] and "FID: done (10)" in lines[-1] and len(lines) == 11


def test_a_test_only_trainer_keeps_a_bar_only_on_a_terminal(monkeypatch):
    for tty, rate in ((True, 1), (False, 0)):
        monkeypatch.setattr(progress, "_interactive", lambda tty=tty: tty)
        assert progress.test_progress_bar().refresh_rate == rate
