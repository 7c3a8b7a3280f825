"""Decoding (docs/decoding.md): KV caches, sampling, batched and paged generation.

    from lmjax import generate as G
    new_tokens = G.generate(params, [[5, 3, 9], [7]], cfg, max_new_tokens=20, temperature=0.8,
                            top_k=50, top_p=0.9, seed=0, stop_tokens=[0])
    for step in G.stream(params, prompts, cfg, max_new_tokens=20):   # step.tokens [B]
        ...

The pieces: `kv_cache` (`init_cache`, `prefill`, `decode_step`; the logits equal the full
forward pass at every position), `paged` (a pool of fixed-size pages, a page table per
sequence, host-side `PageAllocator`), `sampling` (`Sampling`, `sample`), `loop` (`stream`,
`generate`: right-padded batches, power-of-two shape buckets, stop tokens).
"""

from lmjax.generate.kv_cache import (
    KVCache,
    cache_bytes,
    decode_logits,
    decode_step,
    decoding_params,
    init_cache,
    prefill,
    prefill_logits,
)
from lmjax.generate.loop import CACHES, Step, generate, stream
from lmjax.generate.paged import PageAllocator, PagedKVCache, init_paged_cache
from lmjax.generate.sampling import Sampling, sample

__all__ = [
    "CACHES",
    "KVCache",
    "PageAllocator",
    "PagedKVCache",
    "Sampling",
    "Step",
    "cache_bytes",
    "decode_logits",
    "decode_step",
    "decoding_params",
    "generate",
    "init_cache",
    "init_paged_cache",
    "prefill",
    "prefill_logits",
    "sample",
    "stream",
]
