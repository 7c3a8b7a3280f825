"""Embedding lookup with a scatter-add VJP."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from lmjax.errors import TokenError
from lmjax.ops._common import is_concrete, require_float, require_int, require_rank


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
    dtable_VD = (
        jnp.zeros_like(table_VD).at[safe_ids].add(dout_ND.astype(table_VD.dtype), mode="drop")
    )
    return dtable_VD, None


_embedding.defvjp(_embedding_fwd, _embedding_bwd)


def check_ids(ids, vocab_size: int, what: str = "ids") -> None:
    """Host-side range check: raise `TokenError` naming the first id outside `[0, V)`."""
    ids_np = np.asarray(ids)
    bad = (ids_np < 0) | (ids_np >= vocab_size)
    if bad.any():
        where = tuple(int(i) for i in np.argwhere(bad)[0])
        raise TokenError.describe(
            f"{what}{list(where)}",
            int(ids_np[where]),
            f"an id in [0, {vocab_size}) ({int(bad.sum())} of {ids_np.size} ids are outside)",
            "re-tokenize with the model's tokenizer or enlarge vocab_size",
        )


def embedding(table: jax.Array, ids: jax.Array) -> jax.Array:
    """Embedding lookup: `out[..., :] = table[ids[...], :]`.

    Shapes: table `[V, D]`, ids `[...]` (any integer dtype, any rank) -> out `[..., D]`.

    VJP: `dtable[v] = sum over every position p with ids[p] == v of dout[p]` (a scatter-add, so a
    token that occurs twice receives both contributions); ids are integers and get no gradient.

    Out-of-range ids are a `TokenError` whenever the ids are concrete (eager calls and every
    public entry point). Inside `jit` they cannot raise, so they produce NaN rows (and contribute
    nothing to `dtable`) instead of silently reading a clamped or wrapped row.
    """
    require_rank(table, 2, "table", "[vocab, d_model]")
    require_float(table, "table")
    require_int(ids, "ids")
    if is_concrete(ids):
        check_ids(ids, table.shape[0])
    return _embedding(table, jnp.asarray(ids))


def embedding_reference(table: jax.Array, ids: jax.Array) -> jax.Array:
    """Plain `jnp.take`; `jax.grad` derives the scatter-add itself."""
    return jnp.take(table, ids, axis=0)
