"""Hydra entry point: compose -> instantiate -> fit -> test -> ``<run dir>/metrics.json`` (src/runs/training.py).

    python -m src.train                                     # DEQ-DKEF, exact SM, synthetic Gaussian
    python -m src.train model=dkef loss=sm deq=true data=redwine data.root=<data dir>
    python -m src.train -m loss=sm,ssm_vr deq=true,false    # a sweep: one run directory per job
"""

from __future__ import annotations

import hydra
from omegaconf import DictConfig

from src.runs.errors import one_line_errors
from src.runs.training import optimized_value, output_dir, sweeper_needs_value, train
from src.runtime.run_dir import claim_run_dir, release


@hydra.main(version_base="1.3", config_path="../conf", config_name="train")
def main(cfg: DictConfig) -> float | None:
    # the project's own errors (a bad value, a missing file, another run's checkpoint): one line, no traceback
    # (HYDRA_FULL_ERROR=1 keeps it; src/runs/errors.py)
    with one_line_errors():
        # one run, one directory: refuse a run dir another run used (unless resuming from it), then lock it
        lock = claim_run_dir(output_dir(cfg), cfg.get("ckpt_path"))
        try:
            metrics = train(cfg)
        finally:
            release(lock)
        return optimized_value(metrics, cfg, required=sweeper_needs_value())


if __name__ == "__main__":
    main()
