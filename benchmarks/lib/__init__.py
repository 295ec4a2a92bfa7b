"""What the benchmark tools and studies share; no module here imports a tool or a study.

- :mod:`~benchmarks.lib.results`: paths, what a result records, result files and ``--render``;
- :mod:`~benchmarks.lib.jobs`: the one job runner (``python -m src.<entry>`` processes, one or N at a time);
- :mod:`~benchmarks.lib.step`: one training step outside a Trainer, measured;
- :mod:`~benchmarks.lib.step_cases`: the training step of each family and variant;
- :mod:`~benchmarks.lib.step_cost`: the per-family step-cost tables (``benchmarks.tools.step_cost``);
- :mod:`~benchmarks.lib.paper`: the paper's figures;
- :mod:`~benchmarks.lib.runs`: finished run directories and the grids' cells;
- :mod:`~benchmarks.lib.generative_grids`: the generative (VAE, NCSN) training-curve grids.
"""
