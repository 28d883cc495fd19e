# Two commands for a fresh machine: `make quickstart` and `make test` (see README.md).
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip
# The CPU build of torch that lies on this machine's disk; any other spec downloads a CUDA build.
TORCH_SPEC ?= torch==2.13.0
PYTEST_ARGS ?=

.PHONY: quickstart quickstart-smoke test test-all bench lint clean

$(PY):
	$(PYTHON) -m venv $(VENV)
	$(PIP) install --quiet --upgrade pip

# Stamp files: reinstall only when the package metadata changes.
$(VENV)/.installed: setup.cfg pyproject.toml | $(PY)
	$(PIP) install --quiet "$(TORCH_SPEC)"
	$(PIP) install --quiet -e ".[jieba,corpus,train]"
	touch $@

$(VENV)/.installed-test: setup.cfg pyproject.toml | $(PY)
	$(PIP) install --quiet "$(TORCH_SPEC)"
	$(PIP) install --quiet -e ".[jieba,corpus,train,test,bench]"
	touch $(VENV)/.installed $@

quickstart: $(VENV)/.installed
	$(VENV)/bin/roformer-rope quickstart

# The quickstart's whole path in ~2 minutes (2 steps per stage): CI runs it in a fresh venv with only the
# quickstart extras (`make quickstart-smoke VENV=.venv-quickstart`), so a missing dependency fails CI.
quickstart-smoke: $(VENV)/.installed
	$(VENV)/bin/roformer-rope quickstart --smoke --out $(VENV)/quickstart-smoke-out

test: $(VENV)/.installed-test
	$(PY) -m pytest -m "not slow" $(PYTEST_ARGS)

test-all: $(VENV)/.installed-test
	$(PY) -m pytest $(PYTEST_ARGS)

bench: $(VENV)/.installed-test
	$(PY) bench/run_all.py

lint: $(VENV)/.installed-test
	$(VENV)/bin/ruff check .

clean:
	rm -rf $(VENV) build *.egg-info
