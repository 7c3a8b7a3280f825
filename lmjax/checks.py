"""Argument checks, one line each, with the message format of `lmjax.errors`.

    require(is_positive_int(r), "lora.r", r, "an int >= 1", "e.g. r=8")

raises, when the condition is false, `ConfigError` (or the `error` class given) reading

    lora.r = 0; expected an int >= 1. Fix: e.g. r=8.

i.e. `{what} = {value}; expected {expected}. Fix: {fix}.`, the value shortened to one line
(`LMJaxError.describe`). The predicates say what a number is, the way config values arrive
(Python, numpy or YAML scalars): a bool is not a number here, although Python counts it as an int.

This module sits at the bottom of the import order (with `lmjax.errors`), so every layer may use it.
"""

from __future__ import annotations

import math
import numbers
from typing import Any

import numpy as np

from lmjax.errors import ConfigError, LMJaxError


def require(
    ok: bool, what: str, value: Any, expected: str, fix: str, error: type[LMJaxError] = ConfigError
) -> None:
    """Raise `error.describe(what, value, expected, fix)` unless `ok`."""
    if not ok:
        raise error.describe(what, value, expected, fix)


def is_int(value: Any) -> bool:
    """An integer (Python or numpy), not a bool: sizes, counts, offsets, seeds."""
    return isinstance(value, numbers.Integral) and not isinstance(value, bool | np.bool_)


def is_real(value: Any) -> bool:
    """A real number (Python or numpy, ints included), not a bool; may be nan or inf."""
    return isinstance(value, numbers.Real) and not isinstance(value, bool | np.bool_)


def is_finite_real(value: Any) -> bool:
    """A real number with a finite float value: not nan or inf, nor an int past float's range."""
    if not is_real(value):
        return False
    try:
        return math.isfinite(value)
    except OverflowError:  # an int such as 10**400 has no float
        return False


def is_positive_int(value: Any) -> bool:
    """An int >= 1."""
    return is_int(value) and bool(value >= 1)


def is_nonnegative_int(value: Any) -> bool:
    """An int >= 0."""
    return is_int(value) and bool(value >= 0)


__all__ = [
    "require",
    "is_int",
    "is_real",
    "is_finite_real",
    "is_positive_int",
    "is_nonnegative_int",
]
