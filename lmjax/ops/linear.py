"""Affine projection over the last axis, and its Xavier-uniform initializer."""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np

from lmjax.checks import is_positive_int, require
from lmjax.errors import ShapeError
from lmjax.ops._common import expand_left, require_rank, sum_to_last, transposed_gradient_dot

Params = dict[str, jax.Array]


def _affine(params: Params, x_NI: jax.Array) -> jax.Array:
    y_NO = jnp.einsum("...i,oi->...o", x_NI, params["weight"])
    if "bias" in params:
        y_NO = y_NO + expand_left(params["bias"], y_NO.ndim)
    return y_NO


@jax.custom_vjp
def _linear(params: Params, x: jax.Array) -> jax.Array:
    return _affine(params, x)


def _linear_fwd(params, x):
    return _affine(params, x), (params, x)


def _linear_bwd(res, g):
    params, x = res
    weight = params["weight"]
    dx = jnp.einsum("...o,oi->...i", g, weight).astype(x.dtype)
    g_NO = g.reshape(-1, g.shape[-1])
    x_NI = x.reshape(-1, x.shape[-1])
    grads = {"weight": transposed_gradient_dot(g_NO, x_NI).astype(weight.dtype)}
    if "bias" in params:
        grads["bias"] = sum_to_last(g).astype(params["bias"].dtype)
    return grads, dx


_linear.defvjp(_linear_fwd, _linear_bwd)


def check_linear_args(params: Params, x: jax.Array) -> None:
    """Raise ShapeError unless `params` is {weight [O, I], bias [O]?} and `x` is `[..., I]`."""
    unknown = set(params) - {"weight", "bias"}
    if "weight" not in params or unknown:
        raise ShapeError.describe(
            "linear params keys",
            sorted(params),
            "{'weight'} or {'weight', 'bias'}",
            "build the params with lmjax.ops.init_linear (an adapted layer runs through "
            "lmjax.models.project)",
        )
    if not isinstance(params["weight"], jax.Array | np.ndarray):
        raise ShapeError.describe(
            "linear weight",
            type(params["weight"]).__name__,
            "an array [out, in]",
            "run a layer with an NF4 weight through lmjax.models.project",
        )
    require_rank(params["weight"], 2, "weight", "[out, in]")
    out_features, in_features = params["weight"].shape
    if x.ndim < 1 or x.shape[-1] != in_features:
        raise ShapeError.describe(
            "x.shape",
            x.shape,
            f"[..., {in_features}] (the weight is [{out_features}, {in_features}])",
            "project from the last axis or transpose x",
        )
    if "bias" in params and params["bias"].shape != (out_features,):
        raise ShapeError.describe(
            "bias.shape",
            params["bias"].shape,
            f"({out_features},)",
            "give the bias one entry per output feature",
        )


def linear(params: Params, x: jax.Array) -> jax.Array:
    """Affine projection over the last axis: `y = x W^T + b`.

    Shapes: params `{"weight": [O, I], "bias": [O]}` (the bias leaf is absent for a biasless layer),
    x `[..., I]` with any number of leading axes -> y `[..., O]`.

    VJP, with `g = dL/dy` and the leading axes flattened to N rows:
        dx = g W                    [..., I]
        dW = sum_n g_n^T x_n        [O, I]
        db = sum_n g_n              [O]

    Init (`init_linear`): Xavier-uniform weight, `U(-a, a)` with `a = sqrt(6 / (I + O))`, zero bias.
    Adapted and quantized layers run through `lmjax.models.project`, which calls this for a
    dense weight.
    """
    x = jnp.asarray(x)
    check_linear_args(params, x)
    return _linear(dict(params), x)


def linear_reference(params: Params, x: jax.Array) -> jax.Array:
    """Same equation in plain jnp, differentiated by `jax.grad`."""
    return _affine(params, x)


def xavier_uniform(key: jax.Array, shape_OI: tuple[int, int], dtype=jnp.float32) -> jax.Array:
    """`U(-a, a)` with `a = sqrt(6 / (I + O))` for a weight of shape `[O, I]`."""
    out_features, in_features = shape_OI
    limit = math.sqrt(6.0 / (in_features + out_features))
    return jax.random.uniform(key, shape_OI, dtype, -limit, limit)


def init_linear(
    key: jax.Array, in_features: int, out_features: int, *, bias: bool = True, dtype=jnp.float32
) -> Params:
    """Xavier-uniform `weight[O, I]` and (if `bias`) a zero `bias[O]`; no bias leaf otherwise."""
    for name, size in (("in_features", in_features), ("out_features", out_features)):
        fix = f"pass {name} >= 1"
        require(is_positive_int(size), name, size, "a positive int", fix, ShapeError)
    weight = xavier_uniform(key, (out_features, in_features), dtype)
    return (
        {"weight": weight, "bias": jnp.zeros((out_features,), dtype)}
        if bias
        else {"weight": weight}
    )
