"""Sampling (SPEC section 4): greedy, temperature, top-k, top-p, seeds.

Expected distributions are computed in float64 numpy from the definition (scale by 1/T, keep
the top k, keep the smallest sorted prefix whose mass reaches p, renormalise), on logits from
`models.forward`; many samples are drawn in one vectorized call and compared by chi-square.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from scipy import stats

from lmjax import generate as G
from lmjax import models

N_SAMPLES = 40_000
CHI2_LEVEL = 1e-4  # a correct sampler fails with this probability (fixed keys: never flaky)


@pytest.fixture(scope="module")
def model():
    cfg = models.preset("gpt")
    return models.init(jax.random.key(0), cfg), cfg


@pytest.fixture(scope="module")
def logits_V(model):
    """A peaked next-token distribution from the model (scaled up so the filters matter)."""
    params, cfg = model
    logits = models.forward(params, jnp.asarray([[3, 1, 4, 1, 5]]), cfg)[0, -1]
    return np.asarray(logits, np.float64) * 2.0


def expected_probs(z_V, temperature, top_k, top_p):
    s = z_V / temperature
    order = np.argsort(-s, kind="stable")
    kept = order[: top_k or len(s)]
    q = np.exp(s[kept] - s[kept].max())
    q /= q.sum()
    mass_before = np.concatenate([[0.0], np.cumsum(q)[:-1]])
    kept, q = kept[mass_before < top_p], q[mass_before < top_p]
    probs = np.zeros_like(s)
    probs[kept] = q / q.sum()
    return probs


def nucleus_midpoint(z_V, temperature, size):
    """A top_p that keeps exactly `size` tokens, halfway between the two cumulative masses."""
    q = np.sort(np.exp(z_V / temperature - (z_V / temperature).max()))[::-1]
    cumulative = np.cumsum(q / q.sum())
    lo, hi = cumulative[size - 2], cumulative[size - 1]
    assert hi - lo > 1e-3, "the boundary must be far from float32 rounding"
    return float((lo + hi) / 2)


def draw(z_V, sampling, key=0):
    logits_NV = jnp.broadcast_to(jnp.asarray(z_V, jnp.float32), (N_SAMPLES, len(z_V)))
    return np.asarray(jax.jit(G.sample, static_argnums=2)(logits_NV, jax.random.key(key), sampling))


@pytest.mark.parametrize(
    "temperature, top_k, nucleus",
    [(1.0, None, None), (0.7, 5, None), (1.0, None, 4), (2.0, 6, 3)],
    ids=["temperature", "top_k", "top_p", "top_k_then_top_p"],
)
def test_frequencies_match_the_filtered_renormalised_distribution(
    logits_V, temperature, top_k, nucleus
):
    top_p = 1.0 if nucleus is None else nucleus_midpoint(logits_V, temperature, nucleus)
    if top_k and nucleus:
        # The nucleus is taken over the renormalised top-k: find p on those k logits.
        top = np.sort(logits_V)[::-1][:top_k]
        top_p = nucleus_midpoint(top, temperature, nucleus)
    probs = expected_probs(logits_V, temperature, top_k, top_p)
    support = np.flatnonzero(probs)
    if top_k:
        assert len(support) <= top_k
    if nucleus:
        assert len(support) == nucleus
    tokens = draw(logits_V, G.Sampling(temperature, top_k, top_p))
    assert np.isin(tokens, support).all(), "a token outside the top-k / nucleus was emitted"
    counts, expected = (
        np.bincount(tokens, minlength=len(probs))[support],
        N_SAMPLES * probs[support],
    )
    # Chi-square needs expected counts of at least 5: pool the rare tokens into one bin.
    rare = expected < 5
    counts = np.append(counts[~rare], counts[rare].sum())
    expected = np.append(expected[~rare], expected[rare].sum())
    assert (~rare).sum() >= 3  # enough distinct tokens for the test to mean something
    _, p_value = stats.chisquare(counts[expected > 0], expected[expected > 0])
    assert p_value > CHI2_LEVEL


def test_top_k_never_emits_outside_the_k_largest_forward_logits(model):
    params, cfg = model
    tokens = jnp.asarray(np.random.default_rng(0).integers(0, cfg.vocab_size, (8, 16)))
    logits_NV = models.forward(params, tokens, cfg).reshape(-1, cfg.vocab_size) * 3.0
    reps = 500
    tiled = jnp.tile(logits_NV, (reps, 1))
    drawn = np.asarray(G.sample(tiled, jax.random.key(1), G.Sampling(1.0, top_k=3)))
    top3 = np.argsort(-np.asarray(logits_NV), axis=-1)[:, :3]
    assert (drawn.reshape(reps, -1)[..., None] == top3[None]).any(-1).all()
    assert len(np.unique(drawn)) > 3  # different rows have different top-3 sets


def test_temperature_zero_is_greedy_whatever_the_filters(model, logits_V):
    params, cfg = model
    logits_NV = jnp.asarray(np.random.default_rng(3).normal(size=(64, 27)), jnp.float32)
    for sampling in (G.Sampling(), G.Sampling(0.0, top_k=2, top_p=0.1)):
        got = G.sample(logits_NV, jax.random.key(0), sampling)
        np.testing.assert_array_equal(got, np.argmax(np.asarray(logits_NV), axis=-1))
    # A vanishing temperature is greedy too: logits are shifted before the division.
    tiny = G.sample(logits_NV, jax.random.key(0), G.Sampling(1e-30))
    np.testing.assert_array_equal(tiny, np.argmax(np.asarray(logits_NV), axis=-1))
    prompts = [[1, 2, 3], [4]]
    greedy = G.generate(params, prompts, cfg, max_new_tokens=5)
    assert G.generate(params, prompts, cfg, max_new_tokens=5, temperature=0.0, top_k=3) == greedy


@pytest.mark.parametrize("top_k, top_p", [(None, 1.0), (5, 1.0), (None, 0.5), (5, 0.9)])
def test_a_temperature_below_float32_tiny_is_greedy(top_k, top_p):
    """1e-40 is subnormal in float32 (flushed to 0 by XLA): a division would give 0/0 = NaN."""
    logits_NV = np.random.default_rng(4).normal(size=(64, 27)).astype(np.float32)
    sampling = G.Sampling(1e-40, top_k, top_p)
    got = G.sample(jnp.asarray(logits_NV), jax.random.key(0), sampling)
    np.testing.assert_array_equal(got, np.argmax(logits_NV, axis=-1))
    assert sampling.greedy and not G.Sampling(np.finfo(np.float32).tiny, top_k, top_p).greedy


def test_seeds_reproduce_and_differ(model):
    params, cfg = model
    options = dict(max_new_tokens=10, temperature=1.0, top_p=0.95)
    prompts = [[1, 2, 3], [4]]
    first = G.generate(params, prompts, cfg, seed=7, **options)
    assert G.generate(params, prompts, cfg, seed=7, **options) == first
    assert G.generate(params, prompts, cfg, seed=8, **options) != first
