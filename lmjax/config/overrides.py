"""`key=value` strings from the command line, typed.

`parse_overrides(["n_layers=4", "bias=false"])` turns `key=value` strings into typed values:
integers, floats (`1e-5` too, which YAML 1.1 would leave a string), `true`/`false`, `null`,
else the string itself. Imports nothing of lmjax but the errors and checks, so any layer
(`lmjax.lora`'s `r=8,alpha=16`) may parse with it.
"""

from __future__ import annotations

from typing import Any

from lmjax.checks import require

# Only these spellings are special, so string options such as "yes" or "none" (remat=none)
# stay strings.
_WORDS = {"true": True, "false": False, "null": None}


def parse_value(text: str) -> Any:
    """`"4"` -> 4, `"1e-5"` -> 1e-05, `"true"` -> True, `"null"` -> None, `"none"` -> "none"."""
    for convert in (int, float):
        try:
            value = convert(text)
        except ValueError:
            continue
        # float() also reads "nan", "inf" and "infinity": those stay strings (run.dir=nan).
        if any(c.isdigit() for c in text):
            return value
    return _WORDS.get(text.lower(), text)


def parse_overrides(items: list[str]) -> dict[str, Any]:
    """`["a.b=1", "c=x"]` -> `{"a.b": 1, "c": "x"}`; a later key overrides an earlier one."""
    out: dict[str, Any] = {}
    for item in items:
        fix = "pass overrides as strings"
        require(isinstance(item, str), "override", item, "a 'key=value' string", fix)
        key, sep, text = item.partition("=")
        fix = "write the key, '=', the value"
        require(bool(sep and key.strip()), "override", item, "key=value (e.g. n_layers=4)", fix)
        out[key.strip()] = parse_value(text.strip())
    return out
