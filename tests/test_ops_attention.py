"""Edge cases of SPEC section 2 for attention: causal offset, masks, impls, fully masked rows.

impl="flash" runs the Pallas kernel (interpreted on CPU) through
`lmjax.models.dot_product_attention`, the one place that chooses the impl (ops imports nothing
above errors and checks); its own tests are in test_flash_attention.py, these check that the
dispatch keeps the op's semantics. `attention` below is that function for every impl.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from lmjax import ops
from lmjax.errors import ConfigError, ShapeError
from lmjax.models import dot_product_attention as attention

IMPLS = ["materialized", "xla", "flash"]


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
    out = attention(q, k, v, causal=True, offset=offset, impl=impl)
    expected = _np_attention(q, k, v, _causal_keep(2, 2, t, s, offset))
    np.testing.assert_allclose(out, expected, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("impl", IMPLS)
def test_key_padding_equals_dropping_the_padded_keys(impl):
    q, k, v = _qkv(3, 6, seed=1)
    mask = np.ones((2, 1, 1, 6), np.int32)
    mask[1, ..., 4:] = 0  # row 1 has 4 real keys
    out = attention(q, k, v, causal=False, mask=mask, impl=impl)
    # Against the same impl without the padded keys (impls differ in summation order).
    dropped = attention(q[1:], k[1:, :4], v[1:, :4], causal=False, impl=impl)
    np.testing.assert_allclose(out[1], dropped[0], rtol=1e-5, atol=1e-6)
    unmasked = attention(q[:1], k[:1], v[:1], causal=False, impl=impl)
    np.testing.assert_allclose(out[0], unmasked[0], rtol=1e-6)


def test_masked_probabilities_and_gradients_are_exactly_zero():
    q, k, v = _qkv(4, 6, seed=2)
    mask = np.ones((2, 1, 1, 6), bool)
    mask[0, ..., 1] = False
    mask[1, ..., 4:] = False

    def loss(q, k, v):
        out, p = ops.attention(q, k, v, causal=True, offset=2, mask=mask, return_probabilities=True)
        return (out * out).sum() + (p * p).sum(), p

    (_, p), (dq, dk, dv) = jax.jit(jax.value_and_grad(loss, (0, 1, 2), has_aux=True))(q, k, v)
    keep = _causal_keep(2, 2, 4, 6, 2) & mask
    assert np.all(np.asarray(p)[~keep] == 0.0)
    np.testing.assert_allclose(np.asarray(p).sum(-1), 1.0, rtol=1e-6)
    # Keys no query may see (padded keys) receive exactly zero gradient.
    assert np.all(np.asarray(dk)[0, 1] == 0) and np.all(np.asarray(dv)[0, 1] == 0)
    assert np.all(np.asarray(dk)[1, 4:] == 0) and np.all(np.asarray(dv)[1, 4:] == 0)
    # Query 0 sees keys 0..2 only: its loss leaves keys 3.. untouched.
    dk0 = jax.jit(jax.grad(lambda k: ops.attention(q, k, v, causal=True, offset=2)[:, 0].sum()))(k)
    assert np.all(np.asarray(dk0)[:, 3:] == 0)


@pytest.mark.parametrize("impl", IMPLS)
def test_rows_with_no_visible_key_are_zero_with_finite_gradients(impl):
    q, k, v = _qkv(4, 4, seed=3)

    def loss(*a):  # offset -2: queries 0 and 1 see no key at all.
        out = attention(*a, causal=True, offset=-2, impl=impl)
        return (out**2).sum(), out

    # One jitted program (the output as aux), not an eager compile of every primitive.
    grads, out = jax.jit(jax.grad(loss, (0, 1, 2), has_aux=True))(q, k, v)
    assert np.all(np.asarray(out)[:, :2] == 0.0)
    assert all(np.isfinite(np.asarray(g)).all() for g in grads)
    assert np.all(np.asarray(grads[0])[:, :2] == 0.0)


def test_xla_impl_matches_materialized_values_and_gradients():
    q, k, v = _qkv(3, 5, seed=4)
    mask = np.ones((2, 1, 1, 5), bool)
    mask[1, ..., -1] = False
    g = jnp.asarray(np.random.default_rng(5).standard_normal((2, 3, 2, 4)), jnp.float32)

    def run(impl, q, k, v, g):
        out, pull = jax.vjp(
            lambda *a: ops.attention(*a, causal=True, offset=2, mask=mask, impl=impl), q, k, v
        )
        return out, pull(g)

    # One program for both impls' values and VJPs, not an eager compile of every primitive.
    both = jax.jit(lambda *a: [run(impl, *a) for impl in ("materialized", "xla")])
    (out_m, grads_m), (out_x, grads_x) = both(q, k, v, g)
    np.testing.assert_allclose(out_x, out_m, rtol=1e-5, atol=1e-6)
    for a, b in zip(grads_x, grads_m, strict=True):
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


def test_unknown_impls_and_probabilities_without_materialized_are_rejected():
    q, k, v = _qkv(2, 2)
    every = r"one of \('auto', 'materialized', 'xla', 'flash', 'cudnn'\)"
    with pytest.raises(ConfigError, match=every):
        attention(q, k, v, causal=True, impl="cuda")
    with pytest.raises(ConfigError, match=r"one of \('materialized', 'xla'\)"):
        ops.attention(q, k, v, causal=True, impl="cuda")
    for impl in ("xla", "flash", "cudnn", "auto"):
        with pytest.raises(ConfigError, match="return_probabilities"):
            attention(q, k, v, causal=True, impl=impl, return_probabilities=True)


@pytest.mark.parametrize("impl", ["flash", "cudnn", "auto"])
def test_the_op_refuses_flash_naming_the_models_function(impl):
    """ops sits below the Pallas kernels and the choice of impl: impl="flash" (or "cudnn",
    "auto") there is one line naming the place that runs it, and no kernel is imported by ops
    (tests/test_architecture.py, ops-imports)."""
    q, k, v = _qkv(2, 2)
    with pytest.raises(
        ConfigError, match=rf"impl = '{impl}'.*lmjax\.models\.dot_product_attention"
    ):
        ops.attention(q, k, v, causal=True, impl=impl)


def _key_padding_mask(b, s):
    mask = np.ones((b, 1, 1, s), bool)
    mask[1, ..., -2:] = False
    return mask


@pytest.mark.parametrize(
    "t, s, kwargs",
    [
        (5, 5, dict(causal=True)),
        (2, 5, dict(causal=True, offset=3)),
        (3, 5, dict(causal=False, mask=_key_padding_mask(2, 5))),
        (3, 5, dict(causal=True, offset=1, mask=_key_padding_mask(2, 5)[1:])),  # [1,1,1,S]
        (4, 4, dict(causal=True, offset=-2)),  # queries 0 and 1 see no key
    ],
    ids=["causal", "causal_offset", "key_padding", "causal_padding_broadcast", "empty_rows"],
)
def test_flash_impl_matches_materialized_values_and_gradients(t, s, kwargs):
    q, k, v = _qkv(t, s, seed=7)
    g = jnp.asarray(np.random.default_rng(8).standard_normal(q.shape), jnp.float32)

    def run(impl):
        out, pull = jax.vjp(lambda *a: attention(*a, impl=impl, **kwargs), q, k, v)
        return out, pull(g)

    (out_f, grads_f), (out_m, grads_m) = jax.jit(lambda: (run("flash"), run("materialized")))()
    np.testing.assert_allclose(out_f, out_m, rtol=1e-5, atol=1e-6)
    for name, a, b in zip(("dq", "dk", "dv"), grads_f, grads_m, strict=True):
        assert np.isfinite(np.asarray(a)).all(), name
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6, err_msg=name)


@pytest.mark.parametrize(
    "mask",
    [np.ones((2, 1, 3, 5)), np.ones((1, 2, 1, 5)), np.ones((3, 5))],
    ids=["per_query", "per_head", "query_by_key"],
)
def test_flash_impl_takes_only_key_padding_masks(mask):
    q, k, v = _qkv(3, 5)
    with pytest.raises(
        ConfigError, match=r"broadcastable from \[B, 1, 1, S\].*impl='materialized'"
    ):
        attention(q, k, v, causal=False, mask=mask, impl="flash")
    attention(q, k, v, causal=False, mask=mask, impl="materialized")  # valid for the others


def test_flash_impl_needs_a_static_offset():
    q, k, v = _qkv(1, 6)
    step = jax.jit(lambda q, k, v, off: attention(q, k, v, causal=True, offset=off, impl="flash"))
    with pytest.raises(ConfigError, match="offset with impl='flash'.*static Python int"):
        step(q, k, v, jnp.asarray(3))


@pytest.mark.parametrize(
    "shapes, message",
    [
        (((2, 3, 8), (2, 3, 2, 4), (2, 3, 2, 4)), "rank 4"),
        (((2, 3, 2, 4), (2, 3, 2, 4), (2, 4, 2, 4)), "v.shape"),
        (((2, 3, 2, 4), (2, 3, 3, 4), (2, 3, 3, 4)), "H a multiple of Hkv"),
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


def _attention_module():
    import sys

    return sys.modules["lmjax.ops.attention"]


def test_long_causal_self_attention_takes_the_query_block_path(monkeypatch):
    """T > causal_block(T) with causal self-attention, offset 0 and no mask runs by query blocks
    (skipping the key blocks above the diagonal); anything else keeps the full T x S form.
    The block path's values and VJP are checked against the reference and finite differences
    in `OP_CASES` ("attention_causal_blocked"); here: which calls take it, and the values."""
    module = _attention_module()
    calls = []
    blocked = module._attention_causal_blocked

    def spy(q, k, v, block, *window_segments):
        calls.append(block)
        return blocked(q, k, v, block, *window_segments)

    monkeypatch.setattr(module, "CAUSAL_BLOCK_MIN", 2)
    monkeypatch.setattr(module, "_attention_causal_blocked", spy)
    q, k, v = _qkv(5, 5, seed=4)
    out = ops.attention(q, k, v, causal=True)
    assert calls == [2]
    np.testing.assert_allclose(out, _np_attention(q, k, v, _causal_keep(2, 2, 5, 5, 0)), 1e-5, 1e-6)
    mask = np.ones((2, 1, 1, 5), bool)
    # The path is chosen while tracing (static shapes and arguments): tracing them is enough.
    for kwargs in (
        dict(causal=False),
        dict(causal=True, offset=1),
        dict(causal=True, mask=mask),
        dict(causal=True, return_probabilities=True),
        dict(causal=True, impl="xla"),
    ):
        jax.eval_shape(lambda: ops.attention(q, k, v, **kwargs))  # noqa: B023 (called here)
    # T = 2: one block, nothing to skip; then cross-attention shapes (T != S).
    jax.eval_shape(lambda: ops.attention(q[:, :2], k[:, :2], v[:, :2], causal=True))
    jax.eval_shape(lambda: ops.attention(q[:, :3], k, v, causal=True))
    assert calls == [2], "only causal self-attention with offset 0 and no mask is blocked"


def test_query_blocks_equal_the_full_form_at_the_reference_block_size():
    """At the default block size (T = 2 blocks + a ragged 3 rows), the block path against the full
    materialized form: same values and gradients to float32 rounding (only the summation order
    over the skipped, exactly-zero entries differs)."""
    module = _attention_module()
    t = module.CAUSAL_BLOCK_MIN * 2 + 3
    assert module.causal_block(t) == module.CAUSAL_BLOCK_MIN
    q, k, v = _qkv(t, t, seed=5, b=1, h=1, d=4)
    keep = module.keep_mask(q.shape, k.shape, causal=True)

    def loss(fn):
        return lambda q, k, v: (jnp.sin(fn(q, k, v)) ** 2).sum()

    full = loss(lambda q, k, v: module._attention_materialized(q, k, v, keep)[0])
    blocked = loss(lambda q, k, v: ops.attention(q, k, v, causal=True))
    # Jitted (one program each), not an eager compile of every primitive of the two VJPs.
    (lf, gf), (lb, gb) = (
        jax.jit(jax.value_and_grad(f, (0, 1, 2)))(q, k, v) for f in (full, blocked)
    )
    np.testing.assert_allclose(lb, lf, rtol=1e-6)
    for a, b in zip(gb, gf, strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)


def test_causal_blocks_are_64_rows_and_at_most_8():
    module = _attention_module()
    sizes = {t: module.causal_block(t) for t in (65, 128, 256, 512, 513, 1024, 4096)}
    assert sizes == {65: 64, 128: 64, 256: 64, 512: 64, 513: 128, 1024: 128, 4096: 512}
    for t, block in sizes.items():
        assert -(-t // block) <= module.CAUSAL_MAX_BLOCKS and block % 64 == 0


# ---- rows with no visible key: output 0, dq 0, and no share of dk, dv, in every impl ----------

_NO_KEYS_FOR_ROW_1 = np.asarray([[1, 1, 0, 1], [0, 0, 0, 0]], bool)[:, None, None]
EMPTY_ROW_CASES = {
    # offset -2: queries 0 and 1 precede every key (bottom-right alignment gives S - T < 0).
    "negative_offset": dict(causal=True, offset=-2),
    # Batch row 1's key-padding mask hides every key; concrete, and accepted (unlike softmax).
    "all_keys_masked": dict(causal=False, mask=_NO_KEYS_FOR_ROW_1),
    # offset -T: no query sees any key.
    "every_row_empty": dict(causal=True, offset=-4),
}


def _np_keep(b, h, t, s, causal, offset=0, mask=None):
    keep = _causal_keep(b, h, t, s, offset) if causal else np.ones((b, h, t, s), bool)
    return keep if mask is None else keep & np.broadcast_to(mask, keep.shape)


@pytest.mark.parametrize("case", list(EMPTY_ROW_CASES))
@pytest.mark.parametrize("impl", IMPLS)
def test_a_row_with_no_visible_key_gives_zero_and_adds_nothing_to_any_gradient(impl, case):
    """The contract of `attention`: such a row's output and dq are exactly 0, and its cotangent
    changes dk and dv by exactly nothing (against the same call with that cotangent set to 0).
    Costs two tiny eager forward+backward passes per impl and case."""
    kwargs = EMPTY_ROW_CASES[case]
    q, k, v = _qkv(4, 4, seed=9)
    keep = _np_keep(2, 2, 4, 4, **kwargs)
    empty_BT = ~keep.any(axis=-1).all(axis=1)  # [B, T]: every head of the row sees no key
    assert empty_BT.any()
    g = np.random.default_rng(10).standard_normal(q.shape).astype(np.float32)
    g_quiet = np.where(empty_BT[..., None, None], 0.0, g).astype(np.float32)

    def vjp(cotangent):
        out, pull = jax.vjp(lambda *a: attention(*a, impl=impl, **kwargs), q, k, v)
        return [np.asarray(x) for x in (out, *pull(jnp.asarray(cotangent)))]

    out, dq, dk, dv = vjp(g)
    _, dq_quiet, dk_quiet, dv_quiet = vjp(g_quiet)
    assert np.all(out[empty_BT] == 0.0) and np.all(dq[empty_BT] == 0.0)
    np.testing.assert_array_equal(dk, dk_quiet)
    np.testing.assert_array_equal(dv, dv_quiet)
    np.testing.assert_array_equal(dq, dq_quiet)
    np.testing.assert_allclose(out, _np_attention(q, k, v, keep), rtol=1e-5, atol=1e-6)
    if empty_BT.all():
        assert not dk.any() and not dv.any()
    else:  # the other rows are attended as usual, not zeroed along with the empty ones
        assert np.abs(out[~empty_BT]).min() > 0 and np.abs(dk).max() > 0
