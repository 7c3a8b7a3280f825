"""The NF4 matmul's contract and its plain-jnp oracle: `y = x @ dequant(W)^T (+ bias)`.

x `[..., I]` (float32, bfloat16 or float16), W an `lmjax.quant.QuantizedWeight` `[O, I]`,
bias `[O]` -> y `[..., O]` in x's dtype. `check_inputs` is the one check every path (the Pallas
kernels, the tiled XLA path, this reference) runs; `nf4_matmul_reference` dequantizes the whole
weight and lets jax.grad differentiate it: the oracle the tests compare every path with.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from lmjax.errors import ShapeError
from lmjax.quant.nf4 import BLOCK, QuantizedWeight, dequantize

INPUT_DTYPES = (jnp.dtype(jnp.float32), jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16))


def check_inputs(x, qw, bias, *, kernel: bool) -> None:
    """ShapeError unless qw is a 2-D QuantizedWeight [O, I], x a non-empty float [..., I] and
    bias None or [O]; `kernel=True` (the Pallas kernels) also needs I % 64 == 0."""
    if not isinstance(qw, QuantizedWeight):
        raise ShapeError.describe(
            "weight", type(qw).__name__, "a QuantizedWeight", "quantize it with lmjax.quant"
        )
    if qw.ndim != 2:
        raise ShapeError.describe("weight.shape", qw.shape, "[out, in]", "quantize a 2-D weight")
    out_features, in_features = qw.shape
    if x.dtype not in INPUT_DTYPES:
        raise ShapeError.describe(
            "x.dtype", str(x.dtype), "float32, bfloat16 or float16", "cast x to one of them"
        )
    if x.ndim < 1 or x.shape[-1] != in_features or x.size == 0:
        raise ShapeError.describe(
            "x.shape",
            x.shape,
            f"[..., {in_features}], non-empty (the weight is [{out_features}, {in_features}])",
            "project from the last axis",
        )
    if bias is not None and np.shape(bias) != (out_features,):
        raise ShapeError.describe(
            "bias.shape", np.shape(bias), f"({out_features},)", "one entry per output feature"
        )
    if kernel and in_features % BLOCK:
        raise ShapeError.describe(
            "weight in-features",
            in_features,
            f"a multiple of {BLOCK}, so each NF4 block lies in one row of the weight",
            "use nf4_matmul_tiled or nf4_matmul_reference (lmjax.models.project takes the tiled "
            "path) for this weight",
        )


def add_bias(y, bias):
    """y [..., O] + bias [O] (None: y itself), the bias cast to y's dtype and broadcast
    explicitly as [1, ..., 1, O] (implicit rank promotion is an error here)."""
    if bias is None:
        return y
    return y + jnp.asarray(bias).astype(y.dtype).reshape((1,) * (y.ndim - 1) + (-1,))


def nf4_matmul_reference(x, qw: QuantizedWeight, bias=None):
    """The same contract in plain jnp: dequantize the whole weight (in x's dtype), one matmul
    accumulated in float32, differentiated by jax.grad (the weight behind stop_gradient)."""
    x = jnp.asarray(x)
    check_inputs(x, qw, bias, kernel=False)
    w_OI = dequantize(jax.lax.stop_gradient(qw), x.dtype)
    y = jnp.einsum("...i,oi->...o", x, w_OI, preferred_element_type=jnp.float32).astype(x.dtype)
    return add_bias(y, bias)
