"""What the GPU kernel benchmarks (attention_gpu.py, nf4_matmul_gpu.py) share: timing, errors,
and the results file they rewrite after every point."""

from __future__ import annotations

import json
import platform
import time
from pathlib import Path

import jax


def no_gpu_exit(script: str, require_gpu: bool, allow_cpu: bool) -> int | None:
    """The exit status when there is no GPU to time (None: go on).

    Without a GPU the script prints that it skipped and exits 0, or 1 under --require-gpu;
    --allow-cpu runs it anyway, the kernel interpreted (a check of the script itself).
    """
    backend = jax.default_backend()
    if backend == "gpu" or allow_cpu:
        return None
    print(f"{script}: no GPU (jax.default_backend() = {backend!r}); skipped")
    return 1 if require_gpu else 0


def seconds_per_call(fn, args, calls: int, samples: int):
    """(best mean seconds per call, the last output). The first call compiles and warms up.

    Each of `samples` samples times `calls` back-to-back calls and waits once for the last
    result, so the launch queue stays full; the best sample is the least disturbed one.
    """
    out = jax.block_until_ready(fn(*args))
    best = float("inf")
    for _ in range(samples):
        start = time.perf_counter()
        for _ in range(calls):
            out = fn(*args)
        jax.block_until_ready(out)
        best = min(best, (time.perf_counter() - start) / calls)
    return best, out


def environment(**extra) -> dict:
    """Where a GPU benchmark ran: the first device's kind, the backend, jax and Python, and
    `extra` (JSON-able) beside them."""
    return {
        "device": jax.devices()[0].device_kind,
        "backend": jax.default_backend(),
        "jax": jax.__version__,
        "python": platform.python_version(),
        **extra,
    }


def error_text(e: BaseException) -> str:
    """One line for a JSON field: the exception's type and the start of its message."""
    return f"{type(e).__name__}: {str(e)[:300]}"


def write_json(path: Path, result: dict) -> None:
    """Write `result` to `path` atomically: a kill mid-write never leaves half a file."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".json.tmp")
    tmp.write_text(json.dumps(result, indent=2) + "\n")
    tmp.replace(path)
