# The two commands: `make run` serves the default model, `make test` passes the suite.
# Both set up .venv on a fresh machine. torch is installed first and pinned: a looser
# requirement pulls a multi-GB CUDA build, while torch==2.13.0 resolves to the CPU wheel here.
PYTHON ?= python3
# Test files run in this many pytest-xdist workers (a file stays in one, its fixtures with it). Most of a
# test's time is spent waiting on nats-server, boxes and sockets: on the 2-core CI machine two workers
# took the suite from about 19 minutes to 12. TEST_WORKERS=0 runs it in this process alone.
TEST_WORKERS ?= 2
VENV := .venv
BIN := $(VENV)/bin
TORCH := torch==2.13.0
# Where torch==2.13.0 comes from. Empty: pip's own configuration (these machines' find-links hold the CPU wheel).
# On a Linux machine whose pip resolves it to PyPI's CUDA build (a multi-GB download), name PyTorch's CPU index:
#   make run TORCH_PIP_ARGS="--index-url https://download.pytorch.org/whl/cpu"
TORCH_PIP_ARGS ?=
STAMP := $(VENV)/.installed

.PHONY: run test setup lint bench clean

$(BIN)/python:
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip

$(STAMP): $(BIN)/python pyproject.toml
	@echo "fleetbox: installing $(TORCH) (the CPU build) into $(VENV) ..."
	$(BIN)/pip install --quiet $(TORCH_PIP_ARGS) $(TORCH)
	@echo "fleetbox: installing fleetbox and its dependencies (a minute or two on a fresh machine) ..."
	$(BIN)/pip install --quiet -e '.[dev]'
	touch $(STAMP)

setup: $(STAMP)

run: setup
	$(BIN)/fleetbox serve $(ARGS)

test: setup
	$(BIN)/python -m pytest -q -n $(TEST_WORKERS) --dist loadfile $(PYTEST_ARGS)

lint: setup
	$(BIN)/ruff check .

bench: setup
	$(BIN)/python benchmarks/e2e_embed.py

clean:
	rm -rf $(VENV) .pytest_cache
