#!/usr/bin/env bash
# GPU check of the Pallas flash-attention kernel (SPEC section 7): the kernel tests compiled on
# the GPU (not interpreted), then flash vs cuDNN vs XLA timings.
#
# For a machine with an NVIDIA GPU where jax (with its CUDA plugin), pytest, optax, flax and
# chex are already installed. It runs from a copy of this tree with PYTHONPATH set, installs
# nothing and needs no network. From anywhere:
#
#     bash scripts/gpu_check.sh
#
# Writes benchmarks/results/attention_gpu.json. Exit status is non-zero when JAX sees no GPU,
# when a test fails (or the fast tests run out of time), or when the flash kernel fails in the
# benchmark. Time is bounded (about 7.5 minutes worst case); the knobs, in seconds:
#     FAST_TESTS_TIMEOUT_S=150 SLOW_TESTS_TIMEOUT_S=90 BENCH_TIMEOUT_S=200
# The slow product running out of time is reported (exit 124 at the end) but does not stop
# the benchmark; a failing test stops the script at once.
# PYTHON picks the interpreter (default python3).
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
PYTHON="${PYTHON:-python3}"
FAST_TESTS_TIMEOUT_S="${FAST_TESTS_TIMEOUT_S:-150}"
SLOW_TESTS_TIMEOUT_S="${SLOW_TESTS_TIMEOUT_S:-90}"
BENCH_TIMEOUT_S="${BENCH_TIMEOUT_S:-200}"

export PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}"
export PYTHONDONTWRITEBYTECODE=1
# The test file reads this: 0 runs the kernel of the default backend compiled (the TPU-style
# kernel's tests are skipped on a GPU).
export LMJAX_PALLAS_INTERPRET=0

TESTS=(tests/test_flash_attention.py tests/test_ops_attention.py)
PYTEST=("$PYTHON" -m pytest -q -p no:cacheprovider -r fEs --durations=10)
started=$SECONDS

step() { printf '\n==> [%3ds] %s\n' "$((SECONDS - started))" "$*"; }

# Runs "$@" under a time limit; prints why it stopped. Returns the command's status (124: timeout).
bounded() {
    local limit=$1
    shift
    local status=0
    timeout --signal=INT --kill-after=20 "$limit" "$@" || status=$?
    if [ "$status" -eq 124 ]; then
        echo "!! timed out after ${limit}s: $*"
    elif [ "$status" -ne 0 ]; then
        echo "!! exit status $status: $*"
    fi
    return "$status"
}

step "environment"
"$PYTHON" - <<'EOF'
import sys

import jax

print(f"python {sys.version.split()[0]}, jax {jax.__version__}, backend {jax.default_backend()}")
print("devices:", jax.devices())
if jax.default_backend() != "gpu":
    sys.exit("no GPU visible to JAX: this script checks the compiled GPU kernel")
EOF

step "fast kernel tests, compiled on the GPU (limit ${FAST_TESTS_TIMEOUT_S}s)"
bounded "$FAST_TESTS_TIMEOUT_S" "${PYTEST[@]}" -m "not slow" "${TESTS[@]}"

step "slow product of kernel tests, compiled (limit ${SLOW_TESTS_TIMEOUT_S}s)"
slow_status=0
bounded "$SLOW_TESTS_TIMEOUT_S" "${PYTEST[@]}" -m slow "${TESTS[@]}" || slow_status=$?
if [ "$slow_status" -ne 0 ] && [ "$slow_status" -ne 124 ]; then
    exit "$slow_status"  # a failing test
fi

step "timing: flash vs cuDNN vs XLA, bf16, causal (limit ${BENCH_TIMEOUT_S}s)"
# --budget-s stops starting new points early enough for the running one to finish in time.
bounded "$BENCH_TIMEOUT_S" "$PYTHON" benchmarks/attention_gpu.py --require-gpu \
    --budget-s "$((BENCH_TIMEOUT_S - 60))"

step "done"
if [ "$slow_status" -eq 124 ]; then
    echo "all tests that ran passed, but the slow product did not finish in ${SLOW_TESTS_TIMEOUT_S}s"
    exit 124
fi
echo "compiled kernel tests passed; timings in benchmarks/results/attention_gpu.json"
