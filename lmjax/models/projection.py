"""The one place that knows how a projection runs: a dense weight (`ops.linear`), an NF4 weight
(`pallas_kernels.nf4_matmul`), or either with a LoRA adapter riding in the layer's dict.

    y_NO = x_NI W^T + b                      dense or NF4 W [O, I]
         + s (x_NI A^T) B^T                  when the layer holds a "lora" entry

The primitives below know nothing of adapters or quantized weights: an adapter (added by
`lmjax.lora.attach`) wraps its layer here, as a quantized weight does, so `ops.linear` stays
`(params, x) -> y` over float arrays.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from lmjax import ops
from lmjax.errors import ShapeError
from lmjax.models.sharding import context_mesh_shape
from lmjax.quant.nf4 import QuantizedWeight
from pallas_kernels import nf4_matmul as nf4mm

Params = dict


def project(params: Params, x: jax.Array, *, reference: bool = False) -> jax.Array:
    """`y = x W^T + b` for any kind of layer: x `[..., I]` -> y `[..., O]`.

    A `"lora"` entry (an `lmjax.lora.Adapter`) adds its low-rank term to the base projection; it
    is called on x and never combined with W, so a quantized W is never dequantized for it. A
    `QuantizedWeight` runs `pallas_kernels.nf4_matmul.quantized_linear` (the Pallas kernel on
    GPU/TPU, the tiled plain-jnp path elsewhere and on a mesh; dx and db only, the frozen weight
    gets no gradient). `reference=True` takes the plain-jnp references, for `jax.grad` comparisons.
    """
    if "lora" in params:
        base = {k: v for k, v in params.items() if k != "lora"}
        y = project(base, x, reference=reference)
        return y + params["lora"](jnp.asarray(x)).astype(y.dtype)
    if isinstance(params.get("weight"), QuantizedWeight):
        return _quantized(params, x, reference=reference)
    return (ops.linear_reference if reference else ops.linear)(params, x)


def _quantized(params: Params, x: jax.Array, *, reference: bool) -> jax.Array:
    """An NF4 weight (lmjax.quant): the kernel dispatch or its reference."""
    if set(params) - {"weight", "bias"}:
        keys = "{'weight'} or {'weight', 'bias'}"
        raise ShapeError.describe("linear params keys", sorted(params), keys, "drop the rest")
    if reference:
        run = nf4mm.nf4_matmul_reference
    elif context_mesh_shape() is not None:
        # Traced on a mesh (a sharded QLoRA step): the plain-jnp tiled path, which XLA's
        # partitioner splits like any op. The Pallas kernel is a Mosaic / Triton call it cannot
        # split ("Mosaic kernels cannot be automatically partitioned"), and is not shard-mapped.
        run = nf4mm.nf4_matmul_tiled
    else:
        run = nf4mm.quantized_linear
    return run(x, params["weight"], params.get("bias"))
