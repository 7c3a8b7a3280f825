"""Witnesses for decoding tests: the full forward pass, never the decoding code under test."""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
import numpy as np

from lmjax import generate as G
from lmjax import models

F32_TOL = dict(rtol=1e-5, atol=1e-5)  # float32 at matmul precision highest (conftest)


def paged_cache(cfg, batch, capacity=None, page_size=4):
    """A paged cache of `capacity` slots (default C) per row, every page mapped, the rows on
    interleaved, reversed pages, so a table slip would show."""
    capacity = cfg.context_length if capacity is None else capacity
    per_row = math.ceil(capacity / page_size)
    cache = G.init_paged_cache(cfg, batch, batch * per_row, page_size, capacity)
    table = np.arange(batch * per_row)[::-1].reshape(per_row, batch).T
    return cache._replace(page_table=jnp.asarray(table, jnp.int32))


@functools.cache
def padded_forward(cfg):
    return jax.jit(models.forward)


def greedy_witness(params, prompt, cfg, n):
    """Greedy continuation by re-running the full forward pass on the growing sequence.

    The sequence is right-padded to C (one compile); by causality, position len - 1 of the
    padded forward is the last position of the unpadded one.
    """
    seq = list(prompt)
    for _ in range(n):
        padded = jnp.asarray([seq + [0] * (cfg.context_length - len(seq))])
        logits_V = padded_forward(cfg)(params, padded, cfg)[0, len(seq) - 1]
        seq.append(int(jnp.argmax(logits_V)))
    return seq[len(prompt) :]


def check_padded_decode(params, cfg, cache, lengths, seed=1):
    """Prefill two right-padded prompts of `lengths` (row 0 shorter), decode both rows up to C,
    and check the logits equal `models.forward` over the whole sequence at every position."""
    c, t = cfg.context_length, int(max(lengths))
    tokens_BC = np.random.default_rng(seed).integers(0, cfg.vocab_size, (2, c)).astype(np.int32)
    full_BCV = np.asarray(padded_forward(cfg)(params, tokens_BC, cfg))
    lengths = np.asarray(lengths)
    prompt_BT = tokens_BC[:, :t].copy()
    prompt_BT[0, lengths[0] :] = 0  # padding: row 0's prompt is shorter
    logits_BTV, cache = G.prefill(params, prompt_BT, cfg, cache, lengths)
    for b, n in enumerate(lengths):
        np.testing.assert_allclose(logits_BTV[b, :n], full_BCV[b, :n], **F32_TOL)
    for step in range(c - t):
        pos_B = lengths + step
        logits_BV, cache = G.decode_step(params, tokens_BC[[0, 1], pos_B], cfg, cache)
        np.testing.assert_allclose(logits_BV, full_BCV[[0, 1], pos_B], **F32_TOL)
    np.testing.assert_array_equal(cache.lengths, lengths + c - t)
