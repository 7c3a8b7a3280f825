"""The kernel's contract: its argument checks and its plain-jnp reference.

`attention_reference` is the oracle every kernel test compares with: the same equations
(package docstring) in float32 with the whole `[B, H, T, S]` score matrix, differentiated by
`jax.grad`. It is written apart from `lmjax.ops.attention_reference` (a different masked max, no
shared helper), so neither can hide a slip in the other.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from lmjax.checks import check_keep_values, is_int
from lmjax.errors import ConfigError, ShapeError

INPUT_DTYPES = (jnp.float32, jnp.bfloat16, jnp.float16)


def check_inputs(q, k, v, mask, offset) -> None:
    """The kernel's contract on its arguments (`flash_attention_with_lse`); ShapeError or
    ConfigError naming the first one outside it."""
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
    if not is_int(offset):
        raise ConfigError.describe(
            "offset",
            offset,
            "a static Python int (it fixes which blocks are skipped at trace time)",
            "pass an int, or use lmjax.ops.attention(impl='materialized') for a traced offset",
        )


def attention_reference(q, k, v, *, causal: bool, mask=None, offset: int = 0, return_lse=False):
    """The kernel's contract in plain jnp (float32 math), differentiated by jax.grad.

    q `[B, T, H, Dh]`, k and v `[B, S, H, Dh]`, `mask` a `[B, S]` key-padding mask (bool or 0/1,
    1 keeps) -> out `[B, T, H, Dh]` in q's dtype, and with `return_lse` the per-row logsumexp
    `[B, H, T]` of the visible scores. Key u is visible to query t iff mask[b, u] and (not causal
    or u <= t + offset). Rows with no visible key: out 0, lse -inf, zero gradients.
    """
    check_keep_values(mask)
    f32 = jnp.promote_types(q.dtype, jnp.float32)
    q_f, k_f, v_f = (jnp.asarray(a).astype(f32) for a in (q, k, v))
    (b, t, _, dh), s = q.shape, k.shape[1]
    scores_BHTS = jnp.einsum("bthd,bshd->bhts", q_f, k_f) / np.sqrt(dh).astype(f32)
    seen_TS = jnp.ones((t, s), bool)
    if causal:
        seen_TS = jnp.arange(s)[None, :] <= jnp.arange(t)[:, None] + offset
    keys_BS = jnp.ones((b, s), bool) if mask is None else jnp.asarray(mask) != 0
    seen_BHTS = seen_TS[None, None] & keys_BS[:, None, None, :]
    # Hidden scores are -inf, so exp gives exactly 0 for them (and for every key of a row that
    # sees none, whose max is then replaced by 0): no NaN in the values or the gradients.
    hidden_BHTS = jnp.where(seen_BHTS, scores_BHTS, -jnp.inf)
    row_max = jax.lax.stop_gradient(jnp.max(hidden_BHTS, axis=-1, keepdims=True))
    row_max = jnp.where(jnp.isfinite(row_max), row_max, 0.0)
    total = jnp.sum(jnp.exp(hidden_BHTS - row_max), axis=-1, keepdims=True)
    has_key = total > 0
    # log of 1, not of 0, where a row has no key: its lse is -inf and its gradient stays 0.
    lse_BHT1 = jnp.where(has_key, row_max + jnp.log(jnp.where(has_key, total, 1.0)), -jnp.inf)
    probs_BHTS = jnp.exp(hidden_BHTS - jnp.where(has_key, lse_BHT1, 0.0))
    out = jnp.einsum("bhts,bshd->bthd", probs_BHTS, v_f).astype(q.dtype)
    return (out, lse_BHT1[..., 0]) if return_lse else out
