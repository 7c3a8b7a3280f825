#!/usr/bin/env bash
# Train an lmjax config on a Cloud TPU VM or slice (docs/scale.md), with gcloud.
#
#     scripts/tpu/tpu.sh all configs/tpu-gpt2-124m.yaml [section.key=value ...]
#
# runs every step below in order and deletes the TPU at the end, also after a failure or
# Ctrl-C. A worker that is preempted or fails (train.rc not 0, or unreadable because the VM is
# gone) gets the TPU deleted, created and installed again and the training relaunched with
# --resume, up to RESTARTS times; exit status 2 (lmjax refused the config or data) is not
# retried. A RUN_DIR relative to ~/lmjax lives on the VM's disk: it is copied back from the
# last fetch (./runs/tpu/<name>) before relaunching; on a shared mount it is simply there.
# Each step is also a subcommand of its own:
#
#     create                    gcloud compute tpus tpu-vm create (spot with SPOT=1)
#     install                   copy this tree (git archive HEAD) to every worker; on each: uv,
#                               a venv on Python $PYTHON_VERSION, "jax[tpu]" and the project
#     launch CONFIG [k=v ...]   lmjax train on all workers at once (--worker=all) with
#                               LMJAX_DISTRIBUTED=auto (jax finds the slice's hosts itself);
#                               each worker's console goes to ~/lmjax/train.log; RESUME=1
#                               adds --resume where RUN_DIR/config.yaml exists on the worker
#     upload                    copy ./runs/tpu/<name> back to RUN_DIR on every worker
#     logs                      stream worker 0's train.log (process 0 writes the metrics)
#     fetch                     copy RUN_DIR from worker 0 to ./runs/tpu/<its name>, with the
#                               console log (train.log) and exit status (train.rc)
#     delete                    delete the TPU VM
#
# Settings (environment): TPU_NAME (lmjax-tpu), ZONE (us-central2-b), ACCELERATOR (v4-8),
# RUNTIME (tpu-ubuntu2204-base), RUN_NAME (tpu-run), RUN_DIR (runs/$RUN_NAME: the run.dir the
# workers train into, relative to ~/lmjax or absolute), SPOT (0), PROJECT (gcloud's default),
# PYTHON_VERSION (3.12: the workers' venv Python, provided by uv), RESTARTS (3: how many times
# `all` recreates a preempted or failed TPU and resumes), HEARTBEAT (LMJAX_HEARTBEAT_TIMEOUT on
# the workers, seconds; unset: lmjax's 50), DRY_RUN=1 prints every command instead of running it.
#
# The project is installed from the committed tree (git archive HEAD): commit first.
#
# Check the config before creating a VM (any machine, no TPU: libtpu compiles for the slice):
#     lmjax compile configs/tpu-gpt2-124m.yaml --topology v4:2x2x1 [section.key=value ...]
# compiles the sharded train step for the ACCELERATOR's topology (v4-8: v4:2x2x1,
# v5litepod-8: v5e:2x4, v6e-8: v6e:2x4) and exits non-zero unless it fits the chips' HBM.
#
# A slice of several hosts (v4-16 and up) must write checkpoints where all hosts see them:
# orbax saves collectively and each host writes its own shards. Set RUN_DIR=<a shared mount>
# (NFS or gcsfuse, mounted on every worker) there; on one host (v4-8, v5litepod-8) the default
# is fine.
set -euo pipefail

TPU_NAME="${TPU_NAME:-lmjax-tpu}"
ZONE="${ZONE:-us-central2-b}"
ACCELERATOR="${ACCELERATOR:-v4-8}"
RUNTIME="${RUNTIME:-tpu-ubuntu2204-base}"
RUN_NAME="${RUN_NAME:-tpu-run}"
RUN_DIR="${RUN_DIR:-runs/$RUN_NAME}"
SPOT="${SPOT:-0}"
PYTHON_VERSION="${PYTHON_VERSION:-3.12}"
PROJECT="${PROJECT:-}"
DRY_RUN="${DRY_RUN:-0}"
RESTARTS="${RESTARTS:-3}"
RESUME="${RESUME:-0}"
HEARTBEAT="${HEARTBEAT:-}"
REMOTE_DIR="lmjax"
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"

# run CMD...: run it, or print it (shell-quoted, one line) under DRY_RUN=1.
# shellcheck source-path=SCRIPTDIR source=../lib/run.sh
source "$ROOT/scripts/lib/run.sh"

gcloud_tpu() {
    local extra=()
    if [[ -n "$PROJECT" ]]; then
        extra+=("--project=$PROJECT")
    fi
    run gcloud compute tpus tpu-vm "$@" --zone="$ZONE" "${extra[@]}"
}

create() {
    local flags=(--accelerator-type="$ACCELERATOR" --version="$RUNTIME")
    if [[ "$SPOT" == "1" ]]; then
        flags+=(--spot)
    fi
    gcloud_tpu create "$TPU_NAME" "${flags[@]}"
}

install() {
    local archive="${TMPDIR:-/tmp}/lmjax-src-$$.tar.gz"
    # Tracked files only (git ls-files): no .venv, runs or caches travel.
    run git -C "$ROOT" archive --format=tar.gz --output="$archive" HEAD
    # Remote paths without a leading ~ are relative to the home directory (scp's rule).
    gcloud_tpu scp "$archive" "$TPU_NAME:lmjax.tar.gz" --worker=all
    # The TPU images' python3 is Ubuntu 22.04's 3.10 and lmjax needs >= 3.11, so uv (installed
    # into ~/.local/bin if missing) makes the venv on a Python of its own.
    local setup="mkdir -p $REMOTE_DIR && tar -xzf lmjax.tar.gz -C $REMOTE_DIR && cd $REMOTE_DIR"
    # shellcheck disable=SC2016 # expanded by the worker's shell
    setup+=' && export PATH="$HOME/.local/bin:$PATH"'
    setup+=" && { command -v uv > /dev/null || curl -LsSf https://astral.sh/uv/install.sh | sh; }"
    setup+=" && rm -rf .venv && uv venv -q --python $PYTHON_VERSION .venv"
    setup+=" && uv pip install -q --python .venv/bin/python 'jax[tpu]>=0.10.2,<0.13' -e ."
    gcloud_tpu ssh "$TPU_NAME" --worker=all --command="$setup"
    run rm -f "$archive"
}

launch() {
    if [[ $# -lt 1 ]]; then
        echo "usage: $0 launch CONFIG [section.key=value ...]" >&2
        exit 2
    fi
    local args="" arg
    for arg in "$@"; do
        if [[ "$arg" == run.dir=* ]]; then  # fetch must know it: one setting for both
            echo "$0: set RUN_DIR=${arg#run.dir=} instead of passing $arg" >&2
            exit 2
        fi
    done
    for arg in "$@" "run.dir=$RUN_DIR"; do
        args+=" $(printf '%q' "$arg")"
    done
    # The braces keep train.pid beside train.log: in `cd D && X & echo $! > F` the cd happens in
    # X's background subshell and F would land in ~. The training outlives the ssh session
    # (nohup, no terminal); train.pid lets logs follow it, train.rc gets its exit status.
    local runner='.venv/bin/lmjax train "$@"; echo $? > train.rc'
    local env="LMJAX_DISTRIBUTED=auto"
    if [[ -n "$HEARTBEAT" ]]; then
        env+=" LMJAX_HEARTBEAT_TIMEOUT=$(printf '%q' "$HEARTBEAT")"
    fi
    if [[ "$RESUME" == "1" ]]; then  # continue the run where the worker has one to continue
        env+=" RESUME_DIR=$(printf '%q' "$RUN_DIR")"
        # shellcheck disable=SC2016 # expanded by the worker's shell
        runner='if [ -f "$RESUME_DIR/config.yaml" ]; then set -- "$@" --resume; fi; '"$runner"
    fi
    local command="cd $REMOTE_DIR && rm -f train.rc && { $env nohup"
    command+=" bash -c '$runner' lmjax$args"
    command+=' > train.log 2>&1 < /dev/null & echo $! > train.pid; }'
    gcloud_tpu ssh "$TPU_NAME" --worker=all --command="$command"
}

logs() {
    # From the start of the log until the training process on worker 0 exits.
    # shellcheck disable=SC2016 # $(...) is for the worker's shell
    local follow="cd $REMOTE_DIR"' && tail -n +1 --pid="$(cat train.pid)" -f train.log'
    # shellcheck disable=SC2016
    follow+=' && if [ -f train.rc ]; then echo "lmjax train exited with status $(cat train.rc)"; fi'
    gcloud_tpu ssh "$TPU_NAME" --worker=0 --command="$follow"
}

fetch() {
    local remote="$RUN_DIR" here
    if [[ "$remote" != /* ]]; then
        remote="$REMOTE_DIR/$remote"
    fi
    here="runs/tpu/$(basename "$RUN_DIR")"
    run mkdir -p "$here"
    run rm -f "$here/train.rc" # a status left by an earlier attempt must not be read as this one's
    # The console log and exit status first: they exist even when the run directory does not.
    gcloud_tpu scp "$TPU_NAME:$REMOTE_DIR/train.log" "$TPU_NAME:$REMOTE_DIR/train.rc" "$here/" \
        --worker=0 || echo "$0: could not copy train.log/train.rc from worker 0" >&2
    gcloud_tpu scp --recurse "$TPU_NAME:$remote" "runs/tpu/" --worker=0
}

upload() {
    # The last fetched copy of a run on the VM's own disk, back onto a recreated VM.
    local here
    here="runs/tpu/$(basename "$RUN_DIR")"
    if [[ "$RUN_DIR" == /* || ! -f "$here/config.yaml" ]]; then
        return 0 # a shared mount keeps the run itself; without a copy there is nothing to resume
    fi
    gcloud_tpu ssh "$TPU_NAME" --worker=all --command="mkdir -p $REMOTE_DIR/$(dirname "$RUN_DIR")"
    gcloud_tpu scp --recurse "$here" "$TPU_NAME:$REMOTE_DIR/$(dirname "$RUN_DIR")/" --worker=all
}

delete() {
    gcloud_tpu delete "$TPU_NAME" --quiet
}

# The exit status of the last attempt's training on worker 0 (fetched), or "unknown".
train_status() {
    cat "runs/tpu/$(basename "$RUN_DIR")/train.rc" 2> /dev/null || echo unknown
}

# One attempt: launch, follow worker 0's log until the training exits, fetch what is there.
attempt() {
    launch "$@"
    # A dropped ssh connection must not end the run (the trap would delete the TPU under a
    # training that is still going): reconnect a few times; tail exits when training does.
    local tries=0
    until logs; do
        tries=$((tries + 1))
        if [[ $tries -ge 5 ]]; then
            echo "$0: lost the log stream $tries times; fetching what is there" >&2
            break
        fi
        echo "$0: log stream dropped; reconnecting" >&2
        sleep 10
    done
    # A preempted VM answers nothing: the status stays unknown and the next attempt recreates it.
    fetch || echo "$0: could not fetch $RUN_DIR from worker 0" >&2
}

all() {
    # Checked before anything is billed: the workers get the last commit (install).
    if [[ $# -lt 1 ]]; then
        echo "usage: $0 all CONFIG [section.key=value ...]" >&2
        exit 2
    fi
    if ! git -C "$ROOT" cat-file -e "HEAD:$1" 2> /dev/null; then
        echo "$0: $1 is not in the last commit (HEAD), which is what the workers get;" \
            "commit it, with its path relative to the repository root" >&2
        exit 2
    fi
    if [[ ! "$RESTARTS" =~ ^[0-9]+$ ]]; then
        echo "$0: RESTARTS=$RESTARTS; expected a whole number (how many relaunches)" >&2
        exit 2
    fi
    create
    trap delete EXIT # the TPU bills until deleted: delete it however this ends
    install
    attempt "$@"
    local restarts=0 status
    while [[ "$DRY_RUN" != "1" ]]; do
        status="$(train_status)"
        if [[ "$status" == "0" ]]; then
            return 0
        fi
        if [[ "$status" == "2" || $restarts -ge $RESTARTS ]]; then
            echo "$0: lmjax train on worker 0 ended with status $status (see train.log)" \
                "after $restarts restart(s) of $RESTARTS" >&2
            exit 1
        fi
        restarts=$((restarts + 1))
        echo "$0: lmjax train on worker 0 ended with status $status (preempted or failed);" \
            "recreating $TPU_NAME and resuming (restart $restarts of $RESTARTS)" >&2
        delete || echo "$0: could not delete $TPU_NAME (already gone?)" >&2
        create
        install
        upload
        RESUME=1 attempt "$@"
    done
}

main() {
    local step="${1:-}"
    shift || true
    case "$step" in
        create | install | upload | logs | fetch | delete) "$step" ;;
        launch | all) "$step" "$@" ;;
        *)
            echo "usage: $0 {create|install|launch CONFIG [k=v ...]|upload|logs|fetch|delete|all CONFIG [k=v ...]}" >&2
            echo "check CONFIG first, with no TPU: lmjax compile CONFIG --topology v4:2x2x1 (the ACCELERATOR's slice)" >&2
            exit 2
            ;;
    esac
}

main "$@"
