"""Losses: scalar means with hand-written VJPs, computed in at least float32."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from lmjax.checks import is_int
from lmjax.errors import ShapeError
from lmjax.ops._common import (
    check_keep_values,
    check_token_ids,
    compute_dtype,
    is_concrete,
    require_float,
    require_int,
    require_shape,
)

# ---- cross_entropy -----------------------------------------------------------------------------


def counted_positions(
    targets: jax.Array, ignore_index: int, time_range, loss_mask=None
) -> jax.Array:
    """bool `[...]`: positions that enter the mean (not ignored, inside the time range, and
    where `loss_mask` `[...]` (bool or 0/1) is 1)."""
    counted = targets != ignore_index
    if loss_mask is not None:
        counted = counted & (jnp.asarray(loss_mask) != 0)
    if time_range is not None:
        offset, count = time_range
        t = jnp.arange(targets.shape[-1])
        in_range = (t >= offset) & (t < offset + count)
        counted = counted & jnp.broadcast_to(in_range, targets.shape)
    return counted


def _log_softmax_parts(logits_NV):
    """(row max m `[N,1]`, log sum exp(z - m) `[N,1]`); shared by both cross-entropies.

    Kept as two numbers rather than one lse = m + log-sum: for logits near 1e4 a float32 lse has
    a spacing of 1e-3, while z - m and the log-sum are both small and exact enough.
    """
    m = jnp.max(logits_NV, axis=-1, keepdims=True)
    return m, jnp.log(jnp.sum(jnp.exp(logits_NV - m), axis=-1, keepdims=True))


def _target_hits(targets_N, vocab: int):
    """(one-hot bool `[N, V]` by comparison with an iota, in-vocabulary bool `[N]`)."""
    hit = jnp.arange(vocab)[None, :] == targets_N[:, None]
    return hit, (targets_N >= 0) & (targets_N < vocab)


# The custom VJPs below see flattened float32+ operands (`[N, V]`, `[N]`): the public wrappers
# reshape and upcast, and JAX differentiates those two steps, so the cotangent comes back in
# the caller's shape and dtype without shape bookkeeping in the residuals.


def _ce_parts(logits_NV, targets_N, counted_N):
    m, log_sum = _log_softmax_parts(logits_NV)
    hit, valid = _target_hits(targets_N, logits_NV.shape[-1])
    # z_{n, y_n} - m by a fused compare-and-sum over the row: no gather.
    picked = jnp.sum(jnp.where(hit, logits_NV - m, 0.0), axis=-1)
    # A counted target outside the vocabulary makes the loss NaN, never a silent clamp.
    nll = log_sum[:, 0] - jnp.where(valid, picked, jnp.nan)
    n = jnp.maximum(jnp.sum(counted_N), 1).astype(logits_NV.dtype)
    # Residuals: the logits (the caller keeps them alive anyway), two [N,1] row statistics and
    # the targets; softmax and the one-hot are recomputed, not stored as [N, V] arrays.
    return jnp.sum(jnp.where(counted_N, nll, 0.0)) / n, (
        logits_NV,
        m,
        log_sum,
        targets_N,
        counted_N,
        n,
    )


@jax.custom_vjp
def _cross_entropy(logits_NV, targets_N, counted_N):
    return _ce_parts(logits_NV, targets_N, counted_N)[0]


def _cross_entropy_fwd(logits_NV, targets_N, counted_N):
    return _ce_parts(logits_NV, targets_N, counted_N)


def _cross_entropy_bwd(res, g):
    logits_NV, m, log_sum, targets_N, counted_N, n = res
    p = jnp.exp(logits_NV - m - log_sum)
    hit, valid = _target_hits(targets_N, logits_NV.shape[-1])
    scale_N = jnp.where(valid, g / n, jnp.nan)  # an invalid counted target: NaN gradient too
    dz = jnp.where(counted_N[:, None], (p - hit) * scale_N[:, None], 0.0)
    return dz, None, None


_cross_entropy.defvjp(_cross_entropy_fwd, _cross_entropy_bwd)


def _flat_rows(logits):
    """`[..., V]` -> `[N, V]` in float32 or wider."""
    return logits.reshape(-1, logits.shape[-1]).astype(compute_dtype(logits.dtype))


def check_cross_entropy_args(
    logits, targets, ignore_index, time_range, raw_targets, loss_mask=None
):
    """Raise unless `cross_entropy` accepts these: float logits `[..., V]`, int targets `[...]`,
    `time_range` an (offset, count) window inside T, concrete targets in range or ignored,
    `loss_mask` None or bool/0-1 of the targets' shape."""
    require_float(logits, "logits")
    require_int(targets, "targets")
    if logits.ndim < 1 or targets.shape != logits.shape[:-1]:
        raise ShapeError.describe(
            "targets.shape",
            targets.shape,
            f"logits.shape[:-1] = {logits.shape[:-1]}",
            "give one target per logits row",
        )
    if time_range is not None:
        steps = targets.shape[-1] if targets.ndim else 0
        ok = (
            isinstance(time_range, tuple | list)
            and len(time_range) == 2
            and all(is_int(v) for v in time_range)
            and time_range[0] >= 0
            and time_range[1] >= 1
            and sum(time_range) <= steps
        )
        if not ok:
            raise ShapeError.describe(
                "time_range",
                time_range,
                f"(offset, count) ints with offset >= 0, count >= 1 "
                f"and offset + count <= {steps} time steps",
                "pass a window inside the sequence",
            )
    if loss_mask is not None:
        require_shape(loss_mask, targets.shape, "loss_mask", "one 0/1 per target")
        check_keep_values(loss_mask, "loss_mask")
    if is_concrete(raw_targets):
        check_token_ids(
            raw_targets,
            logits.shape[-1],
            "targets",
            ignore_index=ignore_index,
            fix="fix the targets or mark the position with ignore_index",
        )


def cross_entropy(
    logits: jax.Array,
    targets: jax.Array,
    ignore_index: int = -100,
    time_range: tuple[int, int] | None = None,
    *,
    loss_mask: jax.Array | None = None,
) -> jax.Array:
    """Mean token cross-entropy, fused from logits.

    Shapes: logits `[..., V]`, integer targets `[...]` -> scalar (float32 or wider).

    With counted positions c_n = (y_n != ignore_index) and (n's time step in time_range) and
    (loss_mask_n == 1; `loss_mask` `[...]` bool or 0/1, default all ones), N = sum_n c_n and a
    max-subtracted lse_n = log sum_k exp(z_nk):
        L = (1/N) sum_n c_n (lse_n - z_{n, y_n})
    VJP: dL/dz_nk = c_n (softmax(z_n)_k - [k = y_n]) / N, exactly 0 at uncounted positions.

    `time_range=(offset, count)` counts only time steps offset .. offset+count-1 of every row
    (time is the last axis of targets). If nothing is counted (N = 0) loss and gradient are 0.
    A target outside [0, V) that is not ignore_index is a `TokenError` when targets are concrete;
    inside `jit` it makes the loss NaN (loud, never a silent clamp).
    """
    # Range-check the caller's ids before conversion: int32 would wrap an int64 2**32 + 3 to 3.
    raw_targets = targets
    logits, targets = jnp.asarray(logits), jnp.asarray(targets)
    check_cross_entropy_args(logits, targets, ignore_index, time_range, raw_targets, loss_mask)
    counted = counted_positions(targets, ignore_index, time_range, loss_mask)
    return _cross_entropy(_flat_rows(logits), targets.reshape(-1), counted.reshape(-1))


def cross_entropy_reference(
    logits, targets, ignore_index: int = -100, time_range=None, *, loss_mask=None
):
    """`-log_softmax` gathered at the targets, masked mean; `jax.grad` does the rest."""
    logp = jax.nn.log_softmax(logits.astype(compute_dtype(logits.dtype)), axis=-1)
    counted = targets != ignore_index
    if loss_mask is not None:
        counted = counted & jnp.asarray(loss_mask).astype(bool)
    if time_range is not None:  # written out again, not counted_positions: an independent check
        step = jax.lax.broadcasted_iota(jnp.int32, targets.shape, targets.ndim - 1)
        counted = counted & (step >= time_range[0]) & (step < time_range[0] + time_range[1])
    safe = jnp.where(counted, targets, 0)
    nll = -jnp.take_along_axis(logp, safe[..., None], axis=-1)[..., 0]
    return jnp.sum(jnp.where(counted, nll, 0.0)) / jnp.maximum(jnp.sum(counted), 1)


# ---- softmax_cross_entropy (dense targets) -------------------------------------------------------


def _dense_parts(logits_NV, q_NV):
    m, log_sum = _log_softmax_parts(logits_NV)
    logp = logits_NV - m - log_sum
    return -jnp.sum(q_NV * logp) / logits_NV.shape[0], logp


@jax.custom_vjp
def _softmax_cross_entropy(logits_NV, q_NV):
    return _dense_parts(logits_NV, q_NV)[0]


def _softmax_cross_entropy_fwd(logits_NV, q_NV):
    loss, logp = _dense_parts(logits_NV, q_NV)
    return loss, (logp, q_NV)


def _softmax_cross_entropy_bwd(res, g):
    logp, q_NV = res
    scale = g / logp.shape[0]
    dz = (jnp.exp(logp) * jnp.sum(q_NV, axis=-1, keepdims=True) - q_NV) * scale
    return dz, -logp * scale


_softmax_cross_entropy.defvjp(_softmax_cross_entropy_fwd, _softmax_cross_entropy_bwd)


def _same_shape_floats(a, b, what_a: str, what_b: str) -> tuple[jax.Array, jax.Array]:
    """Both as float arrays of one shape, else `ShapeError`."""
    a, b = jnp.asarray(a), jnp.asarray(b)
    require_float(a, what_a)
    require_float(b, what_b)
    if a.shape != b.shape:
        raise ShapeError.describe(
            f"{what_b}.shape",
            b.shape,
            f"{what_a}.shape = {a.shape}",
            f"give {what_b} exactly the shape of {what_a}",
        )
    return a, b


def softmax_cross_entropy(logits: jax.Array, target_probs: jax.Array) -> jax.Array:
    """Cross-entropy against dense (one-hot or soft) targets, mean over positions.

    Shapes: logits and target_probs `[..., V]` -> scalar; N = number of positions.
        L = -(1/N) sum_n sum_k q_nk log p_nk,   p = softmax(z)
    VJP: dL/dz_nk = (p_nk sum_j q_nj - q_nk) / N,   dL/dq_nk = -log p_nk / N
    """
    logits, target_probs = _same_shape_floats(logits, target_probs, "logits", "target_probs")
    return _softmax_cross_entropy(_flat_rows(logits), _flat_rows(target_probs))


def softmax_cross_entropy_reference(logits, target_probs):
    logp = jax.nn.log_softmax(logits.astype(compute_dtype(logits.dtype)), axis=-1)
    return -jnp.mean(jnp.sum(target_probs * logp, axis=-1))


# ---- mse ---------------------------------------------------------------------------------------


@jax.custom_vjp
def _mse(a, b):
    diff = a.astype(compute_dtype(a.dtype)) - b.astype(compute_dtype(b.dtype))
    return jnp.mean(diff * diff)


def _mse_fwd(a, b):
    return _mse(a, b), (a, b)


def _mse_bwd(res, g):
    a, b = res
    da = 2.0 * (a.astype(compute_dtype(a.dtype)) - b) * (g / a.size)
    return da.astype(a.dtype), (-da).astype(b.dtype)


_mse.defvjp(_mse_fwd, _mse_bwd)


def mse(predictions: jax.Array, targets: jax.Array) -> jax.Array:
    """Mean squared error. Shapes: predictions, targets `[...]` (equal) -> scalar.

        L = (1/M) sum (a - b)^2  over the M elements
    VJP: dL/da = 2 (a - b) / M = -dL/db
    """
    predictions, targets = _same_shape_floats(predictions, targets, "predictions", "targets")
    return _mse(predictions, targets)


def mse_reference(predictions, targets):
    return jnp.mean((predictions - targets) ** 2)


# ---- binary_cross_entropy_with_logits ----------------------------------------------------------


def _bce_terms(x, y):
    x = x.astype(compute_dtype(x.dtype))
    return jnp.maximum(x, 0.0) - x * y + jnp.log1p(jnp.exp(-jnp.abs(x)))


@jax.custom_vjp
def _bce(logits, targets):
    return jnp.mean(_bce_terms(logits, targets))


def _bce_fwd(logits, targets):
    return _bce(logits, targets), (logits, targets)


def _bce_bwd(res, g):
    x, y = res
    xf = x.astype(compute_dtype(x.dtype))
    scale = g / x.size
    dx = (jax.nn.sigmoid(xf) - y) * scale
    dy = -xf * scale
    return dx.astype(x.dtype), dy.astype(y.dtype)


_bce.defvjp(_bce_fwd, _bce_bwd)


def binary_cross_entropy_with_logits(logits: jax.Array, targets: jax.Array) -> jax.Array:
    """Mean binary cross-entropy from logits, stable for large |x|.

    Shapes: logits x, targets y in [0, 1], `[...]` (equal) -> scalar; M elements.
        l = max(x, 0) - x y + log(1 + exp(-|x|)),   L = mean(l)
    VJP: dL/dx = (sigmoid(x) - y) / M,   dL/dy = -x / M
    """
    logits, targets = _same_shape_floats(logits, targets, "logits", "targets")
    return _bce(logits, targets)


def binary_cross_entropy_with_logits_reference(logits, targets):
    p = 1.0 / (1.0 + jnp.exp(-logits))
    return -jnp.mean(targets * jnp.log(p) + (1.0 - targets) * jnp.log1p(-p))
