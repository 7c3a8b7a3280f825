"""The GPU (Triton) kernels: grid (query or key blocks, B, H), a fori_loop over the other axis.

Arrays stay `[B, T, H, Dh]`; each program reads whole rows of k and v (or q) and loops over
their blocks, skipping the mask arithmetic on blocks that are entirely visible.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton

from pallas_kernels._backend import dot as _dot
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
from pallas_kernels.flash_attention.plan import Plan, kv_range, q_range


def _gpu_fwd_kernel(q_ref, k_ref, v_ref, mask_ref, o_ref, lse_ref, *, plan: Plan):
    bq, bk = plan.bq, plan.bk
    i = pl.program_id(0)
    q_QDh = q_ref[...]
    rows_Q1 = iota(i * bq, (bq, 1), 0)

    def step(j, carry, masked):
        keys = pl.ds(pl.multiple_of(j * bk, bk), bk)
        s_QK = _dot(q_QDh, k_ref[keys, :], (1, 1)) * plan.scale2
        keep = None
        if masked:
            kmask = None if mask_ref is None else mask_ref[keys][None, :]
            keep = visible(plan, rows_Q1, iota(j * bk, (1, bk), 1), kmask)
        return online_softmax_step(carry, s_QK, keep, v_ref[keys, :])

    full, end = kv_range(plan, i, bq, bk)
    carry = fori(0, full, functools.partial(step, masked=False), init_carry(bq, plan.d_pad))
    carry = fori(full, end, functools.partial(step, masked=True), carry)
    out_QDh, lse_Q1 = finish(*carry)
    o_ref[...] = out_QDh.astype(o_ref.dtype)
    lse_ref[...] = lse_Q1


def _gpu_dq_kernel(q_ref, k_ref, v_ref, mask_ref, do_ref, lse_ref, delta_ref, dq_ref, *, plan):
    bq, bk = plan.bq_bwd, plan.bk_bwd
    i = pl.program_id(0)
    q_QDh, do_QDh, lse_Q1, delta_Q1 = q_ref[...], do_ref[...], lse_ref[...], delta_ref[...]
    rows_Q1 = iota(i * bq, (bq, 1), 0)

    def step(j, dq_QDh, masked):
        keys = pl.ds(pl.multiple_of(j * bk, bk), bk)
        k_KDh = k_ref[keys, :]
        keep = None
        if masked:
            kmask = None if mask_ref is None else mask_ref[keys][None, :]
            keep = visible(plan, rows_Q1, iota(j * bk, (1, bk), 1), kmask)
        _, ds_QK = probs_and_dscores(
            q_QDh, k_KDh, v_ref[keys, :], do_QDh, lse_Q1, delta_Q1, keep, plan.scale2
        )
        return dq_QDh + _dot(ds_QK.astype(k_KDh.dtype), k_KDh, (1, 0))

    full, end = kv_range(plan, i, bq, bk)
    dq_QDh = jnp.zeros((bq, plan.d_pad), jnp.float32)
    dq_QDh = fori(0, full, functools.partial(step, masked=False), dq_QDh)
    dq_QDh = fori(full, end, functools.partial(step, masked=True), dq_QDh)
    dq_ref[...] = (dq_QDh * plan.scale).astype(dq_ref.dtype)


def _gpu_dkdv_kernel(
    q_ref, k_ref, v_ref, mask_ref, do_ref, lse_ref, delta_ref, dk_ref, dv_ref, *, plan
):
    bq, bk = plan.bq_bwd, plan.bk_bwd
    j = pl.program_id(0)
    k_KDh, v_KDh = k_ref[...], v_ref[...]
    cols_1K = iota(j * bk, (1, bk), 1)
    kmask = None if mask_ref is None else mask_ref[...][None, :]

    def step(i, carry, masked):
        dk_KDh, dv_KDh = carry
        rows = pl.ds(pl.multiple_of(i * bq, bq), bq)
        q_QDh, do_QDh = q_ref[rows, :], do_ref[rows, :]
        keep = visible(plan, iota(i * bq, (bq, 1), 0), cols_1K, kmask) if masked else None
        p_QK, ds_QK = probs_and_dscores(
            q_QDh, k_KDh, v_KDh, do_QDh, lse_ref[rows, :], delta_ref[rows, :], keep, plan.scale2
        )
        dv_KDh = dv_KDh + _dot(p_QK.astype(do_QDh.dtype), do_QDh, (0, 0))
        dk_KDh = dk_KDh + _dot(ds_QK.astype(q_QDh.dtype), q_QDh, (0, 0))
        return dk_KDh, dv_KDh

    lo, full, end = q_range(plan, j, bq, bk)
    zeros = jnp.zeros((bk, plan.d_pad), jnp.float32)
    carry = fori(lo, full, functools.partial(step, masked=True), (zeros, zeros))
    dk_KDh, dv_KDh = fori(full, end, functools.partial(step, masked=False), carry)
    dk_ref[...] = (dk_KDh * plan.scale).astype(dk_ref.dtype)
    dv_ref[...] = dv_KDh.astype(dv_ref.dtype)


def _gpu_params(plan: Plan, backward: bool):
    # 4 warps cover a 64-wide head; wider heads (more registers per row) want 8.
    warps = plan.num_warps or (4 if plan.d_pad <= 64 else 8)
    return pltriton.CompilerParams(
        num_warps=warps, num_stages=plan.num_stages or (2 if backward else 3)
    )


def _gpu_specs(plan: Plan, bq: int, bk: int):
    """BlockSpecs on [B, T, H, Dh] arrays for a grid (blocks, B, H); `row` is the block axis."""
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


def forward(plan: Plan, q, k, v, kmask):
    b, _, h, _ = q.shape
    sp = _gpu_specs(plan, plan.bq, plan.bk)
    return pl.pallas_call(
        functools.partial(_gpu_fwd_kernel, plan=plan),
        out_shape=(q, jax.ShapeDtypeStruct((b, h, plan.t_pad, 1), jnp.float32)),
        grid=(plan.t_pad // plan.bq, b, h),
        in_specs=[sp["q_blk"], sp["k_all"], sp["k_all"], maybe_spec(kmask, sp["mask_all"])],
        out_specs=[sp["q_blk"], sp["row_blk"]],
        compiler_params=_gpu_params(plan, backward=False),
        interpret=plan.interpret,
        name="flash_attention_fwd_gpu",
    )(q, k, v, kmask)


def backward(plan: Plan, q, k, v, kmask, do, lse, delta):
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
