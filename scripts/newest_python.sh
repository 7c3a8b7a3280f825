#!/usr/bin/env bash
# Print the path of the newest CPython of the versions given (newest first; default 3.13 3.12)
# that this machine has, for `make test-next`: `pythonX.Y` on PATH when it runs, else the
# newest interpreter pyenv keeps for that version that runs (pyenv's shims refuse a version not
# selected, so the shim alone is not enough). Exits 1, naming what it looked for, if none is found.
set -euo pipefail
versions=("$@")
[ ${#versions[@]} -gt 0 ] || versions=(3.13 3.12)
for v in "${versions[@]}"; do
    if "python$v" -c "" >/dev/null 2>&1; then
        command -v "python$v"
        exit 0
    fi
    if command -v pyenv >/dev/null 2>&1; then
        root=$(pyenv root)
        for full in $(pyenv versions --bare 2>/dev/null | grep -E "^${v//./\\.}\.[0-9]+$" | sort -rV); do
            candidate="$root/versions/$full/bin/python$v"
            if "$candidate" -c "" >/dev/null 2>&1; then
                echo "$candidate"
                exit 0
            fi
        done
    fi
done
echo "no Python ${versions[*]} found (on PATH or under pyenv)" >&2
exit 1
