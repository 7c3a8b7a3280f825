# Every target bootstraps .venv on first use; a stamp makes later runs a no-op until
# pyproject.toml changes. The demo needs only the runtime install (RUNTIME_STAMP); the other
# targets install the test extra and jax's own tpu extra too (STAMP): torch, libtpu and friends.
PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed-stamp
RUNTIME_STAMP := $(VENV)/.installed-runtime-stamp

.PHONY: venv venv-next demo test test-next test-gpu-line test-fast test-portable bench fuzz lint strip-notebooks clean

$(STAMP): pyproject.toml
	@test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -e '.[test,tpu]'
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
# module on one worker, so its module-scoped compiled functions are built once, and
# --no-loadscope-reorder keeps the order tests/conftest.py gives them (longest modules first;
# xdist would otherwise order modules by their number of tests).
# `make test WORKERS=0` runs in one process. Both share one JAX compilation cache under
# .pytest_cache/jax-compile (tests/conftest.py). `make test` ends with its 25 slowest tests.
WORKERS ?= 2
XDIST = $(if $(filter 0,$(WORKERS)),,-n $(WORKERS) --dist loadfile --no-loadscope-reorder)

test: $(STAMP)
	$(PY) -m pytest -q $(XDIST) --durations=25

# The second suite: the whole suite again on the newest line users get. Its own venv on the
# newest Python found (3.13, else 3.12: scripts/newest_python.sh; NEXT_PYTHON=3.12 picks one)
# with the newest jax the pins admit together with jax's tpu extra, whose libtpu must be
# published for that jax (so a jax whose libtpu is not on PyPI yet is passed over). NEXT_JAX pins
# a release instead, in a venv of its own: `make test-next NEXT_JAX=0.11.2 NEXT_PYTHON=3.12` is
# the GPU machine's line. A jax whose libtpu is not published installs with NEXT_EXTRAS=test
# (`make test-next NEXT_JAX=0.12.1 NEXT_EXTRAS=test`): the tests that need libtpu are then
# reported NOT RUN (tests/conftest.py, LMJAX_TEST_WITHOUT), not passed. TESTS narrows the run
# (pytest arguments). The versions it runs on are printed first.
NEXT_PYTHON ?=
NEXT_JAX    ?=
NEXT_EXTRAS ?= test,tpu
TESTS       ?=
NEXT_WITHOUT := $(if $(findstring tpu,$(NEXT_EXTRAS)),,libtpu)
NEXT_VENV   := .venv-next$(if $(NEXT_JAX),-$(NEXT_JAX))$(if $(NEXT_PYTHON),-py$(NEXT_PYTHON))$(if $(NEXT_WITHOUT),-notpu)
NEXT_PY     := $(NEXT_VENV)/bin/python
NEXT_STAMP  := $(NEXT_VENV)/.installed-stamp
NEXT_PINS   := $(if $(NEXT_JAX),'jax==$(NEXT_JAX)' 'jaxlib==$(NEXT_JAX)')

$(NEXT_STAMP): pyproject.toml
	@test -x $(NEXT_PY) || "$$(scripts/newest_python.sh $(NEXT_PYTHON))" -m venv $(NEXT_VENV)
	$(NEXT_PY) -m pip install -q --upgrade pip
	$(NEXT_PY) -m pip install -q -e '.[$(NEXT_EXTRAS)]' $(NEXT_PINS)
	@touch $(NEXT_STAMP)

venv-next: $(NEXT_STAMP)

test-next: $(NEXT_STAMP)
	@$(NEXT_PY) -c "import sys, jax, jaxlib; print('test-next: Python', sys.version.split()[0], 'jax', jax.__version__, 'jaxlib', jaxlib.__version__)"
	$(if $(NEXT_WITHOUT),LMJAX_TEST_WITHOUT=$(NEXT_WITHOUT) )$(NEXT_PY) -m pytest -q $(XDIST) --durations=25 $(TESTS)

# The GPU machine's line (jax 0.11.2, Python 3.12), pinned: every test that lowers a program
# for CUDA on this host (the kernels, the train and decode steps, cuDNN attention, the structure
# audit) and scripts/gpu_check.sh's dry run, so what the GPU check runs is known to build there.
GPU_LINE_JAX    := 0.11.2
GPU_LINE_PYTHON := 3.12
GPU_LINE_TESTS  := tests/test_gpu_lowering.py tests/test_gpu_structure.py \
	tests/test_flash_gpu_defaults.py tests/test_attention_cudnn.py tests/test_compat.py \
	tests/test_flash_attention.py::test_compiled_kernels_lower_for_their_platform \
	tests/test_flash_attention.py::test_gqa_window_segments_lower_for_their_platform \
	tests/test_nf4_matmul.py::test_compiled_kernels_lower_for_their_platform \
	tests/test_ops_fused_head.py::test_the_chunk_and_the_weight_gradient_are_chosen_for_the_platform_lowered_for \
	tests/test_bench_train_step.py::test_gpu_check_dry_run_of_the_train_step_benchmark
test-gpu-line:
	$(MAKE) test-next NEXT_JAX=$(GPU_LINE_JAX) NEXT_PYTHON=$(GPU_LINE_PYTHON) TESTS="$(GPU_LINE_TESTS)"

test-fast: $(STAMP)
	$(PY) -m pytest -q $(XDIST) -m "not slow"

# The numerically sensitive files (sharded against one device, several processes against one,
# kernels against references, models against PyTorch and transformers) as a CPU of another
# vector width runs them: XLA's CPU code generator picks its instructions from the host, so
# float32 sums round differently with and without AVX-512. ISA is XLA's --xla_cpu_max_isa
# (SSE4_2, AVX, AVX2, AVX512); the flag is added to XLA_FLAGS and reaches the subprocesses these
# tests start (tests/_xla_flags.py). `make test-portable ISA=SSE4_2` goes further down.
# It compiles with XLA's default settings, the code users run (`make test` turns LLVM's passes
# off and uses XLA's older CPU emitter, to compile faster: tests/conftest.py).
ISA ?= AVX2
PORTABLE_TESTS := $(addprefix tests/,test_parallel_mesh.py test_parallel.py \
	test_flash_on_a_mesh.py test_multiprocess.py test_flash_attention.py test_flash_gqa.py \
	test_nf4_matmul.py test_nf4_tiled.py test_ops_gradients.py test_train_step.py \
	test_torch_parity.py test_models_torch_parity.py test_hf_gpt2.py test_hf_families.py \
	test_models.py test_models_families.py test_attention_gqa.py test_lora.py \
	test_lora_llama.py test_qlora.py test_finetune_mesh.py)
test-portable: $(STAMP)
	XLA_FLAGS="$$XLA_FLAGS --xla_cpu_max_isa=$(ISA)" LMJAX_TEST_FAST_COMPILE=0 \
		$(PY) -m pytest -q $(XDIST) $(PORTABLE_TESTS)

bench: $(STAMP)
	@$(PLATFORM); \
	if ls benchmarks/*.py >/dev/null 2>&1; then \
		for b in benchmarks/*.py; do echo "== $$b"; env $$platform $(PY) $$b || exit 1; done; \
	else echo "no benchmarks yet"; fi

# Every fuzz target of fuzz/targets.py for FUZZ_SECONDS each, coverage-guided by atheris (the
# 'fuzz' extra; where it cannot install, fuzz/mutate.py's mutations, without coverage), from the
# committed seeds in fuzz/corpus/. A finding (an exception other than lmjax.errors', a hang past
# 5 s, a resident size past the bound) stops with exit 1, its input in fuzz/findings/TARGET/.
# FUZZ_WORK (default /tmp/lmjax-fuzz) keeps the inputs each run found for the next.
FUZZ_SECONDS ?= 60
fuzz: $(STAMP)
	@$(PY) -c "import atheris" 2>/dev/null || $(PY) -m pip install -q -e '.[fuzz]' \
		|| echo "atheris did not install: fuzz/mutate.py's mutations instead (no coverage)"
	@for t in $$(JAX_PLATFORMS=cpu $(PY) fuzz/run.py --list); do \
		echo "== $$t ($(FUZZ_SECONDS) s)"; \
		JAX_PLATFORMS=cpu $(PY) fuzz/run.py $$t -max_total_time=$(FUZZ_SECONDS) || exit 1; \
	done

lint: $(STAMP)
	$(PY) -m ruff check lmjax pallas_kernels tests benchmarks notebooks
	$(PY) -m ruff format --check lmjax pallas_kernels tests benchmarks notebooks

# Notebooks are committed without outputs (tests/test_notebooks.py checks): strip them in place.
strip-notebooks: $(STAMP)
	$(PY) notebooks/strip_outputs.py

clean:
	rm -rf $(VENV) .venv-next* .pytest_cache .ruff_cache *.egg-info
