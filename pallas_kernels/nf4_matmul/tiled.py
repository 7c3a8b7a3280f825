"""`nf4_matmul_tiled`: the NF4 matmul in plain jnp (XLA), W decoded in row tiles.

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
from jax import lax

from lmjax.quant.nf4 import BLOCK, BLOCK2, NF4, QuantizedWeight, absmax_from_codes, unpack_codes
from pallas_kernels import _backend
from pallas_kernels._backend import round_up
from pallas_kernels.nf4_matmul.reference import add_bias, check_inputs

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
        cap = round_up(tile_rows, align)
    count = max(2, -(-o // cap))
    return _RowTiles(o, i, round_up(-(-o // count), align), count)


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


def _tile_group_scales(t: _RowTiles, absmax2_G, index) -> jax.Array:
    """`absmax2[b // 256]` for row tile `index`'s blocks b = index Q .. index Q + Q - 1, f32 [Q].

    The few groups the tile's run of blocks meets, each broadcast over its 256 blocks, and the
    run sliced out at a scalar offset: no index array (issue 32), nothing larger than Q + 512.
    Blocks past the weight read padding (the caller masks their scales).
    """
    near = t.tile_blocks // BLOCK2 + 2  # a run of Q blocks meets at most this many groups
    first = index * t.tile_blocks
    group = first // BLOCK2
    # Padded, so dynamic_slice (which clamps its start) slices where asked for every real block.
    padded_G = jnp.pad(absmax2_G, (0, near))
    near_G = lax.dynamic_slice_in_dim(padded_G, group, near)
    per_block = jnp.broadcast_to(near_G[:, None], (near, BLOCK2)).reshape(near * BLOCK2)
    return lax.dynamic_slice_in_dim(per_block, first - group * BLOCK2, t.tile_blocks)


def _decode_rows(t: _RowTiles, qw: QuantizedWeight, index, packed_B, qabsmax_Q, dtype):
    """Row tile `index`: codes uint8 [rows I / 2] and [rows I / 64] -> W tile [rows, I] in dtype:
    `NF4[code] * absmax'` in float32 (the values of lmjax.quant.dequantize), then cast. The
    block scales are decoded here too, so nothing of the weight's size is built outside."""
    n_blocks = qw.qabsmax.shape[0]
    scale_Q = absmax_from_codes(qabsmax_Q, _tile_group_scales(t, qw.absmax2, index), qw.offset)
    block_Q = index * t.tile_blocks + lax.iota(jnp.int32, t.tile_blocks)
    scale_Q = jnp.where(block_Q < n_blocks, scale_Q, 0.0)  # padding rows
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
    """`x @ dequant(qw)^T (+ bias)` in plain jnp, decoding W in row tiles (this module's docstring);
    y in x's dtype, any shape of W.

    x [..., I], qw [O, I], bias [O] -> y [..., O]. Differentiable in x (dx = g @ W, decoded
    again tile by tile) and bias; the quantized weight gets no gradient. Saved for the backward:
    the NF4 leaves, nothing else. `tile_rows`: rows of W decoded at a time, rounded up to a
    multiple of 64 / gcd(I, 64) (None: about TILE_WEIGHTS weights a tile).
    """
    x = jnp.asarray(x)
    check_inputs(x, qw, bias, kernel=False)
    if tile_rows is not None:
        _backend.require_positive_int(
            tile_rows, "tile_rows", "pass a positive int, or None for the default tiles"
        )
    out_features, in_features = qw.shape
    tiles = _row_tiles(out_features, in_features, tile_rows)
    x_MI = x.reshape(-1, in_features)
    y = _tiled(tiles, x_MI, jax.lax.stop_gradient(qw)).reshape(*x.shape[:-1], out_features)
    return add_bias(y, bias)
