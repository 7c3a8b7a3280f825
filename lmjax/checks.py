"""Argument checks, one line each, with the message format of `lmjax.errors`.

    require(is_positive_int(r), "lora.r", r, "an int >= 1", "e.g. r=8")

raises, when the condition is false, `ConfigError` (or the `error` class given) reading

    lora.r = 0; expected an int >= 1. Fix: e.g. r=8.

i.e. `{what} = {value}; expected {expected}. Fix: {fix}.`, the value shortened to one line
(`LMJaxError.describe`). The predicates say what a number is, the way config values arrive
(Python, numpy or YAML scalars): a bool is not a number here, although Python counts it as an int.

The array checks (`is_concrete`, `check_keep_values`, `check_token_ids`) are host-side checks
of array arguments that ops, models, generate and the Pallas kernels share.

This module sits at the bottom of the import order (with `lmjax.errors`), so every layer may use it.
"""

from __future__ import annotations

import difflib
import math
import numbers
from typing import Any

import jax
import numpy as np

from lmjax.errors import ConfigError, LMJaxError, ShapeError, TokenError


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


def is_concrete(x: Any) -> bool:
    """True when `x` holds values now (not a tracer inside jit/vmap/grad's traced arguments)."""
    return x is not None and not isinstance(x, jax.core.Tracer)


def check_keep_values(mask: Any, what: str = "mask") -> None:
    """Host-side: a concrete `mask` holds only booleans or 0/1 (1 keeps), else `ShapeError`.

    Every public entry point that takes a mask calls this, so the rule is stated once. An
    additive mask (0 keeps, -inf or -1e9 drops: the Hugging Face and PyTorch convention) read
    as "nonzero keeps" would be silently inverted, so any other value is refused. A traced mask
    (inside jit, vmap, grad) cannot be inspected and is left alone: a bool one is always safe.
    """
    if not is_concrete(mask):
        return
    mask_np = np.asarray(mask)
    if mask_np.dtype.kind == "b":
        return
    fix = "pass a bool (or 0/1) keep-mask; from an additive mask use keep = additive == 0"
    if mask_np.dtype.kind not in "iuf":
        raise ShapeError.describe(
            f"{what}.dtype", str(mask_np.dtype), "bool or a real number dtype holding 0/1", fix
        )
    bad = ~((mask_np == 0) | (mask_np == 1))  # NaN compares unequal to both: refused too
    if bad.any():
        where = tuple(int(i) for i in np.argwhere(bad)[0])
        index = f"[{', '.join(map(str, where))}]" if where else ""
        count = int(bad.sum())
        raise ShapeError.describe(
            f"{what}{index}",
            mask_np[where].item(),
            "only booleans or 0/1, since lmjax masks keep where 1 and drop where 0"
            + (f" ({count} entries in all are neither 0 nor 1)" if count > 1 else ""),
            fix,
        )


def check_token_ids(
    ids: Any,
    vocab_size: int,
    what: str,
    *,
    ignore_index: int | None = None,
    fix: str = "re-tokenize with the model's tokenizer or enlarge vocab_size",
) -> None:
    """Host-side range check: raise `TokenError` naming the first id outside `[0, V)`.

    `ids` must be concrete. Entries equal to `ignore_index` (if given) are allowed.
    """
    ids_np = np.asarray(ids)
    bad = (ids_np < 0) | (ids_np >= vocab_size)
    if ignore_index is not None:
        bad &= ids_np != ignore_index
    if bad.any():
        where = tuple(int(i) for i in np.argwhere(bad)[0])
        allowed = f"an id in [0, {vocab_size})" + (
            "" if ignore_index is None else f" or ignore_index={ignore_index}"
        )
        raise TokenError.describe(
            f"{what}{list(where)}",
            int(ids_np[where]),
            f"{allowed} ({int(bad.sum())} of {ids_np.size} are outside)",
            fix,
        )


def unknown_name(what: str, name: str, known) -> ConfigError:
    """The error for a key or section `name` that is none of `known`, suggesting the nearest one
    (difflib's closest match), as a typo (`finetune.bsae`) usually is one letter pair off:
    `finetune key = 'bsae'; expected one of [...]. Fix: did you mean 'base'? Else remove it.`"""
    close = difflib.get_close_matches(name, [str(k) for k in known], n=1)
    fix = f"did you mean {close[0]!r}? Else remove it" if close else "fix the spelling or remove it"
    return ConfigError.describe(what, name, f"one of {list(known)}", fix)


__all__ = [
    "unknown_name",
    "require",
    "is_int",
    "is_real",
    "is_finite_real",
    "is_positive_int",
    "is_nonnegative_int",
    "is_concrete",
    "check_keep_values",
    "check_token_ids",
]
