"""The Pallas kernels' static plan: `BlockSizes` (the tiles asked for) and `Plan` (the tiles
and padded sizes one call runs with, shrunk to the operands and checked against each backend's
tiling rules).
"""

from __future__ import annotations

import dataclasses

from jax.experimental import pallas as pl

from lmjax.checks import require
from lmjax.errors import ConfigError
from lmjax.quant.nf4 import BLOCK
from pallas_kernels import _backend
from pallas_kernels._backend import GPU_MIN_TILE, TPU_LANES, TPU_SUBLANES, round_up


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


def check_blocks(sizes: BlockSizes, kernel: str, interpret: bool) -> None:
    """ConfigError unless `sizes` tile within `kernel`'s rules (BlockSizes' docstring)."""
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
        require(ok, f"BlockSizes.{name}", getattr(sizes, name), expected, "pick a size that fits")


@dataclasses.dataclass(frozen=True)
class Plan:
    """One call's static tiling: the kernel, the sizes before and after padding, the tiles."""

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
    return min(block, round_up(n, floor))


def make_plan(m: int, o: int, i: int, sizes: BlockSizes, kernel: str, interpret: bool) -> Plan:
    """The plan for x [m, i] @ W[o, i]^T: `sizes` shrunk to short axes, each axis padded up."""
    gpu = kernel == "gpu"
    # Shrunk TPU tiles keep the compiled tiling rules (see BlockSizes); interpreted, 8 rows do.
    tpu_m, tpu_n = (TPU_SUBLANES, TPU_SUBLANES) if interpret else (2 * TPU_SUBLANES, TPU_LANES)
    bm = _fit(sizes.block_m, m, kernel, GPU_MIN_TILE if gpu else tpu_m)
    bn = _fit(sizes.block_n, o, kernel, GPU_MIN_TILE if gpu else tpu_n)
    # A shrunk block_k stays a multiple of 64 (compiled on TPU, of 256).
    bk = (
        _fit(sizes.block_k, i, kernel, BLOCK)
        if gpu or interpret
        else min(sizes.block_k, round_up(i, 2 * TPU_LANES))
    )
    return Plan(
        kernel=kernel,
        interpret=interpret,
        m=m,
        o=o,
        i=i,
        m_pad=round_up(m, bm),
        o_pad=round_up(o, bn),
        i_pad=round_up(i, bk),
        bm=bm,
        bn=bn,
        bk=bk,
        num_warps=sizes.num_warps,
        num_stages=sizes.num_stages,
    )
