"""Edge cases of SPEC section 2 for embedding and linear."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from lmjax import ops
from lmjax.errors import ShapeError, TokenError


def test_repeated_ids_accumulate_every_occurrence():
    table = jnp.asarray(np.random.default_rng(0).standard_normal((5, 3)), jnp.float32)
    ids = jnp.array([[2, 2, 4], [2, 0, 4]])
    g = jnp.asarray(np.random.default_rng(1).standard_normal((2, 3, 3)), jnp.float32)
    _, pullback = jax.vjp(lambda t: ops.embedding(t, ids), table)
    (dtable,) = pullback(g)
    expected = np.zeros((5, 3), np.float32)
    for b in range(2):
        for t in range(3):
            expected[int(ids[b, t])] += np.asarray(g[b, t])
    np.testing.assert_allclose(dtable, expected, rtol=1e-6)
    assert np.all(np.asarray(dtable[1]) == 0) and np.all(np.asarray(dtable[3]) == 0)


def test_bf16_table_accumulates_past_256_repeats():
    # A bf16 running sum stalls at 256 (256 + 1 rounds back to 256); accumulation is float32.
    table = jnp.zeros((3, 2), jnp.bfloat16)
    ids = jnp.zeros((1000,), jnp.int32)
    dtable = jax.grad(lambda t: ops.embedding(t, ids).astype(jnp.float32).sum())(table)
    assert dtable.dtype == jnp.bfloat16
    np.testing.assert_array_equal(np.asarray(dtable, np.float32)[0], [1000.0, 1000.0])


def test_embedding_gathers_rows_of_any_rank():
    table = jnp.arange(12.0).reshape(6, 2)
    ids = jnp.array([[[5], [0]], [[3], [3]]])  # rank 3
    out = ops.embedding(table, ids)
    assert out.shape == (2, 2, 1, 2)
    np.testing.assert_array_equal(out[0, 0, 0], table[5])
    np.testing.assert_array_equal(out[1, 1, 0], table[3])


@pytest.mark.parametrize("bad", [-1, 6])
def test_out_of_range_ids_raise_when_concrete(bad):
    with pytest.raises(TokenError, match=rf"= {bad}; expected an id in \[0, 6\)"):
        ops.embedding(jnp.zeros((6, 2)), jnp.array([[0, bad]]))


def test_out_of_range_ids_inside_jit_give_nan_rows_not_a_clamped_row():
    table = jnp.ones((6, 2))
    out = jax.jit(ops.embedding)(table, jnp.array([1, 6, -1]))
    assert np.all(np.asarray(out[0]) == 1)
    assert np.all(np.isnan(np.asarray(out[1:])))
    dtable = jax.jit(jax.grad(lambda t, i: jnp.nansum(ops.embedding(t, i))))(
        table, jnp.array([1, 6, -1])
    )
    np.testing.assert_array_equal(dtable.sum(axis=1), [0, 2, 0, 0, 0, 0])


def test_float_ids_are_rejected():
    with pytest.raises(ShapeError, match="integer dtype"):
        ops.embedding(jnp.zeros((6, 2)), jnp.array([0.0, 1.0]))


def test_ids_get_no_gradient():
    # An integer input of a custom VJP has a float0 cotangent: nothing flows into the ids.
    grads = jax.grad(lambda t, i: ops.embedding(t, i).sum(), argnums=(0, 1), allow_int=True)(
        jnp.ones((4, 2)), jnp.array([1, 1])
    )
    assert grads[1].dtype == jax.dtypes.float0


def test_biasless_linear_has_no_bias_leaf_and_matches_matmul():
    params = ops.init_linear(jax.random.PRNGKey(0), 4, 3, bias=False)
    assert set(params) == {"weight"}
    x = jnp.asarray(np.random.default_rng(0).standard_normal((2, 5, 4)), jnp.float32)
    expected = np.asarray(x) @ np.asarray(params["weight"]).T
    np.testing.assert_allclose(ops.linear(params, x), expected, rtol=1e-5, atol=1e-6)


def test_init_linear_is_xavier_uniform_with_zero_bias():
    fan_in, fan_out = 300, 200
    params = ops.init_linear(jax.random.PRNGKey(1), fan_in, fan_out)
    w = np.asarray(params["weight"])
    limit = np.sqrt(6.0 / (fan_in + fan_out))
    assert w.shape == (fan_out, fan_in) and params["bias"].shape == (fan_out,)
    assert np.all(np.asarray(params["bias"]) == 0)
    assert np.abs(w).max() <= limit
    # U(-a, a) has std a/sqrt(3); with 60,000 draws the sample std is within 1% of it.
    assert abs(w.std() / (limit / np.sqrt(3.0)) - 1.0) < 0.01
    assert abs(w.mean()) < 0.01 * limit


@pytest.mark.parametrize(
    "params, x, message",
    [
        (
            {"weight": jnp.zeros((3, 4))},
            jnp.zeros((2, 5)),
            r"x.shape = \(2, 5\); expected \[\.\.\., 4\]",
        ),
        ({"weight": jnp.zeros((3, 4)), "bias": jnp.zeros(4)}, jnp.zeros((2, 4)), "bias.shape"),
        ({"w": jnp.zeros((3, 4))}, jnp.zeros((2, 4)), "linear params keys"),
        ({"weight": jnp.zeros(4)}, jnp.zeros((2, 4)), "rank 2"),
    ],
)
def test_linear_rejects_mismatched_shapes(params, x, message):
    with pytest.raises(ShapeError, match=message):
        ops.linear(params, x)


def test_init_linear_rejects_zero_sizes_and_accepts_numpy_ints():
    with pytest.raises(ShapeError, match="in_features = 0"):
        ops.init_linear(jax.random.PRNGKey(0), 0, 3)
    with pytest.raises(ShapeError, match="out_features = 2.0"):
        ops.init_linear(jax.random.PRNGKey(0), 3, 2.0)
    assert ops.init_linear(jax.random.PRNGKey(0), np.int64(4), 3)["weight"].shape == (3, 4)


def test_int64_ids_beyond_int32_are_reported_not_wrapped():
    # Converting to int32 first would read 2**32 + 3 as the valid id 3.
    table = jnp.ones((5, 3))
    big = np.array([2**32 + 3], np.int64)
    with pytest.raises(TokenError, match="4294967299"):
        ops.embedding(table, big)
    with pytest.raises(TokenError, match="4294967299"):
        ops.cross_entropy(jnp.zeros((1, 5)), big)
