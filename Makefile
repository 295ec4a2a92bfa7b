# deqsm developer commands. `make install` then `make test`.
PY ?= python

.PHONY: install test test-all train lint clean faults

install:
	pip install torch==2.13.0
	pip install -e '.[dev]'

test:
	$(PY) -m pytest -q

test-all:
	$(PY) -m pytest -q -m "slow or not slow"

# the fault suite (tests/test_faults.py): kills, NaN, corrupt files, full disk, concurrent runs -> a table in
# benchmarks/results/faults.md and faults.json
faults:
	FAULTS_OUT=benchmarks/results $(PY) -m pytest -q -s -m slow tests/test_faults.py

train:
	$(PY) -m src.train $(ARGS)

lint:
	ruff check src tests benchmarks

clean:
	rm -rf outputs multirun wandb lightning_logs .pytest_cache .ruff_cache
	find . -name __pycache__ -type d -prune -exec rm -rf {} +
