# Set-up and everyday commands. Every target creates .venv and installs what it needs on first use.
#   make train ARGS="variant=additive"    train (the default run takes under a minute on 2 CPU cores)
#   make test                             the test suite on every core (CI runs exactly this); WORKERS=0: one process
PYTHON ?= python3
VENV   ?= .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.attnlab-installed
ARGS   ?=

.PHONY: setup train test lint format clean

$(STAMP): pyproject.toml scripts/install-torch.sh
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade "pip>=23.1"
	bash scripts/install-torch.sh $(BIN)/python
	$(BIN)/python -m pip install --quiet -e ".[dev]"
	touch $@

setup: $(STAMP)

train: $(STAMP)
	$(BIN)/python train.py $(ARGS)

# the suite on every core (pytest-xdist); a test file stays on one worker, so its shared fixtures are built once.
# WORKERS=0 runs it in this process (pdb, -s)
WORKERS ?= auto
test: $(STAMP)
	$(BIN)/python -m pytest -n $(WORKERS) --dist loadfile $(ARGS)

lint: $(STAMP)
	$(BIN)/ruff check . && $(BIN)/ruff format --check .

format: $(STAMP)
	$(BIN)/ruff check --fix . && $(BIN)/ruff format .

clean:
	rm -rf outputs multirun .pytest_cache .ruff_cache
