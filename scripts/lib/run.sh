# shellcheck shell=bash
# Sourced by scripts/tpu/tpu.sh and scripts/gpu/train.sh.
#
# run CMD [ARGS...]: run a command, or, under DRY_RUN=1, print it instead as one shell-quoted
# line starting with "+" (the dry-run tests parse these lines back with shlex).
run() {
    if [[ "${DRY_RUN:-0}" == "1" ]]; then
        printf '+'
        printf ' %q' "$@"
        printf '\n'
    else
        "$@"
    fi
}
