"""lmjax.hostmem: the allocator setting that keeps XLA's per-step temporaries mapped.

The witness is the kernel's own count of minor page faults (getrusage), in a fresh numpy-only
subprocess: freeing and re-allocating a 64 MiB buffer faults its pages in again every time under
glibc's defaults, and not at all once `keep_freed_memory` has run.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from lmjax import cli, hostmem

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# Allocate, touch and free a 64 MiB buffer 5 times; print the minor faults of the last 4 rounds.
PROBE = """
import json, resource, sys
sys.path.insert(0, sys.argv[1])
import numpy as np
if sys.argv[2] == "tuned":
    from lmjax.hostmem import keep_freed_memory
    assert keep_freed_memory()["tuned"]
faults = []
for _ in range(5):
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    a = np.ones(64 << 18, dtype=np.float32)  # 64 MiB, every page written
    del a
    faults.append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
print(json.dumps(faults[1:]))
"""


def _faults(mode: str) -> list[int]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("MALLOC_")}
    env.pop(hostmem.ENV_SWITCH, None)
    out = subprocess.run(
        [sys.executable, "-c", PROBE, ROOT, mode], env=env, capture_output=True, text=True
    )
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc mallopt is Linux-only")
def test_keep_freed_memory_stops_refaulting_freed_blocks():
    # At least one fault per 2 MiB: numpy asks for transparent huge pages on large arrays, so a
    # round faults between 32 (all huge pages) and 16,384 (all 4 KiB pages) times.
    at_least = (64 << 20) // (2 << 20)
    default, tuned = _faults("default"), _faults("tuned")
    # glibc's defaults mmap a 64 MiB block and unmap it on free: each round faults it in again.
    assert min(default) >= at_least, default
    # Kept in the heap, the pages stay mapped: the later rounds fault nothing.
    assert max(tuned) <= 2, tuned


def test_switch_off_leaves_glibc_alone(monkeypatch):
    monkeypatch.setenv(hostmem.ENV_SWITCH, "0")
    assert hostmem.keep_freed_memory() == {"tuned": False, "reason": "LMJAX_TUNE_MALLOC=0"}


@pytest.mark.parametrize(
    ("argv", "tuned"),
    [
        (["bench", "/nonexistent/run.yaml"], True),
        (["train", "/nonexistent/run.yaml"], True),
        (["finetune", "/nonexistent/run.yaml"], True),
        (["inspect", "/nonexistent/run.yaml"], False),
    ],
)
def test_long_running_commands_tune_before_running(monkeypatch, capsys, argv, tuned):
    calls = []
    monkeypatch.setattr(hostmem, "keep_freed_memory", lambda: calls.append(1) or {})
    assert cli.main(argv) == 2  # the missing config is refused after the setting
    assert calls == ([1] if tuned else [])
    capsys.readouterr()
