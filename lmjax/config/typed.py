"""A frozen dataclass built from a mapping (YAML), each value checked against its field's type.

    build_section(TrainConfig, {"steps": 100}, "train")  -> TrainConfig(steps=100, ...)

The types a config field may have: int, float, str, bool, `dict[...]`, `tuple[str, ...]`, and
unions of them with None. Ints are accepted for floats (`lr: 1`) and lists for tuples; YAML
1.1's `1e-2` (read as a string) for a float; an int for a string (`run.dir: 2024` is a name).
"""

from __future__ import annotations

import types
import typing
from typing import Any

from lmjax.checks import is_finite_real, is_int, is_real, require, unknown_name
from lmjax.config.overrides import parse_value
from lmjax.errors import ConfigError

INT32 = (-(2**31), 2**31)  # steps, sizes and counts become int32 arrays (optax's step count)


def hint_options(hint: Any) -> tuple:
    """`int | None` -> `(int, NoneType)`; any other hint -> `(hint,)`."""
    return typing.get_args(hint) if typing.get_origin(hint) is types.UnionType else (hint,)


def require_mapping(value: Any, where: str) -> dict[str, Any]:
    """`value` itself, if it is a mapping with string keys; else a ConfigError naming `where`."""
    fix = f"write {where} as a YAML mapping"
    require(isinstance(value, dict), where, value, "a mapping of key: value", fix)
    bad = [k for k in value if not isinstance(k, str)]
    if bad:
        raise ConfigError.describe(f"{where} key", bad[0], "a string", "quote the key")
    return value


def build_section(cls, values: Any, where: str):
    """`cls(**values)`, every key a field of `cls` and every value of its field's type."""
    values = require_mapping(values, where)
    hints = typing.get_type_hints(cls)
    unknown = sorted(set(values) - set(hints))
    if unknown:
        raise unknown_name(f"{where} key", unknown[0], sorted(hints))
    return cls(**{k: _coerce(v, hints[k], f"{where}.{k}") for k, v in values.items()})


def _coerce(value: Any, hint: Any, where: str) -> Any:
    """Check `value` against a field's type hint; ints are accepted for floats, lists for tuples."""
    options = hint_options(hint)
    if value is None:
        require(type(None) in options, where, None, _type_name(hint), "give it a value")
        return None
    for option in options:
        if option is bool and isinstance(value, bool):
            return value
        if option is int and is_int(value):
            low, high = INT32
            require(low <= value < high, where, value, "an int in [-2**31, 2**31)", "lower it")
            return int(value)
        if option is float and is_real(value):
            return _finite(value, where, value)
        if option is float and isinstance(value, str) and isinstance(parse_value(value), float):
            return _finite(parse_value(value), where, value)  # YAML 1.1 reads `1e-2` as a string
        if option is str and isinstance(value, str):
            return value
        if option is str and is_int(value):
            return str(value)  # run.dir=2024 is a name, not a number
        if typing.get_origin(option) is dict and isinstance(value, dict):
            return dict(value)  # the entries are checked by the section's validation
        if typing.get_origin(option) is tuple and isinstance(value, list | tuple):
            if all(isinstance(v, str) for v in value):
                return tuple(value)
    raise ConfigError.describe(where, value, _type_name(hint), "write a value of that type")


def _finite(number: Any, where: str, value: Any) -> float:
    """No field means anything by inf or NaN (`1e999` reads as inf): null switches options off.
    An int past float's range (`1` and 400 zeros) is not finite either: float() overflows."""
    require(is_finite_real(number), where, value, "a finite number", "write a finite value")
    return float(number)


def _type_name(hint: Any) -> str:
    names = {int: "an int", float: "a number", str: "a string", bool: "true or false"}
    options = hint_options(hint)
    words = [
        names.get(o, "a mapping" if typing.get_origin(o) is dict else "a list of strings")
        for o in options
        if o is not type(None)
    ]
    return " or ".join(words) + (" or null" if type(None) in options else "")
