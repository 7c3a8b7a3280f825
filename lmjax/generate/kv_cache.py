"""KV-cached decoding (SPEC section 4): `prefill` a prompt, then `decode_step` one token at a time.

A cache keeps every layer's keys and values at their absolute positions, so a new token attends
to everything before it without recomputing it. With `p_b` the position of row b's token:

    prefill(tokens [B, T], lengths [B]):
        the forward pass of the prompt (causal self-attention over its T tokens, the very
        computation of `models.forward`); each layer's k, v [B, T, H, Dh] stored at slots
        0..T-1; lengths = lengths (default T).                         -> logits [B, T, V]
    decode_step(token [B]):  p_b = lengths[b]
        each layer stores its k, v [B, 1, H, Dh] at slot p_b, then attends over the slots
        u <= p_b (key mask [B, 1, 1, S]); lengths += 1.               -> logits [B, V]

Slot j of a row always holds position j, so RoPE, learned and sinusoidal positions all take
`p_b` and the logits equal the full forward pass at every position. Batches of prompts of
different lengths are right-padded: row b's prompt is `tokens[b, :lengths[b]]`; causality hides
the pad tokens from the real ones, and the pad slots (from `lengths[b]` on) are masked out and
overwritten by the decoded tokens.

Both caches (this contiguous one and `paged.PagedKVCache`) are pytrees with `lengths [B]` and
two methods, `store(layer, k_BTHK, v_BTHK, positions_BT)` and `read(layer) -> (k_BSHK, v_BSHK)`
(slot j = position j), so one `prefill` / `decode_step` serves both.

Contiguous memory: `2 * N * B * S * D * itemsize` bytes (`cache_bytes`) for capacity S <= C,
reserved for every row whatever its length (see `paged` for the alternative).
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from lmjax.checks import is_positive_int, require
from lmjax.errors import ShapeError
from lmjax.generate.paged import PagedKVCache
from lmjax.models import ModelConfig, attend, cached_block, check_params, embed, head
from lmjax.models.transformer import cast, check_tokens


def cache_bytes(cfg: ModelConfig, slots: int) -> int:
    """Bytes of keys plus values for `slots` token slots over all layers: `2 N slots D itemsize`."""
    return 2 * cfg.n_layers * slots * cfg.d_model * cfg.compute_dtype.itemsize


class KVCache(NamedTuple):
    """Contiguous cache: per layer `keys[i]`, `values[i]` `[B, S, H, Dh]`; `lengths [B]` int32."""

    keys: tuple
    values: tuple
    lengths: jax.Array

    @property
    def capacity(self) -> int:
        return self.keys[0].shape[1]

    def store(self, layer: int, k_BTHK, v_BTHK, positions_BT) -> KVCache:
        """Write each token's k, v at the slot of its position; positions >= S are dropped."""
        rows_B1 = jnp.arange(k_BTHK.shape[0])[:, None]

        def put(stack, new_BTHK):
            slab = stack[layer].at[rows_B1, positions_BT].set(new_BTHK, mode="drop")
            return stack[:layer] + (slab,) + stack[layer + 1 :]

        return self._replace(keys=put(self.keys, k_BTHK), values=put(self.values, v_BTHK))

    def read(self, layer: int) -> tuple:
        return self.keys[layer], self.values[layer]


def init_cache(cfg: ModelConfig, batch: int, capacity: int | None = None) -> KVCache:
    """An empty contiguous cache for `batch` rows of `capacity` slots (default C), zeros.

    `ConfigError` for a batch < 1 or a capacity outside [1, C] (as `init_paged_cache`).
    """
    capacity = cfg.context_length if capacity is None else capacity
    for what, value, hi in (("batch", batch, None), ("capacity", capacity, cfg.context_length)):
        ok = is_positive_int(value) and (hi is None or value <= hi)
        bound = f"an int in [1, {hi}] (context_length)" if hi else "an int >= 1"
        require(ok, f"cache {what}", value, bound, f"pass a {what} the model can hold")
    shape = (batch, capacity, cfg.n_heads, cfg.d_head)
    # Distinct buffers for every layer's keys and values: the steps donate each one.
    zeros = [tuple(jnp.zeros(shape, cfg.compute_dtype) for _ in range(cfg.n_layers)) for _ in "kv"]
    return KVCache(*zeros, jnp.zeros((batch,), jnp.int32))


def prefill_hidden(params: dict, tokens_BT, cfg: ModelConfig, cache, lengths_B) -> tuple:
    """The prompt's final hidden states `[B, T, D]` (before the head) and the filled cache."""
    check_params(params, cfg)
    p = cast(params, cfg.compute_dtype)
    b, t = tokens_BT.shape
    positions_BT = jnp.broadcast_to(jnp.arange(t)[None], (b, t))
    x_BTD = embed(p, tokens_BT, cfg)

    def self_attend(cfg, q_BTHK, k_BTHK, v_BTHK):
        return attend(cfg, q_BTHK, k_BTHK, v_BTHK), (k_BTHK, v_BTHK)

    for i in range(cfg.n_layers):
        x_BTD, (k_BTHK, v_BTHK) = cached_block(p["blocks"][str(i)], x_BTD, cfg, None, self_attend)
        cache = cache.store(i, k_BTHK, v_BTHK, positions_BT)
    return x_BTD, cache._replace(lengths=lengths_B.astype(jnp.int32))


def prefill_logits(params: dict, tokens_BT, cfg: ModelConfig, cache, lengths_B) -> tuple:
    """`prefill` without the host-side checks (jit-traceable): `-> (logits [B, T, V], cache)`.

    The caller guarantees what `prefill` checks: T within the capacity and C, and with a paged
    cache a mapped page for every real prompt position (unmapped writes are dropped silently).
    """
    x_BTD, cache = prefill_hidden(params, tokens_BT, cfg, cache, lengths_B)
    return head(cast(params, cfg.compute_dtype), x_BTD, cfg).astype(jnp.float32), cache


def decode_logits(params: dict, token_B, cfg: ModelConfig, cache) -> tuple:
    """`decode_step` without the host-side checks (jit-traceable): `-> (logits [B, V], cache)`.

    The caller guarantees what `decode_step` checks: `lengths < min(capacity, C)` and with a
    paged cache a mapped page at each row's position `lengths[b]` (`loop.stream` maps them with
    its `PageAllocator`); otherwise the logits are silently wrong.
    """
    check_params(params, cfg)
    p = cast(params, cfg.compute_dtype)
    positions_B1 = cache.lengths[:, None]
    x_B1D = embed(p, token_B[:, None], cfg, positions_B1)
    for i in range(cfg.n_layers):

        def cached_attend(cfg, q_B1HK, k_B1HK, v_B1HK, i=i, cache=cache):
            cache = cache.store(i, k_B1HK, v_B1HK, positions_B1)
            k_BSHK, v_BSHK = cache.read(i)
            visible_BS = jnp.arange(k_BSHK.shape[1])[None, :] <= positions_B1
            out = attend(cfg, q_B1HK, k_BSHK, v_BSHK, causal=False, mask=visible_BS[:, None, None])
            return out, cache

        x_B1D, cache = cached_block(p["blocks"][str(i)], x_B1D, cfg, positions_B1, cached_attend)
    logits_BV = head(p, x_B1D, cfg)[:, 0].astype(jnp.float32)
    return logits_BV, cache._replace(lengths=cache.lengths + 1)


# The cache is donated: XLA updates it in place instead of copying every layer each token.
_prefill_jit = jax.jit(prefill_logits, donate_argnames="cache")
_decode_jit = jax.jit(decode_logits, donate_argnames="cache")


def prefill(params: dict, tokens, cfg: ModelConfig, cache, lengths=None) -> tuple:
    """Fill an empty cache with a (right-padded) prompt batch: `-> (logits [B, T, V], cache)`.

    tokens `[B, T]`; `lengths [B]` (default T) are the real prompt lengths, `1 <= lengths <= T`.
    The logits at `t < lengths[b]` are the forward pass's; whatever the cache held is replaced.
    Jitted (one compile per shape), and the cache passed in is donated: use the returned one.
    Raises `ShapeError`/`TokenError` for bad tokens, lengths, `T` beyond the capacity, or (paged
    cache) a real prompt position whose page is not mapped in `cache.page_table`.
    """
    tokens_BT = check_tokens(tokens, cfg)
    b, t = tokens_BT.shape
    lengths_B = np.full((b,), t) if lengths is None else np.asarray(lengths)
    if lengths_B.shape != (b,) or lengths_B.dtype.kind not in "iu":
        raise ShapeError.describe(
            "lengths", lengths, f"{b} integers (one per row)", "give each row's prompt length"
        )
    if lengths_B.min() < 1 or lengths_B.max() > t:
        raise ShapeError.describe(
            "lengths", lengths_B.tolist(), f"each in [1, {t}]", "count only real prompt tokens"
        )
    _check_cache(cache, b, t - 1, cfg)
    _check_mapped(cache, np.zeros(b, np.int64), lengths_B)
    return _prefill_jit(params, tokens_BT, cfg, cache, jnp.asarray(lengths_B, jnp.int32))


def decode_step(params: dict, token, cfg: ModelConfig, cache) -> tuple:
    """Feed one token per row at position `cache.lengths`: `token [B] -> (logits [B, V], cache)`.

    Jitted once per (batch, capacity); the cache passed in is donated: use the returned one.
    Raises `TokenError` for ids outside the vocabulary and `ShapeError` when a row's cache is
    full (its next position would reach the capacity or the context length C; a paged cache's
    capacity, a whole number of pages, can exceed C) or, with a paged cache, when the page of a
    row's position is not mapped in `cache.page_table`.
    """
    token_B = check_tokens(np.asarray(token).reshape(-1, 1), cfg)[:, 0]
    lengths_B = np.asarray(cache.lengths)  # one small host copy: the checks need the values
    _check_cache(cache, token_B.shape[0], int(lengths_B.max()), cfg)
    _check_mapped(cache, lengths_B, lengths_B + 1)
    return _decode_jit(params, token_B, cfg, cache)


def _check_cache(cache, batch: int, last_position: int, cfg: ModelConfig) -> None:
    if cache.lengths.shape != (batch,):
        raise ShapeError.describe(
            "cache batch", cache.lengths.shape[0], f"{batch} (the token batch)", "init_cache(B)"
        )
    # A paged cache holds whole pages, so its capacity can exceed C: the model's positions end.
    limit = min(cache.capacity, cfg.context_length)
    if last_position >= limit:
        raise ShapeError.describe(
            "position",
            last_position,
            f"< cache capacity {limit}"
            if limit < cfg.context_length
            else f"< context_length {limit} (the model has no later positions)",
            f"init the cache with a larger capacity (at most {cfg.context_length})"
            if limit < cfg.context_length
            else f"stop decoding at {cfg.context_length} tokens per row",
        )


def _check_mapped(cache, first_B: np.ndarray, stop_B: np.ndarray) -> None:
    """With a paged cache, every position in `[first_B[b], stop_B[b])` must have a page."""
    if not isinstance(cache, PagedKVCache):
        return
    table_BM, size = np.asarray(cache.page_table), cache.page_size
    num_pages = cache.keys[0].shape[0]
    for b in range(table_BM.shape[0]):
        for page in range(int(first_B[b]) // size, (int(stop_B[b]) - 1) // size + 1):
            if not 0 <= table_BM[b, page] < num_pages:
                position = max(int(first_B[b]), page * size)
                raise ShapeError.describe(
                    f"page_table[{b}, {page}] (row {b}, position {position})",
                    int(table_BM[b, page]),
                    f"a mapped page in [0, {num_pages}) ({num_pages} means none)",
                    "map the row's pages first: PageAllocator.ensure(row, position + 1), then "
                    "cache._replace(page_table=jnp.asarray(allocator.table))",
                )


__all__ = [
    "KVCache",
    "cache_bytes",
    "decode_logits",
    "decode_step",
    "init_cache",
    "prefill",
    "prefill_hidden",
    "prefill_logits",
]
