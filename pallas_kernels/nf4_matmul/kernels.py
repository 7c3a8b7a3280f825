"""The NF4 Pallas kernels: tiles of W decoded on chip, a GPU (Triton) and a TPU (Mosaic) kernel.

What the kernels read: the packed codes, viewed as uint8 `[O, I/2]` (a free reshape: row o holds
bytes o*I/2 .. (o+1)*I/2 - 1, the high nibble the even column), and the block scales
`absmax'[o, I/64]` in float32, decoded from the double quantization by XLA in the wrapper
(`lmjax.quant.nf4.block_absmax`, 1/64 of a float32 weight's size). The float weight is never
written to memory: each tile is decoded in registers (GPU) or VMEM (TPU) right before its matmul.

Even/odd split. Byte j of a row holds columns 2j (high nibble) and 2j+1 (low nibble). Rather than
interleave the two nibbles inside the kernel (a shuffle neither Triton nor Mosaic does well), the
wrapper splits x into its even and odd columns and the kernel runs two matmuls per tile:

    y = x_even @ W_even^T + x_odd @ W_odd^T,   W_even[o, j] = NF4[p[o,j] >> 4] absmax'[o, 2j // 64]
                                               W_odd[o, j]  = NF4[p[o,j] & 15] absmax'[o, 2j // 64]

Decoding a 4-bit code: a tree of 15 selects on its four bits with the 16 NF4 constants (no
gather: TPUs have no vector gather, and a select tree lowers everywhere). The decoded tile is
NF4 * absmax' in float32, rounded to x's dtype, and both matmuls accumulate in float32. Float32
matmuls inside the kernel follow `jax_default_matmul_precision` (on GPUs JAX's default is TF32;
the tests set `highest`). Float16 x on the TPU kernel: Mosaic cannot pack float16 vectors
(libtpu 0.0.42: "failed to legalize operation 'tpu.pack_subelements'"), so the wrapper upcasts x
to float32 (exact), the kernel decodes the tiles in float32 (no float16 rounding of the weight)
and y (and dx) are rounded to float16 once at the end, interpreted too.

Backends: `backend="gpu"` (Triton; grid (M blocks, O blocks), a loop over I inside the forward;
grid (M blocks, I blocks), a loop over O inside the dx kernel) or `backend="tpu"` (Mosaic; the
reduction axis is the last, sequential grid axis with a VMEM float32 accumulator). None follows
the platform compiled for (`jax.default_device`'s, else `jax.default_backend()`); on CPU the GPU
kernel runs interpreted (interpret=None -> True on CPU).

`forward` and `dx` run the chosen kernel on operands padded to the plan (`pallas.py` pads).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from lmjax.quant.nf4 import BLOCK, NF4
from pallas_kernels._backend import dot as _dot
from pallas_kernels._triton import params as triton_params
from pallas_kernels.nf4_matmul.plan import Plan

_HALF_BLOCK = BLOCK // 2  # packed bytes per quantization block


# ---- decoding a tile (shared by every kernel) ---------------------------------------------------


def _nf4_lookup(code):
    """int32 codes -> float32 NF4 values by a select tree on the code's bits (no gather)."""
    level = [jnp.float32(v) for v in NF4]
    for bit in range(4):
        on = (code & (1 << bit)) != 0
        level = [jnp.where(on, level[2 * j + 1], level[2 * j]) for j in range(len(level) // 2)]
    return level[0]


def _decode(packed, scale_of_column, dtype):
    """uint8 [R, kh] tile -> (even, odd) weight columns [R, kh] in dtype.

    `scale_of_column(q)` gives the [R, 1] float32 scale of quantization block q of the tile
    (packed columns q*32 .. q*32+31).
    """
    p = packed.astype(jnp.int32)
    rows, kh = p.shape
    scale = scale_of_column(0)
    if kh > _HALF_BLOCK:  # several quantization blocks per tile: pick each column's scale
        # lax.div, not //: floor division emits a sign op that Mosaic lowers per TPU generation.
        column = lax.div(lax.broadcasted_iota(jnp.int32, (1, kh), 1), _HALF_BLOCK)
        scale = jnp.broadcast_to(scale, (rows, kh))
        for q in range(1, kh // _HALF_BLOCK):
            scale = jnp.where(column == q, scale_of_column(q), scale)
    even = (_nf4_lookup(p >> 4) * scale).astype(dtype)
    odd = (_nf4_lookup(p & 15) * scale).astype(dtype)
    return even, odd


# ---- GPU (Triton) kernels ----------------------------------------------------------------------


def _gpu_fwd_kernel(xe_ref, xo_ref, p_ref, s_ref, y_ref, *, plan: Plan):
    kh, nq = plan.kh, plan.nq

    def step(k, acc):
        cols = pl.ds(pl.multiple_of(k * kh, kh), kh)
        we, wo = _decode(p_ref[:, cols], lambda q: s_ref[:, pl.ds(k * nq + q, 1)], xe_ref.dtype)
        acc = acc + _dot(xe_ref[:, cols], we, (1, 1))
        return acc + _dot(xo_ref[:, cols], wo, (1, 1))

    acc = lax.fori_loop(0, plan.nk, step, jnp.zeros((plan.bm, plan.bn), jnp.float32))
    y_ref[...] = acc.astype(y_ref.dtype)


def _gpu_dx_kernel(g_ref, p_ref, s_ref, dxe_ref, dxo_ref, *, plan: Plan):
    bn = plan.bn

    def step(n, carry):
        dxe, dxo = carry
        rows = pl.ds(pl.multiple_of(n * bn, bn), bn)
        we, wo = _decode(p_ref[rows, :], lambda q: s_ref[rows, pl.ds(q, 1)], g_ref.dtype)
        g = g_ref[:, rows]
        return dxe + _dot(g, we, (1, 0)), dxo + _dot(g, wo, (1, 0))

    zeros = jnp.zeros((plan.bm, plan.kh), jnp.float32)
    dxe, dxo = lax.fori_loop(0, plan.o_pad // bn, step, (zeros, zeros))
    dxe_ref[...] = dxe.astype(dxe_ref.dtype)
    dxo_ref[...] = dxo.astype(dxo_ref.dtype)


def _gpu_params(plan: Plan):
    return triton_params(plan.num_warps or 4, plan.num_stages or 3)


def _gpu_forward(plan: Plan, xe, xo, packed, scales):
    bm, bn = plan.bm, plan.bn
    half = plan.i_pad // 2
    return pl.pallas_call(
        functools.partial(_gpu_fwd_kernel, plan=plan),
        out_shape=jax.ShapeDtypeStruct((plan.m_pad, plan.o_pad), xe.dtype),
        grid=(plan.m_pad // bm, plan.o_pad // bn),
        in_specs=[
            pl.BlockSpec((bm, half), lambda i, j: (i, 0)),
            pl.BlockSpec((bm, half), lambda i, j: (i, 0)),
            pl.BlockSpec((bn, half), lambda i, j: (j, 0)),
            pl.BlockSpec((bn, plan.i_pad // BLOCK), lambda i, j: (j, 0)),
        ],
        out_specs=pl.BlockSpec((bm, bn), lambda i, j: (i, j)),
        compiler_params=_gpu_params(plan),
        interpret=plan.interpret,
        name="nf4_matmul_fwd_gpu",
    )(xe, xo, packed, scales)


def _gpu_dx(plan: Plan, g, packed, scales):
    bm, kh = plan.bm, plan.kh
    out = jax.ShapeDtypeStruct((plan.m_pad, plan.i_pad // 2), g.dtype)
    return pl.pallas_call(
        functools.partial(_gpu_dx_kernel, plan=plan),
        out_shape=(out, out),
        grid=(plan.m_pad // bm, plan.nk),
        in_specs=[
            pl.BlockSpec((bm, plan.o_pad), lambda i, k: (i, 0)),
            pl.BlockSpec((plan.o_pad, kh), lambda i, k: (0, k)),
            pl.BlockSpec((plan.o_pad, plan.nq), lambda i, k: (0, k)),
        ],
        out_specs=[pl.BlockSpec((bm, kh), lambda i, k: (i, k))] * 2,
        compiler_params=_gpu_params(plan),
        interpret=plan.interpret,
        name="nf4_matmul_dx_gpu",
    )(g, packed, scales)


# ---- TPU (Mosaic) kernels: the reduction is the last grid axis, accumulated in VMEM -------------
# Scales come as [nk, nq, O, 1]: a tile's scales for quantization block q are then the leading-
# axis slice s_ref[q], a [rows, 1] column, with no lane slicing.


def _tpu_fwd_kernel(xe_ref, xo_ref, p_ref, s_ref, y_ref, acc_ref):
    k = pl.program_id(2)

    @pl.when(k == 0)
    def _init():
        acc_ref[...] = jnp.zeros(acc_ref.shape, jnp.float32)

    we, wo = _decode(p_ref[...], lambda q: s_ref[q], xe_ref.dtype)
    acc_ref[...] += _dot(xe_ref[...], we, (1, 1)) + _dot(xo_ref[...], wo, (1, 1))

    @pl.when(k == pl.num_programs(2) - 1)
    def _done():
        y_ref[...] = acc_ref[...].astype(y_ref.dtype)


def _tpu_dx_kernel(g_ref, p_ref, s_ref, dxe_ref, dxo_ref, dxe_acc, dxo_acc):
    n = pl.program_id(2)

    @pl.when(n == 0)
    def _init():
        dxe_acc[...] = jnp.zeros(dxe_acc.shape, jnp.float32)
        dxo_acc[...] = jnp.zeros(dxo_acc.shape, jnp.float32)

    we, wo = _decode(p_ref[...], lambda q: s_ref[q], g_ref.dtype)
    g = g_ref[...]
    dxe_acc[...] += _dot(g, we, (1, 0))
    dxo_acc[...] += _dot(g, wo, (1, 0))

    @pl.when(n == pl.num_programs(2) - 1)
    def _done():
        dxe_ref[...] = dxe_acc[...].astype(dxe_ref.dtype)
        dxo_ref[...] = dxo_acc[...].astype(dxo_ref.dtype)


def _tpu_semantics():
    return pltpu.CompilerParams(dimension_semantics=("parallel", "parallel", "arbitrary"))


def _tpu_scales(plan: Plan, scales):
    """[O', I'/64] -> [nk, nq, O', 1] (see above)."""
    s = scales.reshape(plan.o_pad, plan.nk, plan.nq).transpose(1, 2, 0)
    return s[..., None]


def _tpu_forward(plan: Plan, xe, xo, packed, scales):
    bm, bn, kh, nq = plan.bm, plan.bn, plan.kh, plan.nq
    return pl.pallas_call(
        _tpu_fwd_kernel,
        out_shape=jax.ShapeDtypeStruct((plan.m_pad, plan.o_pad), xe.dtype),
        grid=(plan.m_pad // bm, plan.o_pad // bn, plan.nk),
        in_specs=[
            pl.BlockSpec((bm, kh), lambda i, j, k: (i, k)),
            pl.BlockSpec((bm, kh), lambda i, j, k: (i, k)),
            pl.BlockSpec((bn, kh), lambda i, j, k: (j, k)),
            pl.BlockSpec((None, nq, bn, 1), lambda i, j, k: (k, 0, j, 0)),
        ],
        out_specs=pl.BlockSpec((bm, bn), lambda i, j, k: (i, j)),
        scratch_shapes=[pltpu.VMEM((bm, bn), jnp.float32)],
        compiler_params=_tpu_semantics(),
        interpret=plan.interpret,
        name="nf4_matmul_fwd_tpu",
    )(xe, xo, packed, _tpu_scales(plan, scales))


def _tpu_dx(plan: Plan, g, packed, scales):
    bm, bn, kh, nq = plan.bm, plan.bn, plan.kh, plan.nq
    out = jax.ShapeDtypeStruct((plan.m_pad, plan.i_pad // 2), g.dtype)
    return pl.pallas_call(
        _tpu_dx_kernel,
        out_shape=(out, out),
        grid=(plan.m_pad // bm, plan.nk, plan.o_pad // bn),
        in_specs=[
            pl.BlockSpec((bm, bn), lambda i, k, n: (i, n)),
            pl.BlockSpec((bn, kh), lambda i, k, n: (n, k)),
            pl.BlockSpec((None, nq, bn, 1), lambda i, k, n: (k, 0, n, 0)),
        ],
        out_specs=[pl.BlockSpec((bm, kh), lambda i, k, n: (i, k))] * 2,
        scratch_shapes=[pltpu.VMEM((bm, kh), jnp.float32)] * 2,
        compiler_params=_tpu_semantics(),
        interpret=plan.interpret,
        name="nf4_matmul_dx_tpu",
    )(g, packed, _tpu_scales(plan, scales))


def forward(plan: Plan, xe, xo, packed, scales):
    """y [M', O'] = xe @ W_even^T + xo @ W_odd^T by `plan.kernel`'s kernel (operands padded)."""
    return {"gpu": _gpu_forward, "tpu": _tpu_forward}[plan.kernel](plan, xe, xo, packed, scales)


def dx(plan: Plan, g, packed, scales):
    """(dx_even, dx_odd) [M', I'/2] = g @ (W_even, W_odd) by `plan.kernel`'s kernel."""
    return {"gpu": _gpu_dx, "tpu": _tpu_dx}[plan.kernel](plan, g, packed, scales)
