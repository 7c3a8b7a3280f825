"""The TPU (Mosaic) kernels: grid (B, H, outer blocks, inner blocks), the inner axis sequential.

Mosaic tiles the last two dims (8 x 128), so arrays move to `[B, H, T, Dh]` here; VMEM scratch
holds the accumulators across the inner (sequential) axis.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from pallas_kernels._backend import dot as _dot
from pallas_kernels.flash_attention import blocks
from pallas_kernels.flash_attention.plan import Plan, kv_range, q_range


def _visible(plan: Plan, mask_ref, i, j, bq: int, bk: int):
    """bool [Q, K]: which keys of block (i, j) each query row sees; None when nothing is masked."""
    if not plan.needs_mask:
        return None
    kmask = None if mask_ref is None else mask_ref[...]
    rows_Q1, cols_1K = blocks.iota(i * bq, (bq, 1), 0), blocks.iota(j * bk, (1, bk), 1)
    return blocks.visible(plan, rows_Q1, cols_1K, kmask)


def _tpu_fwd_kernel(q_ref, k_ref, v_ref, mask_ref, o_ref, lse_ref, acc, m, l, *, plan):
    bq, bk = plan.bq, plan.bk
    i, j = pl.program_id(2), pl.program_id(3)

    @pl.when(j == 0)
    def _init():
        acc[...], m[...], l[...] = blocks.init_carry(bq, plan.d_pad)

    @pl.when(j < kv_range(plan, i, bq, bk)[1])  # causal skipping: blocks past the diagonal
    def _step():
        s_QK = _dot(q_ref[...], k_ref[...], (1, 1)) * plan.scale2
        keep = _visible(plan, mask_ref, i, j, bq, bk)
        acc[...], m[...], l[...] = blocks.online_softmax_step(
            (acc[...], m[...], l[...]), s_QK, keep, v_ref[...]
        )

    @pl.when(j == pl.num_programs(3) - 1)
    def _done():
        out_QDh, lse_Q1 = blocks.finish(acc[...], m[...], l[...])
        o_ref[...] = out_QDh.astype(o_ref.dtype)
        lse_ref[...] = lse_Q1


def _tpu_dq_kernel(q_ref, k_ref, v_ref, mask_ref, do_ref, lse_ref, delta_ref, dq_ref, dq, *, plan):
    bq, bk = plan.bq_bwd, plan.bk_bwd
    i, j = pl.program_id(2), pl.program_id(3)

    @pl.when(j == 0)
    def _init():
        dq[...] = jnp.zeros(dq.shape, jnp.float32)

    @pl.when(j < kv_range(plan, i, bq, bk)[1])
    def _step():
        keep = _visible(plan, mask_ref, i, j, bq, bk)
        k_KDh = k_ref[...]
        rows = (q_ref[...], k_KDh, v_ref[...], do_ref[...], lse_ref[...], delta_ref[...])
        _, ds_QK = blocks.probs_and_dscores(*rows, keep, plan.scale2)
        dq[...] += _dot(ds_QK.astype(k_KDh.dtype), k_KDh, (1, 0))

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

    lo, _, end = q_range(plan, j, bq, bk)

    @pl.when((i >= lo) & (i < end))
    def _step():
        keep = _visible(plan, mask_ref, i, j, bq, bk)
        q_QDh, do_QDh = q_ref[...], do_ref[...]
        p_QK, ds_QK = blocks.probs_and_dscores(
            q_QDh, k_ref[...], v_ref[...], do_QDh, lse_ref[...], delta_ref[...], keep, plan.scale2
        )
        dv[...] += _dot(p_QK.astype(do_QDh.dtype), do_QDh, (0, 0))
        dk[...] += _dot(ds_QK.astype(q_QDh.dtype), q_QDh, (0, 0))

    @pl.when(i == pl.num_programs(3) - 1)
    def _done():
        dk_ref[...] = (dk[...] * plan.scale).astype(dk_ref.dtype)
        dv_ref[...] = dv[...].astype(dv_ref.dtype)


_TPU_SEMANTICS = pltpu.CompilerParams(
    dimension_semantics=("parallel", "parallel", "parallel", "arbitrary")
)


def _tpu_specs(plan: Plan, bq: int, bk: int, q_outer: bool):
    """BlockSpecs on [B, H, T, Dh] arrays for grid (B, H, outer, inner).

    The visited-but-skipped inner steps map to the nearest block that is computed, so the
    pipeline does not fetch blocks that causal skipping never reads.
    """
    dp = plan.d_pad

    def q_index(b, h, outer, inner):
        if q_outer:
            return outer
        lo, _, end = q_range(plan, outer, bq, bk)
        return jnp.clip(inner, lo, jnp.maximum(end - 1, 0))

    def k_index(b, h, outer, inner):
        if not q_outer:
            return outer
        end = kv_range(plan, outer, bq, bk)[1]
        return jnp.clip(inner, 0, jnp.maximum(end - 1, 0))

    return dict(
        q=pl.BlockSpec((None, None, bq, dp), lambda b, h, o, n: (b, h, q_index(b, h, o, n), 0)),
        k=pl.BlockSpec((None, None, bk, dp), lambda b, h, o, n: (b, h, k_index(b, h, o, n), 0)),
        mask=pl.BlockSpec((None, 1, bk), lambda b, h, o, n: (b, 0, k_index(b, h, o, n))),
        row=pl.BlockSpec((None, None, bq, 1), lambda b, h, o, n: (b, h, q_index(b, h, o, n), 0)),
    )


def _tpu_bwd_in_specs(sp, kmask):
    """(q, k, v, mask, dO, lse, delta), in the order the backward kernels take them."""
    mask = blocks.maybe_spec(kmask, sp["mask"])
    return [sp["q"], sp["k"], sp["k"], mask, sp["q"], sp["row"], sp["row"]]


def _to_bhtd(x):
    return x.transpose(0, 2, 1, 3)


def forward(plan: Plan, q, k, v, kmask):
    # Mosaic tiles the last two dims (8 x 128): heads move out of the way, [B,T,H,Dh] -> [B,H,T,Dh].
    q, k, v = _to_bhtd(q), _to_bhtd(k), _to_bhtd(v)
    b, h, _, dp = q.shape
    sp = _tpu_specs(plan, plan.bq, plan.bk, q_outer=True)
    out, lse = pl.pallas_call(
        functools.partial(_tpu_fwd_kernel, plan=plan),
        out_shape=(q, jax.ShapeDtypeStruct((b, h, plan.t_pad, 1), jnp.float32)),
        grid=(b, h, plan.t_pad // plan.bq, plan.s_pad // plan.bk),
        in_specs=[sp["q"], sp["k"], sp["k"], blocks.maybe_spec(kmask, sp["mask"])],
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


def backward(plan: Plan, q, k, v, kmask, do, lse, delta):
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
