# deqsm developer commands. `make install` then `make test`.
PY ?= python

.PHONY: install test test-all train lint clean bench

install:
	pip install torch==2.13.0
	pip install -e '.[dev]'

test:
	$(PY) -m pytest -q

test-all:
	$(PY) -m pytest -q -m "slow or not slow"

train:
	$(PY) -m src.train $(ARGS)

lint:
	ruff check src tests benchmarks

bench:
	$(PY) -m benchmarks.tools.objectives_bench --quick

clean:
	rm -rf outputs multirun wandb lightning_logs .pytest_cache .ruff_cache
	find . -name __pycache__ -type d -prune -exec rm -rf {} +
