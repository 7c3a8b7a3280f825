"""NF4 matmul in Pallas: `y = x @ dequant(W)^T (+ bias)` with W decoded tile by tile on chip.

Shapes: x `[..., I]` (float32, bfloat16 or float16), W an `lmjax.quant.QuantizedWeight` of shape
`[O, I]` (SPEC section 6), bias `[O]` -> y `[..., O]` in x's dtype. Requirement: I % 64 == 0, so
every 64-weight quantization block lies inside one row of W (`ShapeError` otherwise; the XLA
path `nf4_matmul_tiled` and the reference `nf4_matmul_reference` take any shape).

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

Backends: `backend="gpu"` (Triton; grid (M blocks, O blocks), a loop over I inside the forward;
grid (M blocks, I blocks), a loop over O inside the dx kernel) or `backend="tpu"` (Mosaic; the
reduction axis is the last, sequential grid axis with a VMEM float32 accumulator). None follows
the platform compiled for (`jax.default_device`'s, else `jax.default_backend()`); on CPU the GPU
kernel runs interpreted (interpret=None -> True on CPU).

The XLA path (`nf4_matmul_tiled`, what `quantized_linear` runs on CPU and for in-features that
are not a multiple of 64): the same y and dx in plain jnp, decoding W in tiles of whole rows,

    y[:, tile k] = x @ W[tile k]^T       dx = sum_k g[:, tile k] @ W[tile k]    (fori_loops)

each tile `NF4[code] * absmax'` in float32 (exactly `lmjax.quant.dequantize`'s values, block
scales decoded per tile too), cast to x's dtype, one float32-accumulated matmul. A custom VJP
keeps only the NF4 leaves (codes and block statistics) for the backward, which decodes the tiles
again: no float copy of the weight is saved, and none larger than one tile exists at any time.
A tile is a multiple of 64 / gcd(I, 64) rows, so it holds whole bytes and whole quantization
blocks of the flattened weight (1 row for I a multiple of 64, 16 for I = 100, 64 for odd I);
O is padded to whole tiles with code 7 (0.0) and scale 0, and padded rows of y are dropped.
Two rules keep XLA from undoing the tiling (its CPU scheduler runs anything that depends on
parameters alone at the start of the program, every layer's at once): at least two tiles (a
one-step loop is inlined, and its decode with it), and the loops' initial buffers and padded
codes are made from the layer's input (`_zero_after`), not constants. `nf4_matmul_reference`
keeps the plain form (the whole weight dequantized, jax.grad) as the oracle the tests compare
every path with.
"""

from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu
from jax.experimental.pallas import triton as pltriton

from lmjax.errors import ConfigError, ShapeError
from lmjax.quant.nf4 import (
    BLOCK,
    BLOCK2,
    NF4,
    QuantizedWeight,
    absmax_from_codes,
    block_absmax,
    dequantize,
    unpack_codes,
)
from pallas_kernels import _backend
from pallas_kernels._backend import (  # re-exported: KERNELS, CPU_KERNEL are in __all__
    CPU_KERNEL,
    GPU_MIN_TILE,
    KERNELS,
    TPU_LANES,
    TPU_SUBLANES,
)
from pallas_kernels._backend import dot as _dot
from pallas_kernels._backend import require_platform as _require_platform
from pallas_kernels._backend import round_up as _round_up

INPUT_DTYPES = (jnp.dtype(jnp.float32), jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16))
# x dtypes the TPU kernel runs in another dtype (module docstring: Mosaic packs no float16).
_TPU_COMPUTE_DTYPE = {jnp.dtype(jnp.float16): jnp.dtype(jnp.float32)}
_HALF_BLOCK = BLOCK // 2  # packed bytes per quantization block


@dataclasses.dataclass(frozen=True)
class BlockSizes:
    """Tiles: block_m rows of x, block_n output features, block_k input features.

    The forward tiles y by (block_m, block_n) and steps over I by block_k; the dx kernel tiles dx
    by (block_m, block_k) and steps over O by block_n. block_k is a multiple of 64 (whole
    quantization blocks). GPU kernel: all three powers of two, block_m and block_n >= 16.
    TPU kernel compiled: block_m a multiple of 16 (a bf16 tile's sublanes), block_n of 128 and
    block_k of 256 (block_k / 2 packed bytes span the 128 lanes); interpreted, multiples of 8, 8
    and 64 suffice.
    `num_warps` / `num_stages` tune the Triton launch (None: 4 warps, 3 stages).
    """

    block_m: int = 64
    block_n: int = 64
    block_k: int = 128
    num_warps: int | None = None
    num_stages: int | None = None

    def __post_init__(self):
        for name in ("block_m", "block_n", "block_k", "num_warps", "num_stages"):
            value = getattr(self, name)
            if value is None and name.startswith("num_"):
                continue
            _backend.require_positive_int(value, f"BlockSizes.{name}", f"set {name} to e.g. 64")
        if self.block_k % BLOCK:
            raise ConfigError.describe(
                "BlockSizes.block_k",
                self.block_k,
                f"a multiple of {BLOCK} (whole NF4 quantization blocks)",
                "use 64, 128 or 256",
            )

    @classmethod
    def default(cls, kernel: str) -> BlockSizes:
        return cls() if kernel == "gpu" else cls(128, 256, 512)


def _check_blocks(sizes: BlockSizes, kernel: str, interpret: bool) -> None:
    checks = []
    if kernel == "gpu":
        for name in ("block_m", "block_n", "block_k"):
            size = getattr(sizes, name)
            ok = size >= GPU_MIN_TILE and size & (size - 1) == 0
            checks.append((name, ok, f"a power of two >= {GPU_MIN_TILE} for the GPU kernel"))
    else:
        rows = TPU_SUBLANES if interpret else 2 * TPU_SUBLANES
        lanes_n, lanes_k = (8, BLOCK) if interpret else (TPU_LANES, 2 * TPU_LANES)
        checks += [
            ("block_m", sizes.block_m % rows == 0, f"a multiple of {rows} (TPU kernel)"),
            ("block_n", sizes.block_n % lanes_n == 0, f"a multiple of {lanes_n} (TPU kernel)"),
            ("block_k", sizes.block_k % lanes_k == 0, f"a multiple of {lanes_k} (TPU kernel)"),
        ]
    for name, ok, expected in checks:
        if not ok:
            raise ConfigError.describe(
                f"BlockSizes.{name}", getattr(sizes, name), expected, "pick a size that fits"
            )


# ---- the static plan ----------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class _Plan:
    kernel: str
    interpret: bool
    m: int  # rows of x, output and input features before padding
    o: int
    i: int
    m_pad: int
    o_pad: int
    i_pad: int
    bm: int
    bn: int
    bk: int
    num_warps: int | None
    num_stages: int | None

    @property
    def kh(self) -> int:  # packed bytes (and even or odd columns) per block_k
        return self.bk // 2

    @property
    def nq(self) -> int:  # quantization blocks per block_k
        return self.bk // BLOCK

    @property
    def nk(self) -> int:
        return self.i_pad // self.bk


def _fit(block: int, n: int, kernel: str, floor: int) -> int:
    """Shrink a block longer than n: to n's power of two (GPU) or n rounded up to `floor` (TPU)."""
    if kernel == "gpu":
        return min(block, max(floor, pl.next_power_of_2(n)))
    return min(block, _round_up(n, floor))


def _make_plan(m: int, o: int, i: int, sizes: BlockSizes, kernel: str, interpret: bool) -> _Plan:
    gpu = kernel == "gpu"
    # Shrunk TPU tiles keep the compiled tiling rules (see BlockSizes); interpreted, 8 rows do.
    tpu_m, tpu_n = (TPU_SUBLANES, TPU_SUBLANES) if interpret else (2 * TPU_SUBLANES, TPU_LANES)
    bm = _fit(sizes.block_m, m, kernel, GPU_MIN_TILE if gpu else tpu_m)
    bn = _fit(sizes.block_n, o, kernel, GPU_MIN_TILE if gpu else tpu_n)
    # A shrunk block_k stays a multiple of 64 (compiled on TPU, of 256).
    bk = (
        _fit(sizes.block_k, i, kernel, BLOCK)
        if gpu or interpret
        else min(sizes.block_k, _round_up(i, 2 * TPU_LANES))
    )
    return _Plan(
        kernel=kernel,
        interpret=interpret,
        m=m,
        o=o,
        i=i,
        m_pad=_round_up(m, bm),
        o_pad=_round_up(o, bn),
        i_pad=_round_up(i, bk),
        bm=bm,
        bn=bn,
        bk=bk,
        num_warps=sizes.num_warps,
        num_stages=sizes.num_stages,
    )


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


def _gpu_fwd_kernel(xe_ref, xo_ref, p_ref, s_ref, y_ref, *, plan: _Plan):
    kh, nq = plan.kh, plan.nq

    def step(k, acc):
        cols = pl.ds(pl.multiple_of(k * kh, kh), kh)
        we, wo = _decode(p_ref[:, cols], lambda q: s_ref[:, pl.ds(k * nq + q, 1)], xe_ref.dtype)
        acc = acc + _dot(xe_ref[:, cols], we, (1, 1))
        return acc + _dot(xo_ref[:, cols], wo, (1, 1))

    acc = lax.fori_loop(0, plan.nk, step, jnp.zeros((plan.bm, plan.bn), jnp.float32))
    y_ref[...] = acc.astype(y_ref.dtype)


def _gpu_dx_kernel(g_ref, p_ref, s_ref, dxe_ref, dxo_ref, *, plan: _Plan):
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


def _gpu_params(plan: _Plan):
    return pltriton.CompilerParams(num_warps=plan.num_warps or 4, num_stages=plan.num_stages or 3)


def _gpu_forward(plan: _Plan, xe, xo, packed, scales):
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


def _gpu_dx(plan: _Plan, g, packed, scales):
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


def _tpu_scales(plan: _Plan, scales):
    """[O', I'/64] -> [nk, nq, O', 1] (see above)."""
    s = scales.reshape(plan.o_pad, plan.nk, plan.nq).transpose(1, 2, 0)
    return s[..., None]


def _tpu_forward(plan: _Plan, xe, xo, packed, scales):
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


def _tpu_dx(plan: _Plan, g, packed, scales):
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


# ---- custom VJP over padded operands ------------------------------------------------------------


def _forward(plan: _Plan, xe, xo, packed, scales):
    run = _gpu_forward if plan.kernel == "gpu" else _tpu_forward
    return run(plan, xe, xo, packed, scales)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _matmul(plan: _Plan, xe, xo, packed, scales):
    return _forward(plan, xe, xo, packed, scales)


def _matmul_fwd(plan: _Plan, xe, xo, packed, scales):
    # dx needs only the weight: x is not saved.
    return _forward(plan, xe, xo, packed, scales), (packed, scales)


def _matmul_bwd(plan: _Plan, res, g):
    packed, scales = res
    run = _gpu_dx if plan.kernel == "gpu" else _tpu_dx
    dxe, dxo = run(plan, g, packed, scales)
    return dxe, dxo, None, None  # the frozen weight: no cotangent


_matmul.defvjp(_matmul_fwd, _matmul_bwd)


@functools.partial(jax.jit, static_argnums=(0,))
def _nf4_padded(plan: _Plan, x_MI, packed_OH, scales_OQ):
    """x [M, I], packed [O, I/2], scales [O, I/64] -> y [M, O] (x's dtype)."""
    x_MI = jnp.pad(x_MI, ((0, plan.m_pad - plan.m), (0, plan.i_pad - plan.i)))
    pairs = x_MI.reshape(plan.m_pad, plan.i_pad // 2, 2)
    packed = jnp.pad(packed_OH, ((0, plan.o_pad - plan.o), (0, (plan.i_pad - plan.i) // 2)))
    scales = jnp.pad(scales_OQ, ((0, plan.o_pad - plan.o), (0, (plan.i_pad - plan.i) // BLOCK)))
    y = _matmul(plan, pairs[..., 0], pairs[..., 1], packed, scales)
    return y[: plan.m, : plan.o]


# ---- public API ---------------------------------------------------------------------------------


def resolve_backend(backend: str | None, interpret: bool | None) -> tuple[str, bool]:
    """(kernel, interpret): None follows jax.default_backend(); CPU interprets `CPU_KERNEL`."""
    return _backend.resolve_backend(
        backend,
        interpret,
        what="nf4_matmul backend",
        fix="pass backend='gpu' or backend='tpu', or use nf4_matmul_reference",
    )


def _check_inputs(x, qw, bias, *, kernel: bool) -> None:
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


def nf4_matmul(
    x,
    qw: QuantizedWeight,
    bias=None,
    *,
    block_sizes: BlockSizes | None = None,
    backend: str | None = None,
    interpret: bool | None = None,
):
    """`x @ dequant(qw)^T (+ bias)` by the Pallas kernels (module docstring); y in x's dtype.

    Differentiable in x (kernel dx) and bias; the quantized weight gets no gradient.
    """
    x = jnp.asarray(x)
    _check_inputs(x, qw, bias, kernel=True)
    kernel, interpret = resolve_backend(backend, interpret)
    sizes = _backend.block_sizes_or_default(block_sizes, BlockSizes, kernel)
    _check_blocks(sizes, kernel, interpret)
    _require_platform(kernel, interpret)
    out_features, in_features = qw.shape
    x_MI = x.reshape(-1, in_features)
    plan = _make_plan(x_MI.shape[0], out_features, in_features, sizes, kernel, interpret)
    qw = jax.lax.stop_gradient(qw)
    packed = qw.packed.reshape(out_features, in_features // 2)
    scales = block_absmax(qw).reshape(out_features, in_features // BLOCK)
    x_MI = x_MI.astype(_compute_dtype(kernel, x.dtype))  # a no-op unless float16 on TPU
    y = _nf4_padded(plan, x_MI, packed, scales).astype(x.dtype)
    y = y.reshape(*x.shape[:-1], out_features)
    return y if bias is None else y + _expand(bias, y)


def _compute_dtype(kernel: str, dtype) -> jnp.dtype:
    """The dtype `kernel` computes x of `dtype` in: float16 on the TPU kernel runs as float32
    (module docstring); everything else as itself."""
    dtype = jnp.dtype(dtype)
    return _TPU_COMPUTE_DTYPE.get(dtype, dtype) if kernel == "tpu" else dtype


def _expand(bias, y):
    """bias [O] -> [1, ..., 1, O] in y's dtype (implicit rank promotion is an error here)."""
    return jnp.asarray(bias).astype(y.dtype).reshape((1,) * (y.ndim - 1) + (-1,))


def nf4_matmul_reference(x, qw: QuantizedWeight, bias=None):
    """The same contract in plain jnp: dequantize the whole weight (in x's dtype), one matmul
    accumulated in float32, differentiated by jax.grad (the weight behind stop_gradient)."""
    x = jnp.asarray(x)
    _check_inputs(x, qw, bias, kernel=False)
    w_OI = dequantize(jax.lax.stop_gradient(qw), x.dtype)
    y = jnp.einsum("...i,oi->...o", x, w_OI, preferred_element_type=jnp.float32).astype(x.dtype)
    return y if bias is None else y + _expand(bias, y)


# ---- the XLA path: row tiles decoded in plain jnp, an input-only custom VJP ---------------------

TILE_WEIGHTS = 2**18  # weights decoded at a time by default (1 MiB in float32; module docstring)


@dataclasses.dataclass(frozen=True)
class _RowTiles:
    """The weight's O rows of I in-features cut into `count` tiles of `rows` rows each."""

    o: int
    i: int
    rows: int
    count: int

    @property
    def o_pad(self) -> int:
        return self.rows * self.count

    @property
    def tile_bytes(self) -> int:  # packed bytes per tile (rows * I is a multiple of 64)
        return self.rows * self.i // 2

    @property
    def tile_blocks(self) -> int:  # quantization blocks per tile
        return self.rows * self.i // BLOCK


def _row_tiles(o: int, i: int, tile_rows: int | None) -> _RowTiles:
    """Tiles of about `tile_rows` rows (None: TILE_WEIGHTS weights), each a multiple of
    64 / gcd(I, 64) rows, so every tile starts on a byte and on a quantization block.

    At least two tiles, O padded if need be: XLA inlines a loop of one step, and the decoded
    weight, then free of the loop, may be computed at any time, every layer's together.
    The count is the fewest tiles of that size, the rows spread evenly to pad O little.
    """
    align = BLOCK // math.gcd(i, BLOCK)
    if tile_rows is None:  # rounded down: a default tile stays within TILE_WEIGHTS when it can
        cap = max(align, TILE_WEIGHTS // i // align * align)
    else:
        cap = _round_up(tile_rows, align)
    count = max(2, -(-o // cap))
    return _RowTiles(o, i, _round_up(-(-o // count), align), count)


def _zero_after(ref) -> jax.Array:
    """A float32 +0.0 that XLA cannot compute before `ref` (any array) exists, whatever its
    values (NaN and inf included: d = r - r is 0 or NaN, and d == 0 picks d = +0, else 0).

    The buffers the tile loops start from (y and the dx accumulator, padded codes) would
    otherwise be constants, and XLA's CPU scheduler allocates those at the start of the
    program: every layer's at once, alive until its loop runs.
    """
    r = ref.reshape(-1)[0].astype(jnp.float32)
    d = r - r
    return jnp.where(d == 0, d, 0.0)


def _tiled_codes(t: _RowTiles, qw: QuantizedWeight, ref):
    """The NF4 codes cut into tiles: (packed uint8 [count, tile_bytes], qabsmax uint8
    [count, tile_blocks]); a free reshape unless O is padded (then made after `ref` exists).

    Padding rows get bytes 0x77 (code 7 in both nibbles, NF4 value 0.0) and a scale masked to 0
    (`_decode_rows`), so they decode to exactly 0. For N = O I odd the last real byte's low
    nibble is already code 7.
    """
    packed, qabsmax = qw.packed.reshape(-1), qw.qabsmax.reshape(-1)
    if t.o_pad > t.o:
        fill = _zero_after(ref).astype(jnp.uint8)
        packed = jnp.pad(
            packed, (0, t.count * t.tile_bytes - packed.shape[0]), constant_values=fill + 0x77
        )
        qabsmax = jnp.pad(
            qabsmax, (0, t.count * t.tile_blocks - qabsmax.shape[0]), constant_values=fill
        )
    return packed.reshape(t.count, t.tile_bytes), qabsmax.reshape(t.count, t.tile_blocks)


def _decode_rows(t: _RowTiles, qw: QuantizedWeight, index, packed_B, qabsmax_Q, dtype):
    """Row tile `index`: codes uint8 [rows I / 2] and [rows I / 64] -> W tile [rows, I] in dtype:
    `NF4[code] * absmax'` in float32 (the values of lmjax.quant.dequantize), then cast. The
    block scales are decoded here too, so nothing of the weight's size is built outside."""
    block_Q = index * t.tile_blocks + lax.iota(jnp.int32, t.tile_blocks)
    absmax2_Q = qw.absmax2[jnp.minimum(block_Q // BLOCK2, qw.absmax2.shape[0] - 1)]
    scale_Q = absmax_from_codes(qabsmax_Q, absmax2_Q, qw.offset)
    scale_Q = jnp.where(block_Q < qw.qabsmax.shape[0], scale_Q, 0.0)  # padding rows
    codes = unpack_codes(packed_B, 2 * t.tile_bytes)
    w_QB = jnp.asarray(NF4)[codes].reshape(t.tile_blocks, BLOCK) * scale_Q[:, None]
    return w_QB.reshape(t.rows, t.i).astype(dtype)


def _tiled_y(t: _RowTiles, x_MI, qw: QuantizedWeight):
    """y [M, O] = x @ W^T: a loop over row tiles k, each decoded and written to y[:, tile k]."""
    packed_TB, qabsmax_TQ = _tiled_codes(t, qw, x_MI)

    def tile_y(k, y_MP):
        w_RI = _decode_rows(t, qw, k, packed_TB[k], qabsmax_TQ[k], x_MI.dtype)
        y_MR = jnp.einsum("mi,ri->mr", x_MI, w_RI, preferred_element_type=jnp.float32)
        return lax.dynamic_update_slice(y_MP, y_MR.astype(x_MI.dtype), (0, k * t.rows))

    m = x_MI.shape[0]
    y_MP = jnp.broadcast_to(_zero_after(x_MI).astype(x_MI.dtype), (m, t.o_pad))
    return lax.fori_loop(0, t.count, tile_y, y_MP)[:, : t.o]


def _tiled_dx(t: _RowTiles, qw: QuantizedWeight, g_MO):
    """dx [M, I] = g @ W = sum over row tiles k of g[:, tile k] @ W[tile k], in float32."""
    packed_TB, qabsmax_TQ = _tiled_codes(t, qw, g_MO)
    m = g_MO.shape[0]
    g_MP = jnp.pad(g_MO, ((0, 0), (0, t.o_pad - t.o)))  # padded rows decode to 0 anyway

    def step(k, dx_MI):
        w_RI = _decode_rows(t, qw, k, packed_TB[k], qabsmax_TQ[k], g_MO.dtype)
        g_MR = lax.dynamic_slice_in_dim(g_MP, k * t.rows, t.rows, axis=1)
        return dx_MI + jnp.einsum("mr,ri->mi", g_MR, w_RI, preferred_element_type=jnp.float32)

    dx_MI = jnp.broadcast_to(_zero_after(g_MO), (m, t.i))
    return lax.fori_loop(0, t.count, step, dx_MI).astype(g_MO.dtype)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _tiled(t: _RowTiles, x_MI, qw: QuantizedWeight):
    return _tiled_y(t, x_MI, qw)


def _tiled_fwd(t: _RowTiles, x_MI, qw: QuantizedWeight):
    # The residuals are the NF4 leaves alone: dx needs only W, which the backward decodes again.
    return _tiled_y(t, x_MI, qw), qw


def _tiled_bwd(t: _RowTiles, qw: QuantizedWeight, g_MO):
    return _tiled_dx(t, qw, g_MO), None  # the frozen weight: no cotangent


_tiled.defvjp(_tiled_fwd, _tiled_bwd)


def nf4_matmul_tiled(x, qw: QuantizedWeight, bias=None, *, tile_rows: int | None = None):
    """`x @ dequant(qw)^T (+ bias)` in plain jnp, decoding W in row tiles (module docstring);
    y in x's dtype, any shape of W.

    x [..., I], qw [O, I], bias [O] -> y [..., O]. Differentiable in x (dx = g @ W, decoded
    again tile by tile) and bias; the quantized weight gets no gradient. Saved for the backward:
    the NF4 leaves, nothing else. `tile_rows`: rows of W decoded at a time, rounded up to a
    multiple of 64 / gcd(I, 64) (None: about TILE_WEIGHTS weights a tile).
    """
    x = jnp.asarray(x)
    _check_inputs(x, qw, bias, kernel=False)
    if tile_rows is not None:
        _backend.require_positive_int(
            tile_rows, "tile_rows", "pass a positive int, or None for the default tiles"
        )
    out_features, in_features = qw.shape
    tiles = _row_tiles(out_features, in_features, tile_rows)
    x_MI = x.reshape(-1, in_features)
    y = _tiled(tiles, x_MI, jax.lax.stop_gradient(qw)).reshape(*x.shape[:-1], out_features)
    return y if bias is None else y + _expand(bias, y)


def quantized_linear(x, qw: QuantizedWeight, bias=None):
    """What `lmjax.models.project` runs for a QuantizedWeight: the kernel, compiled, on GPU and TPU
    when in-features are a multiple of 64; otherwise `nf4_matmul_tiled` (on CPU, where the
    kernel could only be interpreted, and for weights whose quantization blocks straddle rows),
    which, like the kernel, never saves a float copy of the weight for the backward."""
    compiled = _backend.platform() in KERNELS  # the default device's, e.g. compiling for a TPU
    if compiled and isinstance(qw, QuantizedWeight) and qw.ndim == 2 and qw.shape[1] % BLOCK == 0:
        return nf4_matmul(x, qw, bias)
    return nf4_matmul_tiled(x, qw, bias)


__all__ = [
    "BlockSizes",
    "CPU_KERNEL",
    "KERNELS",
    "nf4_matmul",
    "nf4_matmul_reference",
    "nf4_matmul_tiled",
    "quantized_linear",
    "resolve_backend",
]
