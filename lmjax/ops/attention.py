"""Scaled dot-product attention: the materialized custom VJP, or XLA's.

The Pallas flash kernel sits above the primitives: `lmjax.models.dot_product_attention` (and a
model's `attention="flash"`) runs it with this module's contract.

Shapes in the legend of `lmjax.models` (B batch, T queries, S keys, H heads, Dh head size); the
einsum strings spell them in lower case, d for Dh.
"""

from __future__ import annotations

from functools import partial

import jax
import jax.numpy as jnp

from lmjax.checks import require
from lmjax.ops._common import check_keep_values, compute_dtype, inv_sqrt, is_int
from lmjax.ops.attention_mask import check_inputs, keep_mask, segment_pair
from lmjax.ops.softmax import masked_softmax, masked_softmax_vjp

IMPLS = ("materialized", "xla")


def _subscripts(groups: int) -> tuple[str, str, str]:
    """einsum subscripts (queries, keys, scores): one key/value head per query head, or the
    query heads grouped as [Hkv, G] (k for the key/value head, g for the query in its group).

    G = 1 keeps the per-head form: XLA's CPU program for a size-1 group axis measured 22% more
    bytes accessed (GPT-2-like heads, T = 256, forward and backward)."""
    return ("bthd", "bshd", "bhts") if groups == 1 else ("btkgd", "bskd", "bkgts")


def _in_groups(x_BTHD, h_kv: int) -> jax.Array:
    """[B, T, H, Dh] -> [B, T, Hkv, G, Dh] (query head h = kv * G + g reads key/value head kv);
    unchanged when G = 1."""
    b, t, h, d = x_BTHD.shape
    return x_BTHD if h == h_kv else x_BTHD.reshape(b, t, h_kv, h // h_kv, d)


def _forward(q, k, v, keep_BHTS):
    """(out [B, T, H, Dh] in q's dtype, p in the compute dtype, [B, H, T, S] or grouped
    [B, Hkv, G, T, S]).

    Grouped-query: the G query heads of a key/value head are one einsum axis, so k and v are
    read as they are, never repeated to H heads."""
    dtype, h_kv = compute_dtype(q.dtype), k.shape[2]
    qs, ks, ps = _subscripts(q.shape[2] // h_kv)
    s = jnp.einsum(f"{qs},{ks}->{ps}", _in_groups(q, h_kv), k, preferred_element_type=dtype)
    p = masked_softmax(s * inv_sqrt(q.shape[-1]), keep_BHTS.reshape(s.shape), axis=-1)
    out = jnp.einsum(f"{ps},{ks}->{qs}", p, v.astype(dtype))
    return out.reshape(q.shape).astype(q.dtype), p


def _backward(q, k, v, keep_BHTS, p, d_out, d_p=None):
    """(dq, dk, dv) in p's dtype from the saved probabilities p of `_forward` (see
    `attention`); dk and dv are summed over each group's G query heads."""
    dtype, scale, h_kv = p.dtype, inv_sqrt(q.shape[-1]), k.shape[2]
    qs, ks, ps = _subscripts(q.shape[2] // h_kv)
    d_out = _in_groups(d_out.astype(dtype), h_kv)
    dv = jnp.einsum(f"{ps},{qs}->{ks}", p, d_out)
    dp = jnp.einsum(f"{qs},{ks}->{ps}", d_out, v.astype(dtype))
    if d_p is not None:
        dp = dp + d_p.astype(dtype).reshape(p.shape)
    ds = masked_softmax_vjp(p, dp, keep_BHTS.reshape(p.shape), axis=-1) * scale
    dq = jnp.einsum(f"{ps},{ks}->{qs}", ds, k.astype(dtype))
    dk = jnp.einsum(f"{ps},{qs}->{ks}", ds, _in_groups(q.astype(dtype), h_kv))
    return dq.reshape(q.shape), dk, dv


def _as_bhts(p) -> jax.Array:
    """Probabilities [B, H, T, S] from `_forward`'s p (grouped or not)."""
    return p.reshape(p.shape[0], -1, *p.shape[-2:])


@jax.custom_vjp
def _attention_materialized(q, k, v, keep):
    out, p = _forward(q, k, v, keep)
    return out, _as_bhts(p).astype(q.dtype)


def _attention_fwd(q, k, v, keep):
    out, p = _forward(q, k, v, keep)
    return (out, _as_bhts(p).astype(q.dtype)), (q, k, v, keep, p)


def _attention_bwd(res, cotangents):
    q, k, v, keep, p = res
    d_out, d_p = cotangents
    dq, dk, dv = _backward(q, k, v, keep, p, d_out, d_p)
    return dq.astype(q.dtype), dk.astype(k.dtype), dv.astype(v.dtype), None


_attention_materialized.defvjp(_attention_fwd, _attention_bwd)


# Query blocks of causal self-attention. Query block [i, e) sees keys [0, e) only, so the fully
# masked key blocks above the diagonal are never computed: with n blocks, (n + 1) / 2n of the
# full products and softmax work remain (5/8 at n = 4). Smaller blocks skip more but each is a
# smaller product and one more set of ops to compile and run, so blocks are 64 rows, or longer
# when that would make more than 8 (measured on the reference config at T = 128..1024,
# benchmarks/train_step.py: 64 rows were 2% faster than 128 at T = 256 and 512, 4% slower at 1024).
CAUSAL_BLOCK_MIN = 64
CAUSAL_MAX_BLOCKS = 8


def causal_block(t: int) -> int:
    """Rows per query block for causal self-attention over `t` positions (see above)."""
    rows = -(-t // CAUSAL_MAX_BLOCKS)
    return max(CAUSAL_BLOCK_MIN, -(-rows // CAUSAL_BLOCK_MIN) * CAUSAL_BLOCK_MIN)


def _causal_spans(t: int, block: int, window) -> tuple[tuple[int, int, int], ...]:
    """(start i, end e, first key lo) of each query block; the last block may be shorter.

    Block [i, e) sees keys [lo, e): lo = 0, or with a window the first key row i still sees,
    i - window + 1 (at least 0), so the key blocks below the band are skipped too."""
    first_key = (lambda i: 0) if window is None else (lambda i: max(0, i - window + 1))
    return tuple((i, min(i + block, t), first_key(i)) for i in range(0, t, block))


def _block(q, k, v, segments, span, window):
    """(q, k, v, keep) of one query block `span` = (i, e, lo): queries [i, e), keys [lo, e)."""
    i, e, lo = span
    segs = None if segments is None else (segments[0][:, i:e], segments[1][:, lo:e])
    q_i, k_i, v_i = q[:, i:e], k[:, lo:e], v[:, lo:e]
    # Causal with the block's first row at offset i - lo from its first key.
    keep = keep_mask(
        q_i.shape, k_i.shape, causal=True, offset=i - lo, window=window, segment_ids=segs
    )
    return q_i, k_i, v_i, keep


def _blocked_fwd(q, k, v, block, window, segments):
    outs, probs = [], []
    for span in _causal_spans(q.shape[1], block, window):
        out, p = _forward(*_block(q, k, v, segments, span, window))
        outs.append(out)
        probs.append(p)
    return jnp.concatenate(outs, axis=1), (q, k, v, segments, tuple(probs))


@partial(jax.custom_vjp, nondiff_argnums=(3, 4))
def _attention_causal_blocked(q, k, v, block, window=None, segments=None):
    """Causal self-attention (offset 0, no mask; a `window`, a (q, kv) `segments` pair allowed)
    by query blocks of `block` rows.

    The same equations as `attention` restricted to the keys each block can see, [lo, e):
        out[:, i:e] = softmax(q[:, i:e] k[:, lo:e]^T / sqrt(Dh), keep) v[:, lo:e]
    VJP per block with its saved p: dq[:, i:e] = ds k[:, lo:e], dk[:, lo:e] += ds^T q[:, i:e],
    dv[:, lo:e] += p^T dO[:, i:e]. Entries it skips are exactly 0 in the materialized form
    (p = 0, ds = 0), so only the summation order differs.
    """
    return _blocked_fwd(q, k, v, block, window, segments)[0]


def _blocked_bwd(block, window, res, d_out):
    q, k, v, segments, probs = res
    dtype = probs[0].dtype
    dq_blocks, dk, dv = [], jnp.zeros(k.shape, dtype), jnp.zeros(v.shape, dtype)
    spans = _causal_spans(q.shape[1], block, window)
    for span, p in zip(spans, probs, strict=True):
        i, e, lo = span
        q_i, k_i, v_i, keep = _block(q, k, v, segments, span, window)
        dq_i, dk_i, dv_i = _backward(q_i, k_i, v_i, keep, p, d_out[:, i:e])
        dq_blocks.append(dq_i)
        # An update of a static slice: `.at[:, lo:e].add` would lower to a scatter (issue 32).
        dk = jax.lax.dynamic_update_slice_in_dim(dk, dk[:, lo:e] + dk_i, lo, axis=1)
        dv = jax.lax.dynamic_update_slice_in_dim(dv, dv[:, lo:e] + dv_i, lo, axis=1)
    dq = jnp.concatenate(dq_blocks, axis=1)
    return dq.astype(q.dtype), dk.astype(k.dtype), dv.astype(v.dtype), None


_attention_causal_blocked.defvjp(_blocked_fwd, _blocked_bwd)


def attention(
    q,
    k,
    v,
    *,
    causal: bool,
    offset=0,
    mask=None,
    window=None,
    segment_ids=None,
    impl: str = "materialized",
    return_probabilities: bool = False,
):
    """Scaled dot-product attention in the layout of `jax.nn.dot_product_attention`.

    Shapes: q `[B, T, H, Dh]`, k and v `[B, S, Hkv, Dh]` with H a multiple of Hkv (grouped-query
    attention; Hkv = H is multi-head, Hkv = 1 multi-query) -> out `[B, T, H, Dh]`. Query head h
    reads key/value head kv(h) = h // (H // Hkv), Hugging Face's repeat_kv order.

        s[b,h,t,u] = q[b,t,h,:] . k[b,u,kv(h),:] / sqrt(Dh)
        keep[b,h,t,u] = (not causal or u <= t + offset)
                        and (window is None or (t + offset) - u < window)
                        and (segment_ids is None or q_seg[b,t] == kv_seg[b,u])
                        and mask[b,h,t,u]
                        (mask bool or 0/1, broadcast from the right, e.g. [B,1,1,S] key padding)
        p = masked softmax of s over u (masked p = 0 exactly)
        out[b,t,h,:] = sum_u p[b,h,t,u] v[b,u,kv(h),:]
      VJP of the materialized form, with dO = dL/dout (and dP = dL/dp when p is returned too):
        dv  = p^T dO  (summed over each kv head's group)    dP' = dO v^T + dP
        ds  = p * (dP' - rowsum(dP' * p))     (0 where masked)
        dq  = ds k / sqrt(Dh)                 dk  = ds^T q / sqrt(Dh)  (summed over the group)
    The materialized impl views q as [B, T, Hkv, G, Dh] (G = H // Hkv) and contracts the group
    axis against k and v as they are: no copy of K or V repeated to H heads is made.

    Masks keep where 1: `mask` is bool or 0/1 (True/1 keeps a key). A concrete mask (numpy, or
    a jax array outside jit) holding any other value is a `ShapeError`: an additive mask (0
    keeps, -inf drops, as in Hugging Face and PyTorch) would otherwise be silently inverted;
    convert one with `keep = additive == 0`. A traced mask (inside jit) cannot be checked and
    is read as "nonzero keeps", so under jit pass a bool mask: a bool mask is always safe.

    `window` (None, or a static int >= 1): a sliding window of that many keys, the query's own
    position included (Mistral's `sliding_window`). `segment_ids` (packed documents): None, one
    int array [B, T] shared by queries and keys (self-attention, T == S), or a pair
    (q_segment_ids [B, T], kv_segment_ids [B, S]); a query sees only keys of its own segment id
    (give padding an id of its own).

    `offset` places query t at absolute position t + offset, i.e. key 0 sits `offset` positions
    before query 0 (the number of earlier keys): decoding one token against a cache of S keys
    uses `offset = S - 1`. A negative offset is defined the same way: the first -offset queries
    precede every key (bottom-right alignment of T > S queries over S keys, offset = S - T).

    A query row with no visible key (all its keys masked, or before every key) has nothing to
    attend to: its output is exactly 0, its dq is exactly 0, and it adds exactly 0 to dk and dv,
    in every impl, with a concrete or a traced mask (never NaN, never an error). Unlike
    `softmax`, which refuses a concrete fully masked slice (it would have no distribution), an
    empty weighted sum is well defined, and batched decoding with padding produces such rows.

    Impls: "materialized" (the custom VJP above; `return_probabilities=True` also returns p
    [B, H, T, S] for inspection; causal self-attention with offset 0, no mask and
    T > `causal_block(T)` runs by query blocks that skip the all-masked key blocks, above the
    diagonal and below a window's band, `_attention_causal_blocked`) and "xla"
    (`jax.nn.dot_product_attention`, grouped natively, differentiated by JAX). The Pallas flash
    kernel, cuDNN and the choice between them are `lmjax.models.dot_product_attention(...,
    impl="flash" | "cudnn" | "auto")`: those impls here are a `ConfigError` pointing there (ops
    imports nothing above errors and checks; `ops.attention_cudnn` is cuDNN's translation).
    """
    fix = f"call lmjax.models.dot_product_attention(q, k, v, ..., impl={impl!r})"
    above = f"one of {IMPLS} (flash, cudnn and auto are chosen above ops)"
    require(impl not in ("flash", "cudnn", "auto"), "impl", impl, above, fix)
    require(impl in IMPLS, "impl", impl, f"one of {IMPLS}", "pick a listed impl")
    q, k, v = jnp.asarray(q), jnp.asarray(k), jnp.asarray(v)
    check_inputs(q, k, v, impl, return_probabilities, mask, window, segment_ids)
    segments = segment_pair(segment_ids, q.shape, k.shape)
    masks = dict(causal=causal, offset=offset, mask=mask, window=window, segment_ids=segments)
    if impl == "xla":
        return _xla(q, k, v, masks)
    return _materialized(q, k, v, return_probabilities, masks)


def _at_zero(offset) -> bool:
    """A static offset of 0: query t is at position t (the shortcuts' precondition)."""
    return is_int(offset) and offset == 0


def _materialized(q, k, v, return_probabilities, masks: dict):
    """The custom VJP over the full [B, H, T, S] keep mask (`masks`: `keep_mask`'s keywords,
    segment ids as a pair), or by query blocks when it can."""
    if (
        masks["causal"]
        and masks["mask"] is None
        and _at_zero(masks["offset"])
        and not return_probabilities
        and q.shape[1] == k.shape[1] > causal_block(q.shape[1])
    ):
        block = causal_block(q.shape[1])
        return _attention_causal_blocked(q, k, v, block, masks["window"], masks["segment_ids"])
    out, p = _attention_materialized(q, k, v, keep_mask(q.shape, k.shape, **masks))
    return (out, p) if return_probabilities else out


def _xla(q, k, v, masks: dict):
    """`jax.nn.dot_product_attention` (grouped natively: k, v keep their Hkv heads)."""
    if _xla_masks_suffice(q.shape, k.shape, **masks):
        return _xla_unmasked(q, k, v, masks["causal"], masks["window"])
    keep = keep_mask(q.shape, k.shape, **masks)
    out = jax.nn.dot_product_attention(q, k, v, mask=keep, implementation="xla")
    # XLA spreads a fully masked row uniformly over the keys; the contract is zeros.
    visible_BTH1 = jnp.any(keep, axis=-1).transpose(0, 2, 1)[..., None]
    return jnp.where(visible_BTH1, out, 0.0).astype(q.dtype)


def _xla_masks_suffice(q_shape, k_shape, *, causal, offset, mask, window, segment_ids) -> bool:
    """Whether XLA's own causal and window masks express `keep` and every row sees a key.

    Then XLA builds them itself instead of our keeping a [B, H, T, S] boolean for the backward.
    Without a window: offset 0 (or no causal mask) and row t sees key 0. With one (offset 0):
    T <= S, so row t sees its own key t (a later row could have none, which XLA would not zero).
    """
    if mask is not None or segment_ids is not None:
        return False
    if window is None:
        return _at_zero(offset) or not causal
    return _at_zero(offset) and q_shape[1] <= k_shape[1]


def _xla_unmasked(q, k, v, causal: bool, window) -> jax.Array:
    """XLA's attention with its own causal and window masks (offset 0; no mask, no segments).

    Its `local_window_size=(left, right)` keeps key u for query t iff -right <= t - u <= left,
    so `window` keys back (the query's own included) is left = window - 1; right = 0 when
    causal, and unbounded (S) otherwise, as `attention`'s window bounds only the past."""
    local = None if window is None else (window - 1, 0 if causal else k.shape[1])
    out = jax.nn.dot_product_attention(
        q, k, v, is_causal=causal, local_window_size=local, implementation="xla"
    )
    return out.astype(q.dtype)


def attention_reference(
    q, k, v, *, causal: bool, offset=0, mask=None, window=None, segment_ids=None, return_lse=False
):
    """Plain jnp: masked logits get the most negative float, rows with no key are zeroed.

    The oracle: k and v are repeated to H heads (kv(h) = h // G), and the mask is built here,
    independently of `keep_mask`. With `return_lse=True` also the per-row logsumexp `[B, H, T]`
    of the visible scores (-inf for a row with no visible key), which the flash kernel saves for
    its backward.
    """
    check_keep_values(mask)
    dtype = compute_dtype(q.dtype)
    qf, kf, vf = (jnp.asarray(a).astype(dtype) for a in (q, k, v))
    groups = qf.shape[2] // kf.shape[2]
    kf, vf = (jnp.repeat(a, groups, axis=2) for a in (kf, vf))
    s = jnp.einsum("bthd,bshd->bhts", qf, kf) / jnp.sqrt(jnp.asarray(q.shape[-1], dtype))
    # Its own mask construction (not keep_mask), so a semantic slip there cannot hide.
    t_idx = jax.lax.broadcasted_iota(jnp.int32, s.shape, 2)
    s_idx = jax.lax.broadcasted_iota(jnp.int32, s.shape, 3)
    keep = (s_idx <= t_idx + offset) if causal else jnp.ones(s.shape, bool)
    if window is not None:
        keep = keep & (t_idx + offset - s_idx < window)
    if segment_ids is not None:
        q_seg, kv_seg = segment_ids if isinstance(segment_ids, tuple | list) else (segment_ids,) * 2
        q_seg_BHTS = jnp.broadcast_to(jnp.asarray(q_seg)[:, None, :, None], s.shape)
        keep = keep & (q_seg_BHTS == jnp.asarray(kv_seg)[:, None, None, :])
    if mask is not None:
        keep = keep & (jnp.broadcast_to(jnp.asarray(mask), s.shape) != 0)
    s = jnp.where(keep, s, jnp.finfo(dtype).min)
    m = jax.lax.stop_gradient(jnp.max(s, axis=-1, keepdims=True))
    e = jnp.where(keep, jnp.exp(s - m), 0.0)
    total = jnp.sum(e, axis=-1, keepdims=True)
    seen = total > 0
    p = e / jnp.where(seen, total, 1.0)
    out = jnp.einsum("bhts,bshd->bthd", p, vf).astype(q.dtype)
    if not return_lse:
        return out
    lse = jnp.where(seen, m + jnp.log(jnp.where(seen, total, 1.0)), -jnp.inf)[..., 0]
    return out, lse
