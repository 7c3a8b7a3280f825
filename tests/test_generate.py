"""Decoding (SPEC section 4): KV caches against the full forward pass, batching, paging, compiles.

Witnesses are independent of the decoding code: `models.forward` over the whole sequence for
logits, and greedy decoding by re-running `models.forward` on the growing sequence for tokens.
"""

from __future__ import annotations

import math

import jax
import jax.monitoring
import jax.numpy as jnp
import numpy as np
import pytest
from _decoding import F32_TOL, check_padded_decode, greedy_witness, padded_forward, paged_cache

from lmjax import generate as G
from lmjax import models
from lmjax.errors import ConfigError, NonFiniteError, ShapeError, TokenError
from lmjax.generate import loop

TINY = dict(vocab_size=27, context_length=16, d_model=32, n_heads=4, n_layers=2, d_ff=64)
CONFIGS = {
    "gpt-learned": models.preset("gpt"),
    "gpt2-learned-tied": models.preset("gpt2", **TINY),
    "llama-rope": models.preset("llama"),
    "gpt-sinusoidal": models.preset("gpt", positions="sinusoidal"),
}
# bfloat16 keeps 8 significant bits: logits of magnitude < 4 are spaced 2**-6 apart, and the
# cached and full passes round in different orders through every layer; 4 such spacings.
BF16_TOL = dict(rtol=0, atol=4 * 2**-6)


@pytest.fixture(scope="module")
def params():
    return {
        name: models.init(jax.random.key(i), cfg) for i, (name, cfg) in enumerate(CONFIGS.items())
    }


# ---- prefill + decode equals the full forward pass ------------------------------------------


@pytest.mark.parametrize("cache_kind", ["contiguous", "paged"])
@pytest.mark.parametrize("name", list(CONFIGS))
def test_prefill_then_decode_equals_forward_at_every_position(params, name, cache_kind):
    """Right-padded rows of different prompt lengths; each row decodes at its own positions."""
    cfg, p = CONFIGS[name], params[name]
    cache = G.init_cache(cfg, 2) if cache_kind == "contiguous" else paged_cache(cfg, 2)
    check_padded_decode(p, cfg, cache, [3, 6])


@pytest.mark.parametrize("gqa_window", [False, True], ids=["mha", "mqa-window5-ring"])
@pytest.mark.parametrize("impl", ["xla", pytest.param("flash", marks=pytest.mark.slow)])
def test_decoding_with_other_attention_impls_equals_forward(impl, gqa_window):
    cfg = CONFIGS["llama-rope"].replace(attention=impl)
    if gqa_window:  # one kv head; window 5 in an 8-slot ring that positions 8..11 wrap
        cfg = cfg.replace(n_kv_heads=1, sliding_window=5)
    p = models.init(jax.random.key(0), cfg)
    tokens_1C = np.random.default_rng(2).integers(0, cfg.vocab_size, (1, 12)).astype(np.int32)
    full_1CV = np.asarray(padded_forward(cfg)(p, tokens_1C, cfg))
    cache = G.init_cache(cfg, 1, 8 if gqa_window else 16)
    logits_1TV, cache = G.prefill(p, tokens_1C[:, :4], cfg, cache)
    np.testing.assert_allclose(logits_1TV, full_1CV[:, :4], **F32_TOL)
    for t in range(4, 12):
        logits_1V, cache = G.decode_step(p, tokens_1C[:, t], cfg, cache)
        np.testing.assert_allclose(logits_1V, full_1CV[:, t], **F32_TOL)


def test_bfloat16_decoding_equals_forward_and_steps_get_cast_params(params, monkeypatch):
    """The params are cast once in `stream`: the jitted steps receive bfloat16 weights."""
    cfg = CONFIGS["gpt-learned"].replace(dtype="bfloat16")
    p = params["gpt-learned"]  # float32 master weights
    tokens_2C = np.random.default_rng(4).integers(0, cfg.vocab_size, (2, 16)).astype(np.int32)
    full_2CV = np.asarray(models.forward(p, tokens_2C, cfg))
    logits_2TV, cache = G.prefill(p, tokens_2C[:, :4], cfg, G.init_cache(cfg, 2))
    np.testing.assert_allclose(logits_2TV, full_2CV[:, :4], **BF16_TOL)
    for t in range(4, 16):
        logits_2V, cache = G.decode_step(p, tokens_2C[:, t], cfg, cache)
        np.testing.assert_allclose(logits_2V, full_2CV[:, t], **BF16_TOL)
    seen = set()

    def spy(name, jitted):
        def call(params, *args, **kwargs):
            seen.update((name, leaf.dtype.name) for leaf in jax.tree.leaves(params))
            return jitted(params, *args, **kwargs)

        return call

    for name in ("prefill_sample", "decode_sample"):
        monkeypatch.setattr(loop, name, spy(name, getattr(loop, name)))
    G.generate(p, [[1, 2, 3]], cfg, max_new_tokens=2)
    assert seen == {("prefill_sample", "bfloat16"), ("decode_sample", "bfloat16")}


# ---- batched generation -----------------------------------------------------------------------

PROMPTS = [[3, 1, 4], [1], [5, 9, 2, 6, 5, 3, 5, 8, 9]]


@pytest.mark.parametrize("name", ["gpt-learned", "llama-rope"])
def test_greedy_batched_equals_one_by_one_equals_the_forward_witness(params, name):
    cfg, p = CONFIGS[name], params[name]
    n = cfg.context_length - len(PROMPTS[2])
    batched = G.generate(p, PROMPTS, cfg, max_new_tokens=n)
    alone = [G.generate(p, [prompt], cfg, max_new_tokens=n)[0] for prompt in PROMPTS]
    witness = [greedy_witness(p, prompt, cfg, n) for prompt in PROMPTS]
    assert batched == alone == witness


def test_stop_tokens_end_only_their_row(params):
    cfg, p = CONFIGS["gpt-learned"], params["gpt-learned"]
    witness = [greedy_witness(p, prompt, cfg, 6) for prompt in PROMPTS]
    stop = witness[1][2]  # row 1 stops at its third token (or earlier, if that id came before)
    expected = [w[: w.index(stop) + 1] if stop in w else w for w in witness]
    assert G.generate(p, PROMPTS, cfg, max_new_tokens=6, stop_tokens=[stop]) == expected
    assert len(expected[1]) <= 3


def test_stream_marks_finished_rows_inactive(params):
    cfg, p = CONFIGS["gpt-learned"], params["gpt-learned"]
    first = G.generate(p, PROMPTS, cfg, max_new_tokens=4)
    steps = list(G.stream(p, PROMPTS, cfg, max_new_tokens=4, stop_tokens=[first[0][0]]))
    assert len(steps) == 4 and steps[0].active.all() and steps[0].pages_in_use is None
    for step in steps[1:]:
        assert not step.active[0] and step.tokens[0] == -1
    assert [int(s.tokens[2]) for s in steps] == first[2]


# ---- paged cache ------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "sampling", [{}, dict(temperature=1.0, top_k=8, top_p=0.9, seed=5)], ids=["greedy", "sampled"]
)
def test_paged_and_contiguous_caches_give_identical_tokens(params, sampling):
    cfg, p = CONFIGS["llama-rope"], params["llama-rope"]
    prompts = [[1], [2, 3, 4, 5, 6, 7, 8], list(range(16)) + [3, 2, 1, 0]]
    options = dict(max_new_tokens=12, **sampling)
    contiguous = G.generate(p, prompts, cfg, **options)
    paged = G.generate(p, prompts, cfg, cache="paged", page_size=4, **options)
    assert paged == contiguous
    assert [len(t) for t in paged] == [12, 12, 12]


def test_page_accounting_follows_the_sequences_and_frees_finished_ones(params):
    cfg, p = CONFIGS["llama-rope"], params["llama-rope"]
    prompts, page = [[1], [2, 3, 4, 5, 6], list(range(14))], 4
    plain = G.generate(p, prompts, cfg, max_new_tokens=10)
    stop = plain[0][3]
    emitted, lengths = np.zeros(3, int), np.array([len(x) for x in prompts])
    worst = int(np.ceil((lengths + 10 - 1) / page).sum())
    steps = G.stream(
        p, prompts, cfg, max_new_tokens=10, stop_tokens=[stop], cache="paged", page_size=page
    )
    done, peak = np.zeros(3, bool), 0
    for step in steps:
        emitted += step.active
        done |= np.isin(step.tokens, [stop]) | (emitted >= 10)
        written = lengths + emitted - 1  # the newest token is written by the next step
        expected = sum(math.ceil(w / page) for w, d in zip(written, done, strict=True) if not d)
        assert step.pages_in_use == expected
        peak = max(peak, expected)
    assert done.all() and step.pages_in_use == 0  # every page went back to the pool
    assert 0 < peak <= worst  # the default pool is the worst case, never exceeded


def test_a_page_size_that_does_not_divide_the_context(params):
    """C = 16, pages of 5: the table holds 20 slots, but positions end at C - 1."""
    cfg, p = CONFIGS["gpt-learned"], params["gpt-learned"]
    prompts = [[3, 1, 4], [1]]
    contiguous = G.generate(p, prompts, cfg, max_new_tokens=13)  # row 0 reaches exactly C
    assert G.generate(p, prompts, cfg, max_new_tokens=13, cache="paged", page_size=5) == contiguous
    cache = G.init_paged_cache(cfg, 1, 4, 5)
    cache = cache._replace(page_table=jnp.asarray([[2, 0, 3, 1]], jnp.int32))
    assert cache.capacity == 20
    tokens_1C = np.random.default_rng(5).integers(0, cfg.vocab_size, (1, 16)).astype(np.int32)
    full_1CV = np.asarray(padded_forward(cfg)(p, tokens_1C, cfg))
    logits_1TV, cache = G.prefill(p, tokens_1C[:, :4], cfg, cache)
    np.testing.assert_allclose(logits_1TV, full_1CV[:, :4], **F32_TOL)
    for t in range(4, 16):  # up to position C - 1 = 15
        logits_1V, cache = G.decode_step(p, tokens_1C[:, t], cfg, cache)
        np.testing.assert_allclose(logits_1V, full_1CV[:, t], **F32_TOL)
    with pytest.raises(ShapeError, match="position = 16; expected < context_length 16"):
        G.decode_step(p, [1], cfg, cache)


def test_public_steps_refuse_writes_to_unmapped_pages(params):
    cfg, p = CONFIGS["gpt-learned"], params["gpt-learned"]
    cache = G.init_paged_cache(cfg, 2, 8, 4)  # no page mapped yet (every entry is 8)
    prompt_2T = np.array([[1, 2, 3, 4, 5, 6], [7, 8, 9, 0, 0, 0]], np.int32)
    with pytest.raises(ShapeError, match=r"row 0, position 0\) = 8; expected a mapped page"):
        G.prefill(p, prompt_2T, cfg, cache, lengths=[6, 3])
    pages = G.PageAllocator(8, 4, 2, 4)
    pages.ensure(0, 4)  # row 0's positions 0..3 of its 6
    pages.ensure(1, 3)  # row 1's positions 0..3
    with pytest.raises(ShapeError, match=r"page_table\[0, 1\] \(row 0, position 4\)"):
        G.prefill(p, prompt_2T, cfg, cache._replace(page_table=jnp.asarray(pages.table)), [6, 3])
    pages.ensure(0, 8)
    cache = cache._replace(page_table=jnp.asarray(pages.table))
    _, cache = G.prefill(p, prompt_2T, cfg, cache, lengths=[6, 3])  # pad slots need no pages
    _, cache = G.decode_step(p, [1, 2], cfg, cache)  # positions 6 and 3: mapped
    with pytest.raises(ShapeError, match=r"page_table\[1, 1\] \(row 1, position 4\) = 8"):
        G.decode_step(p, [1, 2], cfg, cache)


def test_a_pool_that_runs_out_says_the_step_and_the_worst_case(params):
    cfg, p = CONFIGS["gpt-learned"], params["gpt-learned"]
    options = dict(max_new_tokens=8, cache="paged", page_size=2, num_pages=3)
    # Worst case: ceil((1 + 8 - 1) / 2) + ceil((2 + 8 - 1) / 2) = 4 + 5 = 9 pages. Row 0 needs
    # its second page before step 3, when rows 0 and 1 already hold all three.
    message = "num_pages = 3; .*row 0's position 2 .* after 2 completed steps.*num_pages >= 9"
    steps = G.stream(p, [[1], [2, 3]], cfg, **options)
    assert [s.active.all() for s in (next(steps), next(steps))] == [True, True]
    with pytest.raises(ConfigError, match=message):
        next(steps)
    with pytest.raises(ConfigError, match=message):
        G.generate(p, [[1], [2, 3]], cfg, **options)


def test_non_finite_logits_raise_naming_the_row_and_step(params):
    cfg, p = CONFIGS["gpt-learned"], params["gpt-learned"]
    prompts = [[5, 6], [7, 8]]
    first = G.generate(p, prompts, cfg, max_new_tokens=1)
    embedding = p["token_embedding"]["weight"]

    def poison(token):  # a NaN embedding for one token id: only rows that feed it see NaN
        return {**p, "token_embedding": {"weight": embedding.at[token].set(jnp.nan)}}

    with pytest.raises(NonFiniteError, match=r"logits of row 1 at step 1 \(0 steps completed"):
        G.generate(poison(8), prompts, cfg, max_new_tokens=3)
    token = first[0][0]  # fed back by row 0 at step 2 (and maybe by row 1: row 0 is named)
    assert token not in prompts[0] + prompts[1]
    with pytest.raises(NonFiniteError, match=r"row 0 at step 2 \(1 steps completed"):
        G.generate(poison(token), prompts, cfg, max_new_tokens=3)


def test_page_allocator_hands_out_and_takes_back_pages():
    pages = G.PageAllocator(num_pages=5, page_size=4, batch=2, pages_per_row=3)
    pages.ensure(0, 5)  # slots 0..4: 2 pages
    pages.ensure(1, 1)
    pages.ensure(0, 8)  # still 2 pages
    assert pages.in_use == 3 and pages.owned == [[0, 1], [2]]
    np.testing.assert_array_equal(pages.table, [[0, 1, 5], [2, 5, 5]])
    pages.release(0)
    assert pages.in_use == 1 and sorted(pages.free) == [0, 1, 3, 4]
    np.testing.assert_array_equal(pages.table[0], [5, 5, 5])
    pages.ensure(1, 12)
    with pytest.raises(ConfigError, match="raise num_pages"):
        pages.ensure(0, 12)  # 3 more pages wanted, 1 free
    with pytest.raises(ConfigError, match="page table's width"):
        pages.ensure(1, 13)


def test_cache_memory_matches_the_documented_figures():
    cfg = models.preset("gpt2")
    assert G.cache_bytes(cfg, 1) == 72 * 1024
    contiguous = jax.eval_shape(lambda: G.init_cache(cfg, 8, 1024))
    assert sum(a.size * a.dtype.itemsize for a in (contiguous.keys, contiguous.values)) == (
        G.cache_bytes(cfg, 8 * 1024)
    )
    assert G.cache_bytes(cfg, 8 * 1024) == 576 * 2**20
    final_lengths = [20, 40, 60, 100, 150, 300, 500, 1000]
    pages = G.PageAllocator(num_pages=200, page_size=16, batch=8, pages_per_row=64)
    for row, n in enumerate(final_lengths):
        pages.ensure(row, n)
    assert pages.in_use == sum(math.ceil(n / 16) for n in final_lengths) == 140
    pool = jax.eval_shape(lambda: G.init_paged_cache(cfg, 8, 140, 16, 1024))
    pool_bytes = sum(a.size * a.dtype.itemsize for a in (pool.keys, pool.values))
    assert pool_bytes == G.cache_bytes(cfg, 140 * 16) == 157.5 * 2**20
    assert pool.page_table.shape == (8, 64)


# ---- compilation ------------------------------------------------------------------------------


@pytest.mark.parametrize("cache_kind", ["contiguous", "paged"])
def test_no_compilation_after_the_first_decode_step(params, cache_kind):
    cfg, p = CONFIGS["gpt-learned"], params["gpt-learned"]
    compiles = []

    def listen(event, duration, **kwargs):
        if event == "/jax/core/compile/backend_compile_duration":
            compiles.append(event)

    pages = dict(cache="paged", page_size=2) if cache_kind == "paged" else {}
    steps = G.stream(p, PROMPTS, cfg, max_new_tokens=7, **pages)
    next(steps), next(steps)  # prefill, then the first decode step: compiled here if new
    jax.monitoring.register_event_duration_secs_listener(listen)
    try:
        rest = list(steps)
    finally:
        jax.monitoring.unregister_event_duration_listener(listen)
    assert len(rest) == 5 and compiles == []


def test_one_compile_per_shape_bucket():
    cfg = CONFIGS["llama-rope"].replace(context_length=24)  # a config no other test compiles
    p = models.init(jax.random.key(0), cfg)
    before = loop.prefill_sample._cache_size(), loop.decode_sample._cache_size()
    G.generate(p, [[1, 2, 3], [4]], cfg, max_new_tokens=5)  # T bucket 8, S bucket 8
    after_one = loop.prefill_sample._cache_size(), loop.decode_sample._cache_size()
    G.generate(p, [[5, 6], [7, 8, 9, 10]], cfg, max_new_tokens=3)  # same buckets
    assert loop.prefill_sample._cache_size() == after_one[0] == before[0] + 1
    assert loop.decode_sample._cache_size() == after_one[1] == before[1] + 1
    G.generate(p, [[5, 6], [7, 8, 9, 10]], cfg, max_new_tokens=12)  # S bucket 16: one more each
    assert loop.decode_sample._cache_size() == before[1] + 2


# ---- bad input ------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "prompts, options, error, match",
    [
        ([list(range(10)) * 2], {}, TokenError, "len\\(prompts\\[0\\]\\) = 20.*context_length"),
        ([[1, 2], []], {}, TokenError, "prompts\\[1\\]"),
        ([], {}, TokenError, "non-empty batch"),
        ([1, 2, 3], {}, TokenError, "wrap a single prompt"),
        ([[1, 27]], {}, TokenError, "prompts\\[0\\]\\[1\\] = 27"),
        ([[-1, 2]], {}, TokenError, "prompts\\[0\\]\\[0\\] = -1"),
        ([[1.5, 2.0]], {}, TokenError, "integer token ids"),
        ([[1]], dict(top_p=0.0), ConfigError, "top_p = 0.0"),
        ([[1]], dict(top_p=1.5), ConfigError, "top_p = 1.5"),
        ([[1]], dict(temperature=-0.5), ConfigError, "temperature = -0.5"),
        ([[1]], dict(temperature=float("nan")), ConfigError, "temperature = nan"),
        ([[1]], dict(top_k=-1), ConfigError, "top_k = -1"),
        ([[1]], dict(top_k=28), ConfigError, "top_k = 28; expected <= vocab_size = 27"),
        ([[1]], dict(max_new_tokens=0), ConfigError, "max_new_tokens = 0"),
        ([[1], [1] * 10], dict(max_new_tokens=7), ConfigError, "max_new_tokens <= 6"),
        ([[1]], dict(stop_tokens=[27]), TokenError, "stop_tokens\\[0\\] = 27"),
        ([[1]], dict(cache="ring"), ConfigError, "cache = 'ring'"),
        ([[1]], dict(cache="paged", page_size=0), ConfigError, "page_size = 0"),
        ([[1]], dict(seed=1.5), ConfigError, "seed = 1.5"),
        ([[1]], dict(seed=2**64), ConfigError, "seed = 18446744073709551616; expected an int"),
        ([[1]], dict(seed=2**63), ConfigError, "seed = 9223372036854775808"),
        ([[1]], dict(stop_tokens=3), TokenError, "stop_tokens = 3.*stop_tokens=\\[3\\]"),
        ([[1]], dict(stop_tokens=2.5), TokenError, "stop_tokens = 2.5; expected a list"),
        ([[1]], dict(stop_tokens="ab"), TokenError, "stop_tokens = 'ab'"),
        ([[1]], dict(page_size=4), ConfigError, "page_size = 4; expected None with cache="),
        ([[1]], dict(num_pages=3), ConfigError, "num_pages = 3; expected None with cache="),
        ([[1]], dict(cache="paged", num_pages=0), ConfigError, "num_pages = 0"),
        (np.array([[1, 2], [3, 0]]), {}, TokenError, "2-D array of shape \\(2, 2\\)"),
        (jnp.ones((1, 1, 2), int), {}, TokenError, "3-D array"),
    ],
)
def test_bad_generation_input_raises_a_clear_error(params, prompts, options, error, match):
    cfg, p = CONFIGS["gpt-learned"], params["gpt-learned"]
    options = {"max_new_tokens": 2, **options}
    with pytest.raises(error, match=match):
        G.generate(p, prompts, cfg, **options)


def test_no_stop_tokens_may_be_given_as_none(params):
    cfg, p = CONFIGS["gpt-learned"], params["gpt-learned"]
    plain = G.generate(p, PROMPTS, cfg, max_new_tokens=2)
    assert G.generate(p, PROMPTS, cfg, max_new_tokens=2, stop_tokens=None) == plain


def test_bad_cache_input_raises_a_clear_error(params):
    cfg, p = CONFIGS["gpt-learned"], params["gpt-learned"]
    for make in (lambda: G.init_cache(cfg, 1, 17), lambda: G.init_paged_cache(cfg, 1, 4, 4, 17)):
        with pytest.raises(ConfigError, match="capacity = 17; expected an int in \\[1, 16\\]"):
            make()
    for make in (lambda: G.init_cache(cfg, 0), lambda: G.init_paged_cache(cfg, 0, 4, 4)):
        with pytest.raises(ConfigError, match="batch = 0"):
            make()
    with pytest.raises(ShapeError, match="lengths"):
        G.prefill(p, [[1, 2, 3]], cfg, G.init_cache(cfg, 1), lengths=[4])
    deeper = G.init_cache(cfg.replace(n_layers=cfg.n_layers + 1), 1)
    with pytest.raises(ShapeError, match=r"cache layers \(keys.shape\[0\]\) = 3; expected 2"):
        G.prefill(p, [[1, 2, 3]], cfg, deeper)
    with pytest.raises(ShapeError, match="capacity 8"):
        G.prefill(p, [[1] * 9], cfg, G.init_cache(cfg, 1, 8))
    _, cache = G.prefill(p, [[1] * 8], cfg, G.init_cache(cfg, 1, 8))
    with pytest.raises(TokenError, match="= 27"):
        G.decode_step(p, [27], cfg, cache)
    with pytest.raises(ShapeError, match="position = 8; expected < cache capacity 8"):
        G.decode_step(p, [1], cfg, cache)
