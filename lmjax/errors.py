"""One exception family for every bad input lmjax can see (docs/guarantees.md).

Every message names three things: the offending value, what was expected, and how to fix it.
`describe` builds that sentence so the format is the same everywhere:

    >>> str(ShapeError.describe("tokens.ndim", 3, "2 ([batch, time])", "reshape to [B, T]"))
    'tokens.ndim = 3; expected 2 ([batch, time]). Fix: reshape to [B, T].'

Each class also derives from the builtin a Python user would try to catch (ValueError,
TypeError, OSError), so `except ValueError` keeps working around lmjax calls.
"""

from __future__ import annotations

import reprlib
from typing import Any


class LMJaxError(Exception):
    """Base class of every error lmjax raises on purpose."""

    @classmethod
    def describe(cls, what: str, value: Any, expected: str, fix: str) -> LMJaxError:
        """Build an error whose message reads `what = value; expected ... Fix: ...`."""
        return cls(f"{what} = {_short(value)}; expected {expected}. Fix: {fix}.")


class ConfigError(LMJaxError, ValueError):
    """An option, size or hyper-parameter outside its allowed range or set."""


class ShapeError(LMJaxError, ValueError):
    """An array whose rank, shape or dtype does not fit the operation."""


class TokenError(LMJaxError, ValueError):
    """Token ids or targets outside the vocabulary, empty prompts and similar."""


class MaskError(LMJaxError, ValueError):
    """A mask that leaves a softmax slice with nothing to normalise over."""


class FileFormatError(LMJaxError, ValueError):
    """A file that is truncated, corrupt, or not in the expected format."""


class CheckpointError(LMJaxError, OSError):
    """A checkpoint that is missing, incomplete, or from a different architecture."""


class NonFiniteError(LMJaxError, FloatingPointError):
    """A NaN or infinite loss, gradient, parameter update or sampled logits."""


def _short(value: Any, limit: int = 120) -> str:
    # One line whatever the value: an array's repr spans several, so whitespace is collapsed.
    text = " ".join(_bounded_repr(value, limit).split())
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _bounded_repr(value: Any, limit: int) -> str:
    """repr, in time and memory bounded by `limit` for containers: a YAML alias bomb (a list of
    ten lists of ten lists ..., shared, so cheap to build) has a repr of 10**8 characters.
    Scalars keep their plain repr (then cut to `limit`)."""
    if isinstance(value, (list, tuple, dict, set, frozenset)):
        shorten = reprlib.Repr()
        shorten.maxlevel, shorten.maxstring, shorten.maxother = 3, limit, limit
        shorten.maxlist = shorten.maxtuple = shorten.maxdict = shorten.maxset = 12
        return shorten.repr(value)
    if isinstance(value, int) and value.bit_length() > 4000:
        # str() of an int over 4,300 digits raises ValueError; its size is what matters here.
        return f"{'a negative' if value < 0 else 'an'} int of {value.bit_length()} bits"
    return repr(value)


__all__ = [
    "LMJaxError",
    "ConfigError",
    "ShapeError",
    "TokenError",
    "MaskError",
    "FileFormatError",
    "CheckpointError",
    "NonFiniteError",
]
