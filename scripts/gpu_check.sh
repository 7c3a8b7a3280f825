#!/usr/bin/env bash
# GPU check of the Pallas flash-attention kernel (docs/kernels.md), in one bounded run: the kernel
# tests compiled on the GPU (not interpreted), and flash vs cuDNN vs XLA timings.
#
# For a machine with an NVIDIA GPU where jax (with its CUDA plugin), pytest, optax, flax and
# chex are already installed. It runs from a copy of this tree with PYTHONPATH set, installs
# nothing, needs no network and writes nothing into the tree. From anywhere:
#
#     bash scripts/gpu_check.sh
#
# RESULTS_DIR (default: $OUT when set, else benchmarks/results) gets five files at most, so a
# borrowed machine that returns 8 files returns them all:
#     gpu_check.log                the whole console output (tee)
#     summary.txt, summary.json    per step: outcome, exit status, seconds, limit; rewritten
#                                  after every step ("finished": false until the end), so a
#                                  run killed from outside keeps them
#     gpu_profile.json             step 3: tokens/s per attention and the top GPU kernels
#     details.tar.gz               everything else, repacked after every step:
#         environment.json             python, jax, jaxlib, devices
#         junit_{smoke,nf4,fast,slow}.xml  pytest's per-test results (written on a timeout too)
#         attention_gpu.json           the attention timings, rewritten after every point
#         nf4_matmul_gpu.json          the NF4 matmul timings (3c)
#         qlora_gpu.json               QLoRA and LoRA train steps (3d, not in the default run)
#         train_step_gpu.json          `lmjax bench` (3b, not in the default run)
#
# Steps, in this order; limits in seconds, each also cut to what is left of TOTAL_BUDGET_S:
#   1 env    python, jax, devices (and nvidia-smi); no GPU ends the run     ENV_TIMEOUT_S=30
#   2 smoke  GPU_SMOKE of tests/test_flash_attention.py, compiled: causal, non-causal with
#            ragged S and key padding, bf16, f16, rows with no key, block skipping, the
#            backward's own dq tile
#                                                                           SMOKE_TIMEOUT_S=60
#   2b nf4   tests/test_nf4_matmul.py (fast ones), the NF4 matmul kernel compiled
#                                                                           NF4_TEST_TIMEOUT_S=60
#   3 profile  benchmarks/train_profile_gpu.py: configs/gpt2-124m.yaml's bf16 train step with
#            attention cudnn, flash and xla (tokens/s, MFU, compile), then a jax.profiler trace
#            of 3 steps of the first that ran, reduced to the top kernels; right after that one,
#            the same attention with its blocks unrolled (model.scan_layers=false: the scan's
#            compile and step time against the loop, issue 44) -> gpu_profile.json
#            (its --budget-s: no new attention after the limit less min(60, limit/3))
#                                                                           PROFILE_TIMEOUT_S=140
#   3a bench benchmarks/attention_gpu.py; runs whatever step 2 gave        BENCH_TIMEOUT_S=70
#            (its --budget-s, after which no new point starts: the limit less min(60,
#            limit/3), so never negative)
#   3b train gpt2-124m bf16 train step, flash attention: `lmjax bench`     TRAIN_TIMEOUT_S=150
#            (not in the default run: step 3 times the same step, with each attention)
#   3c nf4bench  benchmarks/nf4_matmul_gpu.py: NF4 kernel vs bf16 matmul (and XLA dequantize +
#            matmul) at GPT-2 124M's projections, 4096 and 16 tokens -> nf4_matmul_gpu.json
#            (its --budget-s: the limit less min(40, limit/3))              NF4_BENCH_TIMEOUT_S=50
#   3d qlorabench  benchmarks/qlora_gpu.py: one QLoRA and one LoRA train step of a
#            SmolLM2-135M-shaped and a 1B Llama-shaped model (random weights, bf16, r 16 on
#            every projection), each in its own process: tokens/s, compile, peak device memory
#            -> qlora_gpu.json (its --budget-s: the limit less 45)       QLORA_BENCH_TIMEOUT_S=300
#            (not in the default run: with nf4bench at 180 s it is the second invocation,
#            GPU_CHECK_STEPS="nf4bench qlorabench" NF4_BENCH_TIMEOUT_S=180, about 480 s)
#   3e evalbench  benchmarks/eval_harness.py: lm-evaluation-harness requests/s of lmjax against
#            its Hugging Face backend (HFLM, PyTorch) on the same model and local tasks, with
#            equal metrics -> eval_harness.json; needs lm_eval and torch (pip install
#            'lmjax[eval]' torch), skipped without them                   EVAL_BENCH_TIMEOUT_S=120
#            (not in the default run: GPU_CHECK_STEPS=evalbench)
#   6 gradcheck  `lmjax gradcheck` (its table in the log): every hand-written VJP against
#            jax.grad of its reference on the GPU, with float32 matmuls at full precision (JAX_DEFAULT_MATMUL_PRECISION=highest,
#            not TF32), so the CPU's float32 rtol 1e-5 applies; float64 finite differences
#                                                                           GRADCHECK_TIMEOUT_S=40
#   4 fast   the other fast tests of the kernel and of ops.attention       FAST_TIMEOUT_S=120
#            (all of them, smoke included, when step 2 did not pass)
#   5 slow   the slow product, in the time left; skipped under 30 s        SLOW_TIMEOUT_S=120
# Steps 3b, 3d, 3e, 4 and 5 are not in the default run: the device machine allows 600 s per command, so
# one invocation does the compiled smoke tests, the timings, the profile and the gradient check
# (1-3c, 6) in TOTAL_BUDGET_S=420, and a second, GPU_CHECK_STEPS="fast slow", the rest (at most
# 30 + 120 + 120 s).
# A step out of time gets SIGINT (pytest still writes its junit file, the benchmark its JSON)
# and SIGKILL KILL_AFTER_S=10 later. TOTAL_BUDGET_S ends every step by then, so the worst case
# is 420 s plus the closing summaries (at most 20 s each): 480 s, under the 600 s a command may
# take. The limits of the default steps add up to 450 s: a run whose early steps all use their
# whole limit leaves gradcheck no time (it is then skipped and counted as failed).
# GPU_CHECK_STEPS picks steps for a shorter rerun, e.g. GPU_CHECK_STEPS="bench" or
# "smoke fast" (env always runs); steps left out are recorded as not requested.
# BENCH_EXTRA_ARGS are added to the bench step's command: a run meant to update the flash block
# table, GPU_CHECK_STEPS=bench BENCH_TIMEOUT_S=560 TOTAL_BUDGET_S=570
# BENCH_EXTRA_ARGS="--search-share 0.9 --seq-lens 4096" (docs/kernels.md).
# GPU_CHECK_XLA_FLAGS are added to XLA_FLAGS for the profile step only, to try XLA's GPU options
# on the same step, e.g. GPU_CHECK_STEPS=profile GPU_CHECK_XLA_FLAGS="--xla_gpu_enable_latency_hiding_scheduler=true
# --xla_gpu_enable_triton_gemm=false" (an unknown flag stops XLA: check them against the jaxlib).
#
# Exit status: 0 when every step that ran passed; 1 when one failed, ran out of time, or (all
# but slow) was skipped for lack of time. The slow step skipped for lack of time is reported,
# not a failure, and so is a flash/cuDNN ratio under the 0.8 target.
#
# PYTHON picks the interpreter (default python3). GPU_CHECK_DRY_RUN=1 only checks this script
# on a machine without a GPU: no GPU assertion, the kernel tests interpreted
# (LMJAX_PALLAS_INTERPRET defaults to 1 then), the benchmark on tiny sizes with --allow-cpu.
# Never set it for the GPU run.
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
PYTHON="${PYTHON:-python3}"
RESULTS_DIR="${RESULTS_DIR:-${OUT:-benchmarks/results}}"
DRY_RUN="${GPU_CHECK_DRY_RUN:-0}"
STEPS=" ${GPU_CHECK_STEPS:-smoke nf4 profile bench nf4bench gradcheck} "
ENV_TIMEOUT_S="${ENV_TIMEOUT_S:-30}"
SMOKE_TIMEOUT_S="${SMOKE_TIMEOUT_S:-60}"
BENCH_TIMEOUT_S="${BENCH_TIMEOUT_S:-70}"
PROFILE_TIMEOUT_S="${PROFILE_TIMEOUT_S:-140}" # issue 31: the step per attention, profiled (3)
GRADCHECK_TIMEOUT_S="${GRADCHECK_TIMEOUT_S:-40}" # issue 31: lmjax gradcheck on the GPU (6)
FAST_TIMEOUT_S="${FAST_TIMEOUT_S:-120}"
SLOW_TIMEOUT_S="${SLOW_TIMEOUT_S:-120}"
TRAIN_TIMEOUT_S="${TRAIN_TIMEOUT_S:-150}" # issue 11: the gpt2-124m train-step benchmark (3b)
NF4_TEST_TIMEOUT_S="${NF4_TEST_TIMEOUT_S:-60}"   # issue 8: NF4 matmul kernel tests (2b)
NF4_BENCH_TIMEOUT_S="${NF4_BENCH_TIMEOUT_S:-50}" # issue 8: NF4 vs bf16 matmul timings (3c)
QLORA_BENCH_TIMEOUT_S="${QLORA_BENCH_TIMEOUT_S:-300}" # issue 32: QLoRA vs LoRA train steps (3d)
EVAL_BENCH_TIMEOUT_S="${EVAL_BENCH_TIMEOUT_S:-120}" # issue 46: lm-eval requests/s vs HFLM (3e)
KILL_AFTER_S="${KILL_AFTER_S:-10}"
TOTAL_BUDGET_S="${TOTAL_BUDGET_S:-420}"
MIN_STEP_S=20 # a step with less time than this left is skipped, not started
MIN_SLOW_S=30
for knob in ENV_TIMEOUT_S SMOKE_TIMEOUT_S BENCH_TIMEOUT_S FAST_TIMEOUT_S SLOW_TIMEOUT_S \
    TRAIN_TIMEOUT_S NF4_TEST_TIMEOUT_S NF4_BENCH_TIMEOUT_S PROFILE_TIMEOUT_S GRADCHECK_TIMEOUT_S \
    QLORA_BENCH_TIMEOUT_S \
    KILL_AFTER_S TOTAL_BUDGET_S; do
    case "${!knob}" in
        '' | *[!0-9]*) echo "gpu_check: $knob=${!knob} is not a whole number of seconds" >&2 && exit 2 ;;
    esac
done

mkdir -p "$RESULTS_DIR"
RESULTS_DIR="$(cd "$RESULTS_DIR" && pwd)"
LOG="$RESULTS_DIR/gpu_check.log"
: >"$LOG"
rm -f "$RESULTS_DIR"/summary.txt "$RESULTS_DIR"/summary.json "$RESULTS_DIR"/junit_*.xml \
    "$RESULTS_DIR"/gpu_profile.json "$RESULTS_DIR"/details.tar.gz
# Everything but the summary, the log and the profile is written here and packed into
# RESULTS_DIR/details.tar.gz after every step (pack_details).
DETAILS_DIR="$(mktemp -d "${TMPDIR:-/tmp}/gpu_check.XXXXXX")"
trap 'rm -rf "$DETAILS_DIR"' EXIT

export PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}"
export PYTHONDONTWRITEBYTECODE=1
export PYTHONUNBUFFERED=1 # output reaches the log as it happens, and survives a SIGKILL
if [ "$DRY_RUN" = 1 ]; then
    export LMJAX_PALLAS_INTERPRET="${LMJAX_PALLAS_INTERPRET:-1}"
    MODE="dry run, LMJAX_PALLAS_INTERPRET=$LMJAX_PALLAS_INTERPRET"
    BENCH_ARGS=(--allow-cpu --seq-lens 64 128 --head-dims 32 --tokens 128 --hidden 64
        --search-t 128 --calls 1 --samples 1 --search-candidates 2)
else
    # The test file reads this: 0 runs the kernel of the default backend compiled (the
    # TPU-style kernel's tests are skipped on a GPU).
    export LMJAX_PALLAS_INTERPRET=0
    MODE=compiled
    BENCH_ARGS=(--require-gpu)
fi

TEST_FILE=tests/test_flash_attention.py
TESTS=("$TEST_FILE" tests/test_ops_attention.py)
# jax 0.11 warns on every Pallas Triton compile that the backend is deprecated (it still
# works); one line of each test's id in the warnings summary would crowd the output tail.
PYTEST=("$PYTHON" -m pytest -q -p no:cacheprovider -r fEs --tb=short --durations=10
    -W "ignore:The Pallas Triton backend is deprecated:DeprecationWarning")
DEADLINE=$((SECONDS + TOTAL_BUDGET_S))
STARTED_UTC="$(date -u +%Y-%m-%dT%H:%M:%SZ)"

say() { printf '%s\n' "$*" | tee -a "$LOG"; }
clock() { printf '[%3ds]' "$SECONDS"; }
wanted() { [[ "$STEPS" == *" $1 "* ]]; }

# ---- the record of steps: summary.txt and summary.json, rewritten after each step ----------
STEP_JSON=()
FAILED=()
SKIPPED=()

json_list() { # json_list A B ... -> "A","B"
    local sep="" item
    for item in "$@"; do
        printf '%s"%s"' "$sep" "$item"
        sep=", "
    done
}

write_summary() { # write_summary true|false (finished)
    local tmp="$RESULTS_DIR/summary.json.tmp" sep="" entry
    {
        printf '{\n  "started_utc": "%s",\n  "finished": %s,\n' "$STARTED_UTC" "$1"
        printf '  "dry_run": %s,\n' "$([ "$DRY_RUN" = 1 ] && echo true || echo false)"
        printf '  "elapsed_s": %d,\n  "total_budget_s": %d,\n' "$SECONDS" "$TOTAL_BUDGET_S"
        printf '  "failed_steps": [%s],\n' "$(json_list ${FAILED[@]+"${FAILED[@]}"})"
        printf '  "skipped_steps": [%s],\n' "$(json_list ${SKIPPED[@]+"${SKIPPED[@]}"})"
        printf '  "steps": ['
        for entry in ${STEP_JSON[@]+"${STEP_JSON[@]}"}; do
            printf '%s\n    %s' "$sep" "$entry"
            sep=","
        done
        printf '\n  ]\n}\n'
    } >"$tmp"
    mv "$tmp" "$RESULTS_DIR/summary.json"
}

pack_details() {
    tar -czf "$RESULTS_DIR/details.tar.gz.tmp" -C "$DETAILS_DIR" . &&
        mv "$RESULTS_DIR/details.tar.gz.tmp" "$RESULTS_DIR/details.tar.gz"
}

# record NAME OUTCOME EXIT_STATUS SECONDS LIMIT NOTE   (OUTCOME: ok, failed, timeout, skipped)
# Notes are the script's own text: no quotes or backslashes in them.
record() {
    local name=$1 outcome=$2 status=$3 took=$4 limit=$5 note=$6
    if [ "$outcome" = skipped ]; then SKIPPED+=("$name"); fi
    STEP_JSON+=("$(printf '{"step": "%s", "outcome": "%s", "exit_status": %s, "duration_s": %d, "limit_s": %d, "note": "%s"}' \
        "$name" "$outcome" "${status:-null}" "$took" "$limit" "$note")")
    printf '%-6s %-8s exit=%-4s %4ds of %4ds  %s\n' "$name" "$outcome" "${status:--}" "$took" \
        "$limit" "$note" >>"$RESULTS_DIR/summary.txt"
    write_summary false
    pack_details
}

# begin_step NAME LIMIT MIN DESCRIPTION: sets STEP_LIMIT to LIMIT cut to the time left before
# DEADLINE less the kill margin. Returns 1, with the step recorded as skipped, when it was not
# requested or when fewer than MIN seconds are left.
begin_step() {
    local name=$1 limit=$2 min=$3 what=$4
    local left=$((DEADLINE - SECONDS - KILL_AFTER_S))
    STEP_NAME=$name
    STEP_LIMIT=$((limit < left ? limit : left))
    if [ "$name" != env ] && ! wanted "$name"; then
        say "--- $(clock) $name: not requested (GPU_CHECK_STEPS)"
        record "$name" skipped "" 0 0 "not in GPU_CHECK_STEPS"
        return 1
    fi
    if [ "$STEP_LIMIT" -lt "$min" ]; then
        say "--- $(clock) $name: skipped, ${left}s left of the ${TOTAL_BUDGET_S}s budget"
        record "$name" skipped "" 0 0 "no time left: ${left}s"
        if [ "$name" != slow ]; then FAILED+=("$name"); fi
        return 1
    fi
    say "==> $(clock) $name: $what (limit ${STEP_LIMIT}s)"
}

# run_bounded CMD...: runs CMD for at most STEP_LIMIT seconds, its output to the console and the
# log, and records the step. Never stops the script; the outcome is left in STEP_OUTCOME.
run_bounded() {
    local t0=$SECONDS status outcome=ok note=""
    set +e
    timeout --signal=INT --kill-after="$KILL_AFTER_S" "$STEP_LIMIT" "$@" 2>&1 | tee -a "$LOG"
    status=${PIPESTATUS[0]}
    set -e
    case "$status" in
        0) ;;
        124) outcome=timeout note="stopped at its ${STEP_LIMIT}s limit (SIGINT)" ;;
        137) outcome=timeout note="killed ${KILL_AFTER_S}s after SIGINT at ${STEP_LIMIT}s" ;;
        *) outcome=failed note="exit status $status" ;;
    esac
    STEP_OUTCOME=$outcome
    if [ "$outcome" != ok ]; then FAILED+=("$STEP_NAME"); fi
    say "<== $(clock) $STEP_NAME: $outcome (exit $status, $((SECONDS - t0))s)"
    record "$STEP_NAME" "$outcome" "$status" "$((SECONDS - t0))" "$STEP_LIMIT" "$note"
}

# ---- 1: environment ----------------------------------------------------------------------------
say "gpu_check: results in $RESULTS_DIR ($MODE, budget ${TOTAL_BUDGET_S}s, steps:${STEPS})"
ENV_PY='
import json, os, platform, sys
from importlib import metadata

import jax

devices = jax.devices()
env = {
    "python": platform.python_version(),
    "jax": jax.__version__,
    "backend": jax.default_backend(),
    "devices": [str(d) for d in devices],
    "device_kind": devices[0].device_kind,
    "LMJAX_PALLAS_INTERPRET": os.environ.get("LMJAX_PALLAS_INTERPRET"),
}
for name in ("jaxlib", "jax-cuda12-plugin", "jax-cuda13-plugin", "pytest", "numpy"):
    try:
        env[name] = metadata.version(name)
    except metadata.PackageNotFoundError:
        pass
print(", ".join(f"{k} {v}" for k, v in env.items()))
with open(os.path.join(sys.argv[1], "environment.json"), "w") as f:
    json.dump(env, f, indent=2)
if env["backend"] != "gpu" and sys.argv[2] != "1":
    sys.exit("no GPU visible to JAX: this script checks the compiled GPU kernel")
'
if command -v nvidia-smi >/dev/null 2>&1; then
    timeout 15 nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.max.sm,power.limit \
        --format=csv 2>&1 | tee -a "$LOG" || true
fi
STEP_OUTCOME=skipped
if begin_step env "$ENV_TIMEOUT_S" 5 "python, jax, devices"; then
    run_bounded "$PYTHON" -c "$ENV_PY" "$DETAILS_DIR" "$DRY_RUN"
fi
if [ "$STEP_OUTCOME" != ok ]; then
    for name in smoke nf4 profile bench train nf4bench qlorabench evalbench gradcheck fast slow; do
        record "$name" skipped "" 0 0 "environment step failed"
    done
    FAILED+=(smoke nf4 profile bench train nf4bench qlorabench evalbench gradcheck fast slow)
    write_summary true
    say "gpu_check: FAILED at the environment step; see $LOG"
    exit 1
fi

# ---- 2: the compiled smoke subset ------------------------------------------------------------
# GPU_SMOKE is a literal tuple of node ids in the test file; ast reads it without importing jax.
SMOKE_PY='
import ast, sys

for node in ast.parse(open(sys.argv[1]).read()).body:
    if isinstance(node, ast.Assign) and [getattr(t, "id", "") for t in node.targets] == ["GPU_SMOKE"]:
        print("\n".join(sys.argv[1] + "::" + test_id for test_id in ast.literal_eval(node.value)))
'
SMOKE_IDS=()
while IFS= read -r line; do
    if [ -n "$line" ]; then SMOKE_IDS+=("$line"); fi
done < <(timeout 20 "$PYTHON" -c "$SMOKE_PY" "$TEST_FILE" 2>&1 | tee -a "$LOG" | grep '::' || true)
smoke_passed=0
if [ "${#SMOKE_IDS[@]}" -eq 0 ] && wanted smoke; then
    say "!! no GPU_SMOKE ids found in $TEST_FILE"
    record smoke failed "" 0 0 "no GPU_SMOKE ids in $TEST_FILE"
    FAILED+=(smoke)
elif begin_step smoke "$SMOKE_TIMEOUT_S" "$MIN_STEP_S" "${#SMOKE_IDS[@]} kernel tests ($MODE)"; then
    run_bounded "${PYTEST[@]}" --junitxml="$DETAILS_DIR/junit_smoke.xml" "${SMOKE_IDS[@]}"
    if [ "$STEP_OUTCOME" = ok ]; then smoke_passed=1; fi
fi

# ---- 2b: the NF4 matmul kernel's fast tests, compiled (issue 8) ---------------------------------
# The GPU kernel compiled, the TPU kernel's tests skipped; before the timings, with the smoke tests.
if begin_step nf4 "$NF4_TEST_TIMEOUT_S" "$MIN_STEP_S" "NF4 matmul kernel tests ($MODE)"; then
    run_bounded "${PYTEST[@]}" --junitxml="$DETAILS_DIR/junit_nf4.xml" -m "not slow" \
        tests/test_nf4_matmul.py
fi

# ---- 3: the gpt2-124m train step per attention, and a profile of it (issue 31) ------------------
# The dry run times a tiny model of the same config (flash interpreted, and XLA; cuDNN needs a
# GPU) and profiles it on the CPU, only to check this step and its JSON.
if [ "$DRY_RUN" = 1 ]; then
    PROFILE_ARGS=(--allow-cpu --attention flash xla --steps 2 --profile-steps 2
        model.vocab_size=512 model.n_layers=1 model.d_model=64 model.n_heads=2 model.d_ff=128
        model.context_length=32 train.batch_size=4 train.grad_accum=2 train.seq_len=32)
else
    PROFILE_ARGS=(--require-gpu --steps 5 --profile-steps 3)
fi
if begin_step profile "$PROFILE_TIMEOUT_S" "$MIN_STEP_S" "gpt2-124m bf16 train step: cudnn, flash, xla; profile"; then
    margin=$((STEP_LIMIT / 3 < 60 ? STEP_LIMIT / 3 : 60))
    # XLA reads a non-empty XLA_FLAGS that does not start with "--" as a file name.
    flags="${XLA_FLAGS:-}${GPU_CHECK_XLA_FLAGS:+ $GPU_CHECK_XLA_FLAGS}"
    flags="${flags# }"
    profile_env=()
    if [ -n "$flags" ]; then profile_env=(env XLA_FLAGS="$flags"); fi
    run_bounded ${profile_env[@]+"${profile_env[@]}"} \
        "$PYTHON" benchmarks/train_profile_gpu.py "${PROFILE_ARGS[@]}" \
        --results-dir "$RESULTS_DIR" --budget-s "$((STEP_LIMIT - margin))"
fi

# ---- 3a: attention timings, whatever step 2 gave -----------------------------------------------
if begin_step bench "$BENCH_TIMEOUT_S" "$MIN_STEP_S" "flash vs cuDNN vs XLA, bf16, causal"; then
    margin=$((STEP_LIMIT / 3 < 60 ? STEP_LIMIT / 3 : 60))
    BENCH_EXTRA=()
    if [ -n "${BENCH_EXTRA_ARGS:-}" ]; then read -r -a BENCH_EXTRA <<<"$BENCH_EXTRA_ARGS"; fi
    run_bounded "$PYTHON" benchmarks/attention_gpu.py "${BENCH_ARGS[@]}" \
        ${BENCH_EXTRA[@]+"${BENCH_EXTRA[@]}"} \
        --results-dir "$DETAILS_DIR" --budget-s "$((STEP_LIMIT - margin))"
fi

# ---- 3b: gpt2-124m bf16 train step with flash attention (issue 11) -------------------------------
# `lmjax bench` times the config's own step (batch 64 x 1024 tokens in 4 micro-batches, AdamW,
# bf16 compute over f32 master weights); MFU is quoted on the device's dense bf16 data-sheet peak
# (lmjax.train.bench.BF16_PEAK_FLOPS: H200 989.4 TFLOP/s). The dry run times a tiny model of the
# same config (flash attention interpreted) only to check this step and its JSON.
if [ "$DRY_RUN" = 1 ]; then
    TRAIN_ARGS=(model.vocab_size=512 model.n_layers=1 model.d_model=64 model.n_heads=2
        model.d_ff=128 model.context_length=32 train.batch_size=4 train.grad_accum=2
        train.seq_len=32 --steps 2 --peak-tflops 1)
else
    TRAIN_ARGS=(--steps 10)
fi
if begin_step train "$TRAIN_TIMEOUT_S" "$MIN_STEP_S" "gpt2-124m bf16 train step, flash attention"; then
    run_bounded "$PYTHON" -m lmjax bench configs/gpt2-124m.yaml "${TRAIN_ARGS[@]}" \
        --output "$DETAILS_DIR/train_step_gpu.json"
fi

# ---- 3c: NF4 vs bf16 matmul timings at GPT-2 124M's projections (issue 8) -----------------------
# The dry run interprets the kernel and times one tiny shape, only to check this step and its JSON.
if [ "$DRY_RUN" = 1 ]; then
    NF4_BENCH_ARGS=(--allow-cpu --tokens 16 --shapes 64x128 --calls 1 --samples 1)
else
    NF4_BENCH_ARGS=(--require-gpu)
fi
if begin_step nf4bench "$NF4_BENCH_TIMEOUT_S" "$MIN_STEP_S" "NF4 vs bf16 matmul, GPT-2 124M shapes"; then
    margin=$((STEP_LIMIT / 3 < 40 ? STEP_LIMIT / 3 : 40))
    run_bounded "$PYTHON" benchmarks/nf4_matmul_gpu.py "${NF4_BENCH_ARGS[@]}" \
        --results-dir "$DETAILS_DIR" --budget-s "$((STEP_LIMIT - margin))"
fi

# ---- 3d: QLoRA against LoRA train steps, SmolLM2-135M and 1B Llama shapes (issue 32) -------------
# The dry run times the small model's tiny version on the CPU, only to check this step and its JSON.
if [ "$DRY_RUN" = 1 ]; then
    QLORA_BENCH_ARGS=(--allow-cpu --quick --models smollm2-135m)
else
    QLORA_BENCH_ARGS=(--require-gpu)
fi
if begin_step qlorabench "$QLORA_BENCH_TIMEOUT_S" "$MIN_STEP_S" "QLoRA vs LoRA train steps, bf16"; then
    run_bounded "$PYTHON" benchmarks/qlora_gpu.py "${QLORA_BENCH_ARGS[@]}" \
        --results-dir "$DETAILS_DIR" --budget-s "$((STEP_LIMIT > 65 ? STEP_LIMIT - 45 : 20))"
fi

# ---- 3e: lm-evaluation-harness requests/s, lmjax against HFLM (issue 46) ----------------------
# The dry run scores the benchmark's tiny model (--quick), only to check this step and its JSON.
if [ "$DRY_RUN" = 1 ]; then
    EVAL_BENCH_ARGS=(--quick)
else
    EVAL_BENCH_ARGS=()
fi
if begin_step evalbench "$EVAL_BENCH_TIMEOUT_S" "$MIN_STEP_S" "lm-eval requests/s: lmjax vs HFLM"; then
    if "$PYTHON" -c "import lm_eval, torch" >/dev/null 2>&1; then
        run_bounded "$PYTHON" benchmarks/eval_harness.py "${EVAL_BENCH_ARGS[@]}" \
            --output "$DETAILS_DIR/eval_harness.json"
    else
        say "--- $(clock) evalbench: skipped, lm_eval or torch is not installed"
        record evalbench skipped "" 0 0 "lm_eval or torch not installed: pip install lmjax[eval] torch"
    fi
fi

# ---- 6: every hand-written VJP against jax.grad, on the GPU (issue 31) ---------------------------
# float32 matmuls at full precision: a GPU's default (TF32, 10 mantissa bits) would need
# rtol ~1e-3, and the check would no longer tell a wrong VJP from rounding at 1e-5.
if [ "$DRY_RUN" = 1 ]; then
    GRADCHECK_ARGS=(--ops "linear*")
else
    GRADCHECK_ARGS=()
fi
if begin_step gradcheck "$GRADCHECK_TIMEOUT_S" "$MIN_STEP_S" "lmjax gradcheck, float32 matmuls at full precision"; then
    run_bounded env JAX_DEFAULT_MATMUL_PRECISION=highest "$PYTHON" -m lmjax gradcheck \
        ${GRADCHECK_ARGS[@]+"${GRADCHECK_ARGS[@]}"}
fi

# ---- 4: the rest of the fast tests -----------------------------------------------------------
DESELECT=()
if [ "$smoke_passed" = 1 ]; then
    for id in "${SMOKE_IDS[@]}"; do DESELECT+=(--deselect "$id"); done
fi
if begin_step fast "$FAST_TIMEOUT_S" "$MIN_STEP_S" "fast kernel and ops.attention tests ($MODE)"; then
    run_bounded "${PYTEST[@]}" --junitxml="$DETAILS_DIR/junit_fast.xml" -m "not slow" \
        ${DESELECT[@]+"${DESELECT[@]}"} "${TESTS[@]}"
fi

# ---- 5: the slow product, in the time left -----------------------------------------------------
if begin_step slow "$SLOW_TIMEOUT_S" "$MIN_SLOW_S" "the slow product of kernel tests ($MODE)"; then
    run_bounded "${PYTEST[@]}" --junitxml="$DETAILS_DIR/junit_slow.xml" -m slow "${TESTS[@]}"
fi

# ---- summary -----------------------------------------------------------------------------------
write_summary true
pack_details
say ""
say "==> $(clock) summary (also in $RESULTS_DIR/summary.json)"
tee -a "$LOG" <"$RESULTS_DIR/summary.txt"
if [ -f "$DETAILS_DIR/attention_gpu.json" ]; then
    timeout 20 "$PYTHON" - "$DETAILS_DIR/attention_gpu.json" <<'EOF' 2>&1 | tee -a "$LOG" || true
import json, sys

r = json.load(open(sys.argv[1]))
nan = float("nan")
print(f"bench: {r.get('status')}, {r.get('device')}, jax {r.get('jax')}, "
      f"{len(r.get('rows', []))} points")
for d, s in r.get("block_size_search", {}).items():
    c = s.get("chosen") or {}
    print(f"  d={d}: blocks {c.get('block_q')}x{c.get('block_k')} fwd, "
          f"{c.get('block_q_bwd')}x{c.get('block_k_bwd')} dk/dv, "
          f"{c.get('block_q_dq')}x{c.get('block_k_dq')} dq, warps {c.get('num_warps')}")
for row in r.get("rows", []):
    ms = " ".join(f"{i} {row.get(f't_{i}_ms') or nan:7.3f}" for i in ("flash", "cudnn", "xla"))
    ratio = row.get("ratio_cudnn_over_flash")
    mark = "--" if ratio is None else "ok" if row.get("meets_target") else "LOW"
    print(f"  T={row['T']:<5d} d={row['d']:<3d} fwd+bwd ms: {ms}  cudnn/flash "
          f"{ratio or nan:.2f} {mark}")
if "ratio_cudnn_over_flash_geomean" in r:
    print(f"  cudnn/flash geomean {r['ratio_cudnn_over_flash_geomean']:.2f}, min "
          f"{r['ratio_cudnn_over_flash_min']:.2f}; {r['points_meeting_target']} of "
          f"{r['points_measured']} points >= {r['target_ratio_cudnn_over_flash']}")
EOF
fi
if [ -f "$DETAILS_DIR/train_step_gpu.json" ]; then # issue 11's train-step benchmark (3b)
    timeout 20 "$PYTHON" - "$DETAILS_DIR/train_step_gpu.json" <<'EOF' 2>&1 | tee -a "$LOG" || true
import json, sys

r = json.load(open(sys.argv[1]))
print(f"train: {r['device_kind']}, {r['tokens_per_step']} tokens/step: {r['tokens_per_s']:,.0f} "
      f"tokens/s, MFU {r['mfu']:.1%} of {r['peak_flops'] / 1e12:.4g} TFLOP/s "
      f"({r['peak_flops_source']}), compile {r['compile_s']:.1f} s")
EOF
fi
if [ -f "$RESULTS_DIR/gpu_profile.json" ]; then # issue 31's train step per attention (3)
    timeout 20 "$PYTHON" - "$RESULTS_DIR/gpu_profile.json" <<'EOF' 2>&1 | tee -a "$LOG" || true
import json, sys

r = json.load(open(sys.argv[1]))
for run in r["runs"]:
    if "error" in run:
        print(f"profile: {run['attention']}: {run['error']}")
    else:
        print(f"profile: {run['attention']}: {run['tokens_per_s']:,.0f} tokens/s, MFU "
              f"{run['mfu']:.1%}, compile {run['compile_s']:.1f} s")
for k in ((r.get("profile") or {}).get("kernels") or [])[:5]:
    print(f"  {k['share'] or 0:6.1%} {k['kernel'][:80]}")
EOF
fi
if [ -f "$DETAILS_DIR/nf4_matmul_gpu.json" ]; then # issue 8's NF4 matmul timings (3c)
    timeout 20 "$PYTHON" - "$DETAILS_DIR/nf4_matmul_gpu.json" <<'EOF' 2>&1 | tee -a "$LOG" || true
import json, sys

r = json.load(open(sys.argv[1]))
nan = float("nan")
print(f"nf4: {r.get('status')}, {r.get('device')}, {len(r.get('rows', []))} points")
for row in r.get("rows", []):
    ms = " ".join(f"{i} {row.get(f't_{i}_fwd_ms') or nan:7.3f}" for i in ("nf4", "nf4_xla", "bf16"))
    print(f"  {row['tokens']:5d} x {row['out']}x{row['in']}: fwd ms {ms}  bf16/nf4 "
          f"{row.get('ratio_bf16_over_nf4_fwd') or nan:.2f}")
EOF
fi
say "files: $(cd "$RESULTS_DIR" && ls | tr '\n' ' ')"
skipped_note="${SKIPPED[0]+; skipped: ${SKIPPED[*]}}"
if [ "${#FAILED[@]}" -gt 0 ]; then
    say "gpu_check: FAILED: ${FAILED[*]}${skipped_note} (${SECONDS}s)"
    exit 1
fi
say "gpu_check: every step that ran passed${skipped_note} (${SECONDS}s)"
