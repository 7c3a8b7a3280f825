# Every target bootstraps .venv on first use; the stamp makes later runs a no-op until
# pyproject.toml changes.
PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed-stamp

.PHONY: venv demo test test-fast bench lint clean

$(STAMP): pyproject.toml
	@test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -e '.[test]'
	@touch $(STAMP)

venv: $(STAMP)

# Until the training demo lands, the demo checks every primitive's hand-written VJP against
# jax.grad of its reference and against float64 finite differences, and prints the table.
demo: $(STAMP)
	$(VENV)/bin/lmjax gradcheck

test: $(STAMP)
	$(PY) -m pytest -q

test-fast: $(STAMP)
	$(PY) -m pytest -q -m "not slow"

bench: $(STAMP)
	@if ls benchmarks/*.py >/dev/null 2>&1; then \
		for b in benchmarks/*.py; do echo "== $$b"; $(PY) $$b || exit 1; done; \
	else echo "no benchmarks yet"; fi

lint: $(STAMP)
	$(PY) -m ruff check lmjax pallas_kernels tests benchmarks
	$(PY) -m ruff format --check lmjax pallas_kernels tests benchmarks

clean:
	rm -rf $(VENV) .pytest_cache .ruff_cache *.egg-info
