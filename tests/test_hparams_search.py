"""hparams_search=dkef_optuna: Hydra's Optuna sweeper over src.train's returned `optimized_metric`."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from tests.conftest import CONF_DIR, FAST, REPO_ROOT

pytestmark = pytest.mark.skipif(
    importlib.util.find_spec("hydra_plugins.hydra_optuna_sweeper") is None,
    reason="the Optuna sweeper plugin is not installed (pip install -e '.[optuna]')",
)

# Two trials of two tiny epochs each; checkpoints monitor val/sm_loss, so each job returns its best epoch's score.
SWEEP = ["-m", "hparams_search=dkef_optuna", "hydra.sweeper.n_trials=2", *FAST, "callbacks=default",
         "trainer.enable_progress_bar=false", "trainer.max_epochs=2"]
PARAMS = {"model.optimizer.lr", "deq.norm_lambda", "model.net.deq_width", "loss"}


def sweep(tmp: Path, mode: str) -> tuple[dict, list[tuple[dict, float]]]:
    """Run a sweep; return optimization_results.yaml and each job's (overrides, returned metric)."""
    cmd = [sys.executable, "-m", "src.train", *SWEEP, f"optimized_metric_mode={mode}", f"hydra.sweep.dir={tmp}"]
    res = subprocess.run(cmd, check=False, cwd=REPO_ROOT, capture_output=True, text=True, timeout=600,
                         env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert res.returncode == 0, res.stderr[-3000:]
    assert "Best value:" in res.stdout + res.stderr and "Best parameters:" in res.stdout + res.stderr
    jobs = []
    for job in sorted(p for p in tmp.iterdir() if p.is_dir() and p.name.isdigit()):
        metrics = json.loads((job / "metrics.json").read_text())
        overrides = dict(o.split("=", 1) for o in yaml.safe_load((job / ".hydra" / "overrides.yaml").read_text()))
        jobs.append((overrides, metrics["best/val/sm_loss"]))
    return yaml.safe_load((tmp / "optimization_results.yaml").read_text()), jobs


def test_optuna_sweep_reports_the_best_trial_in_either_direction(tmp_path):
    results = {mode: sweep(tmp_path / mode, mode) for mode in ("min", "max")}
    for mode, pick in (("min", min), ("max", max)):
        best, jobs = results[mode]
        assert len(jobs) == 2
        values = [v for _, v in jobs]
        assert values[0] != values[1]  # two different trials, so the choice of the best one means something
        assert best["best_value"] == pytest.approx(pick(values), rel=1e-9, abs=0)
        winner = jobs[values.index(pick(values))][0]
        assert set(best["best_params"]) == PARAMS
        for key, value in best["best_params"].items():
            assert str(value) == winner[key] or float(value) == pytest.approx(float(winner[key]), rel=1e-12)
        assert 1e-4 <= best["best_params"]["model.optimizer.lr"] <= 1e-2
    # the sampler is seeded by `seed`: both sweeps proposed the same trials, and picked opposite ends
    trials = {mode: [{k: o[k] for k in PARAMS} for o, _ in jobs] for mode, (_, jobs) in results.items()}
    assert trials["min"] == trials["max"]
    assert results["min"][0]["best_params"] != results["max"][0]["best_params"]


def test_direction_follows_optimized_metric_mode():
    from hydra import compose, initialize_config_dir
    from hydra.core.global_hydra import GlobalHydra

    import src  # noqa: F401  (registers the sweep_direction resolver, as every entry point does)

    for mode, direction in (("min", "minimize"), ("max", "maximize")):
        GlobalHydra.instance().clear()
        with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
            cfg = compose(config_name="train", return_hydra_config=True,
                          overrides=["hparams_search=dkef_optuna", f"optimized_metric_mode={mode}", "seed=7"])
        assert cfg.hydra.sweeper.direction == direction
        assert cfg.hydra.sweeper.sampler.seed == 7
        assert cfg.hydra.sweeper.sampler._target_ == "optuna.samplers.TPESampler"
    GlobalHydra.instance().clear()
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        cfg = compose(config_name="train", return_hydra_config=True,
                      overrides=["hparams_search=dkef_optuna", "optimized_metric_mode=lowest"])
    with pytest.raises(Exception, match="optimized_metric_mode='lowest' is invalid"):
        _ = cfg.hydra.sweeper.direction
