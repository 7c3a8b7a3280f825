"""Peak-memory measurement of one process (Linux): its /proc/self/status lines, the VmHWM reset.

No jax or torch import here: a benchmark's torch worker measures itself without the JAX
runtime resident, and its jax worker without torch.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import gc
import re
from pathlib import Path

# glibc's mmap threshold pinned, so freed buffers go back to the system and a freed float base
# does not stay resident by accident (set in a worker's environment before it starts).
RSS_ENV = {"MALLOC_MMAP_THRESHOLD_": "131072"}


def status_bytes(field: str) -> int:
    """A `/proc/self/status` memory line (VmRSS, VmHWM: kB) in bytes."""
    text = Path("/proc/self/status").read_text()
    return int(re.search(rf"^{field}:\s+(\d+) kB", text, re.M).group(1)) * 1024


def release_freed_memory() -> None:
    """Collect Python garbage and return glibc's free heap pages to the system."""
    gc.collect()
    libc = ctypes.util.find_library("c")
    if libc:
        ctypes.CDLL(libc).malloc_trim(0)


def reset_peak() -> tuple[int, int]:
    """`(peak so far, rss)` in bytes: VmHWM until now (this process's mm, so from its exec;
    ru_maxrss would carry the parent's peak over a fork + exec), then free what can be freed
    and set VmHWM := VmRSS (Linux >= 4.0); rss is that VmRSS."""
    peak = status_bytes("VmHWM")
    release_freed_memory()
    rss = status_bytes("VmRSS")
    Path("/proc/self/clear_refs").write_text("5")
    return peak, rss
