"""Element-wise activations, each a custom VJP `dx = g * f'(x)` with f' written by hand.

All map x `[...]` -> `[...]` in x's dtype, computed in at least float32. NaN in, NaN out,
forward and backward: piecewise derivatives (relu, leaky_relu) return NaN where x is NaN
instead of choosing a branch, and `g * f'` keeps a NaN cotangent NaN.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from functools import partial

import jax
import jax.numpy as jnp

from lmjax.checks import is_real
from lmjax.errors import ConfigError
from lmjax.ops._common import compute_dtype, require_float, require_shape

_SQRT_2_OVER_PI = math.sqrt(2.0 / math.pi)
_INV_SQRT_2PI = 1.0 / math.sqrt(2.0 * math.pi)
_GELU_TANH_C = 0.044715


def _in_compute_dtype(fn: Callable) -> Callable:
    """Run `fn` in at least float32 and cast the result back to the input dtype."""

    def wrapped(x, *args):
        return fn(x.astype(compute_dtype(x.dtype)), *args).astype(x.dtype)

    return wrapped


def _keep_nan(x, derivative):
    """Piecewise derivatives would pick a branch for NaN; return NaN there instead."""
    return jnp.where(jnp.isnan(x), x, derivative)


def _elementwise(f: Callable, df: Callable) -> Callable:
    """Build a custom-VJP element-wise op from its function and derivative (both in f32+)."""
    f32, df32 = _in_compute_dtype(f), _in_compute_dtype(df)

    @jax.custom_vjp
    def op(x):
        return f32(x)

    def fwd(x):
        return f32(x), x

    def bwd(x, g):
        return (g * df32(x).astype(g.dtype),)

    op.defvjp(fwd, bwd)

    def checked(x):
        x = jnp.asarray(x)
        require_float(x, "x")
        return op(x)

    return checked


# ---- the functions and their derivatives (plain jnp, float32 or wider) -------------------------


def _gelu_f(x):
    return 0.5 * x * (1.0 + jax.lax.erf(x / math.sqrt(2.0)))


def _gelu_df(x):
    return 0.5 * (1.0 + jax.lax.erf(x / math.sqrt(2.0))) + x * _INV_SQRT_2PI * jnp.exp(-0.5 * x * x)


def _gelu_tanh_f(x):
    return 0.5 * x * (1.0 + jnp.tanh(_SQRT_2_OVER_PI * (x + _GELU_TANH_C * x**3)))


def _gelu_tanh_df(x):
    t = jnp.tanh(_SQRT_2_OVER_PI * (x + _GELU_TANH_C * x**3))
    du = _SQRT_2_OVER_PI * (1.0 + 3.0 * _GELU_TANH_C * x * x)
    return 0.5 * (1.0 + t) + 0.5 * x * (1.0 - t * t) * du


def _relu_f(x):
    # XLA's max propagates NaN (max(NaN, 0) = NaN), which is the contract.
    return jnp.maximum(x, 0.0)


def _relu_df(x):
    return _keep_nan(x, (x > 0).astype(x.dtype))


def _sigmoid_f(x):
    return jax.nn.sigmoid(x)


def _sigmoid_df(x):
    s = jax.nn.sigmoid(x)
    return s * (1.0 - s)


def _tanh_f(x):
    return jnp.tanh(x)


def _tanh_df(x):
    t = jnp.tanh(x)
    return 1.0 - t * t


def _silu_f(x):
    return x * jax.nn.sigmoid(x)


def _silu_df(x):
    s = jax.nn.sigmoid(x)
    return s * (1.0 + x * (1.0 - s))


_gelu = _elementwise(_gelu_f, _gelu_df)
_gelu_tanh = _elementwise(_gelu_tanh_f, _gelu_tanh_df)
_relu = _elementwise(_relu_f, _relu_df)
_sigmoid = _elementwise(_sigmoid_f, _sigmoid_df)
_tanh = _elementwise(_tanh_f, _tanh_df)
_silu = _elementwise(_silu_f, _silu_df)


def gelu(x: jax.Array) -> jax.Array:
    """Exact (erf) GELU. Shapes: x `[...]` -> `[...]`.

    f(x)  = x Phi(x) = x/2 (1 + erf(x / sqrt 2))
    f'(x) = Phi(x) + x phi(x),   phi(x) = exp(-x^2/2) / sqrt(2 pi)
    """
    return _gelu(x)


def gelu_tanh(x: jax.Array) -> jax.Array:
    """GPT-2's tanh-approximated GELU. Shapes: x `[...]` -> `[...]`.

    f(x)  = x/2 (1 + t),  t = tanh(c (x + 0.044715 x^3)),  c = sqrt(2/pi)
    f'(x) = (1 + t)/2 + x/2 (1 - t^2) c (1 + 3 * 0.044715 x^2)
    """
    return _gelu_tanh(x)


def relu(x: jax.Array) -> jax.Array:
    """Rectified linear unit. Shapes: x `[...]` -> `[...]`.

    f(x) = max(x, 0),   f'(x) = 1 if x > 0 else 0   (so relu'(0) = 0; NaN stays NaN)
    """
    return _relu(x)


def sigmoid(x: jax.Array) -> jax.Array:
    """Logistic sigmoid. Shapes: x `[...]` -> `[...]`.

    s = 1 / (1 + exp(-x)),   f'(x) = s (1 - s)
    """
    return _sigmoid(x)


def tanh(x: jax.Array) -> jax.Array:
    """Hyperbolic tangent. Shapes: x `[...]` -> `[...]`.

    t = tanh(x),   f'(x) = 1 - t^2
    """
    return _tanh(x)


def silu(x: jax.Array) -> jax.Array:
    """SiLU (swish). Shapes: x `[...]` -> `[...]`.

    f(x) = x s,  s = sigmoid(x),   f'(x) = s (1 + x (1 - s))
    """
    return _silu(x)


# ---- leaky_relu (a hyper-parameter) and swiglu (two inputs) ------------------------------------


def _leaky_f(x, slope):
    return jnp.where(x > 0, x, slope * x)


def _leaky_df(x, slope):
    return _keep_nan(x, jnp.where(x > 0, 1.0, slope).astype(x.dtype))


@partial(jax.custom_vjp, nondiff_argnums=(1,))
def _leaky_relu(x, slope):
    return _in_compute_dtype(_leaky_f)(x, slope)


def _leaky_relu_fwd(x, slope):
    return _leaky_relu(x, slope), x


def _leaky_relu_bwd(slope, x, g):
    return (g * _in_compute_dtype(_leaky_df)(x, slope).astype(g.dtype),)


_leaky_relu.defvjp(_leaky_relu_fwd, _leaky_relu_bwd)


def leaky_relu(x: jax.Array, negative_slope: float = 0.01) -> jax.Array:
    """Leaky ReLU with slope `a = negative_slope` (default 0.01). Shapes: x `[...]` -> `[...]`.

    f(x) = x if x > 0 else a x,   f'(x) = 1 if x > 0 else a   (NaN stays NaN)
    """
    x = jnp.asarray(x)
    require_float(x, "x")
    if not is_real(negative_slope):
        raise ConfigError.describe(
            "leaky_relu negative_slope",
            negative_slope,
            "a Python or numpy real number",
            "pass a constant such as 0.01 (a traced slope cannot be a static hyper-parameter)",
        )
    return _leaky_relu(x, float(negative_slope))


@jax.custom_vjp
def _swiglu(gate, up):
    return (_in_compute_dtype(_silu_f)(gate) * up).astype(up.dtype)


def _swiglu_fwd(gate, up):
    return _swiglu(gate, up), (gate, up)


def _swiglu_bwd(res, g):
    gate, up = res
    dtype = compute_dtype(g.dtype)
    gf, upf, gatef = g.astype(dtype), up.astype(dtype), gate.astype(dtype)
    d_gate = gf * upf * _silu_df(gatef)
    d_up = gf * _silu_f(gatef)
    return d_gate.astype(gate.dtype), d_up.astype(up.dtype)


_swiglu.defvjp(_swiglu_fwd, _swiglu_bwd)


def swiglu(gate: jax.Array, up: jax.Array) -> jax.Array:
    """SwiGLU gate of the Llama MLP. Shapes: gate, up `[..., F]` -> `[..., F]`.

        f(gate, up) = silu(gate) * up
    VJP: d_gate = g * up * silu'(gate),   d_up = g * silu(gate)
    """
    gate, up = jnp.asarray(gate), jnp.asarray(up)
    require_float(gate, "gate")
    require_float(up, "up")
    require_shape(up, gate.shape, "up", "the same shape as gate")
    return _swiglu(gate, up)


# ---- references: the same functions in plain jnp, differentiated by jax.grad ---------------------


def gelu_reference(x):
    return jax.nn.gelu(x, approximate=False)


def gelu_tanh_reference(x):
    return jax.nn.gelu(x, approximate=True)


def relu_reference(x):
    # Not jax.nn.relu, which carries its own custom derivative: plain where, so jax.grad
    # differentiates the select (derivative 0 at exactly 0).
    return jnp.where(x > 0, x, 0.0)


def sigmoid_reference(x):
    return 1.0 / (1.0 + jnp.exp(-x))


def tanh_reference(x):
    return jnp.tanh(x)


def silu_reference(x):
    return x / (1.0 + jnp.exp(-x))


def leaky_relu_reference(x, negative_slope: float = 0.01):
    return jax.nn.leaky_relu(x, negative_slope)


def swiglu_reference(gate, up):
    return jax.nn.silu(gate) * up
