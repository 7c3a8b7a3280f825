"""Configuration helpers shared by the command line and the library.

`parse_overrides(["n_layers=4", "bias=false"])` turns `key=value` strings into typed values:
integers, floats (`1e-5` too, which YAML 1.1 would leave a string), `true`/`false`, `null`,
else the string itself.
"""

from __future__ import annotations

from typing import Any

from lmjax.errors import ConfigError

# Only these spellings are special, so string options such as "yes" or "none" (remat=none)
# stay strings.
_WORDS = {"true": True, "false": False, "null": None}


def parse_value(text: str) -> Any:
    """`"4"` -> 4, `"1e-5"` -> 1e-05, `"true"` -> True, `"null"` -> None, `"none"` -> "none"."""
    for convert in (int, float):
        try:
            return convert(text)
        except ValueError:
            pass
    return _WORDS.get(text.lower(), text)


def parse_overrides(items: list[str]) -> dict[str, Any]:
    """`["a.b=1", "c=x"]` -> `{"a.b": 1, "c": "x"}`; a later key overrides an earlier one."""
    out: dict[str, Any] = {}
    for item in items:
        key, sep, text = item.partition("=")
        if not sep or not key.strip():
            raise ConfigError.describe(
                "override", item, "key=value (e.g. n_layers=4)", "write the key, '=', the value"
            )
        out[key.strip()] = parse_value(text.strip())
    return out
