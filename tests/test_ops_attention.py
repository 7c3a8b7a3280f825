"""Edge cases of SPEC section 2 for attention: causal offset, masks, impls, fully masked rows."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from lmjax import ops
from lmjax.errors import ConfigError, ShapeError

IMPLS = ["materialized", "xla"]


def _qkv(t, s, seed=0, b=2, h=2, d=4):
    rng = np.random.default_rng(seed)
    return tuple(jnp.asarray(rng.standard_normal((b, n, h, d)), jnp.float32) for n in (t, s, s))


def _np_attention(q, k, v, keep_bhts):
    """float64 numpy attention over an explicit keep mask; rows with no key are zero."""
    q, k, v = (np.asarray(a, np.float64) for a in (q, k, v))
    s = np.einsum("bthd,bshd->bhts", q, k) / np.sqrt(q.shape[-1])
    s = np.where(keep_bhts, s, -np.inf)
    m = np.max(s, axis=-1, keepdims=True)
    e = np.where(keep_bhts, np.exp(s - np.where(np.isfinite(m), m, 0.0)), 0.0)
    total = e.sum(-1, keepdims=True)
    p = e / np.where(total > 0, total, 1.0)
    return np.einsum("bhts,bshd->bthd", p, v)


def _causal_keep(b, h, t, s, offset):
    keep = np.arange(s)[None, :] <= (np.arange(t)[:, None] + offset)
    return np.broadcast_to(keep, (b, h, t, s))


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("t, s, offset", [(4, 4, 0), (2, 6, 4), (3, 6, 1), (1, 5, 4)])
def test_causal_offset_means_key_index_at_most_query_index_plus_offset(impl, t, s, offset):
    q, k, v = _qkv(t, s)
    out = ops.attention(q, k, v, causal=True, offset=offset, impl=impl)
    expected = _np_attention(q, k, v, _causal_keep(2, 2, t, s, offset))
    np.testing.assert_allclose(out, expected, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("impl", IMPLS)
def test_key_padding_equals_dropping_the_padded_keys(impl):
    q, k, v = _qkv(3, 6, seed=1)
    mask = np.ones((2, 1, 1, 6), np.int32)
    mask[1, ..., 4:] = 0  # row 1 has 4 real keys
    out = ops.attention(q, k, v, causal=False, mask=mask, impl=impl)
    np.testing.assert_allclose(
        out[1], ops.attention(q[1:], k[1:, :4], v[1:, :4], causal=False)[0], rtol=1e-5, atol=1e-6
    )
    np.testing.assert_allclose(
        out[0], ops.attention(q[:1], k[:1], v[:1], causal=False)[0], rtol=1e-6
    )


def test_masked_probabilities_and_gradients_are_exactly_zero():
    q, k, v = _qkv(4, 6, seed=2)
    mask = np.ones((2, 1, 1, 6), bool)
    mask[0, ..., 1] = False
    mask[1, ..., 4:] = False

    def loss(q, k, v):
        out, p = ops.attention(q, k, v, causal=True, offset=2, mask=mask, return_probabilities=True)
        return (out * out).sum() + (p * p).sum(), p

    (_, p), (dq, dk, dv) = jax.value_and_grad(loss, (0, 1, 2), has_aux=True)(q, k, v)
    keep = _causal_keep(2, 2, 4, 6, 2) & mask
    assert np.all(np.asarray(p)[~keep] == 0.0)
    np.testing.assert_allclose(np.asarray(p).sum(-1), 1.0, rtol=1e-6)
    # Keys no query may see (padded keys) receive exactly zero gradient.
    assert np.all(np.asarray(dk)[0, 1] == 0) and np.all(np.asarray(dv)[0, 1] == 0)
    assert np.all(np.asarray(dk)[1, 4:] == 0) and np.all(np.asarray(dv)[1, 4:] == 0)
    # Query 0 sees keys 0..2 only: its loss leaves keys 3.. untouched.
    dk0 = jax.grad(lambda k: ops.attention(q, k, v, causal=True, offset=2)[:, 0].sum())(k)
    assert np.all(np.asarray(dk0)[:, 3:] == 0)


@pytest.mark.parametrize("impl", IMPLS)
def test_rows_with_no_visible_key_are_zero_with_finite_gradients(impl):
    q, k, v = _qkv(4, 4, seed=3)
    # offset -2: queries 0 and 1 see no key at all.
    out = ops.attention(q, k, v, causal=True, offset=-2, impl=impl)
    grads = jax.grad(
        lambda *a: (ops.attention(*a, causal=True, offset=-2, impl=impl) ** 2).sum(), (0, 1, 2)
    )(q, k, v)
    assert np.all(np.asarray(out)[:, :2] == 0.0)
    assert all(np.isfinite(np.asarray(g)).all() for g in grads)
    assert np.all(np.asarray(grads[0])[:, :2] == 0.0)


def test_xla_impl_matches_materialized_values_and_gradients():
    q, k, v = _qkv(3, 5, seed=4)
    mask = np.ones((2, 1, 1, 5), bool)
    mask[1, ..., -1] = False
    g = jnp.asarray(np.random.default_rng(5).standard_normal((2, 3, 2, 4)), jnp.float32)

    def run(impl):
        return jax.vjp(
            lambda *a: ops.attention(*a, causal=True, offset=2, mask=mask, impl=impl), q, k, v
        )

    out_m, pull_m = run("materialized")
    out_x, pull_x = run("xla")
    np.testing.assert_allclose(out_x, out_m, rtol=1e-5, atol=1e-6)
    for a, b in zip(pull_x(g), pull_m(g), strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)


def test_traced_offset_under_jit_matches_static_offset():
    q, k, v = _qkv(1, 6, seed=6)
    step = jax.jit(lambda q, k, v, off: ops.attention(q, k, v, causal=True, offset=off))
    for off in (0, 3, 5):
        np.testing.assert_allclose(
            step(q, k, v, jnp.asarray(off)),
            ops.attention(q, k, v, causal=True, offset=off),
            rtol=1e-6,
        )


def test_flash_is_not_available_yet_and_says_what_is():
    q, k, v = _qkv(2, 2)
    with pytest.raises(ConfigError, match=r"available impls \('materialized', 'xla'\)"):
        ops.attention(q, k, v, causal=True, impl="flash")
    with pytest.raises(ConfigError, match="one of"):
        ops.attention(q, k, v, causal=True, impl="cuda")
    with pytest.raises(ConfigError, match="return_probabilities"):
        ops.attention(q, k, v, causal=True, impl="xla", return_probabilities=True)


@pytest.mark.parametrize(
    "shapes, message",
    [
        (((2, 3, 8), (2, 3, 2, 4), (2, 3, 2, 4)), "rank 4"),
        (((2, 3, 2, 4), (2, 3, 2, 4), (2, 4, 2, 4)), "v.shape"),
        (((2, 3, 2, 4), (2, 3, 1, 4), (2, 3, 1, 4)), "k.shape"),
        (((2, 3, 2, 4), (2, 3, 2, 8), (2, 3, 2, 8)), "k.shape"),
    ],
)
def test_attention_rejects_mismatched_shapes(shapes, message):
    q, k, v = (jnp.zeros(s) for s in shapes)
    with pytest.raises(ShapeError, match=message):
        ops.attention(q, k, v, causal=False)


def test_attention_rejects_mixed_dtypes_and_empty_axes():
    q, k, v = _qkv(2, 3)
    with pytest.raises(ShapeError, match="dtypes"):
        ops.attention(q.astype(jnp.bfloat16), k, v, causal=False, impl="xla")
    with pytest.raises(ShapeError, match="zero-size"):
        ops.attention(q, k[:, :0], v[:, :0], causal=False)


def test_attention_rejects_a_mask_that_does_not_broadcast():
    q, k, v = _qkv(3, 5)
    with pytest.raises(ShapeError, match="broadcastable from the right"):
        ops.attention(q, k, v, causal=False, mask=jnp.ones((2, 5, 1)))
