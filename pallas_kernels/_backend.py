"""What every Pallas kernel here shares: picking a backend, the platform check, tiny helpers.

Each kernel module (`flash_attention`, `nf4_matmul`) has a GPU (Triton) and a TPU (Mosaic)
kernel. `backend=None` follows the platform being compiled for (`platform()`: the default
device's, else `jax.default_backend()`); a CPU host compiles neither, so it runs `CPU_KERNEL`
interpreted. The kernel modules wrap `resolve_backend` with their own name and fix hint, so error
messages still say which kernel refused.

Ahead-of-time compiles for a TPU on a CPU host (tests/test_tpu_compile.py, `lmjax compile`) set
the target the standard way, `with jax.default_device(topology.devices[0]):` over compile-only
devices from `jax.experimental.topologies`; the kernels then trace their TPU (Mosaic) path.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax

from lmjax.checks import is_positive_int
from lmjax.errors import ConfigError

KERNELS = ("gpu", "tpu")
# On a CPU host nothing compiles; the GPU-style kernel is the one interpreted by default.
CPU_KERNEL = "gpu"
GPU_MIN_TILE = 16  # Triton's tl.dot needs every matmul dimension >= 16
TPU_SUBLANES, TPU_LANES = 8, 128


def platform() -> str:
    """The platform kernels are traced for: the default device's when one is set
    (`jax.default_device(d)`, e.g. a compile-only TPU device on a CPU host), else
    `jax.default_backend()`. GPU devices report "gpu" (not "cuda"/"rocm")."""
    device = jax.config.jax_default_device
    if device is None:
        return jax.default_backend()
    name = device if isinstance(device, str) else device.platform
    return "gpu" if name in ("cuda", "rocm") else name


def device_kind() -> str:
    """The `device_kind` of the device kernels are traced for (the default device's when one is
    set, else `jax.devices()[0]`'s), e.g. "NVIDIA H200"; "cpu" on a CPU host."""
    device = jax.config.jax_default_device
    if device is None or isinstance(device, str):
        return jax.devices()[0].device_kind
    return device.device_kind


def resolve_backend(
    backend: str | None, interpret: bool | None, *, what: str, fix: str
) -> tuple[str, bool]:
    """(kernel, interpret) for a kernel's arguments on this host.

    None follows `platform()`: "gpu" and "tpu" compile their own kernel; "cpu" runs
    `CPU_KERNEL` interpreted (interpret=None -> True on CPU, False elsewhere). Any other name, or
    a platform with no kernel, is a ConfigError naming `what` (e.g. "nf4_matmul backend") with
    the caller's `fix`.
    """
    target = platform()
    kernel = (CPU_KERNEL if target == "cpu" else target) if backend is None else backend
    if kernel not in KERNELS:
        raise ConfigError.describe(
            what,
            kernel,
            f"one of {KERNELS} (None follows jax.default_backend(); on CPU the "
            f"{CPU_KERNEL!r} kernel runs interpreted)",
            fix,
        )
    return kernel, target == "cpu" if interpret is None else bool(interpret)


def block_sizes_or_default(block_sizes, cls: type, kernel: str):
    """`block_sizes`, or `cls.default(kernel)` when None; anything but a `cls` is a ConfigError."""
    sizes = cls.default(kernel) if block_sizes is None else block_sizes
    if not isinstance(sizes, cls):
        raise ConfigError.describe("block_sizes", sizes, "a BlockSizes", "pass BlockSizes(...)")
    return sizes


def require_platform(kernel: str, interpret: bool) -> None:
    """A compiled kernel needs its own device (or `jax.default_device` set to a compile-only one,
    see `platform()`); only interpret mode runs anywhere."""
    target = platform()
    if not interpret and kernel != target:
        raise ConfigError.describe(
            f"backend={kernel!r} compiled (interpret=False) on platform",
            target,
            f"JAX running on {kernel!r}, or interpret=True",
            "pass interpret=True to run the kernel interpreted (slow, for tests)",
        )


def require_positive_int(value, what: str, fix: str | None = None) -> None:
    """A tile size or launch setting: a positive int (numpy ints too, bools not).

    The error names `what`; its fix is `fix`, or "set <what> to e.g. 64".
    """
    if not is_positive_int(value):
        fix = f"set {what} to e.g. 64" if fix is None else fix
        raise ConfigError.describe(what, value, "a positive int", fix)


def round_up(n: int, multiple: int) -> int:
    """The smallest multiple of `multiple` that is >= n (n >= 0)."""
    return -(-n // multiple) * multiple


def dot(a, b, contract: tuple[int, int]):
    """2-D matmul contracting a's axis contract[0] with b's contract[1], accumulated in f32.

    Float32 operands follow `jax_default_matmul_precision`. Narrower ones (bf16, f16) take
    DEFAULT explicitly: their products are exact in float32 on every backend anyway, and Mosaic
    refuses bf16 operands under a float32 contract precision ("Bad lhs type", libtpu 0.0.42),
    which `jax_default_matmul_precision="highest"` would otherwise ask for.
    """
    dims = (((contract[0],), (contract[1],)), ((), ()))
    wide = jnp.float32 in (a.dtype, b.dtype)
    precision = None if wide else lax.Precision.DEFAULT
    return lax.dot_general(a, b, dims, precision=precision, preferred_element_type=jnp.float32)
