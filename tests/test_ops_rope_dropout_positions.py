"""Edge cases of SPEC section 2 for rope, dropout and sinusoidal_positions; op docstrings."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from lmjax import ops
from lmjax.errors import ConfigError, ShapeError


def _f32(shape, seed=0):
    return jnp.asarray(np.random.default_rng(seed).standard_normal(shape), jnp.float32)


# ---- rope ---------------------------------------------------------------------------------------


def test_rope_at_position_zero_is_the_identity():
    x = _f32((2, 3, 2, 8))
    np.testing.assert_array_equal(ops.rope(x, jnp.zeros(3, jnp.int32)), x)


def test_rope_preserves_the_norm_of_each_rotated_pair():
    x = _f32((1, 4, 2, 8))
    y = ops.rope(x, offset=17)
    pair_norm = lambda a: a[..., :4] ** 2 + a[..., 4:] ** 2  # noqa: E731
    np.testing.assert_allclose(pair_norm(y), pair_norm(x), rtol=1e-5, atol=1e-6)


def test_rope_scores_depend_only_on_relative_position():
    q, k = _f32((1, 1, 1, 8), 1), _f32((1, 1, 1, 8), 2)

    def score(m, n):
        rq = ops.rope(q, jnp.array([m]))
        rk = ops.rope(k, jnp.array([n]))
        return float(jnp.sum(rq * rk))

    assert score(5, 3) == pytest.approx(score(9, 7), rel=1e-5)
    assert score(5, 3) != pytest.approx(score(5, 4), rel=1e-3)


def test_rope_offset_and_per_row_positions_agree_with_explicit_positions():
    x = _f32((2, 3, 1, 4))
    np.testing.assert_allclose(ops.rope(x, offset=5), ops.rope(x, jnp.arange(5, 8)), rtol=1e-6)
    np.testing.assert_allclose(ops.rope(x, jnp.arange(3)[None, :]), ops.rope(x), rtol=1e-6)
    per_row = ops.rope(x, jnp.array([[0, 1, 2], [7, 8, 9]]))
    np.testing.assert_allclose(per_row[0], ops.rope(x[:1], jnp.arange(3))[0], rtol=1e-6)
    np.testing.assert_allclose(per_row[1], ops.rope(x[1:], jnp.arange(7, 10))[0], rtol=1e-6)


@pytest.mark.parametrize(
    "x, positions, message",
    [
        (jnp.zeros((1, 2, 1, 5)), None, "even"),
        (jnp.zeros((1, 2, 4)), None, "rank 4"),
        (jnp.zeros((1, 2, 1, 4)), jnp.arange(3), "positions.shape"),
        (jnp.zeros((1, 2, 1, 4)), jnp.array([0.0, 1.0]), "integer dtype"),
    ],
)
def test_rope_rejects_bad_input(x, positions, message):
    with pytest.raises(ShapeError, match=message):
        ops.rope(x, positions)


@pytest.mark.parametrize("theta", [0.0, -1.0, float("inf"), "10000"])
def test_rope_rejects_bad_theta(theta):
    with pytest.raises(ConfigError, match="rope theta"):
        ops.rope(jnp.zeros((1, 2, 1, 4)), theta=theta)


# ---- dropout ------------------------------------------------------------------------------------


def test_dropout_deterministic_or_rate_zero_is_the_identity():
    x = _f32((3, 4))
    key = jax.random.PRNGKey(0)
    assert ops.dropout(key, x, 0.5, deterministic=True) is x
    assert ops.dropout(key, x, 0.0, deterministic=False) is x


def test_dropout_without_a_key_says_how_to_fix_it():
    with pytest.raises(ConfigError, match="deterministic=True"):
        ops.dropout(None, jnp.ones(3), 0.1, deterministic=False)


@pytest.mark.parametrize("rate", [1.0, -0.1, 1.5, True, "0.1"])
def test_dropout_rejects_rates_outside_zero_one(rate):
    with pytest.raises(ConfigError, match="dropout rate"):
        ops.dropout(jax.random.PRNGKey(0), jnp.ones(3), rate, deterministic=False)


def test_dropout_drops_the_right_fraction_and_rescales_the_rest():
    x = jnp.ones((100, 100))
    y = np.asarray(ops.dropout(jax.random.PRNGKey(3), x, 0.3, deterministic=False))
    # 10,000 Bernoulli(0.3) draws: the dropped fraction has std 0.0046; allow 4.3 sigma.
    assert abs((y == 0).mean() - 0.3) < 0.02
    np.testing.assert_allclose(y[y != 0], 1.0 / 0.7, rtol=1e-6)


def test_dropout_is_a_function_of_the_key_and_its_gradient_uses_the_same_mask():
    x = _f32((4, 5))
    k1, k2 = jax.random.PRNGKey(1), jax.random.PRNGKey(2)
    y1 = ops.dropout(k1, x, 0.5, False)
    np.testing.assert_array_equal(y1, ops.dropout(k1, x, 0.5, False))
    assert not np.array_equal(np.asarray(y1), np.asarray(ops.dropout(k2, x, 0.5, False)))
    grad = jax.grad(lambda x: ops.dropout(k1, x, 0.5, False).sum())(x)
    np.testing.assert_array_equal(np.asarray(grad) != 0, np.asarray(y1) != 0)
    np.testing.assert_allclose(np.asarray(grad)[np.asarray(y1) != 0], 2.0)


# ---- sinusoidal positions ----------------------------------------------------------------------


@pytest.mark.parametrize("length, dim", [(50, 16), (7, 5), (1, 1)])
def test_sinusoidal_positions_match_the_formula(length, dim):
    table = ops.sinusoidal_positions(length, dim)
    assert table.shape == (length, dim) and table.dtype == jnp.float32
    np.testing.assert_allclose(
        table, ops.sinusoidal_positions_reference(length, dim), rtol=1e-5, atol=2e-5
    )
    np.testing.assert_array_equal(table[0, 0::2], 0.0)
    np.testing.assert_array_equal(table[0, 1::2], 1.0)


@pytest.mark.parametrize("length, dim", [(0, 4), (4, 0), (-1, 4), (2.0, 4)])
def test_sinusoidal_positions_reject_bad_sizes(length, dim):
    with pytest.raises(ShapeError, match="sinusoidal_positions"):
        ops.sinusoidal_positions(length, dim)


# ---- docstrings ---------------------------------------------------------------------------------

DIFFERENTIABLE = [
    "embedding", "linear", "layer_norm", "rms_norm", "gelu", "gelu_tanh", "relu", "silu",
    "sigmoid", "tanh", "leaky_relu", "swiglu", "softmax", "cross_entropy", "mse",
    "binary_cross_entropy_with_logits", "softmax_cross_entropy", "attention", "rope", "dropout",
]  # fmt: skip


@pytest.mark.parametrize("name", DIFFERENTIABLE + ["sinusoidal_positions"])
def test_every_public_op_documents_its_shapes_and_has_a_reference(name):
    doc = getattr(ops, name).__doc__
    assert "Shapes" in doc or "Shape:" in doc, doc
    assert "->" in doc
    assert callable(getattr(ops, f"{name}_reference"))


@pytest.mark.parametrize("name", DIFFERENTIABLE)
def test_every_differentiable_op_states_its_backward(name):
    doc = getattr(ops, name).__doc__
    assert "VJP" in doc or "f'(x)" in doc, doc


def test_layer_norm_doc_shows_the_equation():
    doc = ops.layer_norm.__doc__
    for piece in ("sqrt(var + eps)", "xh * scale + bias", "dx     = r * (dxh", "[..., D]"):
        assert piece in doc
