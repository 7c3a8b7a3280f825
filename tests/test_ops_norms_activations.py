"""Edge cases of SPEC section 2 for layer_norm, rms_norm and the activations."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from lmjax import ops
from lmjax.errors import ConfigError, ShapeError

ACTIVATIONS = ["gelu", "gelu_tanh", "relu", "silu", "sigmoid", "tanh", "leaky_relu"]


def _rng_f32(shape, seed=0):
    return jnp.asarray(np.random.default_rng(seed).standard_normal(shape), jnp.float32)


def test_layer_norm_uses_population_variance_and_eps_inside_sqrt():
    x = _rng_f32((3, 7))
    eps = 1e-2  # large enough that eps outside the sqrt would be visible
    xn = np.asarray(x, np.float64)
    expected = (xn - xn.mean(-1, keepdims=True)) / np.sqrt(xn.var(-1, ddof=0, keepdims=True) + eps)
    out = ops.layer_norm(x, jnp.ones(7), jnp.zeros(7), eps=eps)
    np.testing.assert_allclose(out, expected, rtol=1e-5, atol=1e-6)


def test_layer_norm_of_a_constant_slice_is_bias_with_finite_gradients():
    x = jnp.full((2, 3, 5), 4.25, jnp.float32)
    scale, bias = _rng_f32((5,), 1), _rng_f32((5,), 2)
    out = ops.layer_norm(x, scale, bias)
    np.testing.assert_array_equal(out, np.broadcast_to(np.asarray(bias), (2, 3, 5)))
    grads = jax.grad(lambda *a: (ops.layer_norm(*a) * _rng_f32((2, 3, 5), 3)).sum(), (0, 1, 2))(
        x, scale, bias
    )
    assert all(np.isfinite(np.asarray(g)).all() for g in grads)


@pytest.mark.parametrize("value, dim", [(1000.1, 768), (0.1, 768), (-3.7e4, 64)])
def test_layer_norm_of_an_inexact_constant_is_exactly_bias(value, dim):
    # 1000.1 is not representable, and a float32 mean of 768 copies is not exactly it: the
    # shift by the slice's first entry must make the centred slice exactly zero anyway.
    bias = _rng_f32((dim,), 4)
    out = ops.layer_norm(jnp.full((2, dim), value, jnp.float32), jnp.ones(dim), bias)
    np.testing.assert_array_equal(out, np.broadcast_to(np.asarray(bias), (2, dim)))


def test_biasless_layer_norm_has_no_bias_gradient():
    x = _rng_f32((2, 3, 4))
    out, pullback = jax.vjp(lambda x, s: ops.layer_norm(x, s, None), x, jnp.ones(4))
    np.testing.assert_allclose(out, ops.layer_norm(x, jnp.ones(4), jnp.zeros(4)), rtol=1e-6)
    dx, dscale = pullback(jnp.ones_like(out))
    assert dx.shape == x.shape and dscale.shape == (4,)


def test_rms_norm_of_zeros_is_zero_and_finite():
    grads = jax.grad(lambda x: ops.rms_norm(x, jnp.ones(4)).sum())(jnp.zeros((2, 4)))
    np.testing.assert_array_equal(ops.rms_norm(jnp.zeros((2, 4)), jnp.ones(4)), 0.0)
    assert np.isfinite(np.asarray(grads)).all()


@pytest.mark.parametrize("op", [ops.layer_norm, ops.rms_norm])
def test_norms_keep_bf16_inputs_bf16(op):
    x = _rng_f32((2, 8)).astype(jnp.bfloat16)
    args = (jnp.ones(8, jnp.bfloat16),) + (
        (jnp.zeros(8, jnp.bfloat16),) if op is ops.layer_norm else ()
    )
    out = op(x, *args)
    assert out.dtype == jnp.bfloat16
    # Statistics in float32: the result is the float32 computation rounded once to bf16.
    ref = op(x.astype(jnp.float32), *(a.astype(jnp.float32) for a in args))
    np.testing.assert_allclose(np.asarray(out, np.float32), ref, rtol=1e-2, atol=1e-2)


@pytest.mark.parametrize("eps", [0.0, -1e-5, float("nan"), float("inf"), True])
def test_norms_reject_bad_eps(eps):
    with pytest.raises(ConfigError, match="eps"):
        ops.layer_norm(jnp.ones((2, 3)), jnp.ones(3), jnp.zeros(3), eps=eps)
    with pytest.raises(ConfigError, match="eps"):
        ops.rms_norm(jnp.ones((2, 3)), jnp.ones(3), eps=eps)


def test_norms_reject_mismatched_scale():
    with pytest.raises(ShapeError, match=r"scale.shape = \(4,\); expected \(3,\)"):
        ops.layer_norm(jnp.ones((2, 3)), jnp.ones(4), jnp.zeros(3))
    with pytest.raises(ShapeError, match="bias.shape"):
        ops.layer_norm(jnp.ones((2, 3)), jnp.ones(3), jnp.zeros((1, 3)))


def test_relu_derivative_at_zero_is_zero():
    grad = jax.grad(lambda x: ops.relu(x).sum())(jnp.array([-1.0, 0.0, 2.0]))
    np.testing.assert_array_equal(grad, [0.0, 0.0, 1.0])


def test_leaky_relu_slope_and_derivative():
    x = jnp.array([-2.0, 0.0, 3.0])
    np.testing.assert_allclose(ops.leaky_relu(x), [-0.02, 0.0, 3.0], rtol=1e-6)
    np.testing.assert_allclose(jax.grad(lambda x: ops.leaky_relu(x).sum())(x), [0.01, 0.01, 1.0])
    np.testing.assert_allclose(ops.leaky_relu(x, negative_slope=0.2), [-0.4, 0.0, 3.0], rtol=1e-6)


@pytest.mark.parametrize("name", ACTIVATIONS)
def test_nan_stays_nan_forward_and_backward(name):
    op = getattr(ops, name)
    x = jnp.array([jnp.nan, 1.0, -1.0])
    out, pullback = jax.vjp(op, x)
    (dx,) = pullback(jnp.ones(3))
    assert np.isnan(out[0]) and np.isnan(dx[0])
    assert np.isfinite(np.asarray(out[1:])).all() and np.isfinite(np.asarray(dx[1:])).all()
    # A NaN cotangent is not swallowed either (including on relu's zero branch).
    (dx_nan,) = pullback(jnp.array([1.0, jnp.nan, jnp.nan]))
    assert np.isnan(np.asarray(dx_nan[1:])).all()


@pytest.mark.parametrize("name", ACTIVATIONS)
def test_activations_are_finite_for_large_inputs(name):
    x = jnp.array([-1e4, -80.0, 80.0, 1e4])
    out, pullback = jax.vjp(getattr(ops, name), x)
    (dx,) = pullback(jnp.ones(4))
    assert np.isfinite(np.asarray(out)).all() and np.isfinite(np.asarray(dx)).all()


def test_exact_and_tanh_gelu_are_different_functions():
    x = jnp.linspace(-3.0, 3.0, 13)
    diff = np.abs(np.asarray(ops.gelu(x) - ops.gelu_tanh(x))).max()
    assert 1e-5 < diff < 1e-2  # the tanh form approximates, it is not the same curve
    # Exact GELU at 1 is Phi(1) = 0.841344746...
    np.testing.assert_allclose(ops.gelu(jnp.array(1.0)), 0.8413447460685429, rtol=1e-6)


@pytest.mark.parametrize("name", ACTIVATIONS)
def test_activations_keep_dtype(name):
    x = jnp.array([-1.0, 0.5], jnp.bfloat16)
    assert getattr(ops, name)(x).dtype == jnp.bfloat16


@pytest.mark.parametrize("name", ACTIVATIONS)
def test_activations_reject_integer_input_instead_of_truncating(name):
    with pytest.raises(ShapeError, match="floating dtype"):
        getattr(ops, name)(jnp.array([1, 2]))


@pytest.mark.parametrize("slope", [None, "0.1", jnp.asarray(0.1)])
def test_leaky_relu_rejects_a_slope_that_is_not_a_static_number(slope):
    with pytest.raises(ConfigError, match="negative_slope"):
        ops.leaky_relu(jnp.ones(2), negative_slope=slope)


def test_swiglu_rejects_mismatched_halves():
    with pytest.raises(ShapeError, match="up.shape"):
        ops.swiglu(jnp.ones((2, 4)), jnp.ones((2, 3)))
