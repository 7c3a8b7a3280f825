"""KV-cached decoding (docs/decoding.md): `prefill` a prompt, then `decode_step` one token at
a time.

A cache keeps every layer's keys and values at their absolute positions, so a new token attends
to everything before it without recomputing it. The cache holds `Hkv = cfg.kv_heads` heads of
`Dh = cfg.d_head` features (grouped-query attention: H / Hkv query heads share each one, and
the attention reads them as they are, never a repeated copy). With `p_b` the position of row
b's token and S the capacity:

    prefill(tokens [B, T], lengths [B]):
        the forward pass of the prompt (causal self-attention over its T tokens, the very
        computation of `models.forward`, sliding window included); each layer's k, v
        [B, T, Hkv, Dh] of the real positions stored at their slots; lengths = lengths.
                                                                       -> logits [B, T, V]
    decode_step(token [B]):  p_b = lengths[b]
        each layer stores its k, v [B, 1, Hkv, Dh] at the slot of p_b, then attends over the
        slots that hold a position u <= p_b (with `cfg.sliding_window` W also p_b - u < W:
        key mask [B, 1, 1, S]); lengths += 1.                          -> logits [B, V]

Slots (`slots_of`). Without a sliding window slot j of a row holds position j. With one, the
cache is a ring: position u lives in slot `u % S`, so a cache of S >= W slots holds every key
a token can still see, however long the sequence (a position's key is overwritten only once it
is W or more behind the newest token); with S beyond every position the ring is the identity.
Keys are stored after RoPE, so RoPE, learned and sinusoidal positions all take `p_b` and the
logits equal the full forward pass at every position. Batches of prompts of different lengths
are right-padded: row b's prompt is `tokens[b, :lengths[b]]`; causality hides the pad tokens
from the real ones, their k, v are never stored, and the decoded tokens take their slots.

Both caches (this contiguous one and `paged.PagedKVCache`) are pytrees with `lengths [B]`, a
`capacity` and two methods, `store(layer, k_BTHK, v_BTHK, slots_BT)` (a slot outside
[0, capacity) is dropped) and `read(layer) -> (k_BSHK, v_BSHK)` (slot order), so one
`prefill` / `decode_step` serves both.

Layers. The caches are stacked like the blocks (`lmjax.params`): one `keys` and one `values`
array whose leading axis is the layer, `[N, B, S, Hkv, Dh]` (pages `[N, P, page, Hkv, Dh]`).
Prefill and each decode step run the layers through `models.transformer.run_layers`: one
`lax.scan` with `cfg.scan_layers` (the default), a Python loop otherwise, with the same values.
The whole cache rides in the loop's carry and layer i writes its rows in place (`store(i,
...)`, i a traced index in the scan), so a step writes only the new tokens' slots; had the
layers' slices gone in as the scan's xs and come back as its ys, the ys would be a second
cache-sized buffer, and every step would copy every layer's slab into it.

Decoding reads every weight once a token, so its speed is the weights' bandwidth. XLA's CPU
code copies a layer's weights out of the stacked arrays before each matmul (a dynamic slice in
the scan, a static one in the loop: about 2x the memory traffic, half the tokens a second at
batch 1), so on a CPU `decoding_params` splits the blocks into per-layer arrays once, which
`run_layers` runs by its loop (`layers="auto"`; "stacked" or "per_layer" to choose). Off a
CPU the blocks stay stacked and scanned (neither layout timed on an accelerator yet).

Contiguous memory: `2 * N * B * S * Hkv * Dh * itemsize` bytes (`cache_bytes`) for capacity
S <= C, reserved for every row whatever its length (see `paged` for the alternative); GQA makes
it H / Hkv times smaller than multi-head attention's, and a sliding window bounds the S a
decoding loop needs by W (`loop.stream` takes S = min(bucket(prompt + new), bucket(W))).
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from lmjax import params as ptree
from lmjax.checks import is_positive_int, require
from lmjax.errors import ShapeError
from lmjax.generate.paged import PagedKVCache
from lmjax.models import ModelConfig, attend, cached_block, check_params, embed, head
from lmjax.models.transformer import cast, check_tokens, run_layers


def cache_bytes(cfg: ModelConfig, slots: int) -> int:
    """Bytes of keys plus values for `slots` token slots over all layers:
    `2 N slots Hkv Dh itemsize` (`Hkv Dh = cfg.kv_features`: the cache stores the kv heads)."""
    return 2 * cfg.n_layers * slots * cfg.kv_features * cfg.compute_dtype.itemsize


def slots_of(cfg: ModelConfig, capacity: int, positions):
    """The cache slot of each absolute position: itself, or `position % capacity` (a ring) when
    the model has a sliding window (module docstring). Shape-preserving, traceable."""
    return positions if cfg.sliding_window is None else positions % capacity


def visible_slots(cfg: ModelConfig, capacity: int, positions_B1) -> jax.Array:
    """bool `[B, S]`: the slots a token at `positions [B, 1]` attends to, once it is stored.

    Slot s was last written `age = (p - s) mod S` positions ago (every position up to p has
    been written, the oldest overwritten first), so it holds position `p - age`: visible iff
    that position exists (`age <= p`) and, with a window W, is in view (`age < W`). Without a
    ring (S > p) this is `s <= p` and `p - s < W`.
    """
    s_1S = jnp.arange(capacity)[None, :]
    if cfg.sliding_window is None:
        return s_1S <= positions_B1
    age_BS = (positions_B1 - s_1S) % capacity
    return (age_BS <= positions_B1) & (age_BS < cfg.sliding_window)


def is_ring(cfg: ModelConfig, capacity: int) -> bool:
    """Whether a cache of `capacity` slots may take positions past its capacity: a ring of at
    least the window's W slots holds every key still in view."""
    return cfg.sliding_window is not None and capacity >= cfg.sliding_window


def prompt_slots(cfg: ModelConfig, capacity: int, t: int, lengths_B) -> jax.Array:
    """int `[B, T]`: the slot each prompt position is stored at; `capacity` (dropped) for pad
    positions `>= lengths[b]` and for positions a ring has no room for (`< lengths[b] - S`,
    outside every later token's window), so no two stored positions share a slot."""
    positions_BT = jnp.broadcast_to(jnp.arange(t)[None], (lengths_B.shape[0], t))
    lengths_B1 = lengths_B[:, None]
    kept_BT = (positions_BT < lengths_B1) & (positions_BT >= lengths_B1 - capacity)
    return jnp.where(kept_BT, slots_of(cfg, capacity, positions_BT), capacity)


class KVCache(NamedTuple):
    """Contiguous cache, stacked over layers: `keys`, `values` `[N, B, S, Hkv, Dh]`;
    `lengths [B]` int32."""

    keys: jax.Array
    values: jax.Array
    lengths: jax.Array

    @property
    def capacity(self) -> int:
        return self.keys.shape[2]

    def store(self, layer, k_BTHK, v_BTHK, slots_BT) -> KVCache:
        """Write layer `layer`'s (an int, or a traced index in a scan) k, v of each token at its
        slot `slots [B, T]`; slots >= S are dropped. In place under jit: one scatter."""
        rows_B1 = jnp.arange(k_BTHK.shape[0])[:, None]

        def put(stack_NBSHK, new_BTHK):
            return stack_NBSHK.at[layer, rows_B1, slots_BT].set(new_BTHK, mode="drop")

        return self._replace(keys=put(self.keys, k_BTHK), values=put(self.values, v_BTHK))

    def read(self, layer) -> tuple:
        """Layer `layer`'s `(keys, values)` `[B, S, Hkv, Dh]`."""
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
    shape = (cfg.n_layers, batch, capacity, cfg.kv_heads, cfg.d_head)
    # Two distinct buffers, keys and values: the steps donate each one.
    zeros = [jnp.zeros(shape, cfg.compute_dtype) for _ in "kv"]
    return KVCache(*zeros, jnp.zeros((batch,), jnp.int32))


def prefill_hidden(params: dict, tokens_BT, cfg: ModelConfig, cache, lengths_B) -> tuple:
    """The prompt's final hidden states `[B, T, D]` (before the head) and the filled cache."""
    check_layout(params, cfg)
    p = cast(params, cfg.compute_dtype)
    slots_BT = prompt_slots(cfg, cache.capacity, tokens_BT.shape[1], lengths_B)
    x_BTD = embed(p, tokens_BT, cfg)

    def self_attend(cfg, q_BTHK, k_BTHK, v_BTHK):
        return attend(cfg, q_BTHK, k_BTHK, v_BTHK), (k_BTHK, v_BTHK)

    def step(p_layer, carry, i):  # the cache in the carry: written in place (module docstring)
        x_BTD, cache = carry
        x_BTD, (k_BTHK, v_BTHK) = cached_block(p_layer, x_BTD, cfg, None, self_attend)
        return (x_BTD, cache.store(i, k_BTHK, v_BTHK, slots_BT)), None

    (x_BTD, cache), _ = run_layers(cfg, p["blocks"], (x_BTD, cache), step, _layer_index(cfg))
    return x_BTD, cache._replace(lengths=lengths_B.astype(jnp.int32))


LAYOUTS = ("auto", "stacked", "per_layer")


def decoding_params(params: dict, cfg: ModelConfig, layers: str = "auto") -> dict:
    """The weights as decoding reads them: cast to `cfg.compute_dtype` (once, not every token)
    and with the blocks `layers`: "stacked" (`[N, ...]`, one scan), "per_layer" (`{"0": ...}`,
    a loop over N arrays of each) or "auto", per-layer where the params live on a CPU (module
    docstring). Splitting is one copy of the block weights; a tree already laid out so is
    returned cast. `prefill`, `decode_step` and `loop.stream` take either layout."""
    require(layers in LAYOUTS, "layers", layers, f"one of {LAYOUTS}", "pass one of them")
    if layers == "auto":
        layers = "per_layer" if _on_cpu(params) else "stacked"
    held = ptree.blocks_layout(params)
    if layers == "per_layer" and held == "stacked":
        return _split_cast(params, cfg.compute_dtype)
    if layers == "stacked" and held == "layers":
        params = ptree.stack(params)
    return cast(params, cfg.compute_dtype)


@functools.partial(jax.jit, static_argnums=1)
def _split_cast(params: dict, dtype) -> dict:
    """Cast and split in one program: the per-layer arrays are its outputs (one copy)."""
    return ptree.unstack(cast(params, dtype))


def _on_cpu(params: dict) -> bool:
    leaf = jax.tree.leaves(params)[0]
    devices = leaf.devices() if isinstance(leaf, jax.Array) else {jax.devices()[0]}
    return all(d.platform == "cpu" for d in devices)


def check_layout(params: dict, cfg: ModelConfig) -> None:
    """`check_params` for either layout of the blocks (per-layer ones checked as stacked)."""
    if ptree.blocks_layout(params) == "layers":
        params = jax.eval_shape(ptree.stack, params)
    check_params(params, cfg)


def _layer_index(cfg: ModelConfig) -> jax.Array:
    """`[N]` int32 `0..N-1`: `run_layers` hands step i its own layer's index."""
    return jnp.arange(cfg.n_layers, dtype=jnp.int32)


def prefill_logits(params: dict, tokens_BT, cfg: ModelConfig, cache, lengths_B) -> tuple:
    """`prefill` without the host-side checks (jit-traceable): `-> (logits [B, T, V], cache)`.

    The caller guarantees what `prefill` checks: T within the capacity (or a ring, `is_ring`)
    and C, and with a paged cache a mapped page for the slot of every real prompt position a
    ring keeps (unmapped writes are dropped silently).
    """
    x_BTD, cache = prefill_hidden(params, tokens_BT, cfg, cache, lengths_B)
    return head(cast(params, cfg.compute_dtype), x_BTD, cfg).astype(jnp.float32), cache


def decode_logits(params: dict, token_B, cfg: ModelConfig, cache) -> tuple:
    """`decode_step` without the host-side checks (jit-traceable): `-> (logits [B, V], cache)`.

    The caller guarantees what `decode_step` checks: `lengths < min(capacity, C)` (`< C` for a
    ring, `is_ring`) and with a paged cache a mapped page at the slot of each row's position
    `lengths[b]` (`loop.stream` maps them with its `PageAllocator`); otherwise the logits are
    silently wrong.
    """
    check_layout(params, cfg)
    p = cast(params, cfg.compute_dtype)
    positions_B1 = cache.lengths[:, None]
    slots_B1 = slots_of(cfg, cache.capacity, positions_B1)
    # The query sits at t = 0 of a non-causal call (the window there sees every slot), so the
    # mask alone says which slots it sees: the causal and window rules at its own position.
    visible_B11S = visible_slots(cfg, cache.capacity, positions_B1)[:, None, None]
    x_B1D = embed(p, token_B[:, None], cfg, positions_B1)

    def step(p_layer, carry, i):  # the cache in the carry: written in place (module docstring)
        x_B1D, cache = carry

        def cached_attend(cfg, q_B1HK, k_B1GK, v_B1GK):
            # k, v carry the Hkv kv heads (G here): stored and attended as they are (GQA).
            stored = cache.store(i, k_B1GK, v_B1GK, slots_B1)
            k_BSGK, v_BSGK = stored.read(i)
            out = attend(cfg, q_B1HK, k_BSGK, v_BSGK, causal=False, mask=visible_B11S)
            return out, stored

        return cached_block(p_layer, x_B1D, cfg, positions_B1, cached_attend), None

    (x_B1D, cache), _ = run_layers(cfg, p["blocks"], (x_B1D, cache), step, _layer_index(cfg))
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
    Raises `ShapeError`/`TokenError` for bad tokens, lengths, a cache of another depth than
    the model's, `T` beyond the capacity (a ring, `is_ring`, keeps each row's last `capacity`
    prompt positions instead), or (paged cache) a stored prompt position whose page is not
    mapped in `cache.page_table`.
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
    _check_mapped(cache, cfg, np.zeros(b, np.int64), lengths_B)
    return _prefill_jit(params, tokens_BT, cfg, cache, jnp.asarray(lengths_B, jnp.int32))


def decode_step(params: dict, token, cfg: ModelConfig, cache) -> tuple:
    """Feed one token per row at position `cache.lengths`: `token [B] -> (logits [B, V], cache)`.

    Jitted once per (batch, capacity); the cache passed in is donated: use the returned one.
    Raises `TokenError` for ids outside the vocabulary and `ShapeError` when a row's cache is
    full (its next position would reach the capacity or the context length C; a paged cache's
    capacity, a whole number of pages, can exceed C; a ring is full only at C), for a cache of
    another depth than the model's, or, with a paged cache, when the page of a row's slot is
    not mapped in `cache.page_table`.
    """
    token_B = check_tokens(np.asarray(token).reshape(-1, 1), cfg)[:, 0]
    lengths_B = np.asarray(cache.lengths)  # one small host copy: the checks need the values
    _check_cache(cache, token_B.shape[0], int(lengths_B.max()), cfg)
    _check_mapped(cache, cfg, lengths_B, lengths_B + 1)
    return _decode_jit(params, token_B, cfg, cache)


def _check_cache(cache, batch: int, last_position: int, cfg: ModelConfig) -> None:
    if cache.keys.shape[0] != cfg.n_layers:  # the scan would fail deep inside, unnamed
        raise ShapeError.describe(
            "cache layers (keys.shape[0])",
            cache.keys.shape[0],
            f"{cfg.n_layers} (model.n_layers)",
            "init the cache with the model's config",
        )
    if cache.lengths.shape != (batch,):
        raise ShapeError.describe(
            "cache batch", cache.lengths.shape[0], f"{batch} (the token batch)", "init_cache(B)"
        )
    # A paged cache holds whole pages, so its capacity can exceed C: the model's positions end.
    # A ring (sliding window, capacity >= W) takes every position the model has.
    ring = is_ring(cfg, cache.capacity)
    limit = cfg.context_length if ring else min(cache.capacity, cfg.context_length)
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


def _check_mapped(cache, cfg: ModelConfig, first_B: np.ndarray, stop_B: np.ndarray) -> None:
    """With a paged cache, the slot of every position in `[first_B[b], stop_B[b])` that is
    stored (a ring keeps only the last `capacity` of a prompt) must have a page."""
    if not isinstance(cache, PagedKVCache):
        return
    table_BM, size, num_pages = np.asarray(cache.page_table), cache.page_size, cache.num_pages
    for b in range(table_BM.shape[0]):
        first = max(int(first_B[b]), int(stop_B[b]) - cache.capacity)
        positions = np.arange(first, int(stop_B[b]))
        slots = slots_of(cfg, cache.capacity, positions)
        entries = table_BM[b, slots // size]
        unmapped = np.flatnonzero((entries < 0) | (entries >= num_pages))
        if unmapped.size:
            position, slot = int(positions[unmapped[0]]), int(slots[unmapped[0]])
            where = f"position {position}" + (f", slot {slot}" if slot != position else "")
            raise ShapeError.describe(
                f"page_table[{b}, {slot // size}] (row {b}, {where})",
                int(entries[unmapped[0]]),
                f"a mapped page in [0, {num_pages}) ({num_pages} means none)",
                "map the row's pages first: PageAllocator.ensure(row, slot + 1) (the slot is "
                "the position, or position % capacity with a sliding window), then "
                "cache._replace(page_table=jnp.asarray(allocator.table))",
            )


__all__ = [
    "KVCache",
    "cache_bytes",
    "decode_logits",
    "decode_step",
    "init_cache",
    "is_ring",
    "prefill",
    "prefill_hidden",
    "prefill_logits",
    "prompt_slots",
    "slots_of",
    "visible_slots",
]
