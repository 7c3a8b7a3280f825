"""NF4 matmul: `y = x @ dequant(W)^T (+ bias)` with W decoded tile by tile, never whole.

Shapes: x `[..., I]` (float32, bfloat16 or float16), W an `lmjax.quant.QuantizedWeight` of shape
`[O, I]` (docs/fine-tuning.md), bias `[O]` -> y `[..., O]` in x's dtype. Three paths, one contract
(`reference.check_inputs`), each differentiable in x and the bias, the frozen weight getting no
gradient:

- `nf4_matmul` (pallas.py, kernels in kernels.py, tiles in plan.py): the Pallas kernels, a GPU
  (Triton) and a TPU (Mosaic) one, decoding each tile on chip. Requirement: I % 64 == 0, so
  every 64-weight quantization block lies inside one row of W (`ShapeError` otherwise).
- `nf4_matmul_tiled` (tiled.py): the same y and dx in plain jnp, W decoded in row tiles by XLA;
  any shape of W.
- `nf4_matmul_reference` (reference.py): the whole weight dequantized, jax.grad; the oracle the
  tests compare every path with.

`quantized_linear` is the choice `lmjax.models.project` makes between the first two.
"""

from __future__ import annotations

from lmjax.quant.nf4 import BLOCK, QuantizedWeight
from pallas_kernels import _backend, _triton
from pallas_kernels._backend import CPU_KERNEL, KERNELS
from pallas_kernels.nf4_matmul.pallas import nf4_matmul, resolve_backend
from pallas_kernels.nf4_matmul.plan import BlockSizes
from pallas_kernels.nf4_matmul.reference import INPUT_DTYPES, nf4_matmul_reference
from pallas_kernels.nf4_matmul.tiled import TILE_WEIGHTS, nf4_matmul_tiled


def quantized_linear(x, qw: QuantizedWeight, bias=None):
    """What `lmjax.models.project` runs for a QuantizedWeight: the kernel, compiled, on GPU and TPU
    when in-features are a multiple of 64; otherwise `nf4_matmul_tiled` (on CPU, where the
    kernel could only be interpreted, and for weights whose quantization blocks straddle rows),
    which, like the kernel, never saves a float copy of the weight for the backward."""
    target = _backend.platform()  # the default device's, e.g. compiling for a TPU
    # A jax without the Triton backend has no GPU kernel: the tiled path then (docs/kernels.md).
    compiled = target in KERNELS and (target != "gpu" or _triton.available())
    if compiled and isinstance(qw, QuantizedWeight) and qw.ndim == 2 and qw.shape[1] % BLOCK == 0:
        return nf4_matmul(x, qw, bias)
    return nf4_matmul_tiled(x, qw, bias)


__all__ = [
    "BlockSizes",
    "CPU_KERNEL",
    "INPUT_DTYPES",
    "KERNELS",
    "TILE_WEIGHTS",
    "nf4_matmul",
    "nf4_matmul_reference",
    "nf4_matmul_tiled",
    "quantized_linear",
    "resolve_backend",
]
