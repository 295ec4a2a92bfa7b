"""Studies, each the answer to one question (its result and command in ``benchmarks/results``):
``python -m benchmarks.studies.<name> --help``. A study that has answered its question is retired: its result
stays, and the index names the commit that last had its script (``benchmarks.tools.results_index.RETIRED``)."""
