"""The kernel's contract: its argument checks and its plain-jnp reference.

`attention_reference` is the oracle every kernel test compares with: the same equations
(package docstring) in float32 with the whole `[B, Hkv, G, T, S]` score matrix, differentiated by
`jax.grad`. It is written apart from `lmjax.ops.attention_reference` (a different masked max, no
shared helper), so neither can hide a slip in the other.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from lmjax.checks import check_keep_values, is_int, is_positive_int, require
from lmjax.errors import ConfigError, ShapeError

INPUT_DTYPES = (jnp.float32, jnp.bfloat16, jnp.float16)


def check_inputs(q, k, v, mask, offset, window=None, q_segment_ids=None, kv_segment_ids=None):
    """The kernel's contract on its arguments (`flash_attention_with_lse`); ShapeError or
    ConfigError naming the first one outside it."""
    for name, a in (("q", q), ("k", k), ("v", v)):
        _check_array(name, a, q.dtype)
    b, _, h, d = q.shape
    if k.shape != v.shape or (k.shape[0], k.shape[3]) != (b, d):
        raise ShapeError.describe(
            "(k.shape, v.shape)",
            (k.shape, v.shape),
            f"both [{b}, S, {h}, {d}] to match q.shape {q.shape} (or [{b}, S, Hkv, {d}] with "
            f"Hkv dividing {h}: grouped-query attention)",
            "give q, k and v the same batch and head size",
        )
    require(
        h % k.shape[2] == 0,
        "k.shape[2] (key/value heads)",
        k.shape[2],
        f"a divisor of q's {h} heads (query head h reads key/value head h // (H // Hkv))",
        "give k and v a number of heads that divides q's",
        ShapeError,
    )
    if mask is not None and np.shape(mask) != (b, k.shape[1]):
        raise ShapeError.describe(
            "mask.shape", np.shape(mask), f"({b}, {k.shape[1]}) = [B, S] key padding", "reshape it"
        )
    check_keep_values(mask)
    if not is_int(offset):
        raise ConfigError.describe(
            "offset",
            offset,
            "a static Python int (it fixes which blocks are skipped at trace time)",
            "pass an int, or use lmjax.ops.attention(impl='materialized') for a traced offset",
        )
    require(
        window is None or is_positive_int(window),
        "window",
        window,
        "None or a static Python int >= 1 (key u visible to query t iff (t + offset) - u < window)",
        "pass an int such as 4096, or None for no sliding window",
    )
    _check_segments(q_segment_ids, kv_segment_ids, (b, q.shape[1]), (b, k.shape[1]))


def _check_array(name: str, a, dtype) -> None:
    if a.ndim != 4:
        raise ShapeError.describe(
            f"{name}.shape", a.shape, "rank 4 ([batch, time, heads, d_head])", "reshape it"
        )
    if a.dtype not in INPUT_DTYPES or a.dtype != dtype:
        raise ShapeError.describe(
            f"{name}.dtype",
            str(a.dtype),
            f"q's dtype, one of float32, bfloat16, float16 (q is {dtype})",
            "cast q, k, v to one of them (the kernel accumulates in float32)",
        )
    if 0 in a.shape:
        raise ShapeError.describe(f"{name}.shape", a.shape, "no zero-size axis", "drop it")


def _check_segments(q_segment_ids, kv_segment_ids, bt, bs) -> None:
    """Both or neither; integer arrays [B, T] and [B, S]."""
    given = (q_segment_ids is not None, kv_segment_ids is not None)
    require(
        given[0] == given[1],
        "(q_segment_ids, kv_segment_ids) given",
        given,
        "both or neither",
        "for self-attention pass the same [B, T] ids as both",
    )
    if not given[0]:
        return
    pairs = (("q_segment_ids", q_segment_ids, bt), ("kv_segment_ids", kv_segment_ids, bs))
    for name, ids, shape in pairs:
        require(
            np.shape(ids) == shape, f"{name}.shape", np.shape(ids), shape, "reshape it", ShapeError
        )
        dtype = jnp.asarray(ids).dtype
        ok = jnp.issubdtype(dtype, jnp.integer)
        expected, fix = "an integer dtype (int32)", "cast with .astype(jnp.int32)"
        require(ok, f"{name}.dtype", str(dtype), expected, fix, ShapeError)


def attention_reference(
    q,
    k,
    v,
    *,
    causal: bool,
    mask=None,
    offset: int = 0,
    window: int | None = None,
    q_segment_ids=None,
    kv_segment_ids=None,
    return_lse=False,
):
    """The kernel's contract in plain jnp (float32 math), differentiated by jax.grad.

    q `[B, T, H, Dh]`, k and v `[B, S, Hkv, Dh]` (query head h reads key/value head h // G,
    G = H // Hkv), `mask` a `[B, S]` key-padding mask (bool or 0/1, 1 keeps), segment ids
    `[B, T]` and `[B, S]` (both or neither) -> out `[B, T, H, Dh]` in q's dtype, and with
    `return_lse` the per-row logsumexp `[B, H, T]` of the visible scores. Key u is visible to
    query t iff mask[b, u] and (not causal or u <= t + offset) and (window is None or
    (t + offset) - u < window) and q_segment_ids[b, t] == kv_segment_ids[b, u]. Rows with no
    visible key: out 0, lse -inf, zero gradients.
    """
    check_keep_values(mask)
    f32 = jnp.promote_types(q.dtype, jnp.float32)
    q_f, k_f, v_f = (jnp.asarray(a).astype(f32) for a in (q, k, v))
    (b, t, h, dh), (s, h_kv) = q.shape, k.shape[1:3]
    q_BTKGD = q_f.reshape(b, t, h_kv, h // h_kv, dh)  # query head h = kv head * G + g
    scores = jnp.einsum("btkgd,bskd->bkgts", q_BTKGD, k_f) / np.sqrt(dh).astype(f32)
    seen_BTS = _seen(b, t, s, causal, mask, offset, window, q_segment_ids, kv_segment_ids)
    # Hidden scores are -inf, so exp gives exactly 0 for them (and for every key of a row that
    # sees none, whose max is then replaced by 0): no NaN in the values or the gradients.
    hidden = jnp.where(seen_BTS[:, None, None], scores, -jnp.inf)
    row_max = jax.lax.stop_gradient(jnp.max(hidden, axis=-1, keepdims=True))
    row_max = jnp.where(jnp.isfinite(row_max), row_max, 0.0)
    total = jnp.sum(jnp.exp(hidden - row_max), axis=-1, keepdims=True)
    has_key = total > 0
    # log of 1, not of 0, where a row has no key: its lse is -inf and its gradient stays 0.
    lse = jnp.where(has_key, row_max + jnp.log(jnp.where(has_key, total, 1.0)), -jnp.inf)
    probs = jnp.exp(hidden - jnp.where(has_key, lse, 0.0))
    out = jnp.einsum("bkgts,bskd->btkgd", probs, v_f).reshape(b, t, h, dh).astype(q.dtype)
    return (out, lse.reshape(b, h, t)) if return_lse else out


def _seen(b, t, s, causal, mask, offset, window, q_segment_ids, kv_segment_ids):
    """bool [B, T, S]: key u visible to query t (the rules of `attention_reference`)."""
    at_TS = jnp.arange(t)[:, None] + offset  # the query's absolute position t + offset
    key_TS = jnp.arange(s)[None, :]
    seen_TS = jnp.ones((t, s), bool)
    if causal:
        seen_TS &= key_TS <= at_TS
    if window is not None:
        seen_TS &= at_TS - key_TS < window
    keys_BS = jnp.ones((b, s), bool) if mask is None else jnp.asarray(mask) != 0
    seen_BTS = seen_TS[None] & keys_BS[:, None, :]
    if q_segment_ids is not None:
        same_BTS = jnp.asarray(q_segment_ids)[:, :, None] == jnp.asarray(kv_segment_ids)[:, None]
        seen_BTS &= same_BTS
    return seen_BTS
