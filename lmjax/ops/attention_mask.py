"""Which keys each query of `lmjax.ops.attention` sees, and the checks on its arguments.

    keep[b,h,t,u] = (not causal or u <= t + offset)
                    and (window is None or (t + offset) - u < window)
                    and (segment_ids is None or q_seg[b,t] == kv_seg[b,u])
                    and mask[b,h,t,u]

Shapes in the legend of `lmjax.models` (B batch, T queries, S keys, H query heads, Hkv key/value
heads, G = H // Hkv query heads per key/value head, Dh head size). Query head h reads key/value
head h // G (Hugging Face's repeat_kv order), so H splits as [Hkv, G] in row-major order.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from lmjax.checks import is_positive_int, require
from lmjax.errors import ConfigError, ShapeError
from lmjax.ops._common import (
    broadcast_mask,
    check_keep_values,
    require_float,
    require_int,
    require_rank,
)


def kv_groups(q_shape, k_shape) -> int:
    """G = H // Hkv, the query heads sharing each key/value head (`ShapeError` unless H % Hkv
    is 0)."""
    h, h_kv = q_shape[2], k_shape[2]
    if h % h_kv:
        raise ShapeError.describe(
            "(query heads H, key/value heads Hkv)",
            (h, h_kv),
            "H a multiple of Hkv (each key/value head serves H // Hkv query heads)",
            "project keys and values to a number of heads that divides the query heads",
        )
    return h // h_kv


def check_window(window) -> None:
    """`window` is None or a static int >= 1 (the band width, the query's own key included)."""
    require(
        window is None or is_positive_int(window),
        "attention window",
        window,
        "None or a static Python int >= 1 (query i sees key j only if i - j < window)",
        "pass window=None for full attention, or e.g. window=4096 (Mistral's sliding window)",
    )


def segment_pair(segment_ids, q_shape, k_shape) -> tuple[jax.Array, jax.Array] | None:
    """(q_segment_ids [B, T], kv_segment_ids [B, S]) from `segment_ids` in either form, checked.

    `segment_ids` is None, one int array [B, T] shared by queries and keys (self-attention,
    T == S), or a pair (q [B, T], kv [B, S]). A `ShapeError` names the first one outside that.
    """
    if segment_ids is None:
        return None
    (b, t), s = q_shape[:2], k_shape[1]
    if isinstance(segment_ids, tuple | list):
        require(
            len(segment_ids) == 2,
            "len(segment_ids)",
            len(segment_ids),
            "2: (q_segment_ids [B, T], kv_segment_ids [B, S])",
            "pass one [B, T] array for self-attention, or a (queries, keys) pair",
            ShapeError,
        )
        pair = tuple(jnp.asarray(x) for x in segment_ids)
    else:
        pair = (jnp.asarray(segment_ids),) * 2
        require(
            t == s,
            "segment_ids with T queries and S keys (T, S)",
            (t, s),
            "T == S for one shared [B, T] array",
            "pass a (q_segment_ids [B, T], kv_segment_ids [B, S]) pair for T != S",
            ShapeError,
        )
    for what, ids, rows in (
        ("q_segment_ids", pair[0], "query"),
        ("kv_segment_ids", pair[1], "key"),
    ):
        want = (b, t) if rows == "query" else (b, s)
        require_int(ids, what)
        require(
            ids.shape == want,
            f"{what}.shape",
            ids.shape,
            f"{want}, one id per {rows} position (q {tuple(q_shape)}, k {tuple(k_shape)})",
            f"pass {what} as [batch, {rows} positions]",
            ShapeError,
        )
    return pair


def keep_mask(
    q_shape, k_shape, *, causal: bool, offset=0, mask=None, window=None, segment_ids=None
) -> jax.Array:
    """bool `[B, H, T, S]`: True where query t may attend to key u (the module's equation).

    `offset` may be traced; `window` is static (`check_window`); `segment_ids` in either form of
    `segment_pair`; `mask` bool or 0/1, broadcast from the right."""
    (b, t, h, _), s = q_shape, k_shape[1]
    check_window(window)
    pair = segment_pair(segment_ids, q_shape, k_shape)
    q_pos_T1 = jnp.arange(t)[:, None] + offset
    k_pos_1S = jnp.arange(s)[None, :]
    keep_TS = jnp.ones((t, s), bool)
    if causal:
        keep_TS = keep_TS & (k_pos_1S <= q_pos_T1)
    if window is not None:
        keep_TS = keep_TS & (q_pos_T1 - k_pos_1S < window)
    keep = jnp.broadcast_to(keep_TS[None, None], (b, h, t, s))
    if pair is not None:
        same_B1TS = pair[0][:, None, :, None] == pair[1][:, None, None, :]
        keep = keep & jnp.broadcast_to(same_B1TS, (b, h, t, s))
    return keep if mask is None else keep & broadcast_mask(mask, (b, h, t, s))


def check_inputs(
    q,
    k,
    v,
    impl: str,
    return_probabilities: bool = False,
    mask=None,
    window=None,
    segment_ids=None,
) -> None:
    """The contract on (q, k, v, mask, window, segment_ids) of `attention` and of every impl
    that keeps it (`lmjax.models.dot_product_attention`'s flash): ShapeError or ConfigError
    naming the first argument outside it. `impl` is not checked against the impls here, only
    what it requires."""
    for name, a in (("q", q), ("k", k), ("v", v)):
        require_rank(a, 4, name, "[batch, time, heads, d_head]")
        require_float(a, name)
        if 0 in a.shape:
            raise ShapeError.describe(
                f"{name}.shape",
                a.shape,
                "no zero-size axis",
                "attend over at least one key and one query (drop empty batches before the call)",
            )
    if not q.dtype == k.dtype == v.dtype:
        raise ShapeError.describe(
            "(q, k, v) dtypes",
            (str(q.dtype), str(k.dtype), str(v.dtype)),
            "one dtype",
            "cast k and v to q's dtype (e.g. all bf16 with f32 accumulation inside)",
        )
    _check_kv_shapes(q.shape, k.shape, v.shape)
    if impl == "xla" and q.dtype == jnp.float16 and jax.default_backend() == "cpu":
        raise ConfigError.describe(
            "impl='xla' with float16 inputs on CPU",
            str(q.dtype),
            "float32 or bfloat16 (XLA's CPU dot_general has no float16 with float32 accumulation)",
            "use impl='materialized', or bfloat16",
        )
    if return_probabilities and impl != "materialized":
        raise ConfigError.describe(
            "return_probabilities with impl",
            impl,
            "impl='materialized'",
            "only the materialized impl forms the probabilities",
        )
    check_keep_values(mask)
    check_window(window)
    segment_pair(segment_ids, q.shape, k.shape)


def _check_kv_shapes(q_shape, k_shape, v_shape) -> None:
    """k and v `[B, S, Hkv, Dh]` alike, with q's B and Dh and Hkv dividing q's H."""
    if k_shape != v_shape:
        raise ShapeError.describe(
            "v.shape",
            v_shape,
            f"equal to k.shape {k_shape}",
            "project keys and values to the same [B, S, Hkv, Dh]",
        )
    b, _, _, d = q_shape
    if (k_shape[0], k_shape[3]) != (b, d):
        raise ShapeError.describe(
            "k.shape",
            k_shape,
            f"[{b}, S, Hkv, {d}] to match q.shape {q_shape}",
            "give q, k and v the same batch and head size",
        )
    kv_groups(q_shape, k_shape)
