"""The static plan of a flash-attention call: tile sizes, padding, and which blocks run.

Everything here is fixed at trace time from the shapes and `BlockSizes`; the block ranges
(`kv_range`, `q_range`) also take traced program ids, so the kernels skip causal blocks.
Letters as in the package docstring: Q query-block rows, K key-block rows, Dh the head size.
"""

from __future__ import annotations

import dataclasses
import math

import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from lmjax.errors import ConfigError
from pallas_kernels._backend import GPU_MIN_TILE, TPU_LANES, TPU_SUBLANES
from pallas_kernels._backend import require_positive_int as _require_positive_int
from pallas_kernels._backend import round_up as _round_up

LOG2E = math.log2(math.e)


@dataclasses.dataclass(frozen=True)
class BlockSizes:
    """Tile sizes: forward (block_q x block_k), backward (block_q_bwd x block_k_bwd).

    `num_warps` / `num_stages` tune the Triton launch (GPU kernel only; None picks by head dim).
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

    def __post_init__(self):
        # Blocks are required; the launch settings may be left to the kernel (None).
        given = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
        for name, value in given.items():
            if name in self.blocks or value is not None:
                _require_positive_int(value, f"BlockSizes.{name}")

    @classmethod
    def default(cls, kernel: str) -> BlockSizes:
        """Defaults per kernel: TPU tiles are (8, 128)-aligned, so its key blocks are 128."""
        return cls() if kernel == "gpu" else cls(128, 128, 128, 128)

    @property
    def blocks(self) -> dict[str, int]:
        return {n: getattr(self, n) for n in ("block_q", "block_k", "block_q_bwd", "block_k_bwd")}


def check_blocks(sizes: BlockSizes, kernel: str, interpret: bool) -> None:
    """The backend's tiling rules (see `BlockSizes`)."""
    for name, size in sizes.blocks.items():
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
    t: int  # query length, key length, head dim before padding
    s: int
    d: int
    t_pad: int
    s_pad: int
    d_pad: int
    bq: int  # forward blocks
    bk: int
    bq_bwd: int  # backward blocks
    bk_bwd: int
    num_warps: int | None
    num_stages: int | None

    @property
    def scale(self) -> float:
        return 1.0 / math.sqrt(self.d)

    @property
    def scale2(self) -> float:
        """Scores in base 2: exp(x) = exp2(x log2 e), and exp2 is the GPU's native exponent."""
        return self.scale * LOG2E

    @property
    def needs_mask(self) -> bool:
        return self.causal or self.has_mask or self.s_pad != self.s


def _fit(a: int, b: int, n: int, kernel: str) -> tuple[int, int]:
    """Shrink a (forward, backward) block pair that is longer than a sequence of n.

    GPU: to n's power of two (powers of two keep dividing one another). TPU: the smaller to n
    rounded up to 8, the larger to a multiple of the smaller, so that padding to a multiple of
    both stays close to n.
    """
    if kernel == "gpu":
        cap = max(GPU_MIN_TILE, pl.next_power_of_2(n))
        return min(a, cap), min(b, cap)
    small = min(a, b, _round_up(n, TPU_SUBLANES))
    big = min(max(a, b), _round_up(n, small))
    return (small, big) if a <= b else (big, small)


def _pad_head_dim(d: int, kernel: str) -> int:
    return max(GPU_MIN_TILE, pl.next_power_of_2(d)) if kernel == "gpu" else _round_up(d, TPU_LANES)


def make_plan(q_shape, k_shape, sizes, kernel, interpret, causal, offset, has_mask) -> Plan:
    (_, t, _, d), s = q_shape, k_shape[1]
    bq, bq_bwd = _fit(sizes.block_q, sizes.block_q_bwd, t, kernel)
    bk, bk_bwd = _fit(sizes.block_k, sizes.block_k_bwd, s, kernel)
    return Plan(
        kernel=kernel,
        interpret=interpret,
        causal=causal,
        offset=offset,
        has_mask=has_mask,
        t=t,
        s=s,
        d=d,
        t_pad=_round_up(t, math.lcm(bq, bq_bwd)),
        s_pad=_round_up(s, math.lcm(bk, bk_bwd)),
        d_pad=_pad_head_dim(d, kernel),
        bq=bq,
        bk=bk,
        bq_bwd=bq_bwd,
        bk_bwd=bk_bwd,
        num_warps=sizes.num_warps,
        num_stages=sizes.num_stages,
    )


def _div0(x, d: int):
    """floor(max(x, 0) / d) for an int or a traced int32 (lax.div truncates, so clamp first)."""
    return max(x, 0) // d if isinstance(x, int) else lax.div(jnp.maximum(x, 0), d)


def _cdiv0(x, d: int):
    return _div0(x + d - 1, d)


def _min(a, b):
    return min(a, b) if isinstance(a, int) and isinstance(b, int) else jnp.minimum(a, b)


def kv_range(plan: Plan, i, bq: int, bk: int):
    """(full, end) for query block i: key blocks [0, full) need no mask, [full, end) do."""
    end = -(-plan.s // bk)  # blocks holding at least one real key
    full = plan.s // bk  # blocks holding only real keys
    if plan.causal:
        # The block's last row t = i*bq + bq - 1 sees keys u <= t + offset; its first row
        # t = i*bq sees every key of blocks that end at or before t + offset.
        end = _min(_cdiv0(i * bq + bq + plan.offset, bk), end)
        full = _min(_div0(i * bq + plan.offset + 1, bk), _min(full, end))
    if plan.has_mask:
        full = 0
    return full, end


def q_range(plan: Plan, j, bq: int, bk: int):
    """(lo, full, end) for key block j: query blocks [lo, full) need the mask, [full, end) don't."""
    end = -(-plan.t // bq)  # padded query rows past the last real block add nothing
    lo, full = 0, 0
    if plan.causal:
        # Row t sees key u iff t >= u - offset: the block's first key needs t >= j*bk - offset,
        # its last key t >= (j+1)*bk - 1 - offset.
        lo = _min(_div0(j * bk - plan.offset, bq), end)
        full = _min(_cdiv0((j + 1) * bk - 1 - plan.offset, bq), end)
    if plan.s_pad != plan.s:
        # A key block with padded keys always needs the mask; one with no real key, no work.
        # int32 on both branches: Triton's select lowering gives weak Python ints the
        # predicate's type (i1), which would turn the loop bounds into booleans.
        end32 = jnp.int32(end)
        full = jnp.where((j + 1) * bk > plan.s, end32, jnp.asarray(full, jnp.int32))
        lo = jnp.where(j * bk >= plan.s, end32, jnp.asarray(lo, jnp.int32))
    if plan.has_mask:
        full = end
    return lo, full, end
