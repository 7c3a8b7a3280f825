# Every target bootstraps .venv on first use; a stamp makes later runs a no-op until
# pyproject.toml changes. The demo needs only the runtime install (RUNTIME_STAMP); the other
# targets install the test extra too (STAMP), which includes libtpu and torch.
PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed-stamp
RUNTIME_STAMP := $(VENV)/.installed-runtime-stamp

.PHONY: venv demo test test-fast bench lint strip-notebooks clean

$(STAMP): pyproject.toml
	@test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -e '.[test]'
	@touch $(STAMP) $(RUNTIME_STAMP)

$(RUNTIME_STAMP): pyproject.toml
	@test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -e .
	@touch $(RUNTIME_STAMP)

venv: $(STAMP)

# Where libtpu is installed (a venv that ran `make test`) but no TPU is attached, JAX would probe
# for one at start, log libtpu's initialisation errors and take /tmp/libtpu_lockfile: the demo
# and the benchmarks then run with JAX_PLATFORMS=cpu. On a TPU VM, on a GPU machine, without
# libtpu, or with JAX_PLATFORMS already set, the platform is left to JAX. The TPU and GPU tests
# are jax's own (jax/_src/hardware_utils.py, loaded as a file so that jax itself is not
# imported: about 50 ms); if they cannot run, nothing is set. `$$platform` holds the result.
define JAX_PLATFORM_PY
import importlib.util as u, os, pathlib
try:
    if "JAX_PLATFORMS" not in os.environ and u.find_spec("libtpu") is not None:
        path = pathlib.Path(u.find_spec("jax").origin).parent / "_src" / "hardware_utils.py"
        spec = u.spec_from_file_location("jax_hardware_utils", path)
        hw = u.module_from_spec(spec)
        spec.loader.exec_module(hw)
        if hw.num_available_tpu_chips_and_device_id()[0] == 0 and not hw.has_visible_nvidia_gpu():
            print("JAX_PLATFORMS=cpu")
except Exception:
    pass
endef
export JAX_PLATFORM_PY
PLATFORM = platform="$$($(PY) -c "$$JAX_PLATFORM_PY")"

# The demo: fetch and tokenize the bundled Shakespeare corpus (once; cached under
# ~/.cache/lmjax), train the character-level model of configs/tiny-shakespeare.yaml for a few
# minutes, then print the validation loss, a sample and where the run directory and plot are.
# Every demo gets a new run directory, so nothing earlier is overwritten.
demo: $(RUNTIME_STAMP)
	@$(PLATFORM); \
	set -x; \
	env $$platform $(VENV)/bin/lmjax prepare && \
	env $$platform $(VENV)/bin/lmjax train configs/tiny-shakespeare.yaml \
		run.dir=runs/demo-$$(date +%Y%m%d-%H%M%S)

# Two pytest-xdist workers, one per core of the CI machine; --dist loadfile keeps each test
# module on one worker, so its module-scoped compiled functions are built once.
# `make test WORKERS=0` runs in one process.
WORKERS ?= 2
XDIST = $(if $(filter 0,$(WORKERS)),,-n $(WORKERS) --dist loadfile)

test: $(STAMP)
	$(PY) -m pytest -q $(XDIST)

test-fast: $(STAMP)
	$(PY) -m pytest -q $(XDIST) -m "not slow"

bench: $(STAMP)
	@$(PLATFORM); \
	if ls benchmarks/*.py >/dev/null 2>&1; then \
		for b in benchmarks/*.py; do echo "== $$b"; env $$platform $(PY) $$b || exit 1; done; \
	else echo "no benchmarks yet"; fi

lint: $(STAMP)
	$(PY) -m ruff check lmjax pallas_kernels tests benchmarks notebooks
	$(PY) -m ruff format --check lmjax pallas_kernels tests benchmarks notebooks

# Notebooks are committed without outputs (tests/test_notebooks.py checks): strip them in place.
strip-notebooks: $(STAMP)
	$(PY) notebooks/strip_outputs.py

clean:
	rm -rf $(VENV) .pytest_cache .ruff_cache *.egg-info
