"""Rotary position embedding (rotate-half convention), with linear and Llama 3 frequency scaling."""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp

from lmjax.checks import is_finite_real, is_positive_int, is_real, require
from lmjax.errors import ConfigError, ShapeError
from lmjax.ops._common import compute_dtype, require_float, require_int, require_rank
from lmjax.ops._vjp import linear_in_x

SCALING_KINDS = ("none", "linear", "llama3")


@dataclasses.dataclass(frozen=True)
class RopeScaling:
    """How RoPE's inverse frequencies f_i are stretched for a longer context (hashable: static).

    "none": f unchanged. "linear": f / factor (positions / factor). "llama3" (Llama 3.1's
    bands, by wavelength w = 2 pi / f against the original context L):
        w < L / high_freq_factor          f               (high frequencies kept)
        w > L / low_freq_factor           f / factor      (low frequencies stretched)
        otherwise, with s = (L / w - low_freq_factor) / (high_freq_factor - low_freq_factor):
                                          (1 - s) f / factor + s f
    """

    kind: str = "none"
    factor: float = 1.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_context: int = 8192

    def __post_init__(self):
        fix = "pick a listed kind (other RoPE scalings are not implemented)"
        require(
            self.kind in SCALING_KINDS, "rope scaling", self.kind, f"one of {SCALING_KINDS}", fix
        )
        for name in ("factor", "low_freq_factor", "high_freq_factor"):
            value = getattr(self, name)
            ok = is_finite_real(value) and value > 0
            require(ok, f"rope scaling {name}", value, "a finite float > 0", "use e.g. 1.0")
        ok, fix = is_positive_int(self.original_context), "use the pretraining context, e.g. 8192"
        require(ok, "rope scaling original_context", self.original_context, "an int >= 1", fix)
        low, high = self.low_freq_factor, self.high_freq_factor
        ok, fix = self.kind != "llama3" or high > low, "use e.g. low 1.0 and high 4.0"
        require(ok, "rope scaling high_freq_factor", high, f"> low_freq_factor = {low}", fix)


def scale_inv_freq(inv_freq_F: jax.Array, scaling: RopeScaling | None) -> jax.Array:
    """`inv_freq [Dh/2]` stretched by `scaling` (see `RopeScaling`); None or "none" is identity."""
    if scaling is None or scaling.kind == "none":
        return inv_freq_F
    if scaling.kind == "linear":
        return inv_freq_F / scaling.factor
    context, low, high = scaling.original_context, scaling.low_freq_factor, scaling.high_freq_factor
    wavelength_F = 2 * math.pi / inv_freq_F
    smooth_F = (context / wavelength_F - low) / (high - low)
    between_F = (1 - smooth_F) * inv_freq_F / scaling.factor + smooth_F * inv_freq_F
    stretched_F = jnp.where(wavelength_F > context / low, inv_freq_F / scaling.factor, between_F)
    return jnp.where(wavelength_F < context / high, inv_freq_F, stretched_F)


def rope_frequencies(d_head: int, theta: float, scaling=None, dtype=jnp.float32) -> jax.Array:
    """The inverse frequencies `[Dh/2]`: f_i = theta^(-2i/Dh), then `scale_inv_freq`."""
    inv_freq_F = theta ** (-jnp.arange(0, d_head, 2, dtype=dtype) / d_head)
    return scale_inv_freq(inv_freq_F, scaling)


def rope_angles(
    positions_BT: jax.Array, d_head: int, theta: float, dtype, scaling: RopeScaling | None = None
) -> tuple:
    """cos, sin of shape `[B or 1, T, 1, Dh]` for integer `positions[B or 1, T]`."""
    inv_freq = rope_frequencies(d_head, theta, scaling, dtype)
    angle_BTF = positions_BT.astype(dtype)[..., None] * inv_freq[None, None, :]
    angle_BTD = jnp.concatenate([angle_BTF, angle_BTF], axis=-1)[:, :, None, :]
    return jnp.cos(angle_BTD), jnp.sin(angle_BTD)


def _rotate_half(x):
    x1, x2 = jnp.split(x, 2, axis=-1)
    return jnp.concatenate([-x2, x1], axis=-1)


def _rotate_half_transpose(y):
    y1, y2 = jnp.split(y, 2, axis=-1)
    return jnp.concatenate([y2, -y1], axis=-1)


def _apply(x, positions_BT, static):
    dtype = compute_dtype(x.dtype)
    theta, scaling = static
    cos, sin = rope_angles(positions_BT, x.shape[-1], theta, dtype, scaling)
    xf = x.astype(dtype)
    return (xf * cos + _rotate_half(xf) * sin).astype(x.dtype)


def _apply_transpose(g, positions_BT, static):
    """The transpose of `_apply` in x: g cos + R^T (g sin), R the rotate-half map."""
    dtype = compute_dtype(g.dtype)
    theta, scaling = static
    cos, sin = rope_angles(positions_BT, g.shape[-1], theta, dtype, scaling)
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
    x: jax.Array,
    positions: jax.Array | None = None,
    *,
    offset=0,
    theta: float = 10000.0,
    scaling: RopeScaling | None = None,
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
    `scaling` (a `RopeScaling`: linear or Llama 3) replaces f by its stretched frequencies; the
    map stays a rotation, so the VJP is unchanged. Positions are integers and get no gradient.
    Angles are computed in float32 (or wider).
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
    _check_scaling(scaling)
    return _rope(x, _positions_BT(x, positions, offset), (float(theta), scaling))


def _check_scaling(scaling) -> None:
    ok = scaling is None or isinstance(scaling, RopeScaling)
    fix = "pass lmjax.ops.rope.RopeScaling(kind, factor, ...) or None"
    require(ok, "rope scaling", scaling, "None or a RopeScaling", fix)


def rope_reference(x, positions=None, *, offset=0, theta: float = 10000.0, scaling=None):
    """Pairs (i, i + Dh/2) rotated as complex numbers: `(x1 + i x2) * exp(i a)`."""
    _check_scaling(scaling)
    dtype = compute_dtype(x.dtype)
    pos = _positions_BT(x, positions, offset).astype(dtype)
    half = x.shape[-1] // 2
    inv_freq = 1.0 / (theta ** (jnp.arange(half, dtype=dtype) * 2.0 / x.shape[-1]))
    inv_freq = scale_inv_freq(inv_freq, scaling)
    angle = pos[:, :, None, None] * inv_freq[None, None, None, :]
    xf = x.astype(dtype)
    x1, x2 = xf[..., :half], xf[..., half:]
    c, s = jnp.cos(angle), jnp.sin(angle)
    return jnp.concatenate([x1 * c - x2 * s, x1 * s + x2 * c], axis=-1).astype(x.dtype)
