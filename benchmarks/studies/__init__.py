"""One-off studies, each the answer to one question (its result and command in ``benchmarks/results``):
``python -m benchmarks.studies.<name> --help``."""
