#!/usr/bin/env bash
# Train an lmjax config on every GPU of one host (docs/scale.md), FSDP over the GPUs.
#
#     scripts/gpu/train.sh CONFIG [section.key=value ...]
#
# Run from a copy of this tree on the GPU host. Steps:
#   1 install   with INSTALL=1 (or when .venv is missing): a venv on $PYTHON (>= 3.11) with
#               jax[cuda12] and the project (pip install -e .)
#   2 inspect   lmjax inspect CONFIG --mesh MESH: the per-GPU memory of this mesh
#   3 train     lmjax train CONFIG parallel.mesh=MESH [overrides], console tee'd to $LOG
#
# Settings (environment): GPUS (default: nvidia-smi -L | wc -l), MESH (default fsdp=$GPUS;
# e.g. data=2,fsdp=4 or fsdp=4,model=2), INSTALL (0), VENV (.venv), PYTHON (python3),
# LOG (train-gpu.log, in the tree's root), DRY_RUN=1 prints every command instead of running it.
set -euo pipefail

DRY_RUN="${DRY_RUN:-0}"
INSTALL="${INSTALL:-0}"
VENV="${VENV:-.venv}"
PYTHON="${PYTHON:-python3}"
LOG="${LOG:-train-gpu.log}"
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"

# run CMD...: run it, or print it (shell-quoted, one line) under DRY_RUN=1.
# shellcheck source-path=SCRIPTDIR source=../lib/run.sh
source "$ROOT/scripts/lib/run.sh"

if [[ $# -lt 1 ]]; then
    echo "usage: $0 CONFIG [section.key=value ...]" >&2
    exit 2
fi
config="$1"
shift

if [[ -z "${GPUS:-}" ]]; then
    GPUS="$(nvidia-smi -L 2>/dev/null | grep -c '^GPU' || true)"
fi
if [[ ! "$GPUS" =~ ^[1-9][0-9]*$ ]]; then
    echo "$0: found no GPUs (nvidia-smi -L); set GPUS=<count> to say how many" >&2
    exit 2
fi
MESH="${MESH:-fsdp=$GPUS}"

cd "$ROOT"
if [[ "$INSTALL" == "1" || ! -x "$VENV/bin/lmjax" ]]; then
    if [[ "$DRY_RUN" != "1" ]] && ! "$PYTHON" -c 'import sys; sys.exit(sys.version_info < (3, 11))'; then
        echo "$0: lmjax needs Python >= 3.11 ($PYTHON is older); set PYTHON=python3.12 or so" >&2
        exit 2
    fi
    run "$PYTHON" -m venv "$VENV"
    run "$VENV/bin/pip" install -q -U pip
    run "$VENV/bin/pip" install -q 'jax[cuda12]>=0.10.2,<0.13' -e .
fi
run "$VENV/bin/lmjax" inspect "$config" --mesh "$MESH"
if [[ "$DRY_RUN" == "1" ]]; then
    run "$VENV/bin/lmjax" train "$config" "parallel.mesh=$MESH" "$@"
else
    # pipefail: the script fails when training does, not when tee succeeds.
    "$VENV/bin/lmjax" train "$config" "parallel.mesh=$MESH" "$@" 2>&1 | tee "$LOG"
fi
