"""The host allocator for long CPU runs: keep freed memory in the process for reuse.

XLA's CPU runtime allocates each execution's temporary buffers afresh and frees them at the end.
With glibc's default settings a block above the mmap threshold (which adapts up to 32 MiB) is
mmap'd on allocation and unmapped on free, so every train step of the reference config touched
about 265 MiB of fresh pages: ~68k minor page faults and ~140 ms of kernel time per step on one
core, about 13% of the step (measured; `benchmarks/train_step.py`). Telling glibc to serve every
block from one heap that it never trims makes those pages stay mapped between steps.

    one arena (M_ARENA_MAX=1), no mmap'd blocks (M_MMAP_MAX=0),
    never trim (M_TRIM_THRESHOLD=2**31-1), grow in 256 MiB steps (M_TOP_PAD)

The cost is that the process keeps its peak heap until it exits, which is what a training
process does anyway. `lmjax train`, `lmjax finetune` and `lmjax bench` call `keep_freed_memory`
before JAX starts its threads; `LMJAX_TUNE_MALLOC=0` leaves glibc's defaults. The same settings
can be given to any process (a notebook's kernel) through glibc's environment variables, all four:

    MALLOC_ARENA_MAX=1  MALLOC_MMAP_MAX_=0
    MALLOC_TRIM_THRESHOLD_=2147483647  MALLOC_TOP_PAD_=268435456
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os

# glibc's mallopt parameter numbers (malloc.h) and the values set.
MALLOPT = {
    "M_ARENA_MAX": (-8, 1),
    "M_MMAP_MAX": (-4, 0),
    "M_TRIM_THRESHOLD": (-1, 2**31 - 1),
    "M_TOP_PAD": (-2, 256 << 20),
}
ENV_SWITCH = "LMJAX_TUNE_MALLOC"


def keep_freed_memory() -> dict:
    """Apply `MALLOPT` through glibc's `mallopt`; return what was done (for logs and JSON).

    Call it before JAX creates its CPU client: a thread picks its arena at its first malloc, so
    threads started earlier keep theirs. A libc without `mallopt` (musl, macOS) is left alone, as
    is any process where `LMJAX_TUNE_MALLOC=0`.
    """
    if os.environ.get(ENV_SWITCH, "1") == "0":
        return {"tuned": False, "reason": f"{ENV_SWITCH}=0"}
    try:
        mallopt = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6").mallopt
    except (OSError, AttributeError) as e:
        return {"tuned": False, "reason": f"no glibc mallopt ({type(e).__name__}: {e})"}
    ok = {name: bool(mallopt(code, value)) for name, (code, value) in MALLOPT.items()}
    set_ = {name: value for name, (_, value) in MALLOPT.items()}
    return {"tuned": all(ok.values()), "set": set_, "ok": ok}
