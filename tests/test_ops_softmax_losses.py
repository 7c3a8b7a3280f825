"""Edge cases of SPEC section 2 for softmax and the losses."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from lmjax import ops
from lmjax.errors import MaskError, ShapeError, TokenError


def _f32(shape, seed=0, scale=1.0):
    return jnp.asarray(scale * np.random.default_rng(seed).standard_normal(shape), jnp.float32)


def _np_softmax(x, axis=-1):
    e = np.exp(x - x.max(axis=axis, keepdims=True))
    return e / e.sum(axis=axis, keepdims=True)


def test_softmax_of_huge_logits_is_finite_and_shift_invariant():
    p = ops.softmax(jnp.array([10000.0, 10001.0, 10002.0]))
    assert np.isfinite(np.asarray(p)).all()
    np.testing.assert_allclose(p, _np_softmax(np.array([0.0, 1.0, 2.0])), rtol=1e-6)


def test_masked_entries_get_exactly_zero_probability_and_gradient():
    x = _f32((2, 3, 6), scale=3.0)
    mask = np.random.default_rng(1).random((2, 3, 6)) < 0.5
    mask[..., 2] = True
    p, pullback = jax.vjp(lambda x: ops.softmax(x, mask=mask), x)
    # Even a NaN cotangent at a masked entry must not leak into its gradient.
    g = np.array(_f32((2, 3, 6), 2))
    g[~mask] = np.nan
    (dx,) = pullback(jnp.asarray(g))
    assert np.all(np.asarray(p)[~mask] == 0.0)
    assert np.all(np.asarray(dx)[~mask] == 0.0)
    # ...and kept entries get exactly the gradient of a cotangent that is 0 where masked.
    (dx_clean,) = pullback(jnp.asarray(np.where(mask, g, 0.0), jnp.float32))
    assert np.isfinite(np.asarray(dx)).all()
    np.testing.assert_array_equal(dx, dx_clean)
    np.testing.assert_allclose(np.asarray(p).sum(-1), 1.0, rtol=1e-6)
    expected = _np_softmax(np.where(mask, np.asarray(x), -np.inf))
    np.testing.assert_allclose(p, expected, rtol=1e-6, atol=1e-7)


def test_mask_broadcasts_from_the_right():
    x = _f32((2, 3, 4))
    row_mask = jnp.array([1, 0, 1, 1])  # [V] applies to every slice
    np.testing.assert_allclose(
        ops.softmax(x, mask=row_mask), ops.softmax(x, mask=jnp.broadcast_to(row_mask, (2, 3, 4)))
    )
    with pytest.raises(ShapeError, match="broadcastable from the right"):
        ops.softmax(x, mask=jnp.ones((2, 1)))


def test_fully_masked_slice_is_rejected_when_mask_is_concrete():
    mask = np.ones((2, 4), bool)
    mask[1] = False
    with pytest.raises(MaskError, match=r"index \[1\] along axis 1"):
        ops.softmax(jnp.zeros((2, 4)), mask=mask)


def test_fully_masked_slice_inside_jit_gives_zeros_not_nan():
    mask = jnp.array([[True, False], [False, False]])
    p, dx = jax.jit(
        lambda x, m: jax.value_and_grad(lambda x: (ops.softmax(x, mask=m) ** 2).sum())(x)
    )(jnp.ones((2, 2)), mask)
    p_rows = jax.jit(lambda x, m: ops.softmax(x, mask=m))(jnp.ones((2, 2)), mask)
    np.testing.assert_array_equal(p_rows, [[1.0, 0.0], [0.0, 0.0]])
    assert np.isfinite(np.asarray(dx)).all() and np.all(np.asarray(dx)[1] == 0)


@pytest.mark.parametrize("axis, shape", [(3, (2, 3, 4)), (-4, (2, 3, 4)), (0, ())])
def test_softmax_rejects_an_axis_that_does_not_exist(axis, shape):
    with pytest.raises(ShapeError, match="softmax axis"):
        ops.softmax(jnp.zeros(shape), axis=axis)


def test_softmax_along_a_middle_axis():
    x = _f32((2, 5, 3))
    np.testing.assert_allclose(ops.softmax(x, axis=1), _np_softmax(np.asarray(x), 1), rtol=1e-6)


# ---- cross_entropy ------------------------------------------------------------------------------


def _ce_numpy(logits, targets, counted):
    """Mean over counted positions, and its gradient (softmax - onehot) / N."""
    p = _np_softmax(logits.astype(np.float64))
    onehot = np.eye(logits.shape[-1])[np.where(counted, targets, 0)]
    nll = -np.log((p * onehot).sum(-1))
    n = counted.sum()
    grad = np.where(counted[..., None], (p - onehot) / n, 0.0)
    return (nll * counted).sum() / n, grad


def test_ignore_index_positions_are_excluded_from_mean_and_get_zero_gradient():
    logits = _f32((2, 5, 7), scale=2.0)
    targets = np.array([[1, -100, 3, 6, -100], [0, 2, -100, 5, 5]])
    counted = targets != -100
    loss, grad = jax.value_and_grad(ops.cross_entropy)(logits, jnp.asarray(targets))
    expected_loss, expected_grad = _ce_numpy(np.asarray(logits), targets, counted)
    np.testing.assert_allclose(loss, expected_loss, rtol=1e-6)
    np.testing.assert_allclose(grad, expected_grad, rtol=1e-5, atol=1e-7)
    assert np.all(np.asarray(grad)[~counted] == 0.0)


def test_time_range_counts_only_its_window_of_every_row():
    logits = _f32((3, 6, 5), 1, scale=2.0)
    targets = np.random.default_rng(2).integers(0, 5, (3, 6))
    counted = np.zeros((3, 6), bool)
    counted[:, 2:5] = True  # offset 2, count 3
    loss, grad = jax.value_and_grad(ops.cross_entropy)(
        logits, jnp.asarray(targets), time_range=(2, 3)
    )
    expected_loss, expected_grad = _ce_numpy(np.asarray(logits), targets, counted)
    np.testing.assert_allclose(loss, expected_loss, rtol=1e-6)
    np.testing.assert_allclose(grad, expected_grad, rtol=1e-5, atol=1e-7)
    assert np.all(np.asarray(grad)[~counted] == 0.0)


def test_time_range_and_ignore_index_combine():
    logits = _f32((2, 4, 3), 3)
    targets = np.array([[0, -100, 2, 1], [1, 1, -100, 0]])
    counted = (targets != -100) & (np.arange(4) >= 1)[None, :]
    loss = ops.cross_entropy(logits, jnp.asarray(targets), time_range=(1, 3))
    np.testing.assert_allclose(loss, _ce_numpy(np.asarray(logits), targets, counted)[0], rtol=1e-6)


def test_nothing_counted_gives_zero_loss_and_zero_gradient():
    loss, grad = jax.value_and_grad(ops.cross_entropy)(_f32((2, 3, 4)), jnp.full((2, 3), -100))
    assert float(loss) == 0.0 and np.all(np.asarray(grad) == 0.0)


@pytest.mark.parametrize("bad", [7, -3])
def test_target_outside_vocab_raises_when_concrete(bad):
    with pytest.raises(TokenError, match=rf"targets\[0, 1\] = {bad}"):
        ops.cross_entropy(_f32((2, 3, 7)), jnp.array([[0, bad, 1], [2, 3, 4]]))


def test_target_outside_vocab_inside_jit_makes_loss_and_its_row_gradient_nan():
    targets = jnp.array([[0, 9, 1], [2, 3, 4]])
    loss, grad = jax.jit(jax.value_and_grad(ops.cross_entropy))(_f32((2, 3, 7)), targets)
    assert np.isnan(float(loss))
    assert np.isnan(np.asarray(grad)[0, 1]).all()
    assert np.isfinite(np.asarray(grad)[1]).all()


@pytest.mark.parametrize(
    "targets, time_range, message",
    [
        (jnp.zeros((2, 4), jnp.int32), None, "targets.shape"),
        (jnp.zeros((2, 3), jnp.float32), None, "integer dtype"),
        (jnp.zeros((2, 3), jnp.int32), (2, 2), "time_range"),
        (jnp.zeros((2, 3), jnp.int32), (-1, 1), "time_range"),
        (jnp.zeros((2, 3), jnp.int32), (0, 0), "time_range"),
    ],
)
def test_cross_entropy_rejects_bad_shapes(targets, time_range, message):
    with pytest.raises(ShapeError, match=message):
        ops.cross_entropy(jnp.zeros((2, 3, 5)), targets, time_range=time_range)


def test_cross_entropy_of_bf16_logits_returns_f32_and_bf16_gradient():
    logits = _f32((2, 3, 5)).astype(jnp.bfloat16)
    loss, grad = jax.value_and_grad(ops.cross_entropy)(logits, jnp.zeros((2, 3), jnp.int32))
    assert loss.dtype == jnp.float32 and grad.dtype == jnp.bfloat16


def test_dense_cross_entropy_with_one_hot_targets_equals_sparse():
    logits = _f32((2, 3, 5), 4)
    targets = jnp.array([[0, 4, 2], [1, 1, 3]])
    dense = jax.nn.one_hot(targets, 5)
    np.testing.assert_allclose(
        ops.softmax_cross_entropy(logits, dense), ops.cross_entropy(logits, targets), rtol=1e-6
    )
    np.testing.assert_allclose(
        jax.grad(ops.softmax_cross_entropy)(logits, dense),
        jax.grad(ops.cross_entropy)(logits, targets),
        rtol=1e-5,
        atol=1e-7,
    )


def test_binary_cross_entropy_is_stable_for_huge_logits():
    x = jnp.array([100.0, -100.0, 30.0])
    y = jnp.array([1.0, 0.0, 0.0])
    loss, (dx, dy) = jax.value_and_grad(ops.binary_cross_entropy_with_logits, (0, 1))(x, y)
    # Per element: ~0, ~0 and 30 + log(1 + e^-30); mean over 3.
    np.testing.assert_allclose(loss, (30.0 + np.log1p(np.exp(-30.0))) / 3, rtol=1e-6)
    assert np.isfinite(np.asarray(dx)).all() and np.isfinite(np.asarray(dy)).all()


def test_mse_value_and_shape_check():
    a, b = jnp.array([[1.0, 2.0], [3.0, 4.0]]), jnp.array([[0.0, 2.0], [5.0, 4.0]])
    np.testing.assert_allclose(ops.mse(a, b), (1.0 + 4.0) / 4)
    with pytest.raises(ShapeError, match="targets.shape"):
        ops.mse(a, b[0])
