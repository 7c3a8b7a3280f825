"""Numerically stable, optionally masked softmax."""

from __future__ import annotations

from functools import partial

import jax
import jax.numpy as jnp
import numpy as np

from lmjax.errors import MaskError, ShapeError
from lmjax.ops._common import (
    broadcast_mask,
    check_keep_values,
    compute_dtype,
    is_concrete,
    require_float,
)


def masked_softmax(x: jax.Array, keep: jax.Array | None, axis: int) -> jax.Array:
    """Forward in x's (already float32+) dtype; `keep` is a bool array of x's shape or None."""
    if keep is not None:
        x = jnp.where(keep, x, -jnp.inf)
    m = jnp.max(x, axis=axis, keepdims=True)
    # A slice with every entry masked has m = -inf; shift by 0 instead so exp gives 0, not NaN.
    e = jnp.exp(x - jnp.where(jnp.isneginf(m), 0.0, m))
    total = jnp.sum(e, axis=axis, keepdims=True)
    return e / jnp.where(total > 0, total, 1.0)


def masked_softmax_vjp(p: jax.Array, g: jax.Array, keep: jax.Array | None, axis: int):
    """`dx = p * (g - sum(g * p))`, exactly 0 where masked.

    The cotangent at masked entries is zeroed *before* the row sum: p = 0 there, but a NaN or
    inf `g` would still turn `g * p` into NaN and poison every kept entry of the row.
    """
    if keep is not None:
        g = jnp.where(keep, g, 0.0)
    dx = p * (g - jnp.sum(g * p, axis=axis, keepdims=True))
    return dx if keep is None else jnp.where(keep, dx, 0.0)


@partial(jax.custom_vjp, nondiff_argnums=(2,))
def _softmax(x, keep, axis):
    return masked_softmax(x.astype(compute_dtype(x.dtype)), keep, axis).astype(x.dtype)


def _softmax_fwd(x, keep, axis):
    p = masked_softmax(x.astype(compute_dtype(x.dtype)), keep, axis)
    return p.astype(x.dtype), (p, keep)


def _softmax_bwd(axis, res, g):
    p, keep = res
    dx = masked_softmax_vjp(p, g.astype(p.dtype), keep, axis)
    return dx.astype(g.dtype), None


_softmax.defvjp(_softmax_fwd, _softmax_bwd)


def check_not_fully_masked(mask, shape: tuple[int, ...], axis: int, what: str = "mask") -> None:
    """Host-side check: every slice along `axis` keeps at least one entry, else `MaskError`.

    `mask` must be concrete (numpy or a non-traced jax array) and broadcastable to `shape`.
    """
    keep_np = np.broadcast_to(np.asarray(mask) != 0, shape)
    empty = ~keep_np.any(axis=axis)
    if empty.any():
        where = tuple(int(i) for i in np.argwhere(empty)[0])
        raise MaskError.describe(
            f"{what} slice at index {list(where)} along axis {axis}",
            "all entries masked",
            f"at least one kept entry in every slice ({int(empty.sum())} slices are empty)",
            "unmask at least one position per slice or drop those slices",
        )


def softmax(x: jax.Array, axis: int = -1, mask: jax.Array | None = None) -> jax.Array:
    """Numerically stable, optionally masked softmax along one axis.

    Shapes: x `[...]`, mask broadcastable from the right to x (0/1 or bool; 1 keeps an entry;
    a concrete mask holding any other value is a `ShapeError`, see `check_keep_values`),
    -> p with x's shape and dtype (computed in at least float32).

        m = max over kept entries of x
        p_i = exp(x_i - m) / sum_{kept j} exp(x_j - m)   for kept i,   p_i = 0 for masked i
      VJP, with g = dL/dp:
        dx_i = p_i (g_i - sum_j g_j p_j)                 for kept i,   dx_i = 0 exactly for masked i

    Subtracting the max keeps `softmax([10000, 10001, 10002])` finite. A slice whose entries are
    all masked has nothing to normalise: with a concrete mask that is a `MaskError`; inside `jit`
    (where values cannot raise) such a slice yields zeros, the convention attention uses for rows
    with no visible key.
    """
    x = jnp.asarray(x)
    require_float(x, "x")
    if x.ndim == 0 or not -x.ndim <= axis < x.ndim:
        raise ShapeError.describe(
            "softmax axis",
            axis,
            f"an axis of x.shape {x.shape}, in [-{x.ndim}, {x.ndim})",
            "pass an existing axis (softmax of a scalar is not defined)",
        )
    axis = axis % x.ndim
    check_keep_values(mask)
    keep = None if mask is None else broadcast_mask(mask, x.shape)
    if keep is not None and is_concrete(mask):
        check_not_fully_masked(mask, x.shape, axis)
    return _softmax(x, keep, axis)


def softmax_reference(x: jax.Array, axis: int = -1, mask: jax.Array | None = None) -> jax.Array:
    """Plain jnp: masked entries get a huge negative logit, then exp / sum."""
    xf = x.astype(compute_dtype(x.dtype))
    if mask is not None:
        keep = jnp.broadcast_to(jnp.asarray(mask) != 0, x.shape)
        xf = jnp.where(keep, xf, jnp.finfo(xf.dtype).min)
    e = jnp.exp(xf - jax.lax.stop_gradient(jnp.max(xf, axis=axis, keepdims=True)))
    p = e / jnp.sum(e, axis=axis, keepdims=True)
    if mask is not None:
        p = jnp.where(keep, p, 0.0)
    return p.astype(x.dtype)
