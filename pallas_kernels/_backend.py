"""What every Pallas kernel here shares: picking a backend, the platform check, tiny helpers.

Each kernel module (`flash_attention`, `nf4_matmul`) has a GPU (Triton) and a TPU (Mosaic)
kernel. `backend=None` follows `jax.default_backend()`; a CPU host compiles neither, so it runs
`CPU_KERNEL` interpreted. The kernel modules wrap `resolve_backend` with their own name and fix
hint, so error messages still say which kernel refused.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from lmjax.errors import ConfigError

KERNELS = ("gpu", "tpu")
# On a CPU host nothing compiles; the GPU-style kernel is the one interpreted by default.
CPU_KERNEL = "gpu"
GPU_MIN_TILE = 16  # Triton's tl.dot needs every matmul dimension >= 16
TPU_SUBLANES, TPU_LANES = 8, 128


def resolve_backend(
    backend: str | None, interpret: bool | None, *, what: str, fix: str
) -> tuple[str, bool]:
    """(kernel, interpret) for a kernel's arguments on this host.

    None follows `jax.default_backend()`: "gpu" and "tpu" compile their own kernel; "cpu" runs
    `CPU_KERNEL` interpreted (interpret=None -> True on CPU, False elsewhere). Any other name, or
    a platform with no kernel, is a ConfigError naming `what` (e.g. "nf4_matmul backend") with
    the caller's `fix`.
    """
    platform = jax.default_backend()
    kernel = (CPU_KERNEL if platform == "cpu" else platform) if backend is None else backend
    if kernel not in KERNELS:
        raise ConfigError.describe(
            what,
            kernel,
            f"one of {KERNELS} (None follows jax.default_backend(); on CPU the "
            f"{CPU_KERNEL!r} kernel runs interpreted)",
            fix,
        )
    return kernel, platform == "cpu" if interpret is None else bool(interpret)


def block_sizes_or_default(block_sizes, cls: type, kernel: str):
    """`block_sizes`, or `cls.default(kernel)` when None; anything but a `cls` is a ConfigError."""
    sizes = cls.default(kernel) if block_sizes is None else block_sizes
    if not isinstance(sizes, cls):
        raise ConfigError.describe("block_sizes", sizes, "a BlockSizes", "pass BlockSizes(...)")
    return sizes


def require_platform(kernel: str, interpret: bool) -> None:
    """A compiled kernel needs its own device; only interpret mode runs anywhere."""
    platform = jax.default_backend()
    if not interpret and kernel != platform:
        raise ConfigError.describe(
            f"backend={kernel!r} compiled (interpret=False) on platform",
            platform,
            f"JAX running on {kernel!r}, or interpret=True",
            "pass interpret=True to run the kernel interpreted (slow, for tests)",
        )


def require_positive_int(value, what: str, fix: str | None = None) -> None:
    """A tile size or launch setting: a positive int (numpy ints too, bools not).

    The error names `what`; its fix is `fix`, or "set <what> to e.g. 64".
    """
    if not isinstance(value, int | np.integer) or isinstance(value, bool) or value <= 0:
        fix = f"set {what} to e.g. 64" if fix is None else fix
        raise ConfigError.describe(what, value, "a positive int", fix)


def round_up(n: int, multiple: int) -> int:
    """The smallest multiple of `multiple` that is >= n (n >= 0)."""
    return -(-n // multiple) * multiple


def dot(a, b, contract: tuple[int, int]):
    """2-D matmul contracting a's axis contract[0] with b's contract[1], accumulated in f32."""
    dims = (((contract[0],), (contract[1],)), ((), ()))
    return lax.dot_general(a, b, dims, preferred_element_type=jnp.float32)
