"""Reusable, tested command-line tools: ``python -m benchmarks.tools.<name> --help``."""
