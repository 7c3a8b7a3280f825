"""`nf4_matmul`: the Pallas path, its input-only custom VJP and the padding around the kernels.

Input gradient (`jax.custom_vjp`): dx = g @ dequant(W), computed by a second kernel that decodes
the same tiles, again as even and odd column halves that the wrapper interleaves. The quantized
weight is frozen: its cotangent is zero (the packed codes are integers; the float statistics
absmax2/offset get zeros), so differentiate with respect to x, the bias, or adapters, not the
QuantizedWeight: jax.grad over a tree holding one is JAX's integer-input error, as for any
integer array, while jax.vjp and jax.grad(..., allow_int=True) give float0 for the codes and
zeros for the statistics. The bias is added outside the kernel by XLA, so its gradient is the
ordinary sum of g.

Padding (the wrapper's, undone on the way out): the rows of x (all leading axes flattened) to a
multiple of block_m, O to block_n, I to block_k; padded weight rows and columns have scale 0 and
padded x columns are 0, so they add exactly nothing.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from lmjax.quant.nf4 import BLOCK, QuantizedWeight, block_absmax
from pallas_kernels import _backend, _triton
from pallas_kernels.nf4_matmul import kernels
from pallas_kernels.nf4_matmul.plan import BlockSizes, Plan, check_blocks, make_plan
from pallas_kernels.nf4_matmul.reference import add_bias, check_inputs

# x dtypes the TPU kernel runs in another dtype (kernels.py: Mosaic packs no float16).
_TPU_COMPUTE_DTYPE = {jnp.dtype(jnp.float16): jnp.dtype(jnp.float32)}


# ---- custom VJP over padded operands ------------------------------------------------------------


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _matmul(plan: Plan, xe, xo, packed, scales):
    return kernels.forward(plan, xe, xo, packed, scales)


def _matmul_fwd(plan: Plan, xe, xo, packed, scales):
    # dx needs only the weight: x is not saved.
    return kernels.forward(plan, xe, xo, packed, scales), (packed, scales)


def _matmul_bwd(plan: Plan, res, g):
    dxe, dxo = kernels.dx(plan, g, *res)
    return dxe, dxo, None, None  # the frozen weight: no cotangent


_matmul.defvjp(_matmul_fwd, _matmul_bwd)


@functools.partial(jax.jit, static_argnums=(0,))
def _nf4_padded(plan: Plan, x_MI, packed_OH, scales_OQ):
    """x [M, I], packed [O, I/2], scales [O, I/64] -> y [M, O] (x's dtype)."""
    x_MI = jnp.pad(x_MI, ((0, plan.m_pad - plan.m), (0, plan.i_pad - plan.i)))
    pairs = x_MI.reshape(plan.m_pad, plan.i_pad // 2, 2)
    packed = jnp.pad(packed_OH, ((0, plan.o_pad - plan.o), (0, (plan.i_pad - plan.i) // 2)))
    scales = jnp.pad(scales_OQ, ((0, plan.o_pad - plan.o), (0, (plan.i_pad - plan.i) // BLOCK)))
    y = _matmul(plan, pairs[..., 0], pairs[..., 1], packed, scales)
    return y[: plan.m, : plan.o]


def resolve_backend(backend: str | None, interpret: bool | None) -> tuple[str, bool]:
    """(kernel, interpret): None follows jax.default_backend(); CPU interprets `CPU_KERNEL`."""
    return _backend.resolve_backend(
        backend,
        interpret,
        what="nf4_matmul backend",
        fix="pass backend='gpu' or backend='tpu', or use nf4_matmul_reference",
    )


def nf4_matmul(
    x,
    qw: QuantizedWeight,
    bias=None,
    *,
    block_sizes: BlockSizes | None = None,
    backend: str | None = None,
    interpret: bool | None = None,
):
    """`x @ dequant(qw)^T (+ bias)` by the Pallas kernels (kernels.py); y in x's dtype.

    Differentiable in x (kernel dx) and bias; the quantized weight gets no gradient.
    """
    x = jnp.asarray(x)
    check_inputs(x, qw, bias, kernel=True)
    kernel, interpret = resolve_backend(backend, interpret)
    sizes = _backend.block_sizes_or_default(block_sizes, BlockSizes, kernel)
    check_blocks(sizes, kernel, interpret)
    _backend.require_platform(kernel, interpret)
    if kernel == "gpu" and not interpret:
        _triton.require("nf4_matmul backend", "use the XLA path (nf4_matmul_tiled)")
    out_features, in_features = qw.shape
    x_MI = x.reshape(-1, in_features)
    plan = make_plan(x_MI.shape[0], out_features, in_features, sizes, kernel, interpret)
    qw = jax.lax.stop_gradient(qw)
    packed = qw.packed.reshape(out_features, in_features // 2)
    scales = block_absmax(qw).reshape(out_features, in_features // BLOCK)
    x_MI = x_MI.astype(_compute_dtype(kernel, x.dtype))  # a no-op unless float16 on TPU
    y = _nf4_padded(plan, x_MI, packed, scales).astype(x.dtype)
    y = y.reshape(*x.shape[:-1], out_features)
    return add_bias(y, bias)


def _compute_dtype(kernel: str, dtype) -> jnp.dtype:
    """The dtype `kernel` computes x of `dtype` in: float16 on the TPU kernel runs as float32
    (module docstring); everything else as itself."""
    dtype = jnp.dtype(dtype)
    return _TPU_COMPUTE_DTYPE.get(dtype, dtype) if kernel == "tpu" else dtype
