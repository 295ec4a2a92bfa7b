"""The benchmarks: ``tools`` (reusable command-line tools), ``studies`` (one study a question),
``lib`` (what tools and studies share) and ``results`` (every committed table, with the command that made it).

Run a tool or a study from the repository root as a module: ``python -m benchmarks.tools.run_grid dkef …``."""
