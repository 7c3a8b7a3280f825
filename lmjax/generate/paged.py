"""A paged KV cache (docs/decoding.md): fixed-size pages from one pool, a page table per sequence.

Layout, stacked over layers like the blocks: `keys`, `values` `[N, P, page_size, Hkv, Dh]` (layer
i's pool, `keys[i]`, is P pages of the model's `cfg.kv_heads` key/value heads; every layer
uses the same page numbers); `page_table [B, M]` int32 maps row b's slot j (its
position j, or with a sliding window `j % capacity`: `kv_cache.slots_of`) to page
`page_table[b, j // page_size]`, offset `j % page_size`; an entry outside `[0, P)` (P is the
sentinel) means "no page": writes there are dropped and reads give zeros (always masked out: a
row only attends to positions it has written).
The table has `M = ceil(capacity / page_size)` entries per row, so the capacity `M * page_size`
can exceed the context length C; `kv_cache.decode_step` bounds positions by `min(capacity, C)`.

Cost per step, stated plainly: `read` gathers a row's pages into a contiguous
`[B, M * page_size, Hkv, Dh]` view, for keys and for values, in every layer at every step, so that
`prefill` / `decode_step` of `kv_cache` run unchanged and give the same tokens. That view is as
large as one layer of a contiguous cache of the same capacity (a transient, one layer at a time),
and the gather reads the pages once more each step: paging saves resident memory, not per-step
bandwidth or compute (a paged-attention kernel would read the pages in place; this is the
pure-JAX form).

`PageAllocator` is the host-side bookkeeping between jitted steps (`loop.stream` drives it): a
free list, the pages each row owns, `ensure(row, n_slots)` before a row writes slot
n_slots - 1, `release(row)` when it finishes (stop token or max tokens). The pool and the table
have static shapes, so the decode step never recompiles as pages come and go. A caller of
`kv_cache.prefill` / `decode_step` with a paged cache maps pages the same way before each call;
those public entry points check the table on the host and raise `ShapeError` naming the row and
position of an unmapped write. The jitted forms (`prefill_logits`, `decode_logits`, the steps of
`loop.stream`) do not check: that would cost a host sync per step, and `stream`'s allocator
maps every page before the step that writes it.

Memory. A contiguous cache reserves `B * S` slots (capacity S <= C) for every batch; a pool of
P pages holds `P * page_size` slots, whatever the batch. For GPT-2 124M in float32 one slot is
`2 * 12 * 768 * 4 = 72 KiB` (`cache_bytes(cfg, 1)`); 8 sequences of final lengths 20, 40, 60,
100, 150, 300, 500 and 1000 tokens, with C = 1024, need:
    contiguous  8 * 1024 slots                             = 576.0 MiB
    paged       (2+3+4+7+10+19+32+63) = 140 pages of 16     = 157.5 MiB  (+ a [8, 64] int32 table)
The paged figure is the pool the caller sizes for those lengths, `num_pages=140`. Both figures
scale with `cfg.kv_features = Hkv * Dh` (grouped-query attention: a model of 12 query heads and
4 kv heads needs a third), and with a sliding window W a row never holds more than its table's
`ceil(S / page_size)` pages, S ~ W (the ring of `kv_cache.slots_of`). `loop.stream`
cannot know in advance where rows will stop, so its default `num_pages` is the worst case, every
row running to `max_new_tokens` (`sum_b ceil((len_b + max_new_tokens - 1) / page_size)`): close
to the contiguous size (smaller only by the prompts' length differences and the contiguous
cache's power-of-two rounding of S). Pages a finished row frees go back to the pool, but
within one `stream` call no new sequence draws on them (the batch is fixed), so they only help
if the pool is smaller than the worst case. A smaller pool saves memory at the risk of running
out mid-stream: `stream` then raises `ConfigError` with the worst-case page count for the batch.
"""

from __future__ import annotations

import math
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from lmjax.checks import is_int, is_positive_int, require
from lmjax.errors import ConfigError
from lmjax.models import ModelConfig


class PagedKVCache(NamedTuple):
    """Pools `keys`, `values` `[N, P, page, Hkv, Dh]`, `page_table [B, M]`, `lengths [B]`."""

    keys: jax.Array
    values: jax.Array
    page_table: jax.Array
    lengths: jax.Array

    @property
    def num_pages(self) -> int:
        return self.keys.shape[1]

    @property
    def page_size(self) -> int:
        return self.keys.shape[2]

    @property
    def capacity(self) -> int:
        return self.page_table.shape[1] * self.page_size

    def store(self, layer, k_BTHK, v_BTHK, slots_BT) -> PagedKVCache:
        """Write layer `layer`'s (an int, or a traced index in a scan) k, v of each token into
        its row's page for its slot `slots [B, T]` (dropped if the page is unmapped or the
        slot >= capacity). In place under jit: one scatter."""
        page_BT = jnp.take_along_axis(
            self.page_table,
            slots_BT // self.page_size,
            axis=1,
            mode="fill",
            fill_value=self.num_pages,
        )
        offset_BT = slots_BT % self.page_size

        def put(stack_NPLHK, new_BTHK):
            return stack_NPLHK.at[layer, page_BT, offset_BT].set(new_BTHK, mode="drop")

        return self._replace(keys=put(self.keys, k_BTHK), values=put(self.values, v_BTHK))

    def read(self, layer) -> tuple:
        """Layer `layer`'s pages of row b in table order: `[B, M * page, Hkv, Dh]`, in slot
        order, for keys and for values."""

        def gather(pool_PLHK):
            pages_BMLHK = jnp.take(pool_PLHK, self.page_table, axis=0, mode="fill", fill_value=0)
            b, m, page, h, k = pages_BMLHK.shape
            return pages_BMLHK.reshape(b, m * page, h, k)

        return gather(self.keys[layer]), gather(self.values[layer])


def init_paged_cache(
    cfg: ModelConfig, batch: int, num_pages: int, page_size: int, capacity: int | None = None
) -> PagedKVCache:
    """An empty pool of `num_pages` pages and a `[batch, ceil(capacity / page_size)]` table.

    Every entry of the table is `num_pages` (no page). `ConfigError` for sizes < 1 or a capacity
    outside [1, C] (as `kv_cache.init_cache`).
    """
    capacity = cfg.context_length if capacity is None else capacity
    for what, value in (("batch", batch), ("num_pages", num_pages), ("page_size", page_size)):
        require(is_positive_int(value), what, value, "an int >= 1", f"pass a positive {what}")
    if not is_int(capacity) or not 1 <= capacity <= cfg.context_length:
        raise ConfigError.describe(
            "capacity",
            capacity,
            f"an int in [1, {cfg.context_length}] (context_length)",
            "pass a capacity the model can hold",
        )
    shape = (cfg.n_layers, num_pages, page_size, cfg.kv_heads, cfg.d_head)
    # Two distinct buffers, keys and values: the steps donate each one.
    zeros = [jnp.zeros(shape, cfg.compute_dtype) for _ in "kv"]
    table = jnp.full((batch, math.ceil(capacity / page_size)), num_pages, jnp.int32)
    return PagedKVCache(*zeros, table, jnp.zeros((batch,), jnp.int32))


class PageAllocator:
    """Host-side page bookkeeping for a pool of `num_pages` pages of `page_size` slots.

    `table` (numpy `[B, M]`) is what the jitted steps read; it changes only through `ensure`
    and `release`, which keep `in_use == sum over rows of len(owned[row])`.
    """

    def __init__(self, num_pages: int, page_size: int, batch: int, pages_per_row: int):
        self.num_pages, self.page_size = num_pages, page_size
        self.free = list(range(num_pages - 1, -1, -1))  # pop() hands out page 0 first
        self.owned: list[list[int]] = [[] for _ in range(batch)]
        self.table = np.full((batch, pages_per_row), num_pages, np.int32)

    @property
    def in_use(self) -> int:
        return self.num_pages - len(self.free)

    def ensure(self, row: int, n_slots: int) -> None:
        """Give `row` enough pages for slots `0..n_slots-1`; `ConfigError` if the pool is empty."""
        need = math.ceil(n_slots / self.page_size)
        if need > self.table.shape[1]:
            raise ConfigError.describe(
                "slots requested for one row",
                n_slots,
                f"<= {self.table.shape[1] * self.page_size} (the page table's width)",
                "build the cache with a larger capacity",
            )
        while len(self.owned[row]) < need:
            if not self.free:
                raise ConfigError.describe(
                    "free pages",
                    0,
                    f"a page for row {row} (pool of {self.num_pages} x {self.page_size} slots)",
                    "raise num_pages, or decode fewer or shorter sequences at once",
                )
            page = self.free.pop()
            self.table[row, len(self.owned[row])] = page
            self.owned[row].append(page)

    def release(self, row: int) -> None:
        """Return every page of `row` to the pool and unmap its table row."""
        self.free.extend(reversed(self.owned[row]))
        self.owned[row] = []
        self.table[row] = self.num_pages


__all__ = ["PageAllocator", "PagedKVCache", "init_paged_cache"]
