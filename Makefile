# Set-up and everyday commands. Every target creates .venv and installs what it needs on first use.
#   make train ARGS="variant=additive"    train (the default run takes under a minute on 2 CPU cores)
#   make test                             the test suite on every core (CI runs this); WORKERS=0: one process
#   make docs                             the docs site into site/ (strict: a broken link or API entry fails; CI runs this)
PYTHON ?= python3
VENV   ?= .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.attnlab-installed
ARGS   ?=

.PHONY: setup train test docs lint format clean

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

# mkdocs.yml: offline (nothing fetched), strict. NO_MKDOCS_2_WARNING silences mkdocs-material's banner about its
# successor, printed on every build.
docs: $(STAMP)
	NO_MKDOCS_2_WARNING=1 $(BIN)/mkdocs build --strict --site-dir site

lint: $(STAMP)
	$(BIN)/ruff check . && $(BIN)/ruff format --check .

format: $(STAMP)
	$(BIN)/ruff check --fix . && $(BIN)/ruff format .

clean:
	rm -rf outputs multirun site .pytest_cache .ruff_cache
