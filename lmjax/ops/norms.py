"""Normalisations over the last axis, statistics in at least float32: LayerNorm, RMSNorm."""

from __future__ import annotations

from functools import partial

import jax
import jax.numpy as jnp

from lmjax.checks import is_real
from lmjax.errors import ConfigError, ShapeError
from lmjax.ops._common import compute_dtype, expand_left, require_float, require_shape, sum_to_last


def _mean(a: jax.Array) -> jax.Array:
    return jnp.mean(a, axis=-1, keepdims=True)


def _layer_norm_stats(x, eps):
    xf = x.astype(compute_dtype(x.dtype))
    # LayerNorm is shift-invariant; shifting by the slice's first entry first makes a constant
    # slice exactly 0 (a float32 mean of 768 copies of 1000.1 is not exactly 1000.1, and the
    # rounding error would be amplified by rsqrt(eps) ~ 316).
    xf = xf - xf[..., :1]
    centered = xf - _mean(xf)
    rstd = jax.lax.rsqrt(_mean(centered * centered) + eps)
    return centered * rstd, rstd


def _rms_norm_stats(x, eps):
    xf = x.astype(compute_dtype(x.dtype))
    rstd = jax.lax.rsqrt(_mean(xf * xf) + eps)
    return xf * rstd, rstd


def _affine(xh, scale, bias, dtype):
    y = xh * expand_left(scale.astype(xh.dtype), xh.ndim)
    if bias is not None:
        y = y + expand_left(bias.astype(xh.dtype), xh.ndim)
    return y.astype(dtype)


# ---- LayerNorm ---------------------------------------------------------------------------------


@partial(jax.custom_vjp, nondiff_argnums=(3,))
def _layer_norm(x, scale, bias, eps):
    xh, _ = _layer_norm_stats(x, eps)
    return _affine(xh, scale, bias, x.dtype)


def _layer_norm_fwd(x, scale, bias, eps):
    xh, rstd = _layer_norm_stats(x, eps)
    return _affine(xh, scale, bias, x.dtype), (xh, rstd, scale, bias)


def _layer_norm_bwd(eps, res, g):
    xh, rstd, scale, bias = res
    gf = g.astype(xh.dtype)
    dxh = gf * expand_left(scale.astype(xh.dtype), xh.ndim)
    dx = rstd * (dxh - _mean(dxh) - xh * _mean(dxh * xh))
    dscale = sum_to_last(gf * xh).astype(scale.dtype)
    dbias = None if bias is None else sum_to_last(gf).astype(bias.dtype)
    return dx.astype(g.dtype), dscale, dbias


_layer_norm.defvjp(_layer_norm_fwd, _layer_norm_bwd)


def _check(x, scale, bias, eps, what):
    require_float(x, "x")
    if x.ndim == 0:
        raise ShapeError.describe(
            f"{what} x.shape",
            x.shape,
            "rank >= 1 ([..., D])",
            "normalise a vector or a batch of vectors",
        )
    d = x.shape[-1:]
    require_shape(scale, d, "scale", f"one entry per feature of x {x.shape}")
    if bias is not None:
        require_shape(bias, d, "bias", f"one entry per feature of x {x.shape}")
    if not (is_real(eps) and 0 < eps < float("inf")):
        raise ConfigError.describe(
            f"{what} eps",
            eps,
            "a finite float > 0",
            "use the default (1e-5 LayerNorm, 1e-6 RMSNorm)",
        )


def layer_norm(
    x: jax.Array, scale: jax.Array, bias: jax.Array | None, eps: float = 1e-5
) -> jax.Array:
    """LayerNorm over the last axis (population variance, eps inside the square root).

    Shapes: x `[..., D]`, scale `[D]`, bias `[D]` -> `[..., D]` in x's dtype (statistics in
    float32 or wider).

        mu = mean(x),  var = mean((x - mu)^2),  r = 1 / sqrt(var + eps),  xh = (x - mu) r
        y  = xh * scale + bias
    VJP (fused), with g = dL/dy and dxh = g * scale:
        dx     = r * (dxh - mean(dxh) - xh * mean(dxh * xh))
        dscale = sum over rows of g * xh,    dbias = sum over rows of g
    A constant slice has var = 0, so r = 1/sqrt(eps) stays finite, xh = 0 and y = bias exactly.
    `bias=None` is a biasless LayerNorm (y = xh * scale; no bias gradient).
    """
    x = jnp.asarray(x)
    _check(x, scale, bias, eps, "layer_norm")
    return _layer_norm(x, scale, bias, float(eps))


def layer_norm_reference(x, scale, bias, eps: float = 1e-5):
    xf = x.astype(compute_dtype(x.dtype))
    mu = jnp.mean(xf, axis=-1, keepdims=True)
    var = jnp.var(xf, axis=-1, keepdims=True)
    return _affine((xf - mu) / jnp.sqrt(var + eps), scale, bias, x.dtype)


# ---- RMSNorm -----------------------------------------------------------------------------------


@partial(jax.custom_vjp, nondiff_argnums=(2,))
def _rms_norm(x, scale, eps):
    xh, _ = _rms_norm_stats(x, eps)
    return _affine(xh, scale, None, x.dtype)


def _rms_norm_fwd(x, scale, eps):
    xh, rstd = _rms_norm_stats(x, eps)
    return _affine(xh, scale, None, x.dtype), (xh, rstd, scale)


def _rms_norm_bwd(eps, res, g):
    xh, rstd, scale = res
    gf = g.astype(xh.dtype)
    dxh = gf * expand_left(scale.astype(xh.dtype), xh.ndim)
    dx = rstd * (dxh - xh * _mean(dxh * xh))
    return dx.astype(g.dtype), sum_to_last(gf * xh).astype(scale.dtype)


_rms_norm.defvjp(_rms_norm_fwd, _rms_norm_bwd)


def rms_norm(x: jax.Array, scale: jax.Array, eps: float = 1e-6) -> jax.Array:
    """RMSNorm over the last axis.

    Shapes: x `[..., D]`, scale `[D]` -> `[..., D]` in x's dtype (statistics in float32 or wider).

        r = 1 / sqrt(mean(x^2) + eps),  xh = x r,  y = xh * scale
    VJP, with g = dL/dy and dxh = g * scale:
        dx = r * (dxh - xh * mean(dxh * xh)),   dscale = sum over rows of g * xh
    """
    x = jnp.asarray(x)
    _check(x, scale, None, eps, "rms_norm")
    return _rms_norm(x, scale, float(eps))


def rms_norm_reference(x, scale, eps: float = 1e-6):
    xf = x.astype(compute_dtype(x.dtype))
    return _affine(
        xf / jnp.sqrt(jnp.mean(xf * xf, axis=-1, keepdims=True) + eps), scale, None, x.dtype
    )
