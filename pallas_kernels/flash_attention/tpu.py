"""The TPU (Mosaic) kernels: grid (B, heads, outer blocks, inner axes), the inner axes sequential.

Mosaic tiles the last two dims (8 x 128), so arrays move to `[B, H, T, Dh]` here (k, v
`[B, Hkv, S, Dh]`); VMEM scratch holds the accumulators across the inner (sequential) axes.
Segment ids travel as `[B, T, 1]` (queries: one per sublane row) and `[B, 1, S]` (keys: one per
lane), so a block compares `[Q, 1]` with `[1, K]`. Grouped-query attention goes through the
index maps: the forward and dq programs of query head h read key/value head h // G; the dk/dv
grid is (B, Hkv, key blocks, G, query blocks), so its accumulators sum the G query heads of the
group over the two inner axes, in VMEM.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from pallas_kernels._backend import dot as _dot
from pallas_kernels.flash_attention import blocks
from pallas_kernels.flash_attention.plan import Plan, kv_head, kv_range, q_range, segment_bounds


def _visible(plan: Plan, extra_refs, i, j, bq: int, bk: int):
    """bool [Q, K]: which keys of block (i, j) each query row sees; None when nothing is masked.

    `extra_refs`: the (mask, query segments, key segments) refs, each None when absent."""
    if not plan.needs_mask:
        return None
    mask, qseg, kvseg = (None if r is None else r[...] for r in extra_refs)
    rows_Q1, cols_1K = blocks.iota(i * bq, (bq, 1), 0), blocks.iota(j * bk, (1, bk), 1)
    return blocks.visible(plan, rows_Q1, cols_1K, mask, qseg, kvseg)


def _split_bounds(plan: Plan, refs):
    """(the scalar-prefetched (lo, end) refs of `segment_bounds` or None, the other refs):
    with segment ids the kernels get the two first."""
    return ((refs[0], refs[1]), refs[2:]) if plan.has_segments else (None, refs)


def _bounds_at(bounds, b, n_blocks: int, n):
    """(lo, end) of block n of batch row b from the flat [B * n_blocks] SMEM refs, or None."""
    if not bounds:
        return None
    at = b * n_blocks + n
    return bounds[0][at], bounds[1][at]


def _tpu_fwd_kernel(*refs, plan):
    bounds, (q_ref, k_ref, v_ref, *refs) = _split_bounds(plan, refs)
    *extra, o_ref, lse_ref, acc, m, l = refs
    bq, bk = plan.bq, plan.bk
    b, i, j = pl.program_id(0), pl.program_id(2), pl.program_id(3)
    lo, _, _, end = kv_range(plan, i, bq, bk, _bounds_at(bounds, b, plan.t_pad // bq, i))

    @pl.when(j == 0)
    def _init():
        acc[...], m[...], l[...] = blocks.init_carry(bq, plan.d_pad)

    @pl.when((j >= lo) & (j < end))  # causal and window skipping: blocks outside the band
    def _step():
        s_QK = _dot(q_ref[...], k_ref[...], (1, 1)) * plan.scale2
        keep = _visible(plan, extra, i, j, bq, bk)
        acc[...], m[...], l[...] = blocks.online_softmax_step(
            (acc[...], m[...], l[...]), s_QK, keep, v_ref[...]
        )

    @pl.when(j == pl.num_programs(3) - 1)
    def _done():
        out_QDh, lse_Q1 = blocks.finish(acc[...], m[...], l[...])
        o_ref[...] = out_QDh.astype(o_ref.dtype)
        lse_ref[...] = lse_Q1


def _tpu_dq_kernel(*refs, plan):
    bounds, (q_ref, k_ref, v_ref, *refs) = _split_bounds(plan, refs)
    *extra, do_ref, lse_ref, delta_ref, dq_ref, dq = refs
    bq, bk = plan.bq_bwd, plan.bk_bwd
    b, i, j = pl.program_id(0), pl.program_id(2), pl.program_id(3)
    lo, _, _, end = kv_range(plan, i, bq, bk, _bounds_at(bounds, b, plan.t_pad // bq, i))

    @pl.when(j == 0)
    def _init():
        dq[...] = jnp.zeros(dq.shape, jnp.float32)

    @pl.when((j >= lo) & (j < end))
    def _step():
        keep = _visible(plan, extra, i, j, bq, bk)
        k_KDh = k_ref[...]
        rows = (q_ref[...], k_KDh, v_ref[...], do_ref[...], lse_ref[...], delta_ref[...])
        _, ds_QK = blocks.probs_and_dscores(*rows, keep, plan.scale2)
        dq[...] += _dot(ds_QK.astype(k_KDh.dtype), k_KDh, (1, 0))

    @pl.when(j == pl.num_programs(3) - 1)
    def _done():
        dq_ref[...] = (dq[...] * plan.scale).astype(dq_ref.dtype)


def _tpu_dkdv_kernel(*refs, plan):
    """Grid (B, Hkv, key blocks j, group heads g, query blocks i): dk, dv of key block j sum
    over the G query heads and every query block that sees it."""
    bounds, (q_ref, k_ref, v_ref, *refs) = _split_bounds(plan, refs)
    *extra, do_ref, lse_ref, delta_ref, dk_ref, dv_ref, dk, dv = refs
    bq, bk = plan.bq_bwd, plan.bk_bwd
    b, j, g, i = pl.program_id(0), pl.program_id(2), pl.program_id(3), pl.program_id(4)
    lo, _, _, end = q_range(plan, j, bq, bk, _bounds_at(bounds, b, plan.s_pad // bk, j))

    @pl.when((g == 0) & (i == 0))
    def _init():
        dk[...] = jnp.zeros(dk.shape, jnp.float32)
        dv[...] = jnp.zeros(dv.shape, jnp.float32)

    @pl.when((i >= lo) & (i < end))
    def _step():
        keep = _visible(plan, extra, i, j, bq, bk)
        q_QDh, do_QDh = q_ref[...], do_ref[...]
        p_QK, ds_QK = blocks.probs_and_dscores(
            q_QDh, k_ref[...], v_ref[...], do_QDh, lse_ref[...], delta_ref[...], keep, plan.scale2
        )
        dv[...] += _dot(p_QK.astype(do_QDh.dtype), do_QDh, (0, 0))
        dk[...] += _dot(ds_QK.astype(q_QDh.dtype), q_QDh, (0, 0))

    @pl.when((g == pl.num_programs(3) - 1) & (i == pl.num_programs(4) - 1))
    def _done():
        dk_ref[...] = (dk[...] * plan.scale).astype(dk_ref.dtype)
        dv_ref[...] = dv[...].astype(dv_ref.dtype)


def _semantics(inner: int):
    """B, heads and the outer blocks are parallel; the `inner` accumulating axes sequential."""
    return pltpu.CompilerParams(dimension_semantics=("parallel",) * 3 + ("arbitrary",) * inner)


def _clip(n, lo, end):
    """A block index in [lo, end) nearest to n (a valid block even when the range is empty)."""
    hi = jnp.maximum(end - 1, 0)
    return jnp.clip(n, jnp.minimum(lo, hi), hi)


def _specs(plan: Plan, bq: int, bk: int, q_at, k_at):
    """BlockSpecs for a grid (B, *ids): q_at(b, *ids) -> (query head, query block) and
    k_at(b, *ids) -> (key/value head, key block). With segment ids, `ids` ends with the two
    scalar-prefetched bounds refs.

    Visited-but-skipped inner steps map to the nearest block that is computed (`_clip`), so the
    pipeline does not fetch blocks that block skipping never reads.
    """
    dp = plan.d_pad
    return dict(
        q=pl.BlockSpec((None, None, bq, dp), lambda b, *ids: (b, *q_at(b, *ids), 0)),
        k=pl.BlockSpec((None, None, bk, dp), lambda b, *ids: (b, *k_at(b, *ids), 0)),
        mask=pl.BlockSpec((None, 1, bk), lambda b, *ids: (b, 0, k_at(b, *ids)[1])),
        qseg=pl.BlockSpec((None, bq, 1), lambda b, *ids: (b, q_at(b, *ids)[1], 0)),
        row=pl.BlockSpec((None, None, bq, 1), lambda b, *ids: (b, *q_at(b, *ids), 0)),
    )


def _q_outer_specs(plan: Plan, bq: int, bk: int):
    """Grid (B, H, query blocks o, key blocks n): the forward and dq kernels."""

    def k_at(b, h, o, n, *bounds):
        seg = _bounds_at(bounds, b, plan.t_pad // bq, o)
        lo, _, _, end = kv_range(plan, o, bq, bk, seg)
        return kv_head(h, plan.groups), _clip(n, lo, end)

    return _specs(plan, bq, bk, lambda b, h, o, n, *bounds: (h, o), k_at)


def _dkdv_specs(plan: Plan, bq: int, bk: int):
    """Grid (B, Hkv, key blocks j, group heads g, query blocks n): the dk/dv kernel."""

    def q_at(b, h, j, g, n, *bounds):
        lo, _, _, end = q_range(plan, j, bq, bk, _bounds_at(bounds, b, plan.s_pad // bk, j))
        return h * plan.groups + g, _clip(n, lo, end)

    return _specs(plan, bq, bk, q_at, lambda b, h, j, g, n, *bounds: (h, j))


def _in_specs(sp, extras, backward: bool):
    """(q, k, v, mask, q segments, key segments[, dO, lse, delta]) in the kernels' order."""
    kmask, qseg, kvseg = extras
    specs = [sp["q"], sp["k"], sp["k"]]
    specs += [blocks.maybe_spec(x, sp[n]) for x, n in ((kmask, "mask"), (qseg, "qseg"))]
    specs.append(blocks.maybe_spec(kvseg, sp["mask"]))
    return specs + [sp["q"], sp["row"], sp["row"]] * backward


def _to_bhtd(x):
    return x.transpose(0, 2, 1, 3)


def _tpu_extras(kmask, qseg, kvseg):
    """Mask and key segments [B, S] -> [B, 1, S] (lanes); query segments [B, T] -> [B, T, 1]."""
    lanes = lambda x: None if x is None else x[:, None, :]  # noqa: E731
    return lanes(kmask), None if qseg is None else qseg[:, :, None], lanes(kvseg)


def _bounds(sb, side: str):
    """The scalar-prefetch operands: `segment_bounds` `sb`'s (lo, end) for `side` ("kv" or
    "q", see `SegmentBounds.side`), each flattened to [B * blocks] (SMEM holds 1-D arrays
    without 2-D tile padding); () without segments."""
    return () if sb is None else tuple(x.reshape(-1) for x in sb.side(side))


def _call(kernel, plan: Plan, bounds, *, grid, in_specs, out_specs, scratch, inner, **kw):
    """pallas_call with the segment bounds (if any) as scalar prefetch: the kernel and every
    index map get them, so the map can point skipped steps at a computed block."""
    spec = pltpu.PrefetchScalarGridSpec(
        num_scalar_prefetch=len(bounds),
        grid=grid,
        in_specs=in_specs,
        out_specs=out_specs,
        scratch_shapes=scratch,
    )
    run = pl.pallas_call(
        functools.partial(kernel, plan=plan),
        grid_spec=spec,
        compiler_params=_semantics(inner),
        interpret=plan.interpret,
        **kw,
    )
    return lambda *args: run(*bounds, *args)


def forward(plan: Plan, q, k, v, kmask, qseg, kvseg):
    # Mosaic tiles the last two dims (8 x 128): heads move out of the way, [B,T,H,Dh] -> [B,H,T,Dh].
    q, k, v = _to_bhtd(q), _to_bhtd(k), _to_bhtd(v)
    b, h, _, dp = q.shape
    extras = _tpu_extras(kmask, qseg, kvseg)
    sp = _q_outer_specs(plan, plan.bq, plan.bk)
    out, lse = _call(
        _tpu_fwd_kernel,
        plan,
        _bounds(segment_bounds(plan, qseg, kvseg, plan.bq, plan.bk), "kv"),
        out_shape=(q, jax.ShapeDtypeStruct((b, h, plan.t_pad, 1), jnp.float32)),
        grid=(b, h, plan.t_pad // plan.bq, plan.s_pad // plan.bk),
        in_specs=_in_specs(sp, extras, backward=False),
        out_specs=[sp["q"], sp["row"]],
        scratch=[
            pltpu.VMEM((plan.bq, dp), jnp.float32),
            pltpu.VMEM((plan.bq, 1), jnp.float32),
            pltpu.VMEM((plan.bq, 1), jnp.float32),
        ],
        inner=1,
        name="flash_attention_fwd_tpu",
    )(q, k, v, *extras)
    return _to_bhtd(out), lse


def backward(plan: Plan, q, k, v, kmask, qseg, kvseg, do, lse, delta):
    q, k, v, do = _to_bhtd(q), _to_bhtd(k), _to_bhtd(v), _to_bhtd(do)
    b, h, _, dp = q.shape
    h_kv = k.shape[1]
    bq, bk = plan.bq_bwd, plan.bk_bwd
    nq, nk = plan.t_pad // bq, plan.s_pad // bk
    extras = _tpu_extras(kmask, qseg, kvseg)
    sb = segment_bounds(plan, qseg, kvseg, bq, bk)  # once for both kernels
    sp = _q_outer_specs(plan, bq, bk)
    dq = _call(
        _tpu_dq_kernel,
        plan,
        _bounds(sb, "kv"),
        out_shape=q,
        grid=(b, h, nq, nk),
        in_specs=_in_specs(sp, extras, backward=True),
        out_specs=sp["q"],
        scratch=[pltpu.VMEM((bq, dp), jnp.float32)],
        inner=1,
        name="flash_attention_dq_tpu",
    )(q, k, v, *extras, do, lse, delta)
    sp = _dkdv_specs(plan, bq, bk)
    dk, dv = _call(
        _tpu_dkdv_kernel,
        plan,
        _bounds(sb, "q"),
        out_shape=(k, v),
        grid=(b, h_kv, nk, plan.groups, nq),
        in_specs=_in_specs(sp, extras, backward=True),
        out_specs=[sp["k"], sp["k"]],
        scratch=[pltpu.VMEM((bk, dp), jnp.float32), pltpu.VMEM((bk, dp), jnp.float32)],
        inner=2,
        name="flash_attention_dkdv_tpu",
    )(q, k, v, *extras, do, lse, delta)
    return _to_bhtd(dq), _to_bhtd(dk), _to_bhtd(dv)
