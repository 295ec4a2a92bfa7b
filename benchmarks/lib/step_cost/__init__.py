"""The step-cost tables of ``python -m benchmarks.tools.step_cost FAMILY``: one module per family, each with
``STEM`` (its result file), ``options(parser)``, ``run(args)`` and ``render(res)``."""
