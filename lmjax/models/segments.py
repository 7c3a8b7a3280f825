"""Packed rows: several documents in one `[B, T]` row, told apart by segment ids (docs/models.md).

    segment_ids [B, T] int: one id per document in the row (padding its own id)
    positions[b, t] = t - (first index of the contiguous run of segment_ids[b] holding t)
    attention: query t sees key u only if segment_ids[b, t] == segment_ids[b, u] (and u <= t)

So each document in a packed row gets the logits it would get alone: its positions (learned,
sinusoidal or RoPE) start at 0 and its attention never reads another document.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from lmjax.checks import is_concrete
from lmjax.errors import ShapeError


def segment_positions(segment_ids_BT: jax.Array) -> jax.Array:
    """Each token's position inside its contiguous segment: `[B, T] -> [B, T]` int32.

    A run starts where the id differs from the previous token's (and at t = 0); the running
    maximum of those start indices is each token's start, so position = t - start.
    """
    segment_ids_BT = jnp.asarray(segment_ids_BT)
    t = segment_ids_BT.shape[-1]
    t_BT = jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32), segment_ids_BT.shape)
    changed_BT = segment_ids_BT[:, 1:] != segment_ids_BT[:, :-1]
    starts_BT = jnp.concatenate([jnp.ones_like(changed_BT[:, :1]), changed_BT], axis=1)
    start_BT = jax.lax.cummax(jnp.where(starts_BT, t_BT, 0), axis=1)
    return t_BT - start_BT


def check_segment_ids(segment_ids, tokens_BT: jax.Array) -> jax.Array | None:
    """None, or `segment_ids` as an int array of the tokens' shape `[B, T]` (else ShapeError)."""
    if segment_ids is None:
        return None
    if is_concrete(segment_ids) and not isinstance(segment_ids, jax.Array):
        segment_ids = np.asarray(segment_ids)
    fix = "pass one integer segment id per token, shaped like tokens [batch, time]"
    if tuple(segment_ids.shape) != tuple(tokens_BT.shape):
        raise ShapeError.describe("segment_ids.shape", segment_ids.shape, tokens_BT.shape, fix)
    if not jnp.issubdtype(segment_ids.dtype, jnp.integer):
        raise ShapeError.describe("segment_ids.dtype", segment_ids.dtype, "an integer dtype", fix)
    return jnp.asarray(segment_ids, jnp.int32)
