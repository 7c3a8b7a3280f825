"""Decoding with grouped-query attention and sliding windows (issue 23): KV and paged caches.

Witnesses are independent of the decoding code: `models.forward` over the whole sequence for
logits, greedy decoding by re-running `models.forward` on the growing sequence for tokens, and,
for the window itself, a one-layer RoPE model run *without* a window on just the last W tokens
(RoPE scores depend only on relative positions, so that is what the windowed query sees).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from _decoding import F32_TOL, check_padded_decode, greedy_witness, padded_forward, paged_cache

from lmjax import generate as G
from lmjax import models, testing
from lmjax import params as ptree
from lmjax.errors import ConfigError, ShapeError
from lmjax.generate import kv_cache, loop

# C = 24 and prompts up to 11 tokens: every window below is shorter than the longest prompt.
TINY = dict(vocab_size=27, context_length=24, d_model=32, n_heads=4, n_layers=2, d_ff=64)
CONFIGS = {
    "gqa2": models.preset("llama", **TINY, n_kv_heads=2),
    "mqa-window5": models.preset("llama", **TINY, n_kv_heads=1, sliding_window=5),
    "gqa2-qknorm-dh12-window6": models.preset(
        "llama", **TINY, n_kv_heads=2, head_dim=12, qk_norm=True, sliding_window=6
    ),
}
PROMPTS = [[3, 1, 4], [1], [5, 9, 2, 6, 5, 3, 5, 8, 9, 7, 9]]


@pytest.fixture(scope="module")
def params():
    return {
        name: models.init(jax.random.key(i), cfg) for i, (name, cfg) in enumerate(CONFIGS.items())
    }


def nbytes(cache) -> int:
    return sum(a.size * a.dtype.itemsize for a in (cache.keys, cache.values))


# ---- what the caches hold -------------------------------------------------------------------


def test_caches_store_the_kv_heads_and_cache_bytes_counts_them():
    cfg = CONFIGS["gqa2-qknorm-dh12-window6"]  # Hkv 2 of Dh 12 (Hkv * Dh = 24 != D = 32)
    mha = cfg.replace(n_kv_heads=None)
    for c in (cfg, mha):
        contiguous = jax.eval_shape(lambda c=c: G.init_cache(c, 3, 16))
        assert contiguous.keys.shape == (c.n_layers, 3, 16, c.kv_heads, 12)  # stacked: [N, ...]
        assert nbytes(contiguous) == G.cache_bytes(c, 3 * 16)
        pool = jax.eval_shape(lambda c=c: G.init_paged_cache(c, 3, 10, 4, 16))
        assert pool.values.shape == (c.n_layers, 10, 4, c.kv_heads, 12)
        assert nbytes(pool) == G.cache_bytes(c, 10 * 4)
    assert G.cache_bytes(mha, 8) == (mha.n_heads // cfg.kv_heads) * G.cache_bytes(cfg, 8)
    assert G.cache_bytes(cfg, 1) == 2 * 2 * (2 * 12) * 4  # 2 (k, v) x N x Hkv Dh x float32


@pytest.mark.parametrize("scan", [True, False], ids=["scanned", "unrolled"])
def test_decoding_attends_over_the_kv_heads_without_a_repeated_copy(monkeypatch, scan):
    """Scanned, the step traces one layer's attention (the scan's body); unrolled, N."""
    cfg = CONFIGS["mqa-window5"].replace(scan_layers=scan)
    seen = []

    def spy(cfg, q, k, v, **kwargs):
        seen.append((q.shape, k.shape, v.shape))
        return models.attend(cfg, q, k, v, **kwargs)

    monkeypatch.setattr(kv_cache, "attend", spy)
    p = models.abstract_params(cfg)
    cache = G.init_cache(cfg, 2, 8)
    jax.eval_shape(lambda p, t, c: kv_cache.decode_logits(p, t, cfg, c), p, np.zeros(2, int), cache)
    assert seen == [((2, 1, 4, 8), (2, 8, 1, 8), (2, 8, 1, 8))] * (1 if scan else cfg.n_layers)


# ---- prefill + decode equals the full forward pass ------------------------------------------


@pytest.mark.parametrize("cache_kind", ["contiguous", "paged"])
@pytest.mark.parametrize("name", list(CONFIGS))
def test_prefill_then_decode_equals_forward_at_every_position(params, name, cache_kind):
    """Right-padded rows of lengths 3 and 9 (longer than the windows) decoding up to C. With a
    window the cache has 8 slots (a ring past W: positions wrap twice); without, C."""
    cfg, p = CONFIGS[name], params[name]
    s = cfg.context_length if cfg.sliding_window is None else 8
    cache = G.init_cache(cfg, 2, s) if cache_kind == "contiguous" else paged_cache(cfg, 2, s)
    check_padded_decode(p, cfg, cache, [3, 9])


def test_a_window_hides_keys_w_or_more_behind_the_query():
    """One RoPE layer, window 4: decoded position t sees exactly tokens t-3..t, as the same
    model without a window fed only those four tokens (an independent witness of the rule)."""
    cfg = models.preset("llama", **TINY | dict(n_layers=1), n_kv_heads=2, sliding_window=4)
    plain = cfg.replace(sliding_window=None)
    p = models.init(jax.random.key(7), cfg)
    tokens_1C = np.random.default_rng(3).integers(0, cfg.vocab_size, (1, 16)).astype(np.int32)
    logits_1TV, cache = G.prefill(p, tokens_1C[:, :6], cfg, G.init_cache(cfg, 1, 8))
    for t in range(6, 16):
        logits_1V, cache = G.decode_step(p, tokens_1C[:, t], cfg, cache)
        window_1V = padded_forward(plain)(p, tokens_1C[:, t - 3 : t + 1], plain)[:, -1]
        np.testing.assert_allclose(logits_1V, window_1V, **F32_TOL)
    # Without the window the same decode sees the whole prefix, and differs.
    _, cache = G.prefill(p, tokens_1C[:, :15], plain, G.init_cache(plain, 1, 16))
    full_1V, _ = G.decode_step(p, tokens_1C[:, 15], plain, cache)
    assert np.abs(np.asarray(full_1V) - np.asarray(window_1V)).max() > 1e-3


def test_a_ring_takes_positions_past_its_capacity_a_short_cache_does_not():
    cfg = CONFIGS["mqa-window5"]
    p = models.abstract_params(cfg)
    tokens = np.zeros((1, 9), np.int32)
    assert kv_cache.is_ring(cfg, 5) and not kv_cache.is_ring(cfg, 4)
    assert not kv_cache.is_ring(cfg.replace(sliding_window=None), 16)
    with pytest.raises(ShapeError, match="position = 8; expected < cache capacity 4"):
        G.prefill(p, tokens, cfg, G.init_cache(cfg, 1, 4))
    # A paged ring of 8 slots with only its second page mapped: position 8 writes slot 0.
    paged = G.init_paged_cache(cfg, 1, 2, 4, 8)
    paged = paged._replace(page_table=jnp.asarray([[2, 0]], jnp.int32), lengths=jnp.asarray([8]))
    with pytest.raises(ShapeError, match=r"page_table\[0, 0\] \(row 0, position 8, slot 0\)"):
        G.decode_step(p, [0], cfg, paged)
    with pytest.raises(ShapeError, match=r"page_table\[0, 0\] \(row 0, position 1\) = 2"):
        G.prefill(p, tokens, cfg, paged)  # positions 1..8 are kept: slots 1..7 and 0


def test_prompt_slots_keep_each_rows_last_capacity_real_positions():
    cfg = CONFIGS["mqa-window5"]
    slots_BT = kv_cache.prompt_slots(cfg, 4, 6, np.array([6, 2]))
    # Row 0 keeps positions 2..5 in slots 2, 3, 0, 1; row 1 its two real positions; 4 = dropped.
    np.testing.assert_array_equal(slots_BT, [[4, 4, 2, 3, 0, 1], [0, 1, 4, 4, 4, 4]])
    # Window 5 in 8 slots: position 2 sees slots 0..2; position 11 sees 7..11 = slots 7, 0..3.
    visible_BS = kv_cache.visible_slots(cfg, 8, np.array([[2], [11]]))
    np.testing.assert_array_equal(visible_BS, [[1, 1, 1, 0, 0, 0, 0, 0], [1, 1, 1, 1, 0, 0, 0, 1]])


# ---- generation ------------------------------------------------------------------------------


@pytest.mark.parametrize("name", list(CONFIGS))
def test_greedy_generate_equals_the_full_recompute_witness(params, name):
    """Batched prompts of lengths 3, 1 and 11 (right-padded), contiguous and paged caches."""
    cfg, p = CONFIGS[name], params[name]
    n = cfg.context_length - len(PROMPTS[2])
    witness = [greedy_witness(p, prompt, cfg, n) for prompt in PROMPTS]
    assert G.generate(p, PROMPTS, cfg, max_new_tokens=n) == witness
    assert G.generate(p, PROMPTS, cfg, max_new_tokens=n, cache="paged", page_size=4) == witness


def test_a_windowed_stream_holds_at_most_its_ring(params):
    """Window 5: 8 slots per row (not the 32 of the prompt + 13 tokens), so at most 4 pages of 2
    per row are ever in use, and the tokens are the contiguous cache's."""
    cfg, p = CONFIGS["mqa-window5"], params["mqa-window5"]
    assert loop.cache_slots(cfg, 11 + 13) == 8
    assert loop.cache_slots(cfg.replace(sliding_window=None), 11 + 13) == 24
    assert loop.cache_slots(cfg, 3 + 2) == 8  # short runs: the usual bucket
    contiguous = G.generate(p, PROMPTS, cfg, max_new_tokens=13)
    steps = list(G.stream(p, PROMPTS, cfg, max_new_tokens=13, cache="paged", page_size=2))
    assert [[int(s.tokens[b]) for s in steps] for b in range(3)] == contiguous
    assert max(s.pages_in_use for s in steps) == 3 * 4


# ---- scanned and unrolled layers (issue 44) --------------------------------------------------


def decode_all(p, cfg, cache, tokens_BC, lengths):
    """Prefill right-padded rows of `lengths`, then decode every row up to C: the logits of
    each row's real positions, in order, `[B, C - t0, V]` per step stacked after the prompt's."""
    t = int(max(lengths))
    prompt_BT = tokens_BC[:, :t].copy()
    prompt_BT[0, lengths[0] :] = 0
    logits_BTV, cache = G.prefill(p, prompt_BT, cfg, cache, lengths)
    steps = [np.asarray(logits_BTV[b, : lengths[b]]) for b in range(2)]
    for step in range(cfg.context_length - t):
        pos_B = np.asarray(lengths) + step
        logits_BV, cache = G.decode_step(p, tokens_BC[[0, 1], pos_B], cfg, cache)
        steps = [np.concatenate([s, np.asarray(logits_BV[b])[None]]) for b, s in enumerate(steps)]
    return steps, cache


@pytest.mark.parametrize("cache_kind", ["contiguous", "paged"])
@pytest.mark.parametrize("name", ["gqa2", "gqa2-qknorm-dh12-window6"])
def test_scanned_and_unrolled_decoding_give_the_same_logits_and_caches(params, name, cache_kind):
    """The same decode, layers as one `lax.scan` (the default), as a Python loop over slices,
    and as a loop over per-layer arrays (`decoding_params`, a CPU's layout): logits within
    f32_rtol of the model's rounding chain (the programs fuse, hence round, apart), with
    attention over the cache's S slots; the caches hold the same keys and values."""
    scanned = CONFIGS[name]
    unrolled, p = scanned.replace(scan_layers=False), params[name]
    split = G.decoding_params(p, scanned, "per_layer")
    s = scanned.context_length if scanned.sliding_window is None else 8  # a ring with a window
    tokens_BC = np.random.default_rng(11).integers(0, scanned.vocab_size, (2, 24)).astype(np.int32)
    runs = []
    for cfg, weights in ((scanned, p), (unrolled, p), (scanned, split)):
        cache = G.init_cache(cfg, 2, s) if cache_kind == "contiguous" else paged_cache(cfg, 2, s)
        runs.append(decode_all(weights, cfg, cache, tokens_BC, [3, 9]))
    logits_s, cache_s = runs[0]
    for logits_u, cache_u in runs[1:]:
        for a, b in zip(logits_s, logits_u, strict=True):
            np.testing.assert_allclose(a, b, rtol=0, atol=testing.logits_atol(scanned, b, t=s))
            np.testing.assert_array_equal(a.argmax(-1), b.argmax(-1))
        scale = float(np.abs(cache_u.keys).max())
        atol = testing.logits_atol(scanned, [[scale]], t=s)
        for x, y in ((cache_s.keys, cache_u.keys), (cache_s.values, cache_u.values)):
            np.testing.assert_allclose(x, y, rtol=0, atol=atol)
        np.testing.assert_array_equal(cache_s.lengths, cache_u.lengths)


@pytest.mark.parametrize("name", ["gqa2", "mqa-window5"])
def test_scanned_and_unrolled_generate_the_same_greedy_tokens(params, name):
    """Batched prompts, contiguous and paged caches, the three layer layouts (stacked and
    scanned, stacked and looped, per-layer arrays: `layers="auto"` on this CPU), and the
    full-forward witness: one list of tokens."""
    cfg, p = CONFIGS[name], params[name]
    n = cfg.context_length - len(PROMPTS[2])
    witness = [greedy_witness(p, prompt, cfg, n) for prompt in PROMPTS]
    for c, layers in ((cfg, "stacked"), (cfg.replace(scan_layers=False), "stacked"), (cfg, "auto")):
        assert G.generate(p, PROMPTS, c, max_new_tokens=n, layers=layers) == witness, layers
        paged = G.generate(
            p, PROMPTS, c, max_new_tokens=n, cache="paged", page_size=4, layers=layers
        )
        assert paged == witness, (c.scan_layers, layers)


def test_decoding_params_lays_the_blocks_out_for_the_platform(params):
    """On a CPU "auto" splits the blocks into per-layer arrays (values unchanged); "stacked"
    restacks a split tree; both take the compute dtype; a bad layout or layer is one line."""
    cfg, p = CONFIGS["gqa2"], params["gqa2"]
    split = G.decoding_params(p, cfg)
    assert sorted(split["blocks"]) == [str(i) for i in range(cfg.n_layers)]
    want = ptree.flatten(ptree.unstack(p))
    got = ptree.flatten(split)
    assert got.keys() == want.keys()
    for name, leaf in got.items():
        np.testing.assert_array_equal(leaf, want[name].astype(cfg.compute_dtype), err_msg=name)
    restacked = G.decoding_params(split, cfg, "stacked")
    assert ptree.blocks_layout(restacked) == "stacked"
    for name, leaf in ptree.flatten(restacked).items():
        np.testing.assert_array_equal(leaf, ptree.flatten(p)[name], err_msg=name)
    with pytest.raises(ConfigError, match="layers = 'split'; expected one of"):
        G.decoding_params(p, cfg, "split")
    with pytest.raises(ConfigError, match="layers = 'scan'"):
        G.generate(p, PROMPTS, cfg, max_new_tokens=2, layers="scan")
    short = {**split, "blocks": {k: v for k, v in split["blocks"].items() if k != "1"}}
    with pytest.raises(ShapeError):
        G.generate(short, PROMPTS, cfg, max_new_tokens=2)


def _lowered_decode(cfg, cache):
    """The jitted decode step (cache donated, as `decode_step`'s) lowered for `cfg`."""
    token = jax.ShapeDtypeStruct((cache.lengths.shape[0],), jnp.int32)
    return kv_cache._decode_jit.lower(models.abstract_params(cfg), token, cfg, cache)


@pytest.mark.parametrize("cache_kind", ["contiguous", "paged"])
def test_a_scanned_decode_step_is_one_loop_updating_its_donated_cache_in_place(cache_kind):
    """The step's program holds one layer whatever N is (a while loop; the unrolled one grows
    with N), the donated cache is the output's buffer, and with 8 layers the step's scratch
    memory stays below half the cache's (layer slices as the scan's xs and ys would allocate a
    second cache: the whole cache, copied each step)."""

    def make(scan, n_layers):  # a cache (2 MiB at 8 layers) far larger than the activations
        c = CONFIGS["gqa2"].replace(n_layers=n_layers, scan_layers=scan, context_length=256)
        if cache_kind == "contiguous":
            return c, jax.eval_shape(lambda: G.init_cache(c, 8, 256))
        return c, jax.eval_shape(lambda: G.init_paged_cache(c, 8, 8 * 256 // 16, 16, 256))

    lines = {
        (scan, n): _lowered_decode(*make(scan, n)).as_text().count("\n")
        for scan in (True, False)
        for n in (2, 8)
    }
    assert lines[True, 8] <= lines[True, 2] + 20, lines  # only shapes change
    assert lines[False, 8] > 2 * lines[False, 2], lines
    cfg, cache = make(True, 8)
    assert "stablehlo.while" in _lowered_decode(cfg, cache).as_text()
    cache_bytes = sum(a.size * a.dtype.itemsize for a in (cache.keys, cache.values))
    memory = _lowered_decode(cfg, cache).compile().memory_analysis()
    assert memory.alias_size_in_bytes >= cache_bytes
    assert memory.temp_size_in_bytes < cache_bytes / 2, (memory.temp_size_in_bytes, cache_bytes)
