"""The GPU (Triton) kernels: grid (query or key blocks, B, heads), a fori_loop over the other axis.

Arrays stay `[B, T, H, Dh]` (k, v `[B, S, Hkv, Dh]`); each program reads whole rows of k and v
(or q) and loops over their blocks, skipping the mask arithmetic on blocks that are entirely
visible. Grouped-query attention goes through the index maps: the forward and dq programs of
query head h read key/value head h // G; the dk/dv program of key/value head h reads the G query
heads h*G .. h*G + G - 1 and sums their contributions in its own accumulators.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from pallas_kernels._backend import dot as _dot
from pallas_kernels._triton import params as triton_params
from pallas_kernels.flash_attention.blocks import (
    finish,
    fori,
    init_carry,
    iota,
    maybe_spec,
    online_softmax_step,
    probs_and_dscores,
    visible,
)
from pallas_kernels.flash_attention.plan import Plan, kv_head, kv_range, q_range, segment_bounds


def _sweep(ranges, step, carry):
    """Run step(n, carry, masked) over blocks [lo, end): masked outside [full_lo, full_hi)."""
    lo, full_lo, full_hi, end = ranges
    carry = fori(lo, full_lo, functools.partial(step, masked=True), carry)
    carry = fori(full_lo, full_hi, functools.partial(step, masked=False), carry)
    return fori(full_hi, end, functools.partial(step, masked=True), carry)


def _bounds_at(bounds, n):
    """(lo, end) of block n from the row refs (lo, end) of `segment_bounds`; None without
    segments."""
    return None if bounds is None else (bounds[0][n], bounds[1][n])


def _key_keep(plan: Plan, rows_Q1, qseg_Q1, j, bk: int, mask_ref, kvseg_ref):
    """`visible` for key block j of whole-row refs (forward and dq programs)."""
    keys = pl.ds(pl.multiple_of(j * bk, bk), bk)
    kmask = None if mask_ref is None else mask_ref[keys][None, :]
    kvseg = None if kvseg_ref is None else kvseg_ref[keys][None, :]
    return visible(plan, rows_Q1, iota(j * bk, (1, bk), 1), kmask, qseg_Q1, kvseg)


def _gpu_fwd_kernel(
    q_ref, k_ref, v_ref, mask_ref, qseg_ref, kvseg_ref, bounds, o_ref, lse_ref, *, plan
):
    bq, bk = plan.bq, plan.bk
    i = pl.program_id(0)
    q_QDh = q_ref[...]
    rows_Q1 = iota(i * bq, (bq, 1), 0)
    qseg_Q1 = None if qseg_ref is None else qseg_ref[...][:, None]

    def step(j, carry, masked):
        keys = pl.ds(pl.multiple_of(j * bk, bk), bk)
        s_QK = _dot(q_QDh, k_ref[keys, :], (1, 1)) * plan.scale2
        keep = _key_keep(plan, rows_Q1, qseg_Q1, j, bk, mask_ref, kvseg_ref) if masked else None
        return online_softmax_step(carry, s_QK, keep, v_ref[keys, :])

    ranges = kv_range(plan, i, bq, bk, _bounds_at(bounds, i))
    carry = _sweep(ranges, step, init_carry(bq, plan.d_pad))
    out_QDh, lse_Q1 = finish(*carry)
    o_ref[...] = out_QDh.astype(o_ref.dtype)
    lse_ref[...] = lse_Q1


def _gpu_dq_kernel(
    q_ref,
    k_ref,
    v_ref,
    mask_ref,
    qseg_ref,
    kvseg_ref,
    bounds,
    do_ref,
    lse_ref,
    delta_ref,
    dq_ref,
    *,
    plan,
):
    bq, bk = plan.bq_dq, plan.bk_dq
    i = pl.program_id(0)
    q_QDh, do_QDh, lse_Q1, delta_Q1 = q_ref[...], do_ref[...], lse_ref[...], delta_ref[...]
    rows_Q1 = iota(i * bq, (bq, 1), 0)
    qseg_Q1 = None if qseg_ref is None else qseg_ref[...][:, None]

    def step(j, dq_QDh, masked):
        keys = pl.ds(pl.multiple_of(j * bk, bk), bk)
        k_KDh = k_ref[keys, :]
        keep = _key_keep(plan, rows_Q1, qseg_Q1, j, bk, mask_ref, kvseg_ref) if masked else None
        _, ds_QK = probs_and_dscores(
            q_QDh, k_KDh, v_ref[keys, :], do_QDh, lse_Q1, delta_Q1, keep, plan.scale2
        )
        return dq_QDh + _dot(ds_QK.astype(k_KDh.dtype), k_KDh, (1, 0))

    dq_QDh = jnp.zeros((bq, plan.d_pad), jnp.float32)
    dq_QDh = _sweep(kv_range(plan, i, bq, bk, _bounds_at(bounds, i)), step, dq_QDh)
    dq_ref[...] = (dq_QDh * plan.scale).astype(dq_ref.dtype)


def _gpu_dkdv_kernel(
    q_ref,
    k_ref,
    v_ref,
    mask_ref,
    qseg_ref,
    kvseg_ref,
    bounds,
    do_ref,
    lse_ref,
    delta_ref,
    dk_ref,
    dv_ref,
    *,
    plan,
):
    """dk, dv of one key block of key/value head h: q, dO `[T', G, Dh]` and lse, delta
    `[G, 1, T']` hold the G query heads of h's group, whose sums land in one accumulator.

    The layout is FlashAttention-2's backward as its Triton implementations write it (Dao,
    arXiv 2307.08691, Algorithm 2; Triton's tutorial 06 "Fused Attention",
    python/tutorials/06-fused-attention.py, `_attn_bwd_dkdv`), for these reasons:

    * A wide key block, a narrow query step (the tutorial: 128 keys, 32 queries). The program
      keeps k, v and the f32 dk, dv of its keys throughout and streams q, dO, lse, delta: the
      wide side amortises that state over many steps, the narrow step keeps the [K, Q] tiles
      and each pipeline stage's buffers small, so more stages fit (the tutorial runs 5).
    * Scores taken as s^T = k q^T, [K, Q]:
          p^T = exp2(s^T c log2 e - lse2[None, :])     dp^T = v dO^T
          ds^T = p^T * (dp^T - delta[None, :])         dv += p^T dO      dk += ds^T q
      p^T and ds^T leave their matmul in the layout the next matmul takes as its left operand.
      Formed as [Q, K] and contracted over Q (this kernel before), each of them needs a
      transpose (through shared memory) before its dot; here only q and dO enter transposed,
      as views of tiles already loaded.
    * lse and delta are [1, Q] rows (a free reshape outside), read once per query step;
      delta = rowsum(dO * O) - dlse comes from XLA before the kernel (vjp.py).
    * `q_range` never visits a query block that sees none of these keys (causal, window,
      segments), and `_sweep` runs the blocks every pair of which is visible without any mask
      arithmetic; the masked ones build `visible` as [K, Q] from transposed arguments.
    The dq kernel is the transpose: a wide query block held, narrow key steps (the tutorial:
    128 x 32), on its own tile (`plan.bq_dq` x `plan.bk_dq`). The tutorial runs both in one
    program; here they stay two calls, each with its own grid and the GQA loop above.
    """
    bq, bk = plan.bq_bwd, plan.bk_bwd
    j = pl.program_id(0)
    k_KDh, v_KDh = k_ref[...], v_ref[...]
    cols_K1 = iota(j * bk, (bk, 1), 0)
    kmask_K1 = None if mask_ref is None else mask_ref[...][:, None]
    kvseg_K1 = None if kvseg_ref is None else kvseg_ref[...][:, None]
    ranges = q_range(plan, j, bq, bk, _bounds_at(bounds, j))

    def step(i, carry, masked, g):
        dk_KDh, dv_KDh = carry
        rows = pl.ds(pl.multiple_of(i * bq, bq), bq)
        q_QDh, do_QDh = q_ref[rows, g, :], do_ref[rows, g, :]
        keep_KQ = None
        if masked:
            qseg_1Q = None if qseg_ref is None else qseg_ref[rows][None, :]
            rows_1Q = iota(i * bq, (1, bq), 1)
            keep_KQ = visible(plan, rows_1Q, cols_K1, kmask_K1, qseg_1Q, kvseg_K1)
        lse_1Q, delta_1Q = lse_ref[g, :, rows], delta_ref[g, :, rows]
        p_KQ, ds_KQ = probs_and_dscores(
            q_QDh, k_KDh, v_KDh, do_QDh, lse_1Q, delta_1Q, keep_KQ, plan.scale2, transposed=True
        )
        dv_KDh = dv_KDh + _dot(p_KQ.astype(do_QDh.dtype), do_QDh, (1, 0))
        dk_KDh = dk_KDh + _dot(ds_KQ.astype(q_QDh.dtype), q_QDh, (1, 0))
        return dk_KDh, dv_KDh

    def head(g, carry):
        return _sweep(ranges, functools.partial(step, g=g), carry)

    zeros = jnp.zeros((bk, plan.d_pad), jnp.float32)
    # One query head (G = 1) indexes statically; a group loops over its heads in the kernel.
    carry = (
        head(0, (zeros, zeros)) if plan.groups == 1 else fori(0, plan.groups, head, (zeros,) * 2)
    )
    dk_KDh, dv_KDh = carry
    dk_ref[...] = (dk_KDh * plan.scale).astype(dk_ref.dtype)
    dv_ref[...] = dv_KDh.astype(dv_ref.dtype)


def launch(plan: Plan, backward: bool) -> tuple[int, int]:
    """(num_warps, num_stages) of the forward or of the backward kernels (see `BlockSizes`)."""
    # 4 warps cover a 64-wide head; wider heads (more registers per row) want 8.
    warps = plan.num_warps or (4 if plan.d_pad <= 64 else 8)
    stages = plan.num_stages or (2 if backward else 3)
    if backward:
        return plan.num_warps_bwd or warps, plan.num_stages_bwd or stages
    return warps, stages


def _gpu_params(plan: Plan, backward: bool):
    return triton_params(*launch(plan, backward))


def _gpu_specs(plan: Plan, bq: int, bk: int):
    """BlockSpecs for a grid (blocks, B, heads); `n` is the block axis.

    q-side arrays `[B, T, H, Dh]` (`row_blk`: lse, delta `[B, H, T, 1]`; `row_group`: them as
    rows, `[B, H, 1, T]`), k-side `[B, S, Hkv, Dh]`,
    mask and key segments `[B, S]`, query segments `[B, T]`. `*_blk`/`*_all`: one block or the
    whole row of a query (or key) head; `*_group`: the G query heads of key/value head h.
    """
    dp, g = plan.d_pad, plan.groups
    return dict(
        q_blk=pl.BlockSpec((None, bq, None, dp), lambda n, b, h: (b, n, h, 0)),
        k_blk=pl.BlockSpec((None, bk, None, dp), lambda n, b, h: (b, n, h, 0)),
        q_group=pl.BlockSpec((None, plan.t_pad, g, dp), lambda n, b, h: (b, 0, h, 0)),
        k_all=pl.BlockSpec((None, plan.s_pad, None, dp), lambda n, b, h: (b, 0, kv_head(h, g), 0)),
        mask_blk=pl.BlockSpec((None, bk), lambda n, b, h: (b, n)),
        mask_all=pl.BlockSpec((None, plan.s_pad), lambda n, b, h: (b, 0)),
        qseg_blk=pl.BlockSpec((None, bq), lambda n, b, h: (b, n)),
        qseg_all=pl.BlockSpec((None, plan.t_pad), lambda n, b, h: (b, 0)),
        row_blk=pl.BlockSpec((None, None, bq, 1), lambda n, b, h: (b, h, n, 0)),
        row_group=pl.BlockSpec((None, g, 1, plan.t_pad), lambda n, b, h: (b, h, 0, 0)),
        kv_bounds=pl.BlockSpec((None, plan.t_pad // bq), lambda n, b, h: (b, 0)),
        q_bounds=pl.BlockSpec((None, plan.s_pad // bk), lambda n, b, h: (b, 0)),
    )


def _bounds(sb, sp, side: str):
    """The (lo, end) rows of `segment_bounds` `sb` for the kernels' `side` ("kv" or "q", see
    `SegmentBounds.side`) and their specs; (None, None) without segments."""
    return (None, None) if sb is None else (sb.side(side), (sp[f"{side}_bounds"],) * 2)


def forward(plan: Plan, q, k, v, kmask, qseg, kvseg):
    b, _, h, _ = q.shape
    sp = _gpu_specs(plan, plan.bq, plan.bk)
    sb = segment_bounds(plan, qseg, kvseg, plan.bq, plan.bk)
    bounds, bounds_spec = _bounds(sb, sp, "kv")
    optional = [
        maybe_spec(kmask, sp["mask_all"]),
        maybe_spec(qseg, sp["qseg_blk"]),
        maybe_spec(kvseg, sp["mask_all"]),
        bounds_spec,
    ]
    return pl.pallas_call(
        functools.partial(_gpu_fwd_kernel, plan=plan),
        out_shape=(q, jax.ShapeDtypeStruct((b, h, plan.t_pad, 1), jnp.float32)),
        grid=(plan.t_pad // plan.bq, b, h),
        in_specs=[sp["q_blk"], sp["k_all"], sp["k_all"], *optional],
        out_specs=[sp["q_blk"], sp["row_blk"]],
        compiler_params=_gpu_params(plan, backward=False),
        interpret=plan.interpret,
        name="flash_attention_fwd_gpu",
    )(q, k, v, kmask, qseg, kvseg, bounds)


def backward(plan: Plan, q, k, v, kmask, qseg, kvseg, do, lse, delta):
    """(dq, dk, dv): the dq kernel over `plan.bq_dq` x `plan.bk_dq` tiles, the dk/dv kernel
    over `plan.bq_bwd` x `plan.bk_bwd`, each with the segment bounds of its own tiles."""
    args = (plan, q, k, v, kmask, qseg, kvseg, do, lse, delta)
    return _dq(*args), *_dkdv(*args)


def _dq(plan: Plan, q, k, v, kmask, qseg, kvseg, do, lse, delta):
    b, _, h, _ = q.shape
    bq, bk = plan.bq_dq, plan.bk_dq
    sp = _gpu_specs(plan, bq, bk)
    bounds, bounds_spec = _bounds(segment_bounds(plan, qseg, kvseg, bq, bk), sp, "kv")
    return pl.pallas_call(
        functools.partial(_gpu_dq_kernel, plan=plan),
        out_shape=q,
        grid=(plan.t_pad // bq, b, h),
        in_specs=[sp["q_blk"], sp["k_all"], sp["k_all"]]
        + [maybe_spec(x, sp[n]) for x, n in ((kmask, "mask_all"), (qseg, "qseg_blk"))]
        + [maybe_spec(kvseg, sp["mask_all"]), bounds_spec]
        + [sp["q_blk"], sp["row_blk"], sp["row_blk"]],
        out_specs=sp["q_blk"],
        compiler_params=_gpu_params(plan, backward=True),
        interpret=plan.interpret,
        name="flash_attention_dq_gpu",
    )(q, k, v, kmask, qseg, kvseg, bounds, do, lse, delta)


def _dkdv(plan: Plan, q, k, v, kmask, qseg, kvseg, do, lse, delta):
    b, h_kv = q.shape[0], k.shape[2]
    bq, bk = plan.bq_bwd, plan.bk_bwd
    sp = _gpu_specs(plan, bq, bk)
    bounds, bounds_spec = _bounds(segment_bounds(plan, qseg, kvseg, bq, bk), sp, "q")
    # lse, delta [B, H, T', 1] -> rows [B, H, 1, T']: moving a unit axis copies nothing.
    rows = [jnp.swapaxes(x, 2, 3) for x in (lse, delta)]
    return pl.pallas_call(
        functools.partial(_gpu_dkdv_kernel, plan=plan),
        out_shape=(k, v),
        grid=(plan.s_pad // bk, b, h_kv),
        in_specs=[sp["q_group"], sp["k_blk"], sp["k_blk"]]
        + [maybe_spec(x, sp[n]) for x, n in ((kmask, "mask_blk"), (qseg, "qseg_all"))]
        + [maybe_spec(kvseg, sp["mask_blk"]), bounds_spec]
        + [sp["q_group"], sp["row_group"], sp["row_group"]],
        out_specs=[sp["k_blk"], sp["k_blk"]],
        compiler_params=_gpu_params(plan, backward=True),
        interpret=plan.interpret,
        name="flash_attention_dkdv_gpu",
    )(q, k, v, kmask, qseg, kvseg, bounds, do, *rows)
