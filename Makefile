# The two commands: `make run` serves the default model, `make test` passes the suite.
# Both set up .venv on a fresh machine. torch is installed first and pinned: a looser
# requirement pulls a multi-GB CUDA build, while torch==2.13.0 resolves to the CPU wheel.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
TORCH := torch==2.13.0
STAMP := $(VENV)/.installed

.PHONY: run test setup lint bench clean

$(BIN)/python:
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip

$(STAMP): $(BIN)/python pyproject.toml
	@echo "fleetbox: installing $(TORCH) (the CPU build) into $(VENV) ..."
	$(BIN)/pip install --quiet $(TORCH)
	@echo "fleetbox: installing fleetbox and its dependencies (a minute or two on a fresh machine) ..."
	$(BIN)/pip install --quiet -e '.[dev]'
	touch $(STAMP)

setup: $(STAMP)

run: setup
	$(BIN)/fleetbox serve $(ARGS)

test: setup
	$(BIN)/python -m pytest -q $(PYTEST_ARGS)

lint: setup
	$(BIN)/ruff check .

bench: setup
	$(BIN)/python benchmarks/e2e_embed.py

clean:
	rm -rf $(VENV) .pytest_cache
