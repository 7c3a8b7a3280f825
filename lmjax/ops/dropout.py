"""Inverted dropout with an explicit PRNG key."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from lmjax.checks import is_real
from lmjax.errors import ConfigError
from lmjax.ops._common import require_float
from lmjax.ops._vjp import linear_in_x


def keep_mask(key: jax.Array, shape, rate: float) -> jax.Array:
    """bool keep-mask, True with probability `1 - rate`; shared by the op and its reference."""
    return jax.random.bernoulli(key, 1.0 - rate, shape)


def _scaled(x, keep, rate):
    return jnp.where(keep, x / jnp.asarray(1.0 - rate, x.dtype), jnp.zeros((), x.dtype))


# Scaling by the keep-mask is linear in x and symmetric: the backward scales g the same way.
_dropout = linear_in_x(_scaled, _scaled)


def _check_rate(rate) -> float:
    if not (is_real(rate) and 0.0 <= rate < 1.0):
        raise ConfigError.describe(
            "dropout rate", rate, "a float in [0, 1)", "use e.g. 0.1, or 0.0 to disable dropout"
        )
    return float(rate)


def dropout(key: jax.Array, x: jax.Array, rate: float, deterministic: bool) -> jax.Array:
    """Inverted dropout with an explicit PRNG key (never a global random stream).

    Shapes: x `[...]` -> y `[...]`. With keep-mask m ~ Bernoulli(1 - rate) drawn from `key`:
        y = m * x / (1 - rate)
      VJP: dx = m * g / (1 - rate)   (the same mask; the key gets no gradient)
    `deterministic=True` or `rate == 0` returns x unchanged. `rate` must lie in [0, 1).
    """
    rate = _check_rate(rate)
    x = jnp.asarray(x)
    require_float(x, "x")
    if deterministic or rate == 0.0:
        return x
    if key is None:
        raise ConfigError.describe(
            "dropout key",
            None,
            "a PRNG key (jax.random.key or PRNGKey)",
            "pass a key split from the run's key, or deterministic=True for evaluation",
        )
    return _dropout(x, keep_mask(key, x.shape, rate), rate)


def dropout_reference(key, x, rate: float, deterministic: bool):
    if deterministic or rate == 0.0:
        return x
    return jnp.where(keep_mask(key, x.shape, rate), x / (1.0 - rate), 0.0).astype(x.dtype)
