"""Rotary position embedding (rotate-half convention)."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from lmjax.checks import is_real
from lmjax.errors import ConfigError, ShapeError
from lmjax.ops._common import compute_dtype, require_float, require_int, require_rank
from lmjax.ops._vjp import linear_in_x


def rope_angles(positions_BT: jax.Array, d_head: int, theta: float, dtype) -> tuple:
    """cos, sin of shape `[B or 1, T, 1, Dh]` for integer `positions[B or 1, T]`."""
    inv_freq = theta ** (-jnp.arange(0, d_head, 2, dtype=dtype) / d_head)
    angle_BTF = positions_BT.astype(dtype)[..., None] * inv_freq[None, None, :]
    angle_BTD = jnp.concatenate([angle_BTF, angle_BTF], axis=-1)[:, :, None, :]
    return jnp.cos(angle_BTD), jnp.sin(angle_BTD)


def _rotate_half(x):
    x1, x2 = jnp.split(x, 2, axis=-1)
    return jnp.concatenate([-x2, x1], axis=-1)


def _rotate_half_transpose(y):
    y1, y2 = jnp.split(y, 2, axis=-1)
    return jnp.concatenate([y2, -y1], axis=-1)


def _apply(x, positions_BT, theta):
    dtype = compute_dtype(x.dtype)
    cos, sin = rope_angles(positions_BT, x.shape[-1], theta, dtype)
    xf = x.astype(dtype)
    return (xf * cos + _rotate_half(xf) * sin).astype(x.dtype)


def _apply_transpose(g, positions_BT, theta):
    """The transpose of `_apply` in x: g cos + R^T (g sin), R the rotate-half map."""
    dtype = compute_dtype(g.dtype)
    cos, sin = rope_angles(positions_BT, g.shape[-1], theta, dtype)
    gf = g.astype(dtype)
    return (gf * cos + _rotate_half_transpose(gf * sin)).astype(g.dtype)


_rope = linear_in_x(_apply, _apply_transpose)


def _positions_BT(x, positions, offset) -> jax.Array:
    b, t = x.shape[0], x.shape[1]
    if positions is None:
        return (offset + jnp.arange(t))[None, :]
    positions = jnp.asarray(positions)
    require_int(positions, "positions")
    if positions.shape == (t,):
        return positions[None, :] + offset
    if positions.shape in ((b, t), (1, t)):
        return positions + offset
    raise ShapeError.describe(
        "positions.shape",
        positions.shape,
        f"({t},), (1, {t}) or ({b}, {t})",
        "give one position per time step (optionally per batch row)",
    )


def rope(
    x: jax.Array, positions: jax.Array | None = None, *, offset=0, theta: float = 10000.0
) -> jax.Array:
    """Rotary position embedding, rotate-half convention (as Hugging Face Llama).

    Shapes: x `[B, T, H, Dh]` (Dh even), positions `[T]`, `[1, T]` or `[B, T]` integers
    (default `arange(T)`) -> `[B, T, H, Dh]`. The rotation uses `positions + offset`: `offset`
    shifts explicit positions too, so pass one or the other for decoding, not both.

    With half = Dh/2, inverse frequencies f_i = theta^(-2i/Dh) for i < half, angle a = pos * f:
        cos = [cos a, cos a],  sin = [sin a, sin a]        (each [.., Dh])
        rot(x) = [-x2, x1]       where x = [x1, x2] split at half
        y = x * cos + rot(x) * sin
      The map is a rotation per (i, i + half) pair, so its VJP is the inverse rotation:
        dx = g * cos + rot^T(g * sin),   rot^T(y) = [y2, -y1]
    Positions are integers and get no gradient. Angles are computed in float32 (or wider).
    """
    x = jnp.asarray(x)
    require_rank(x, 4, "x", "[batch, time, heads, d_head]")
    require_float(x, "x")
    if not (is_real(theta) and 0 < theta < float("inf")):
        raise ConfigError.describe(
            "rope theta",
            theta,
            "a finite float > 0",
            "use the model's base, e.g. 10000.0 (Llama 2) or 500000.0",
        )
    if x.shape[-1] % 2:
        raise ShapeError.describe(
            "d_head",
            x.shape[-1],
            "an even number (RoPE rotates pairs)",
            "choose d_model / n_heads even",
        )
    return _rope(x, _positions_BT(x, positions, offset), float(theta))


def rope_reference(x, positions=None, *, offset=0, theta: float = 10000.0):
    """Pairs (i, i + Dh/2) rotated as complex numbers: `(x1 + i x2) * exp(i a)`."""
    dtype = compute_dtype(x.dtype)
    pos = _positions_BT(x, positions, offset).astype(dtype)
    half = x.shape[-1] // 2
    inv_freq = 1.0 / (theta ** (jnp.arange(half, dtype=dtype) * 2.0 / x.shape[-1]))
    angle = pos[:, :, None, None] * inv_freq[None, None, None, :]
    xf = x.astype(dtype)
    x1, x2 = xf[..., :half], xf[..., half:]
    c, s = jnp.cos(angle), jnp.sin(angle)
    return jnp.concatenate([x1 * c - x2 * s, x1 * s + x2 * c], axis=-1).astype(x.dtype)
