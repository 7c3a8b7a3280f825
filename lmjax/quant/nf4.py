"""NF4 with double quantization, in bitsandbytes' layout (docs/fine-tuning.md).

For a weight of N elements, flattened row-major and cut into `B = ceil(N / 64)` blocks of 64:

    absmax[b]  = max_i |w[64 b + i]|                                     f32 [B]
    code[j]    = #{k : mid[k] < w[j] * (1 / absmax[j // 64])}          in 0..15
                 mid[k] = (NF4[k] + NF4[k+1]) / 2 in float32: the nearest NF4 value, ties
                 (a scaled weight exactly on a midpoint) to the lower code
    packed[p]  = code[2p] << 4 | code[2p + 1]                            uint8 [ceil(N/2)]
  double quantization of the block scales, in `B2 = ceil(B / 256)` groups of 256:
    offset     = mean(absmax)                                            f32 []
    absmax2[g] = max_b |absmax[256 g + b] - offset|                      f32 [B2]
    qabsmax[b] = nearest of the 256 signed dynamic-map values `DYNAMIC` to
                 (absmax[b] - offset) * (1 / absmax2[b // 256]), ties to the lower code
                                                                         uint8 [B]
  dequantization (float32 arithmetic, then cast to the weight's dtype):
    absmax'[b] = DYNAMIC[qabsmax[b]] * absmax2[b // 256] + offset
    w'[j]      = NF4[code[j]] * absmax'[j // 64]

Storage: `ceil(N/2) + B + 4 B2 + 4` bytes (`storage_bytes(n)`), which is the
`N/2 + ceil(N/64) + 4 ceil(N/16384) + 4` (N/2 rounded up): about 4.127 bits per weight.

Sizes that are not a multiple of 64 (or of 2): as bitsandbytes, the last block holds the
`N mod 64` remaining weights (its absmax is over those alone) and, for N odd, the last byte's
low nibble holds the code of a padding 0.0 (code 7); dequantization drops it. Nothing is
required of N beyond N >= 1.

Edge cases: a block of zeros has absmax 0 and codes 7 (NF4 value 0.0), and the reciprocal is
taken of max(absmax, smallest normal float32), so no block gives inf or NaN. Subnormal weights
count as zeros on CPU (XLA flushes them there; a block of them gets codes 7 and dequantizes to
0, where bitsandbytes' CPU kernel gives code 6 and a nonzero weight; on GPU untested). The
weight must be finite, float32, bfloat16 or float16, with block maxima whose float32 sum (the
offset) does not overflow; both are checked when the weight is concrete (outside jit). Under jit
a NaN or inf weight, or an overflowing offset, makes the offset and absmax2 NaN or inf, so the
whole weight dequantizes to NaN (or inf): loud, never plausible garbage. One block with a huge
outlier (1e4 among weights of 0.02) is legal but ruins the others, exactly as in bitsandbytes:
the offset and absmax2 follow the outlier, and the 8-bit code of a small block's absmax is then
a coarse step of absmax2 (its dequantized absmax can even come out negative, flipping that
block's signs).

The one place "nearest" needs a convention: 9 of the 15 NF4 midpoints are not float32 numbers.
The comparison is with the float32-rounded midpoint (as bitsandbytes' `torch.bucketize` on its
float32 bounds), so a scaled weight equal to a midpoint that rounded *up* gets the lower code
although the upper one is nearer by less than half a float32 ulp. The same rule picks the
nested 8-bit codes. (bitsandbytes' CPU kernel rounds the nested codes through a 65,536-bin
table instead, so a few of its codes differ from these by one step; its CUDA kernel rounds to
the nearest.)
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from lmjax.errors import NonFiniteError, ShapeError

BLOCK = 64  # weights per NF4 block (one absmax each)
BLOCK2 = 256  # absmax values per double-quantization group (one absmax2 each)
WEIGHT_DTYPES = (jnp.dtype(jnp.float32), jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16))

# The 16 NF4 values, codes 0..15 (bitsandbytes' NF4: quantiles of N(0, 1) scaled to [-1, 1]).
NF4 = np.array(
    [
        -1.0,
        -0.6961928009986877,
        -0.5250730514526367,
        -0.39491748809814453,
        -0.28444138169288635,
        -0.18477343022823334,
        -0.09105003625154495,
        0.0,
        0.07958029955625534,
        0.16093020141124725,
        0.24611230194568634,
        0.33791524171829224,
        0.44070982933044434,
        0.5626170039176941,
        0.7229568362236023,
        1.0,
    ],
    np.float32,
)


def _linspace_f32(start: float, stop: float, num: int) -> np.ndarray:
    """`num` float32 points from start to stop, each rounded once from an exact product-sum.

    The first half counts up from start, the second half down from stop (so both ends are
    exact), with a float32 step: the values bitsandbytes' map is built from.
    """
    start32, stop32 = np.float32(start), np.float32(stop)
    step = np.float64((stop32 - start32) / np.float32(num - 1))
    k = np.arange(num)
    # start + step * k is exact in float64 here (24-bit step times a 7-bit k, same binade).
    exact = np.where(k < num // 2, start32 + step * k, stop32 - step * (num - 1 - k))
    return exact.astype(np.float32)


def dynamic_map_signed() -> np.ndarray:
    """The signed 8-bit dynamic map (float32 [256], sorted): bitsandbytes'
    `create_dynamic_map(signed=True)` (Dettmers, 8-bit approximations, 2015).

    For exponent i = 0..6 the fraction grid `linspace(0.1, 1, 2^i + 1)` gives 2^i bin
    midpoints, scaled by 10^(i-6) and mirrored to negative: 2 (1 + 2 + ... + 64) = 254 values,
    plus 0 and 1. All arithmetic in float32, as in bitsandbytes.
    """
    values = [0.0, 1.0]
    for i in range(7):
        edges = _linspace_f32(0.1, 1.0, 2**i + 1)
        means = (edges[:-1] + edges[1:]) / np.float32(2)
        scaled = np.float32(10.0 ** (i - 6)) * means
        values += [*scaled, *(-scaled)]
    return np.sort(np.array(values, np.float32))


DYNAMIC = dynamic_map_signed()
ZERO_CODE = int(np.nonzero(DYNAMIC == 0)[0][0])  # 127


def _midpoints(values: np.ndarray) -> np.ndarray:
    return (values[:-1] + values[1:]) / np.float32(2)


_NF4_MID = _midpoints(NF4)
_DYNAMIC_MID = _midpoints(DYNAMIC)
_TINY = float(np.finfo(np.float32).tiny)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class QuantizedWeight:
    """An NF4 weight with double-quantized block scales (see the module docstring).

    Array leaves: `packed` uint8 [ceil(N/2)], `qabsmax` uint8 [ceil(N/64)], `absmax2` f32
    [ceil(N/16384)], `offset` f32 []. Static (pytree aux data): the original `shape` and
    `dtype`. `shape`, `dtype`, `size` and `ndim` describe the original weight, so code that
    only reads shapes (parameter counts, shape checks) treats it like the array it replaces.

    Stacked (`quantize_layers`: a model's stacked blocks, `lmjax.params`): the four arrays lead
    with the layer count L (`lead_shape == (L,)`, each layer quantized on its own) while `shape`
    stays one layer's; `jax.tree.map(lambda a: a[i], qw)` (what a scan over the blocks does)
    gives layer i's weight. `weights` counts every layer's.
    """

    packed: jax.Array
    qabsmax: jax.Array
    absmax2: jax.Array
    offset: jax.Array
    shape: tuple[int, ...] = dataclasses.field(metadata=dict(static=True))
    dtype: Any = dataclasses.field(metadata=dict(static=True))

    @property
    def size(self) -> int:
        return math.prod(self.shape)

    @property
    def ndim(self) -> int:
        return len(self.shape)

    @property
    def lead_shape(self) -> tuple[int, ...]:
        """The stacked axes before one weight's arrays: () for one weight, (L,) for L layers."""
        return tuple(self.offset.shape)

    @property
    def weights(self) -> int:
        """Weights stored, over every layer: `size` times the layers."""
        return self.size * math.prod(self.lead_shape)

    @property
    def nbytes(self) -> int:
        """Bytes actually stored: the four array leaves."""
        return sum(int(np.prod(a.shape)) * jnp.dtype(a.dtype).itemsize for a in self._arrays)

    @property
    def _arrays(self):
        return (self.packed, self.qabsmax, self.absmax2, self.offset)

    def __array__(self, dtype=None, copy=None):
        # Without this numpy would wrap the object in a 0-d object array, and code that converts
        # leaves (a safetensors writer, np.testing) would fail far away with a useless message.
        raise ShapeError.describe(
            f"an NF4 QuantizedWeight of shape {self.shape} converted to a numpy array",
            "QuantizedWeight",
            "a plain array (the NF4 weight is four arrays, not one)",
            "call lmjax.quant.dequantize(qw) for the float weight; to save a quantized model, "
            "save its float base and re-quantize it on load (quantize is deterministic)",
        )


def storage_bytes(n: int) -> int:
    """Bytes of an NF4 weight of n elements: `ceil(n/2) + ceil(n/64) + 4 ceil(n/16384) + 4`."""
    blocks = -(-n // BLOCK)
    return -(-n // 2) + blocks + 4 * -(-blocks // BLOCK2) + 4


def _check_weight(w: jax.Array) -> None:
    if w.dtype not in WEIGHT_DTYPES:
        raise ShapeError.describe(
            "weight.dtype",
            str(w.dtype),
            "float32, bfloat16 or float16",
            "quantize a floating-point weight (cast it with .astype(jnp.float32))",
        )
    if w.ndim == 0 or w.size == 0:
        raise ShapeError.describe(
            "weight.shape",
            w.shape,
            "at least one axis and at least one element",
            "quantize a non-empty weight array",
        )
    if isinstance(w, jax.core.Tracer):
        return
    finite = jnp.isfinite(w)  # on w's device: one bool comes back, not a host copy of w
    if not bool(finite.all()):
        bad = int(jnp.sum(~finite))
        raise NonFiniteError.describe(
            "weight",
            f"{bad} NaN or infinite of {w.size} elements",
            "finite values (NF4 scales each block by its largest magnitude)",
            "find where the NaN or inf came from; quantize only a finite weight",
        )


def _nearest_code(scaled: jax.Array, midpoints: np.ndarray) -> jax.Array:
    """Index of the nearest table value: the number of midpoints strictly below (ties lower)."""
    # A sum of comparisons: XLA fuses it into one reduction, [..., len(midpoints)] is never built.
    below = scaled[..., None] > jnp.asarray(midpoints).reshape((1,) * scaled.ndim + (-1,))
    return jnp.sum(below, axis=-1, dtype=jnp.int32)


def _blockwise_absmax(x: jax.Array, block: int) -> tuple[jax.Array, jax.Array]:
    """x [n] f32 -> (x zero-padded to [nb, block], absmax [nb]); padding leaves the max alone."""
    nb = -(-x.shape[0] // block)
    blocks = jnp.pad(x, (0, nb * block - x.shape[0])).reshape(nb, block)
    return blocks, jnp.max(jnp.abs(blocks), axis=1)


def _scale_by_reciprocal(blocks, absmax):
    inv = 1.0 / jnp.maximum(absmax, _TINY)
    return jnp.clip(blocks * inv[:, None], -1.0, 1.0)


def quantize(w) -> QuantizedWeight:
    """Float weight (any shape, N >= 1 elements) -> `QuantizedWeight` (module docstring).

    Jittable (shapes are static); the finiteness check runs only on concrete input.
    """
    w = jnp.asarray(w)
    _check_weight(w)
    # The jitted part sees a flat float32 vector: one compile per size, whatever shape or dtype.
    packed, qabsmax, absmax2, offset = _quantize(w.reshape(-1).astype(jnp.float32))
    if not isinstance(offset, jax.core.Tracer) and not np.isfinite(float(offset)):
        _raise_scale_overflow(w)
    return QuantizedWeight(packed, qabsmax, absmax2, offset, shape=tuple(w.shape), dtype=w.dtype)


def quantize_layers(w) -> QuantizedWeight:
    """A stacked weight `[L, ...]` -> a stacked `QuantizedWeight`: each layer quantized on its own
    (`quantize(w[i])`, the same bytes as a weight of its own), the arrays stacked on a leading
    axis, `shape` one layer's (class docstring)."""
    if np.ndim(w) < 2:
        raise ShapeError.describe(
            "stacked weight.shape", np.shape(w), "[layers, ...]", "pass a stacked weight"
        )
    layers = [quantize(w[i]) for i in range(np.shape(w)[0])]
    return jax.tree.map(lambda *arrays: jnp.stack(arrays), *layers)


def _raise_scale_overflow(w: jax.Array):
    """offset = mean(absmax) is a float32 sum, as bitsandbytes': finite weights near the float32
    limit overflow it to inf, and every dequantized weight would be NaN."""
    raise NonFiniteError.describe(
        "weight",
        f"max |w| = {float(jnp.max(jnp.abs(w.astype(jnp.float32)))):.3g}",
        "block maxima whose float32 sum (the double-quantization offset) stays finite, "
        "below about 3.4e38 in total",
        "rescale the weight (quantize w / s and multiply the layer's output by s)",
    )


@jax.jit
def _quantize(flat: jax.Array):
    n = flat.shape[0]
    blocks, absmax = _blockwise_absmax(flat, BLOCK)
    codes = _nearest_code(_scale_by_reciprocal(blocks, absmax), _NF4_MID).reshape(-1)
    codes = codes[: 2 * (-(-n // 2))].astype(jnp.uint8)  # keeps one padding code when n is odd
    packed = (codes[0::2] << 4) | codes[1::2]
    # A true division, as torch's mean: under jit XLA would turn `/ nb` into `* (1 / nb)`,
    # which rounds differently; the barrier keeps the divisor opaque.
    offset = jnp.sum(absmax) / lax.optimization_barrier(jnp.float32(absmax.shape[0]))
    groups, absmax2 = _blockwise_absmax(absmax - offset, BLOCK2)
    qabsmax = _nearest_code(_scale_by_reciprocal(groups, absmax2), _DYNAMIC_MID).reshape(-1)
    return packed, qabsmax[: absmax.shape[0]].astype(jnp.uint8), absmax2, offset


def block_absmax(qw: QuantizedWeight) -> jax.Array:
    """The dequantized block scales, f32 [ceil(N/64)]: `DYNAMIC[qabsmax] * absmax2 + offset`."""
    return _block_absmax(qw.qabsmax, qw.absmax2, qw.offset)


def _block_absmax(qabsmax, absmax2, offset):
    return absmax_from_codes(qabsmax, group_scale_of_blocks(absmax2, qabsmax.shape[0]), offset)


def group_scale_of_blocks(absmax2, n_blocks: int) -> jax.Array:
    """f32 [B2] -> [n_blocks]: block b's group scale `absmax2[b // 256]`, by a broadcast over
    each group's 256 blocks and a reshape. No index array: `jnp.repeat` with a length builds
    one by scatter and prefix sum, which a GPU compiler folds at compile time (issue 32)."""
    groups = absmax2.shape[0]
    per_block = jnp.broadcast_to(absmax2[:, None], (groups, BLOCK2))
    return per_block.reshape(groups * BLOCK2)[:n_blocks]


def absmax_from_codes(qabsmax, absmax2_of_block, offset):
    """`DYNAMIC[qabsmax] * absmax2_of_block + offset` (f32, qabsmax's shape): the dequantized
    scales of any run of blocks, given each block's group scale `absmax2[b // 256]`."""
    code = qabsmax.astype(jnp.int32)
    scaled = jnp.asarray(DYNAMIC)[code] * absmax2_of_block
    # Two roundings, as bitsandbytes (multiply, then add). Fused by XLA, the pair would become
    # one multiply-add that rounds once; a select between them (a no-op in value: DYNAMIC at
    # the zero code is 0) keeps them apart.
    scaled = jnp.where(code == ZERO_CODE, 0.0, scaled)
    return scaled + offset


def unpack_codes(packed: jax.Array, n: int) -> jax.Array:
    """uint8 [ceil(n/2)] -> int32 codes [n]: high nibble first."""
    pairs = jnp.stack([packed >> 4, packed & 15], axis=-1).astype(jnp.int32)
    return pairs.reshape(-1)[:n]


def dequantize(qw: QuantizedWeight, dtype=None) -> jax.Array:
    """`NF4[code] * absmax'` in float32, cast to `dtype` (default: the original dtype), with
    the original shape; a stacked weight gives `[L, *shape]`, each layer as its own weight
    would. Materializes the full float weight: the kernel in `pallas_kernels.nf4_matmul` does
    not."""
    if not isinstance(qw, QuantizedWeight):
        raise ShapeError.describe(
            "qw", type(qw).__name__, "a QuantizedWeight", "build one with lmjax.quant.quantize(w)"
        )
    one = functools.partial(_dequantize, n=qw.size)
    for _ in qw.lead_shape:  # elementwise per block: vmapped, each layer's values unchanged
        one = jax.vmap(one)
    flat = one(qw.packed, qw.qabsmax, qw.absmax2, qw.offset)
    return flat.reshape(*qw.lead_shape, *qw.shape).astype(qw.dtype if dtype is None else dtype)


@functools.partial(jax.jit, static_argnums=4)
def _dequantize(packed, qabsmax, absmax2, offset, n: int) -> jax.Array:
    """Flat float32 [n]: one compile per size, whatever the original shape or dtype."""
    n_blocks = qabsmax.shape[0]
    scale_Q = _block_absmax(qabsmax, absmax2, offset)
    # Whole blocks [n_blocks, 64] times each block's scale, then the tail dropped: the
    # expansion of scales to weights is a broadcast, with no index array (issue 32).
    packed = jnp.pad(packed, (0, n_blocks * BLOCK // 2 - packed.shape[0]))
    codes_QB = unpack_codes(packed, n_blocks * BLOCK).reshape(n_blocks, BLOCK)
    w_QB = jnp.asarray(NF4)[codes_QB] * scale_Q[:, None]
    return w_QB.reshape(-1)[:n]


__all__ = [
    "BLOCK",
    "BLOCK2",
    "DYNAMIC",
    "NF4",
    "QuantizedWeight",
    "absmax_from_codes",
    "block_absmax",
    "dequantize",
    "dynamic_map_signed",
    "group_scale_of_blocks",
    "quantize",
    "quantize_layers",
    "storage_bytes",
    "unpack_codes",
]
