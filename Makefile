# Set-up and everyday commands. Every target creates .venv and installs what it needs on first use.
#   make train ARGS="variant=additive"    train (a fresh clone's set-up and the default run: under a minute on 2 cores)
#   make test                             the test suite on every core (CI runs this); WORKERS=0: one process
#   make docs                             the docs site into site/ (strict: a broken link or API entry fails; CI runs this)
PYTHON ?= python3
VENV   ?= .venv
BIN    := $(VENV)/bin
RUN_STAMP := $(VENV)/.attnlab-run
STAMP  := $(VENV)/.attnlab-installed
ARGS   ?=
# pip without its version check (a network round trip); here only to bring an old pip up to date
PIP    := PIP_DISABLE_PIP_VERSION_CHECK=1 $(BIN)/python -m pip install --quiet

.PHONY: setup train test docs lint format clean

# what training needs: torch (never a CUDA build on a machine without a GPU) and the package with its dependencies,
# in one resolve, by uv where it can be installed (scripts/install-torch.sh says why), else pip
$(RUN_STAMP): pyproject.toml scripts/install-torch.sh
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -c "import pip, sys; sys.exit(int(pip.__version__.split('.')[0]) < 23)" || $(PIP) --upgrade "pip>=23.1"
	PIP_DISABLE_PIP_VERSION_CHECK=1 bash scripts/install-torch.sh $(BIN)/python -e .
	touch $@

# and the tools: tests, lint, docs, the optional Hydra plugins (with uv, as above, where it can)
$(STAMP): $(RUN_STAMP)
	PIP_DISABLE_PIP_VERSION_CHECK=1 bash scripts/install-torch.sh $(BIN)/python -e ".[dev]"
	touch $@

setup: $(STAMP)

train: $(RUN_STAMP)
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
