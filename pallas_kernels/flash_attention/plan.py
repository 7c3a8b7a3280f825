"""The static plan of a flash-attention call: tile sizes, padding, and which blocks run.

Everything here is fixed at trace time from the shapes and `BlockSizes`; the block ranges
(`kv_range`, `q_range`) also take traced program ids, so the kernels skip the blocks that the
causal and sliding-window rules hide entirely; `segment_bounds` (traced, from the segment ids)
narrows them further to the blocks that share a document.
Letters as in the package docstring: Q query-block rows, K key-block rows, Dh the head size.
"""

from __future__ import annotations

import dataclasses
import math
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from lmjax.errors import ConfigError
from pallas_kernels._backend import GPU_MIN_TILE, TPU_LANES, TPU_SUBLANES
from pallas_kernels._backend import require_positive_int as _require_positive_int
from pallas_kernels._backend import round_up as _round_up

LOG2E = math.log2(math.e)
_REQUIRED = ("block_q", "block_k", "block_q_bwd", "block_k_bwd")


@dataclasses.dataclass(frozen=True)
class BlockSizes:
    """Tile sizes: forward (block_q x block_k), backward (block_q_bwd x block_k_bwd).

    The GPU kernel's dq kernel may take its own tile, `block_q_dq` x `block_k_dq` (None: the
    backward's, `block_q_bwd` x `block_k_bwd`): the dk/dv kernel holds a key block and steps over
    queries, the dq kernel holds a query block and steps over keys, so a wide key block with a
    narrow query step for one wants the transpose for the other (gpu.py's backward). The TPU
    kernel keeps `block_q_bwd` x `block_k_bwd` for both and ignores them.
    `num_warps` / `num_stages` tune the Triton launch of the forward (GPU kernel only; None: 4
    warps up to a 64-wide head, else 8; 3 stages), `num_warps_bwd` / `num_stages_bwd` that of
    the two backward kernels (None: `num_warps` / `num_stages` when given, else the same warps
    and 2 stages). They are plain ints: nothing here knows Triton (`gpu.py` turns them into its
    launch parameters).
    Requirements: every block a positive int; GPU kernel: powers of two >= 16; TPU kernel
    compiled: block_q (and block_q_bwd) a multiple of 8, block_k (and block_k_bwd) of 128 (in
    interpret mode a multiple of 8 suffices, so CPU tests can use several small blocks).
    """

    block_q: int = 128
    block_k: int = 64
    block_q_bwd: int = 64
    block_k_bwd: int = 64
    num_warps: int | None = None
    num_stages: int | None = None
    num_warps_bwd: int | None = None
    num_stages_bwd: int | None = None
    block_q_dq: int | None = None
    block_k_dq: int | None = None

    def __post_init__(self):
        # Blocks are required; the launch settings may be left to the kernel (None).
        given = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
        for name, value in given.items():
            if name in _REQUIRED or value is not None:
                _require_positive_int(value, f"BlockSizes.{name}")

    @classmethod
    def default(cls, kernel: str) -> BlockSizes:
        """Defaults per kernel: TPU tiles are (8, 128)-aligned, so its key blocks are 128."""
        return cls() if kernel == "gpu" else cls(128, 128, 128, 128)

    @property
    def blocks(self) -> dict[str, int]:
        """Every tile by field name, the dq kernel's resolved (`dq_blocks`)."""
        dq = dict(zip(("block_q_dq", "block_k_dq"), self.dq_blocks, strict=True))
        return {n: getattr(self, n) for n in _REQUIRED} | dq

    @property
    def dq_blocks(self) -> tuple[int, int]:
        """(query, key) tile of the GPU dq kernel: `block_q_dq` x `block_k_dq`, each defaulting
        to the backward's."""
        q = self.block_q_bwd if self.block_q_dq is None else self.block_q_dq
        return q, self.block_k_bwd if self.block_k_dq is None else self.block_k_dq


def check_blocks(sizes: BlockSizes, kernel: str, interpret: bool) -> None:
    """The backend's tiling rules (see `BlockSizes`); the TPU kernel ignores the dq tile."""
    for name, size in sizes.blocks.items():
        if kernel != "gpu" and name.endswith("_dq"):
            continue
        if kernel == "gpu":
            ok = size >= GPU_MIN_TILE and size & (size - 1) == 0
            expected = f"a power of two >= {GPU_MIN_TILE} for the GPU (Triton) kernel"
            fix = "use 16, 32, 64 or 128"
        else:
            # A key block is the lane (last) dim of the mask tile, so compiled it spans 128.
            lanes = not interpret and name.startswith("block_k")
            multiple = TPU_LANES if lanes else TPU_SUBLANES
            ok = size % multiple == 0
            expected = f"a multiple of {multiple} for the TPU kernel" + (" compiled" * lanes)
            fix = f"round it to a multiple of {multiple}"
        if not ok:
            raise ConfigError.describe(f"BlockSizes.{name}", size, expected, fix)


@dataclasses.dataclass(frozen=True)
class Plan:
    kernel: str
    interpret: bool
    causal: bool
    offset: int
    has_mask: bool
    window: int | None  # sliding window: key u visible to query t iff (t + offset) - u < window
    has_segments: bool  # segment ids given: keep only keys of the query's own segment
    groups: int  # G = H // Hkv query heads per key/value head (1 = multi-head attention)
    t: int  # query length, key length, head dim before padding
    s: int
    d: int
    t_pad: int
    s_pad: int
    d_pad: int
    bq: int  # forward blocks
    bk: int
    bq_bwd: int  # backward blocks (the dk/dv kernel; TPU: both backward kernels)
    bk_bwd: int
    bq_dq: int  # the GPU dq kernel's blocks (TPU: bq_bwd, bk_bwd)
    bk_dq: int
    num_warps: int | None  # launch settings (GPU kernel), forward then backward
    num_stages: int | None
    num_warps_bwd: int | None
    num_stages_bwd: int | None

    @property
    def scale(self) -> float:
        return 1.0 / math.sqrt(self.d)

    @property
    def scale2(self) -> float:
        """Scores in base 2: exp(x) = exp2(x log2 e), and exp2 is the GPU's native exponent."""
        return self.scale * LOG2E

    @property
    def needs_mask(self) -> bool:
        return self.causal or self.window is not None or self.per_element or self.s_pad != self.s

    @property
    def per_element(self) -> bool:
        """A mask read per key (padding) or per pair (segments): no block is entirely visible."""
        return self.has_mask or self.has_segments


def _fit(a: int, b: int, n: int, kernel: str) -> tuple[int, int]:
    """Shrink a (forward, backward) block pair that is longer than a sequence of n.

    GPU: to n's power of two (powers of two keep dividing one another). TPU: the smaller to n
    rounded up to 8, the larger to a multiple of the smaller, so that padding to a multiple of
    both stays close to n.
    """
    if kernel == "gpu":
        cap = _gpu_cap(n)
        return min(a, cap), min(b, cap)
    small = min(a, b, _round_up(n, TPU_SUBLANES))
    big = min(max(a, b), _round_up(n, small))
    return (small, big) if a <= b else (big, small)


def _gpu_cap(n: int) -> int:
    """The largest GPU tile a sequence of n needs: n's power of two (at least the minimum)."""
    return max(GPU_MIN_TILE, pl.next_power_of_2(n))


def _pad_head_dim(d: int, kernel: str) -> int:
    return max(GPU_MIN_TILE, pl.next_power_of_2(d)) if kernel == "gpu" else _round_up(d, TPU_LANES)


def make_plan(
    q_shape,
    k_shape,
    sizes,
    kernel,
    interpret,
    causal,
    offset,
    has_mask,
    window: int | None = None,
    has_segments: bool = False,
) -> Plan:
    (_, t, h, d), (_, s, h_kv, _) = q_shape, k_shape
    bq, bq_bwd = _fit(sizes.block_q, sizes.block_q_bwd, t, kernel)
    bk, bk_bwd = _fit(sizes.block_k, sizes.block_k_bwd, s, kernel)
    # GPU: the dq tile shrinks like the others (powers of two: every tile divides the largest,
    # so the lcm below is the largest). TPU: its dq kernel uses the backward tile.
    bq_dq, bk_dq = (bq_bwd, bk_bwd)
    if kernel == "gpu":
        bq_dq, bk_dq = (min(b, _gpu_cap(n)) for b, n in zip(sizes.dq_blocks, (t, s), strict=True))
    return Plan(
        kernel=kernel,
        interpret=interpret,
        causal=causal,
        offset=offset,
        has_mask=has_mask,
        window=window,
        has_segments=has_segments,
        groups=h // h_kv,
        t=t,
        s=s,
        d=d,
        t_pad=_round_up(t, math.lcm(bq, bq_bwd, bq_dq)),
        s_pad=_round_up(s, math.lcm(bk, bk_bwd, bk_dq)),
        d_pad=_pad_head_dim(d, kernel),
        bq=bq,
        bk=bk,
        bq_bwd=bq_bwd,
        bk_bwd=bk_bwd,
        bq_dq=bq_dq,
        bk_dq=bk_dq,
        num_warps=sizes.num_warps,
        num_stages=sizes.num_stages,
        num_warps_bwd=sizes.num_warps_bwd,
        num_stages_bwd=sizes.num_stages_bwd,
    )


def _div0(x, d: int):
    """floor(max(x, 0) / d) for an int or a traced int32 (lax.div truncates, so clamp first)."""
    return max(x, 0) // d if isinstance(x, int) else lax.div(jnp.maximum(x, 0), d)


def _cdiv0(x, d: int):
    return _div0(x + d - 1, d)


def _min(a, b):
    return min(a, b) if isinstance(a, int) and isinstance(b, int) else jnp.minimum(a, b)


def _max(a, b):
    return max(a, b) if isinstance(a, int) and isinstance(b, int) else jnp.maximum(a, b)


def _ordered(lo, full_lo, full_hi, end):
    """Clamp to lo <= full_lo <= full_hi <= end (a rule's bound may overshoot another's)."""
    lo = _min(lo, end)
    full_lo = _min(_max(full_lo, lo), end)
    return lo, full_lo, _min(_max(full_hi, full_lo), end), end


def kv_head(h, groups: int):
    """The key/value head query head h reads: h // G (lax.div: a program id is >= 0, and the
    Mosaic lowering has no rule for the sign arithmetic of a floor division)."""
    return h if groups == 1 else lax.div(h, groups)


def kv_range(plan: Plan, i, bq: int, bk: int, seg=None):
    """(lo, full_lo, full_hi, end) for query block i (rows t in [i*bq, i*bq + bq)): key blocks
    [lo, end) are visited, and of them [full_lo, full_hi) need no mask.

    Causal: row t sees keys u <= t + offset, so the last row bounds `end` and the first row
    bounds the fully visible blocks. Window: row t sees keys u > t + offset - window, so the
    first row bounds `lo` and the last row the fully visible blocks. Segments: `seg` is this
    block's (lo, end) from `segment_bounds`, intersected with the rest.
    """
    end = -(-plan.s // bk)  # blocks holding at least one real key
    lo, full_lo, full_hi = 0, 0, plan.s // bk  # full_hi: blocks holding only real keys
    first, last = i * bq + plan.offset, i * bq + bq - 1 + plan.offset  # t + offset of the rows
    if plan.causal:
        end = _min(_cdiv0(last + 1, bk), end)
        full_hi = _min(_div0(first + 1, bk), full_hi)
    if plan.window is not None:
        lo = _div0(first - plan.window + 1, bk)
        full_lo = _cdiv0(last - plan.window + 1, bk)
    if plan.per_element:
        full_hi = full_lo  # every visited block is masked
    lo, end = _narrow(lo, end, seg)
    return _ordered(lo, full_lo, full_hi, end)


def q_range(plan: Plan, j, bq: int, bk: int, seg=None):
    """(lo, full_lo, full_hi, end) for key block j (keys u in [j*bk, j*bk + bk)): query blocks
    [lo, end) are visited, and of them [full_lo, full_hi) need no mask.

    Causal: row t sees key u iff t >= u - offset: the block's first key bounds `lo`, its last
    key the fully visible rows. Window: row t sees key u iff t < u - offset + window: the last
    key bounds `end`, the first key the fully visible rows. Segments: `seg` is this block's
    (lo, end) from `segment_bounds`, intersected with the rest.
    """
    end = -(-plan.t // bq)  # padded query rows past the last real block add nothing
    lo, full_lo, full_hi = 0, 0, end
    first, last = j * bk - plan.offset, j * bk + bk - 1 - plan.offset  # u - offset of the keys
    if plan.causal:
        lo = _div0(first, bq)
        full_lo = _cdiv0(last, bq)
    if plan.window is not None:
        end = _min(_cdiv0(last + plan.window, bq), end)  # rows t <= last + window - 1
        full_hi = _div0(first + plan.window, bq)  # blocks whose every row t < first + window
    if plan.per_element:
        full_hi = full_lo
    lo, end = _narrow(lo, end, seg)
    lo, full_lo, full_hi, end = _ordered(lo, full_lo, full_hi, end)
    if plan.s_pad != plan.s:
        # A key block with padded keys always needs the mask; one with no real key, no work.
        # int32 on both branches: Triton's select lowering gives weak Python ints the
        # predicate's type (i1), which would turn the loop bounds into booleans.
        padded = (j + 1) * bk > plan.s
        full_hi = jnp.where(padded, jnp.asarray(full_lo, jnp.int32), jnp.int32(full_hi))
        lo = jnp.where(j * bk >= plan.s, jnp.asarray(end, jnp.int32), jnp.int32(lo))
        full_lo = jnp.maximum(full_lo, lo)
        full_hi = jnp.maximum(full_hi, full_lo)
    return lo, full_lo, full_hi, end


def _narrow(lo, end, seg):
    """[lo, end) intersected with a segment range (lo', end'), if there is one."""
    return (lo, end) if seg is None else (_max(lo, seg[0]), _min(end, seg[1]))


class SegmentBounds(NamedTuple):
    """Per-block ranges that segment ids allow, int32: query block i of row b visits key blocks
    [kv_lo[b, i], kv_end[b, i]) at most; key block j is seen by query blocks
    [q_lo[b, j], q_end[b, j]) at most. An empty range is (n, 0)."""

    kv_lo: jax.Array  # [B, nq]
    kv_end: jax.Array
    q_lo: jax.Array  # [B, nk]
    q_end: jax.Array

    def side(self, name: str):
        """(lo, end) for "kv" (per query block: the forward and dq kernels) or "q" (per key
        block: the dk/dv kernel)."""
        return (self.kv_lo, self.kv_end) if name == "kv" else (self.q_lo, self.q_end)


def _block_id_range(ids_BN, n_real: int, blk: int):
    """(min, max) of each block's real ids, ordered as uint32(id - 1), [B, N / blk] each.

    id -> uint32(id - 1) is a bijection, so equal ids stay equal and unequal ones unequal, but
    the padding a packed row ends with (id 0, or a negative id) now sorts after every document
    (1, 2, ... -> 0, 1, ...), and such a row stays non-decreasing. A block with no real
    position gets (UINT32_MAX, 0)."""
    big = jnp.uint32(jnp.iinfo(jnp.uint32).max)
    b, n = ids_BN.shape
    real = (jnp.arange(n) < n_real).reshape(1, n // blk, blk)
    ids = lax.bitcast_convert_type(ids_BN - 1, jnp.uint32).reshape(b, n // blk, blk)
    lo = jnp.min(jnp.where(real, ids, big), axis=2)
    hi = jnp.max(jnp.where(real, ids, jnp.uint32(0)), axis=2)
    return lo, hi


def segment_bounds(plan: Plan, qseg_BT, kvseg_BS, bq: int, bk: int) -> SegmentBounds | None:
    """Which blocks segment ids can leave any pair visible in, from padded ids [B, T'], [B, S'].

        Query block i and key block j share a document only if their id intervals meet:
            qmin_i <= kmax_j and kmin_j <= qmax_i      (over real positions; ids ordered as
                                                        uint32(id - 1): padding 0 sorts last)
        and query block i visits key blocks [first j that meets it, last j that meets it + 1); the
        dk/dv side is the same over i. This never drops a visible pair, whatever the ids; for a
        packed row (ids non-decreasing, the same on both sides) it is exactly the blocks that hold
        one (also with padding 0 after the last document), so a row of documents of length L visits
    O(T * L / (bq * bk)) blocks, not O(T^2 / (bq * bk)).
        Cost: [B, T'/bq, S'/bk] comparisons in XLA, before the kernel. None without segment ids.
    """
    if qseg_BT is None:
        return None
    qlo, qhi = _block_id_range(qseg_BT, plan.t, bq)
    klo, khi = _block_id_range(kvseg_BS, plan.s, bk)
    meet = (qlo[:, :, None] <= khi[:, None, :]) & (klo[:, None, :] <= qhi[:, :, None])
    nq, nk = meet.shape[1:]
    j, i = jnp.arange(nk, dtype=jnp.int32), jnp.arange(nq, dtype=jnp.int32)[:, None]
    return SegmentBounds(
        kv_lo=jnp.min(jnp.where(meet, j, nk), axis=2).astype(jnp.int32),
        kv_end=jnp.max(jnp.where(meet, j + 1, 0), axis=2).astype(jnp.int32),
        q_lo=jnp.min(jnp.where(meet, i, nq), axis=1).astype(jnp.int32),
        q_end=jnp.max(jnp.where(meet, i + 1, 0), axis=1).astype(jnp.int32),
    )
