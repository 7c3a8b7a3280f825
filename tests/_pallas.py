"""What the Pallas kernel tests (test_flash_attention, test_nf4_matmul) share: which kernels
run here, and lowering a kernel for a platform this host does not have."""

from __future__ import annotations

import os

import jax
import pytest

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


def lowered_text(traced, platform: str) -> str:
    """The StableHLO text of `traced` (a `jax.jit(...).trace(...)`) lowered for `platform`.

    Skips the test where this jax cannot lower Triton without a local GPU: jax >= 0.11 asks
    the device for its compute capability before emitting Triton IR (scripts/gpu_check.sh
    runs the kernels compiled on a GPU instead).
    """
    try:
        return traced.lower(lowering_platforms=(platform,)).as_text()
    except RuntimeError as err:
        if "No supported GPU devices" not in str(err):
            raise
        pytest.skip(f"this jax {jax.__version__} needs a GPU to lower Triton: {err}")
