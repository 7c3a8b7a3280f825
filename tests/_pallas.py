"""What the Pallas kernel tests (test_flash_attention, test_nf4_matmul) share: which kernels
run here, and lowering a kernel for a platform this host does not have."""

from __future__ import annotations

import os

import jax
import pytest

from lmjax import compat

# LMJAX_PALLAS_INTERPRET=0 (scripts/gpu_check.sh on a GPU) runs the kernels compiled.
INTERPRET = os.environ.get("LMJAX_PALLAS_INTERPRET", "1") != "0"
PLATFORM = jax.default_backend()
# The custom call each kernel's pallas_call lowers to, counted in the lowered text.
CUSTOM_CALL = {"gpu": "__gpu$xla.gpu.triton", "tpu": "tpu_custom_call"}


def _not_runnable(kernel: str) -> str | None:
    """Why `kernel` cannot run here, or None: it runs interpreted anywhere, compiled only on
    its own platform."""
    if INTERPRET or kernel == PLATFORM:
        return None
    return f"compiled run on {PLATFORM}: the {kernel} kernel needs its own device"


def kernel_param(kernel: str):
    """`kernel` as a pytest parameter, skipped where it cannot run (see `_not_runnable`)."""
    reason = _not_runnable(kernel)
    mark = pytest.mark.skipif(reason is not None, reason=reason or "")
    return pytest.param(kernel, marks=mark, id=kernel)


def skip_unless_runnable(kernel: str) -> None:
    """Skip the running test where `kernel` cannot run (see `_not_runnable`)."""
    reason = _not_runnable(kernel)
    if reason is not None:
        pytest.skip(reason)


def lowered_text(fn, *args, platform: str, device: str | None = None) -> str:
    """The StableHLO text of `jax.jit(fn)(*args)` (`fn` may be jitted already) traced with
    `device` as the default device (None: this host's; "gpu" picks the GPU kernels) and lowered
    for `platform` on this host, on every supported jax (`lmjax.compat.lowering_for`)."""
    jitted = fn if hasattr(fn, "trace") else jax.jit(fn)
    _, lowered = compat.lowering_for(jitted, *args, platform=platform, trace_device=device)
    return lowered.as_text()
