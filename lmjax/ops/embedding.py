"""Embedding lookup with a scatter-add VJP."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from lmjax.ops._common import (
    check_token_ids,
    compute_dtype,
    is_concrete,
    require_float,
    require_int,
    require_rank,
)


def _valid(ids: jax.Array, vocab: int) -> jax.Array:
    return (ids >= 0) & (ids < vocab)


@jax.custom_vjp
def _embedding(table_VD: jax.Array, ids: jax.Array) -> jax.Array:
    vocab = table_VD.shape[0]
    valid = _valid(ids, vocab)
    rows = jnp.take(table_VD, jnp.where(valid, ids, 0), axis=0)
    return jnp.where(valid[..., None], rows, jnp.asarray(jnp.nan, table_VD.dtype))


def _embedding_fwd(table_VD, ids):
    # The table is a residual only for its shape and dtype: it is a live input anyway, so
    # keeping it costs no extra memory.
    return _embedding(table_VD, ids), (ids, table_VD)


def _embedding_bwd(res, dout_ND):
    ids, table_VD = res
    vocab = table_VD.shape[0]
    # Invalid ids are pointed past the end and dropped, so they add nothing anywhere.
    safe_ids = jnp.where(_valid(ids, vocab), ids, vocab)
    # Accumulate in float32 (or wider): in bf16 a sum of repeated rows stalls at 256 copies.
    acc = compute_dtype(table_VD.dtype)
    # A scatter indexed by the tokens, data known only at run time: nothing for a compiler to
    # fold (tests/test_gpu_lowering.py allows this scatter and no other).
    dtable_VD = jnp.zeros(table_VD.shape, acc).at[safe_ids].add(dout_ND.astype(acc), mode="drop")
    return dtable_VD.astype(table_VD.dtype), None


_embedding.defvjp(_embedding_fwd, _embedding_bwd)


def embedding(table: jax.Array, ids: jax.Array) -> jax.Array:
    """Embedding lookup: `out[..., :] = table[ids[...], :]`.

    Shapes: table `[V, D]`, ids `[...]` (any integer dtype, any rank) -> out `[..., D]`.

    VJP: `dtable[v] = sum over every position p with ids[p] == v of dout[p]` (a scatter-add, so a
    token that occurs twice receives both contributions); ids are integers and get no gradient.

    Out-of-range ids are a `TokenError` whenever the ids are concrete (eager calls and every
    public entry point). Inside `jit` they cannot raise, so they produce NaN rows (and contribute
    nothing to `dtable`) instead of silently reading a clamped or wrapped row.
    """
    # Range-check the caller's ids before conversion: int32 would wrap an int64 2**32 + 3 to 3.
    raw_ids = ids
    table, ids = jnp.asarray(table), jnp.asarray(ids)
    require_rank(table, 2, "table", "[vocab, d_model]")
    require_float(table, "table")
    require_int(ids, "ids")
    if is_concrete(raw_ids):
        check_token_ids(raw_ids, table.shape[0], "ids")
    return _embedding(table, ids)


def embedding_reference(table: jax.Array, ids: jax.Array) -> jax.Array:
    """Plain `jnp.take`; `jax.grad` derives the scatter-add itself."""
    return jnp.take(table, ids, axis=0)
