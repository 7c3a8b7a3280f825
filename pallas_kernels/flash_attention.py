"""FlashAttention-2 in Pallas: a GPU (Triton) kernel and a TPU (Mosaic) kernel, one custom VJP.

Shapes (the layout of `jax.nn.dot_product_attention`): q `[B, T, H, D]`, k and v `[B, S, H, D]`,
optional key-padding mask `[B, S]` (0/1 or bool) -> out `[B, T, H, D]` and the per-row
logsumexp `[B, H, T]` (float32).

Forward, per batch row b and head h, with c = 1/sqrt(D) (D the head dim *before* padding):

    s[t,u]    = c * q[t,:] . k[u,:]
    keep[t,u] = mask[u] and (not causal or u <= t + offset)
    over key blocks j (online softmax; f32 running max m, sum l, unnormalised output acc):
        m'  = max(m, max_{u in j, keep} s[t,u])
        p   = exp(s[t,u] - m') where keep, else 0
        l   = exp(m - m') l + sum_u p          acc = exp(m - m') acc + p v_j
    out[t] = acc / l          lse[t] = m + log l
    A row with no visible key has l = 0: out = 0 and lse = -inf (never NaN).

The forward saves only (q, k, v, mask, out, lse): O(T) memory, no [T, S] probabilities.
Dtypes: float32, bfloat16 or float16 inputs; matmul operands stay in the input dtype (p and ds
are rounded to it before their matmuls), every accumulator and softmax statistic is float32.
Float16 on the TPU kernel: Mosaic has no float16 vector loads (libtpu 0.0.42 refuses them,
"Invalid vector type for load"), so the wrapper upcasts q, k, v to float32 (exact), runs the
float32 kernel and rounds out (and dq, dk, dv) to float16; lse stays float32. Its results are
the float32 kernel's rounded once to float16, closer to exact than float16 operands would be,
at float32's VMEM and matmul cost (interpreted too, so the CPU tests check these numerics).

Backward (FlashAttention-2), given dO = dL/dout and dlse = dL/dlse (zero unless lse is used):

    delta[t] = sum_d dO[t,d] out[t,d] - dlse[t]     (d lse / d s = p, so dlse folds in here)
    p[t,u]   = exp(s[t,u] - lse[t]) where keep, else 0      (recomputed block by block)
    dv = p^T dO      dp = dO v^T      ds = p * (dp - delta)
    dq = c ds k      dk = c ds^T q
  One kernel accumulates dk, dv over query blocks; another accumulates dq over key blocks.

Causal block skipping: query block i only visits key blocks that hold a key u <= t + offset for
some row t of the block; the dk/dv kernel likewise starts at the first query block that sees its
keys. Blocks that are entirely visible skip the mask arithmetic (GPU kernel).

Padding (done in the wrapper, undone on the way out, so callers never see it):
  * T is padded to a multiple of the query blocks, S to a multiple of the key blocks. Padded keys
    are masked; padded query rows are computed and dropped (their dO is 0, so they add nothing
    to dk, dv).
  * D is zero-padded (zero columns change no score and give zero output columns):
    GPU kernel to the next power of two >= 16 (Triton tiles are powers of two, `tl.dot` needs
    >= 16); TPU kernel to a multiple of 128 (the vector lane width).
  * A block larger than its (rounded-up) sequence shrinks to it, so short inputs are not padded
    up to a full default block.

Backends: `backend="gpu"` (grid (query blocks, B, H), fori_loop over key blocks in the kernel)
or `backend="tpu"` (grid (B, H, query blocks, key blocks), key axis sequential, VMEM scratch
accumulators). `backend=None` follows the platform compiled for (`jax.default_device`'s, e.g. a
compile-only TPU device on a CPU host, else `jax.default_backend()`); on CPU it runs the GPU
kernel (`CPU_KERNEL`) in interpret mode. Both kernels run interpreted on CPU (`interpret=True`).
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
from lmjax.ops._common import check_keep_values
from lmjax.ops.attention import attention_reference as _ops_attention_reference
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
from pallas_kernels._backend import require_positive_int as _require_positive_int
from pallas_kernels._backend import round_up as _round_up

INPUT_DTYPES = (jnp.float32, jnp.bfloat16, jnp.float16)
# Input dtypes the TPU kernel runs in another dtype (module docstring: Mosaic loads no float16).
_TPU_COMPUTE_DTYPE = {jnp.dtype(jnp.float16): jnp.dtype(jnp.float32)}
# Masked scores before the max: finite, so `m - m_new` never forms inf - inf.
_MASKED = -1e30
_LOG2E = math.log2(math.e)


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
        for name in ("block_q", "block_k", "block_q_bwd", "block_k_bwd"):
            _require_positive_int(getattr(self, name), f"BlockSizes.{name}")
        for name in ("num_warps", "num_stages"):
            if getattr(self, name) is not None:
                _require_positive_int(getattr(self, name), f"BlockSizes.{name}")

    @classmethod
    def default(cls, kernel: str) -> BlockSizes:
        """Defaults per kernel: TPU tiles are (8, 128)-aligned, so its key blocks are 128."""
        return cls() if kernel == "gpu" else cls(128, 128, 128, 128)

    @property
    def blocks(self) -> dict[str, int]:
        return {n: getattr(self, n) for n in ("block_q", "block_k", "block_q_bwd", "block_k_bwd")}


def _check_blocks(sizes: BlockSizes, kernel: str, interpret: bool) -> None:
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


# ---- the static plan: every size a kernel needs, fixed at trace time -----------------------


@dataclasses.dataclass(frozen=True)
class _Plan:
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
        return self.scale * _LOG2E

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


def _make_plan(q_shape, k_shape, sizes, kernel, interpret, causal, offset, has_mask) -> _Plan:
    (_, t, _, d), s = q_shape, k_shape[1]
    bq, bq_bwd = _fit(sizes.block_q, sizes.block_q_bwd, t, kernel)
    bk, bk_bwd = _fit(sizes.block_k, sizes.block_k_bwd, s, kernel)
    return _Plan(
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


# ---- block ranges (causal skipping); arguments may be traced program ids ---------------------


def _div0(x, d: int):
    """floor(max(x, 0) / d) for an int or a traced int32 (lax.div truncates, so clamp first)."""
    return max(x, 0) // d if isinstance(x, int) else lax.div(jnp.maximum(x, 0), d)


def _cdiv0(x, d: int):
    return _div0(x + d - 1, d)


def _min(a, b):
    return min(a, b) if isinstance(a, int) and isinstance(b, int) else jnp.minimum(a, b)


def _kv_range(plan: _Plan, i, bq: int, bk: int):
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


def _q_range(plan: _Plan, j, bq: int, bk: int):
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


def _fori(lo, hi, body, carry):
    """fori_loop that emits nothing when the range is statically empty."""
    if isinstance(lo, int) and isinstance(hi, int) and lo >= hi:
        return carry
    return lax.fori_loop(lo, hi, body, carry)


# ---- the block math both kernels share -------------------------------------------------------


def _keep(plan: _Plan, rows_Q1, cols_1K, kmask_1K):
    """bool [Q, K] (or [1, K]): key u visible to query t. None when nothing is masked."""
    keep = None
    if kmask_1K is not None:
        keep = kmask_1K != 0  # padded keys carry 0 in the mask already
    elif plan.s_pad != plan.s:
        keep = cols_1K < plan.s
    if plan.causal:
        causal = cols_1K <= rows_Q1 + plan.offset
        keep = causal if keep is None else keep & causal
    return keep


def _iota(start, shape, axis):
    return start + lax.broadcasted_iota(jnp.int32, shape, axis)


def _online_softmax_step(carry, s_QK, keep, v_KD):
    """Fold one key block into (acc [Q, D], m [Q, 1], l [Q, 1])."""
    acc_QD, m_Q1, l_Q1 = carry
    if keep is not None:
        s_QK = jnp.where(keep, s_QK, _MASKED)
    m_new = jnp.maximum(m_Q1, jnp.max(s_QK, axis=1, keepdims=True))
    p_QK = jnp.exp2(s_QK - m_new)
    if keep is not None:
        p_QK = jnp.where(keep, p_QK, 0.0)  # a row with nothing kept yet must stay at l = 0
    alpha = jnp.exp2(m_Q1 - m_new)
    l_new = alpha * l_Q1 + jnp.sum(p_QK, axis=1, keepdims=True)
    acc_QD = alpha * acc_QD + _dot(p_QK.astype(v_KD.dtype), v_KD, (1, 0))
    return acc_QD, m_new, l_new


def _init_carry(bq: int, d: int):
    return (
        jnp.zeros((bq, d), jnp.float32),
        jnp.full((bq, 1), _MASKED, jnp.float32),
        jnp.zeros((bq, 1), jnp.float32),
    )


def _finish(acc_QD, m_Q1, l_Q1):
    """out = acc / l and the natural-log lse = (m + log2 l) ln 2 (m, l are base 2).

    A row that saw no key gives out 0, lse -inf."""
    seen = l_Q1 > 0
    l_safe = jnp.where(seen, l_Q1, 1.0)
    lse = (m_Q1 + jnp.log2(l_safe)) * (1.0 / _LOG2E)
    return acc_QD / l_safe, jnp.where(seen, lse, -jnp.inf)


def _probs_and_dscores(q_QD, k_KD, v_KD, do_QD, lse2_Q1, delta_Q1, keep, scale2):
    """Recompute p from the saved (base-2) logsumexp; ds = p * (dO v^T - delta), [Q, K] f32."""
    p_QK = jnp.exp2(_dot(q_QD, k_KD, (1, 1)) * scale2 - lse2_Q1)
    if keep is not None:
        p_QK = jnp.where(keep, p_QK, 0.0)
    dp_QK = _dot(do_QD, v_KD, (1, 1))
    return p_QK, p_QK * (dp_QK - delta_Q1)


# ---- GPU (Triton) kernels: grid over (query or key blocks, B, H), loops inside ----------------


def _gpu_fwd_kernel(q_ref, k_ref, v_ref, mask_ref, o_ref, lse_ref, *, plan: _Plan):
    bq, bk = plan.bq, plan.bk
    i = pl.program_id(0)
    q_QD = q_ref[...]
    rows_Q1 = _iota(i * bq, (bq, 1), 0)

    def step(j, carry, masked):
        keys = pl.ds(pl.multiple_of(j * bk, bk), bk)
        s_QK = _dot(q_QD, k_ref[keys, :], (1, 1)) * plan.scale2
        keep = None
        if masked:
            kmask = None if mask_ref is None else mask_ref[keys][None, :]
            keep = _keep(plan, rows_Q1, _iota(j * bk, (1, bk), 1), kmask)
        return _online_softmax_step(carry, s_QK, keep, v_ref[keys, :])

    full, end = _kv_range(plan, i, bq, bk)
    carry = _fori(0, full, functools.partial(step, masked=False), _init_carry(bq, plan.d_pad))
    carry = _fori(full, end, functools.partial(step, masked=True), carry)
    out_QD, lse_Q1 = _finish(*carry)
    o_ref[...] = out_QD.astype(o_ref.dtype)
    lse_ref[...] = lse_Q1


def _gpu_dq_kernel(q_ref, k_ref, v_ref, mask_ref, do_ref, lse_ref, delta_ref, dq_ref, *, plan):
    bq, bk = plan.bq_bwd, plan.bk_bwd
    i = pl.program_id(0)
    q_QD, do_QD, lse_Q1, delta_Q1 = q_ref[...], do_ref[...], lse_ref[...], delta_ref[...]
    rows_Q1 = _iota(i * bq, (bq, 1), 0)

    def step(j, dq_QD, masked):
        keys = pl.ds(pl.multiple_of(j * bk, bk), bk)
        k_KD = k_ref[keys, :]
        keep = None
        if masked:
            kmask = None if mask_ref is None else mask_ref[keys][None, :]
            keep = _keep(plan, rows_Q1, _iota(j * bk, (1, bk), 1), kmask)
        _, ds_QK = _probs_and_dscores(
            q_QD, k_KD, v_ref[keys, :], do_QD, lse_Q1, delta_Q1, keep, plan.scale2
        )
        return dq_QD + _dot(ds_QK.astype(k_KD.dtype), k_KD, (1, 0))

    full, end = _kv_range(plan, i, bq, bk)
    dq_QD = jnp.zeros((bq, plan.d_pad), jnp.float32)
    dq_QD = _fori(0, full, functools.partial(step, masked=False), dq_QD)
    dq_QD = _fori(full, end, functools.partial(step, masked=True), dq_QD)
    dq_ref[...] = (dq_QD * plan.scale).astype(dq_ref.dtype)


def _gpu_dkdv_kernel(
    q_ref, k_ref, v_ref, mask_ref, do_ref, lse_ref, delta_ref, dk_ref, dv_ref, *, plan
):
    bq, bk = plan.bq_bwd, plan.bk_bwd
    j = pl.program_id(0)
    k_KD, v_KD = k_ref[...], v_ref[...]
    cols_1K = _iota(j * bk, (1, bk), 1)
    kmask = None if mask_ref is None else mask_ref[...][None, :]

    def step(i, carry, masked):
        dk_KD, dv_KD = carry
        rows = pl.ds(pl.multiple_of(i * bq, bq), bq)
        q_QD, do_QD = q_ref[rows, :], do_ref[rows, :]
        keep = _keep(plan, _iota(i * bq, (bq, 1), 0), cols_1K, kmask) if masked else None
        p_QK, ds_QK = _probs_and_dscores(
            q_QD, k_KD, v_KD, do_QD, lse_ref[rows, :], delta_ref[rows, :], keep, plan.scale2
        )
        dv_KD = dv_KD + _dot(p_QK.astype(do_QD.dtype), do_QD, (0, 0))
        dk_KD = dk_KD + _dot(ds_QK.astype(q_QD.dtype), q_QD, (0, 0))
        return dk_KD, dv_KD

    lo, full, end = _q_range(plan, j, bq, bk)
    zeros = jnp.zeros((bk, plan.d_pad), jnp.float32)
    carry = _fori(lo, full, functools.partial(step, masked=True), (zeros, zeros))
    dk_KD, dv_KD = _fori(full, end, functools.partial(step, masked=False), carry)
    dk_ref[...] = (dk_KD * plan.scale).astype(dk_ref.dtype)
    dv_ref[...] = dv_KD.astype(dv_ref.dtype)


def _maybe(kmask, spec):
    """The mask's BlockSpec, or None when there is no mask (the kernel then gets None)."""
    return None if kmask is None else spec


def _gpu_params(plan: _Plan, backward: bool):
    # 4 warps cover a 64-wide head; wider heads (more registers per row) want 8.
    warps = plan.num_warps or (4 if plan.d_pad <= 64 else 8)
    return pltriton.CompilerParams(
        num_warps=warps, num_stages=plan.num_stages or (2 if backward else 3)
    )


def _gpu_specs(plan: _Plan, bq: int, bk: int):
    """BlockSpecs on [B, T, H, D] arrays for a grid (blocks, B, H); `row` is the block axis."""
    dp = plan.d_pad
    return dict(
        q_blk=pl.BlockSpec((None, bq, None, dp), lambda n, b, h: (b, n, h, 0)),
        k_blk=pl.BlockSpec((None, bk, None, dp), lambda n, b, h: (b, n, h, 0)),
        q_all=pl.BlockSpec((None, plan.t_pad, None, dp), lambda n, b, h: (b, 0, h, 0)),
        k_all=pl.BlockSpec((None, plan.s_pad, None, dp), lambda n, b, h: (b, 0, h, 0)),
        mask_blk=pl.BlockSpec((None, bk), lambda n, b, h: (b, n)),
        mask_all=pl.BlockSpec((None, plan.s_pad), lambda n, b, h: (b, 0)),
        row_blk=pl.BlockSpec((None, None, bq, 1), lambda n, b, h: (b, h, n, 0)),
        row_all=pl.BlockSpec((None, None, plan.t_pad, 1), lambda n, b, h: (b, h, 0, 0)),
    )


def _gpu_forward(plan: _Plan, q, k, v, kmask):
    b, _, h, _ = q.shape
    sp = _gpu_specs(plan, plan.bq, plan.bk)
    return pl.pallas_call(
        functools.partial(_gpu_fwd_kernel, plan=plan),
        out_shape=(q, jax.ShapeDtypeStruct((b, h, plan.t_pad, 1), jnp.float32)),
        grid=(plan.t_pad // plan.bq, b, h),
        in_specs=[sp["q_blk"], sp["k_all"], sp["k_all"], _maybe(kmask, sp["mask_all"])],
        out_specs=[sp["q_blk"], sp["row_blk"]],
        compiler_params=_gpu_params(plan, backward=False),
        interpret=plan.interpret,
        name="flash_attention_fwd_gpu",
    )(q, k, v, kmask)


def _gpu_backward(plan: _Plan, q, k, v, kmask, do, lse, delta):
    b, _, h, _ = q.shape
    bq, bk = plan.bq_bwd, plan.bk_bwd
    sp = _gpu_specs(plan, bq, bk)
    mask_all, mask_blk = (None, None) if kmask is None else (sp["mask_all"], sp["mask_blk"])
    dq = pl.pallas_call(
        functools.partial(_gpu_dq_kernel, plan=plan),
        out_shape=q,
        grid=(plan.t_pad // bq, b, h),
        in_specs=[sp["q_blk"], sp["k_all"], sp["k_all"], mask_all]
        + [sp["q_blk"], sp["row_blk"], sp["row_blk"]],
        out_specs=sp["q_blk"],
        compiler_params=_gpu_params(plan, backward=True),
        interpret=plan.interpret,
        name="flash_attention_dq_gpu",
    )(q, k, v, kmask, do, lse, delta)
    dk, dv = pl.pallas_call(
        functools.partial(_gpu_dkdv_kernel, plan=plan),
        out_shape=(k, v),
        grid=(plan.s_pad // bk, b, h),
        in_specs=[sp["q_all"], sp["k_blk"], sp["k_blk"], mask_blk]
        + [sp["q_all"], sp["row_all"], sp["row_all"]],
        out_specs=[sp["k_blk"], sp["k_blk"]],
        compiler_params=_gpu_params(plan, backward=True),
        interpret=plan.interpret,
        name="flash_attention_dkdv_gpu",
    )(q, k, v, kmask, do, lse, delta)
    return dq, dk, dv


# ---- TPU (Mosaic) kernels: grid (B, H, outer blocks, inner blocks), inner axis sequential ----


def _tpu_fwd_kernel(q_ref, k_ref, v_ref, mask_ref, o_ref, lse_ref, acc, m, l, *, plan):
    bq, bk = plan.bq, plan.bk
    i, j = pl.program_id(2), pl.program_id(3)

    @pl.when(j == 0)
    def _init():
        acc[...], m[...], l[...] = _init_carry(bq, plan.d_pad)

    @pl.when(j < _kv_range(plan, i, bq, bk)[1])  # causal skipping: blocks past the diagonal
    def _step():
        s_QK = _dot(q_ref[...], k_ref[...], (1, 1)) * plan.scale2
        keep = None
        if plan.needs_mask:
            kmask = None if mask_ref is None else mask_ref[...]
            keep = _keep(plan, _iota(i * bq, (bq, 1), 0), _iota(j * bk, (1, bk), 1), kmask)
        acc[...], m[...], l[...] = _online_softmax_step(
            (acc[...], m[...], l[...]), s_QK, keep, v_ref[...]
        )

    @pl.when(j == pl.num_programs(3) - 1)
    def _done():
        out_QD, lse_Q1 = _finish(acc[...], m[...], l[...])
        o_ref[...] = out_QD.astype(o_ref.dtype)
        lse_ref[...] = lse_Q1


def _tpu_dq_kernel(q_ref, k_ref, v_ref, mask_ref, do_ref, lse_ref, delta_ref, dq_ref, dq, *, plan):
    bq, bk = plan.bq_bwd, plan.bk_bwd
    i, j = pl.program_id(2), pl.program_id(3)

    @pl.when(j == 0)
    def _init():
        dq[...] = jnp.zeros(dq.shape, jnp.float32)

    @pl.when(j < _kv_range(plan, i, bq, bk)[1])
    def _step():
        keep = None
        if plan.needs_mask:
            kmask = None if mask_ref is None else mask_ref[...]
            keep = _keep(plan, _iota(i * bq, (bq, 1), 0), _iota(j * bk, (1, bk), 1), kmask)
        k_KD = k_ref[...]
        rows = (q_ref[...], k_KD, v_ref[...], do_ref[...], lse_ref[...], delta_ref[...])
        _, ds_QK = _probs_and_dscores(*rows, keep, plan.scale2)
        dq[...] += _dot(ds_QK.astype(k_KD.dtype), k_KD, (1, 0))

    @pl.when(j == pl.num_programs(3) - 1)
    def _done():
        dq_ref[...] = (dq[...] * plan.scale).astype(dq_ref.dtype)


def _tpu_dkdv_kernel(
    q_ref, k_ref, v_ref, mask_ref, do_ref, lse_ref, delta_ref, dk_ref, dv_ref, dk, dv, *, plan
):
    bq, bk = plan.bq_bwd, plan.bk_bwd
    j, i = pl.program_id(2), pl.program_id(3)

    @pl.when(i == 0)
    def _init():
        dk[...] = jnp.zeros(dk.shape, jnp.float32)
        dv[...] = jnp.zeros(dv.shape, jnp.float32)

    lo, _, end = _q_range(plan, j, bq, bk)

    @pl.when((i >= lo) & (i < end))
    def _step():
        keep = None
        if plan.needs_mask:
            kmask = None if mask_ref is None else mask_ref[...]
            keep = _keep(plan, _iota(i * bq, (bq, 1), 0), _iota(j * bk, (1, bk), 1), kmask)
        q_QD, do_QD = q_ref[...], do_ref[...]
        p_QK, ds_QK = _probs_and_dscores(
            q_QD, k_ref[...], v_ref[...], do_QD, lse_ref[...], delta_ref[...], keep, plan.scale2
        )
        dv[...] += _dot(p_QK.astype(do_QD.dtype), do_QD, (0, 0))
        dk[...] += _dot(ds_QK.astype(q_QD.dtype), q_QD, (0, 0))

    @pl.when(i == pl.num_programs(3) - 1)
    def _done():
        dk_ref[...] = (dk[...] * plan.scale).astype(dk_ref.dtype)
        dv_ref[...] = dv[...].astype(dv_ref.dtype)


_TPU_SEMANTICS = pltpu.CompilerParams(
    dimension_semantics=("parallel", "parallel", "parallel", "arbitrary")
)


def _tpu_specs(plan: _Plan, bq: int, bk: int, q_outer: bool):
    """BlockSpecs on [B, H, T, D] arrays for grid (B, H, outer, inner).

    The visited-but-skipped inner steps map to the nearest block that is computed, so the
    pipeline does not fetch blocks that causal skipping never reads.
    """
    dp = plan.d_pad

    def q_index(b, h, outer, inner):
        if q_outer:
            return outer
        lo, _, end = _q_range(plan, outer, bq, bk)
        return jnp.clip(inner, lo, jnp.maximum(end - 1, 0))

    def k_index(b, h, outer, inner):
        if not q_outer:
            return outer
        end = _kv_range(plan, outer, bq, bk)[1]
        return jnp.clip(inner, 0, jnp.maximum(end - 1, 0))

    return dict(
        q=pl.BlockSpec((None, None, bq, dp), lambda b, h, o, n: (b, h, q_index(b, h, o, n), 0)),
        k=pl.BlockSpec((None, None, bk, dp), lambda b, h, o, n: (b, h, k_index(b, h, o, n), 0)),
        mask=pl.BlockSpec((None, 1, bk), lambda b, h, o, n: (b, 0, k_index(b, h, o, n))),
        row=pl.BlockSpec((None, None, bq, 1), lambda b, h, o, n: (b, h, q_index(b, h, o, n), 0)),
    )


def _tpu_bwd_in_specs(sp, kmask):
    """(q, k, v, mask, dO, lse, delta), in the order the backward kernels take them."""
    return [sp["q"], sp["k"], sp["k"], _maybe(kmask, sp["mask"]), sp["q"], sp["row"], sp["row"]]


def _to_bhtd(x):
    return x.transpose(0, 2, 1, 3)


def _tpu_forward(plan: _Plan, q, k, v, kmask):
    # Mosaic tiles the last two dims (8 x 128): heads move out of the way, [B,T,H,D] -> [B,H,T,D].
    q, k, v = _to_bhtd(q), _to_bhtd(k), _to_bhtd(v)
    b, h, _, dp = q.shape
    sp = _tpu_specs(plan, plan.bq, plan.bk, q_outer=True)
    out, lse = pl.pallas_call(
        functools.partial(_tpu_fwd_kernel, plan=plan),
        out_shape=(q, jax.ShapeDtypeStruct((b, h, plan.t_pad, 1), jnp.float32)),
        grid=(b, h, plan.t_pad // plan.bq, plan.s_pad // plan.bk),
        in_specs=[sp["q"], sp["k"], sp["k"], _maybe(kmask, sp["mask"])],
        out_specs=[sp["q"], sp["row"]],
        scratch_shapes=[
            pltpu.VMEM((plan.bq, dp), jnp.float32),
            pltpu.VMEM((plan.bq, 1), jnp.float32),
            pltpu.VMEM((plan.bq, 1), jnp.float32),
        ],
        compiler_params=_TPU_SEMANTICS,
        interpret=plan.interpret,
        name="flash_attention_fwd_tpu",
    )(q, k, v, None if kmask is None else kmask[:, None, :])
    return _to_bhtd(out), lse


def _tpu_backward(plan: _Plan, q, k, v, kmask, do, lse, delta):
    q, k, v, do = _to_bhtd(q), _to_bhtd(k), _to_bhtd(v), _to_bhtd(do)
    b, h, _, dp = q.shape
    bq, bk = plan.bq_bwd, plan.bk_bwd
    nq, nk = plan.t_pad // bq, plan.s_pad // bk
    kmask = None if kmask is None else kmask[:, None, :]
    sp = _tpu_specs(plan, bq, bk, q_outer=True)
    dq = pl.pallas_call(
        functools.partial(_tpu_dq_kernel, plan=plan),
        out_shape=q,
        grid=(b, h, nq, nk),
        in_specs=_tpu_bwd_in_specs(sp, kmask),
        out_specs=sp["q"],
        scratch_shapes=[pltpu.VMEM((bq, dp), jnp.float32)],
        compiler_params=_TPU_SEMANTICS,
        interpret=plan.interpret,
        name="flash_attention_dq_tpu",
    )(q, k, v, kmask, do, lse, delta)
    sp = _tpu_specs(plan, bq, bk, q_outer=False)
    dk, dv = pl.pallas_call(
        functools.partial(_tpu_dkdv_kernel, plan=plan),
        out_shape=(k, v),
        grid=(b, h, nk, nq),
        in_specs=_tpu_bwd_in_specs(sp, kmask),
        out_specs=[sp["k"], sp["k"]],
        scratch_shapes=[pltpu.VMEM((bk, dp), jnp.float32), pltpu.VMEM((bk, dp), jnp.float32)],
        compiler_params=_TPU_SEMANTICS,
        interpret=plan.interpret,
        name="flash_attention_dkdv_tpu",
    )(q, k, v, kmask, do, lse, delta)
    return _to_bhtd(dq), _to_bhtd(dk), _to_bhtd(dv)


# ---- custom VJP over padded inputs -------------------------------------------------------------


def _forward(plan: _Plan, q, k, v, kmask):
    """Padded [B,T',H,D'] inputs -> (out [B,T',H,D'], lse [B,H,T',1] f32)."""
    run = _gpu_forward if plan.kernel == "gpu" else _tpu_forward
    return run(plan, q, k, v, kmask)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _flash(plan: _Plan, q, k, v, kmask):
    return _forward(plan, q, k, v, kmask)


def _flash_fwd(plan: _Plan, q, k, v, kmask):
    out, lse = _forward(plan, q, k, v, kmask)
    return (out, lse), (q, k, v, kmask, out, lse)


def _flash_bwd(plan: _Plan, res, cotangents):
    q, k, v, kmask, out, lse = res
    do, dlse = cotangents
    out_f32, do_f32 = out.astype(jnp.float32), do.astype(jnp.float32)
    delta = jnp.einsum("BTHD,BTHD->BHT", out_f32, do_f32)[..., None] - dlse
    # The kernels recompute p = exp2(s log2e - lse log2e). A row that saw no key gets
    # lse = +inf there, so its p is exactly 0 in every block: the mask already zeroes it in the
    # blocks such a row meets, this keeps it zero should an unmasked block ever meet one.
    lse2 = jnp.where(jnp.isneginf(lse), jnp.inf, lse * _LOG2E)
    run = _gpu_backward if plan.kernel == "gpu" else _tpu_backward
    dq, dk, dv = run(plan, q, k, v, kmask, do.astype(q.dtype), lse2, delta)
    return dq, dk, dv, None


_flash.defvjp(_flash_fwd, _flash_bwd)


def _pad_bthd(x, n: int, d: int):
    """Zero-pad [B, T, H, D] to [B, n, H, d]."""
    return jnp.pad(x, ((0, 0), (0, n - x.shape[1]), (0, 0), (0, d - x.shape[3])))


@functools.partial(jax.jit, static_argnums=(0,))
def _flash_padded(plan: _Plan, q, k, v, kmask):
    """Pad to the plan, run the custom VJP, crop: (out [B,T,H,D], lse [B,H,T])."""
    q_p, k_p, v_p = (
        _pad_bthd(x, n, plan.d_pad) for x, n in ((q, plan.t_pad), (k, plan.s_pad), (v, plan.s_pad))
    )
    if kmask is not None:
        kmask = jnp.pad(kmask, ((0, 0), (0, plan.s_pad - plan.s)))  # padded keys: masked
    out, lse = _flash(plan, q_p, k_p, v_p, kmask)
    return out[:, : plan.t, :, : plan.d], lse[:, :, : plan.t, 0]


# ---- public API --------------------------------------------------------------------------------


def resolve_backend(backend: str | None, interpret: bool | None) -> tuple[str, bool]:
    """(kernel, interpret) for the arguments of `flash_attention` on this host.

    None follows `jax.default_backend()`: "gpu" and "tpu" compile their own kernel; "cpu" runs
    `CPU_KERNEL` interpreted. Any other name, or a platform with no kernel, is a ConfigError.
    """
    return _backend.resolve_backend(
        backend,
        interpret,
        what="flash attention backend",
        fix="pass backend='gpu' or backend='tpu', or use lmjax.ops.attention(impl='xla')",
    )


def _check_inputs(q, k, v, mask, offset) -> None:
    for name, a in (("q", q), ("k", k), ("v", v)):
        if a.ndim != 4:
            raise ShapeError.describe(
                f"{name}.shape", a.shape, "rank 4 ([batch, time, heads, d_head])", "reshape it"
            )
        if a.dtype not in INPUT_DTYPES or a.dtype != q.dtype:
            raise ShapeError.describe(
                f"{name}.dtype",
                str(a.dtype),
                f"q's dtype, one of float32, bfloat16, float16 (q is {q.dtype})",
                "cast q, k, v to one of them (the kernel accumulates in float32)",
            )
        if 0 in a.shape:
            raise ShapeError.describe(f"{name}.shape", a.shape, "no zero-size axis", "drop it")
    b, _, h, d = q.shape
    if k.shape != v.shape or (k.shape[0], k.shape[2], k.shape[3]) != (b, h, d):
        raise ShapeError.describe(
            "(k.shape, v.shape)",
            (k.shape, v.shape),
            f"both [{b}, S, {h}, {d}] to match q.shape {q.shape}",
            "give q, k and v the same batch, heads and head size",
        )
    if mask is not None and np.shape(mask) != (b, k.shape[1]):
        raise ShapeError.describe(
            "mask.shape", np.shape(mask), f"({b}, {k.shape[1]}) = [B, S] key padding", "reshape it"
        )
    check_keep_values(mask)
    if not isinstance(offset, int | np.integer) or isinstance(offset, bool):
        raise ConfigError.describe(
            "offset",
            offset,
            "a static Python int (it fixes which blocks are skipped at trace time)",
            "pass an int, or use lmjax.ops.attention(impl='materialized') for a traced offset",
        )


def flash_attention_with_lse(
    q,
    k,
    v,
    *,
    causal: bool,
    mask=None,
    offset: int = 0,
    block_sizes: BlockSizes | None = None,
    backend: str | None = None,
    interpret: bool | None = None,
):
    """(out [B, T, H, D], lse [B, H, T] f32); both differentiable. See the module docstring.

    `mask` is a `[B, S]` key-padding mask, bool or 0/1 (1 keeps the key), as in
    `lmjax.ops.attention`: a concrete mask with any other value is a `ShapeError` (an additive
    mask converts with `keep = additive == 0`); a traced one is read as "nonzero keeps", so
    under jit pass a bool mask. Causal: key u is visible to query t iff u <= t + offset
    (`offset` a static int; a cache of S keys decoding T new queries uses offset = S - T, which
    is negative when T > S: the first rows then see no key). Rows with no visible key: out 0,
    lse -inf, and exactly zero gradients (dq of the row, its share of dk and dv).
    """
    q, k, v = jnp.asarray(q), jnp.asarray(k), jnp.asarray(v)
    _check_inputs(q, k, v, mask, offset)
    kernel, interpret = resolve_backend(backend, interpret)
    sizes = _backend.block_sizes_or_default(block_sizes, BlockSizes, kernel)
    _check_blocks(sizes, kernel, interpret)
    _require_platform(kernel, interpret)
    plan = _make_plan(
        q.shape, k.shape, sizes, kernel, interpret, bool(causal), int(offset), mask is not None
    )
    kmask = None if mask is None else (jnp.asarray(mask) != 0).astype(jnp.int32)
    compute = _compute_dtype(kernel, q.dtype)
    q_c, k_c, v_c = (x.astype(compute) for x in (q, k, v))  # no-ops unless float16 on TPU
    out, lse = _flash_padded(plan, q_c, k_c, v_c, kmask)
    return out.astype(q.dtype), lse


def _compute_dtype(kernel: str, dtype) -> jnp.dtype:
    """The dtype `kernel` computes inputs of `dtype` in: float16 on the TPU kernel runs as
    float32 (module docstring); everything else as itself."""
    dtype = jnp.dtype(dtype)
    return _TPU_COMPUTE_DTYPE.get(dtype, dtype) if kernel == "tpu" else dtype


def flash_attention(
    q,
    k,
    v,
    *,
    causal: bool,
    mask=None,
    offset: int = 0,
    block_sizes: BlockSizes | None = None,
    backend: str | None = None,
    interpret: bool | None = None,
):
    """FlashAttention-2: `out [B, T, H, D]` (the arguments as in `flash_attention_with_lse`)."""
    out, _ = flash_attention_with_lse(
        q,
        k,
        v,
        causal=causal,
        mask=mask,
        offset=offset,
        block_sizes=block_sizes,
        backend=backend,
        interpret=interpret,
    )
    return out


def attention_reference(q, k, v, *, causal: bool, mask=None, offset: int = 0, return_lse=False):
    """The kernel's contract in plain jnp (float32 math), differentiated by jax.grad: out, and
    lse [B, H, T] if asked. `lmjax.ops.attention_reference` with the [B, S] key-padding mask
    broadcast over heads and queries; rows with no visible key: out 0, lse -inf.
    """
    check_keep_values(mask)
    key_mask = None if mask is None else jnp.asarray(mask)[:, None, None, :]
    return _ops_attention_reference(
        q, k, v, causal=causal, offset=offset, mask=key_mask, return_lse=return_lse
    )


__all__ = [
    "BlockSizes",
    "CPU_KERNEL",
    "KERNELS",
    "attention_reference",
    "flash_attention",
    "flash_attention_with_lse",
    "resolve_backend",
]
