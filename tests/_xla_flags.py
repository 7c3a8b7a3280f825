"""XLA_FLAGS for a test's subprocess that simulates several CPU devices.

The device count has to be set before jax starts, so such tests start a subprocess with it in
XLA_FLAGS. The caller's own flags go along: `make test-portable` runs the numerically sensitive
files under `--xla_cpu_max_isa=...` (a CPU without AVX-512, say), and their subprocesses must
compute as that CPU would too.
"""

from __future__ import annotations

import os

DEVICE_COUNT = "--xla_force_host_platform_device_count"


def host_devices(n: int, flags: str | None = None) -> str:
    """`flags` (default: this process's XLA_FLAGS) with any device count replaced by `n`."""
    flags = os.environ.get("XLA_FLAGS", "") if flags is None else flags
    kept = [f for f in flags.split() if not f.startswith(DEVICE_COUNT + "=")]
    return " ".join([*kept, f"{DEVICE_COUNT}={n}"])
