"""Sinusoidal position encoding."""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np

from lmjax.checks import is_positive_int, require
from lmjax.errors import ShapeError


def _check(length: int, dim: int) -> None:
    for name, size in (("length", length), ("dim", dim)):
        ok, fix = is_positive_int(size), f"pass {name} >= 1"
        require(ok, f"sinusoidal_positions {name}", size, "a positive int", fix, ShapeError)


def sinusoidal_positions(length: int, dim: int, dtype=jnp.float32) -> jax.Array:
    """Sinusoidal position encoding of "Attention Is All You Need".

    Shape: `sinusoidal_positions(T, D) -> [T, D]` float32 (a constant: it has no inputs to
    differentiate, so it needs no VJP).

        PE[t, 2i]     = sin(t / 10000^(2i / D))
        PE[t, 2i + 1] = cos(t / 10000^(2i / D))
    An odd D ends with a sin column.
    """
    _check(length, dim)
    # Built in float64 numpy (it is a constant): float32 angles t * freq lose ~1e-4 by t ~ 2k.
    t = np.arange(length, dtype=np.float64)[:, None]
    pair = np.arange(0, dim, 2, dtype=np.float64)[None, :]  # 2i for each sin/cos pair
    angle = t * np.exp(-math.log(10000.0) * pair / dim)
    table = np.stack([np.sin(angle), np.cos(angle)], axis=-1).reshape(length, -1)
    return jnp.asarray(table[:, :dim], dtype)


def sinusoidal_positions_reference(length: int, dim: int) -> np.ndarray:
    """Element-by-element loops in float64 numpy, the formula exactly as written."""
    _check(length, dim)
    table = np.zeros((length, dim))
    for t in range(length):
        for j in range(dim):
            freq = 10000.0 ** ((j - j % 2) / dim)
            table[t, j] = math.sin(t / freq) if j % 2 == 0 else math.cos(t / freq)
    return table
