"""`LoraConfig`: which projections get adapters, their rank, scale, initialization and dropout
(lmjax.lora's docstring has the whole picture).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping
from typing import Any

from lmjax.checks import (
    is_finite_real,
    is_int,
    is_positive_int,
    is_real,
    require,
    unknown_name,
)
from lmjax.config.overrides import parse_value
from lmjax.errors import ConfigError

ALL_LINEAR = "all-linear"
INITS = ("kaiming", "gaussian")
DEFAULT_TARGETS = ("*.attention.query", "*.attention.value")
# peft's module names (a peft name matches a module whose name ends with it) -> lmjax's globs.
HF_TARGETS = {
    "q_proj": "*.attention.query",
    "k_proj": "*.attention.key",
    "v_proj": "*.attention.value",
    "o_proj": "*.attention.output",
    "gate_proj": "*.feed_forward.gate",
    "up_proj": "*.feed_forward.up",
    "down_proj": "*.feed_forward.down",
}


@dataclasses.dataclass(frozen=True)
class LoraConfig:
    """Which projections get adapters, their rank, scale, initialization and dropout."""

    r: int = 8
    alpha: float = 16.0
    targets: tuple[str, ...] = DEFAULT_TARGETS  # globs over layer names, or ("all-linear",)
    dropout: float = 0.0  # on the adapter input only
    init: str = "kaiming"  # kaiming (peft's default) | gaussian
    rslora: bool = False  # scale alpha / sqrt(r) instead of alpha / r

    def __post_init__(self):
        if isinstance(self.targets, str):
            object.__setattr__(self, "targets", (self.targets,))
        object.__setattr__(self, "targets", tuple(self.targets))
        _validate(self)

    @property
    def scale(self) -> float:
        return self.alpha / (math.sqrt(self.r) if self.rslora else self.r)

    def to_dict(self) -> dict[str, Any]:
        return {**dataclasses.asdict(self), "targets": list(self.targets)}

    @classmethod
    def from_dict(cls, data: Mapping[str, Any], where: str = "lora") -> LoraConfig:
        if not isinstance(data, Mapping):
            raise ConfigError.describe(where, data, "a mapping of LoRA fields", "write r: 8 ...")
        names = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(data) - names)
        if unknown:
            raise unknown_name(f"{where} key", unknown[0], sorted(names))
        return cls(**{k: _coerce(k, v, where) for k, v in data.items()})

    @classmethod
    def parse(cls, text: str, base: LoraConfig | None = None) -> LoraConfig:
        """`"r=8,alpha=16,targets=*.query|*.value,rslora=true"` over `base` (default fields)."""
        if not isinstance(text, str):
            raise ConfigError.describe(
                "--lora", text, "a string such as 'r=8,alpha=16'", "pass the spec as one string"
            )
        fields: dict[str, Any] = {}
        for item in filter(None, (part.strip() for part in text.split(","))):
            key, sep, value = item.partition("=")
            if not sep:
                raise ConfigError.describe(
                    "--lora item", item, "key=value (e.g. r=8,alpha=16)", "write key=value pairs"
                )
            key = key.strip()
            if key in fields:
                raise ConfigError.describe(
                    "--lora key", key, "each key once", f"keep one {key}=... in {text!r}"
                )
            fields[key] = value.split("|") if key == "targets" else parse_value(value.strip())
        merged = {**(base or cls()).to_dict(), **fields}
        return cls.from_dict(merged, where="--lora")


def _coerce(key: str, value: Any, where: str) -> Any:
    if key == "targets":
        if isinstance(value, str):
            value = [value]
        if not isinstance(value, list | tuple) or not all(isinstance(v, str) for v in value):
            raise ConfigError.describe(
                f"{where}.targets",
                value,
                "a list of name globs or 'all-linear'",
                "e.g. ['*.attention.query', '*.attention.value']",
            )
        return tuple(value)
    if key == "alpha" and is_int(value):
        return float(value)
    return value


def _validate(c: LoraConfig) -> None:
    require(is_positive_int(c.r), "lora.r", c.r, "an int >= 1", "e.g. r=8")
    ok = is_finite_real(c.alpha) and c.alpha > 0
    require(ok, "lora.alpha", c.alpha, "a finite number > 0", "e.g. 16")
    ok = is_real(c.dropout) and 0 <= c.dropout < 1
    require(ok, "lora.dropout", c.dropout, "a float in [0, 1)", "e.g. 0.05, or 0")
    require(c.init in INITS, "lora.init", c.init, f"one of {INITS}", "pick one")
    ok = isinstance(c.rslora, bool)
    require(ok, "lora.rslora", c.rslora, "true or false", "write true/false")
    ok = bool(c.targets) and all(isinstance(t, str) and t for t in c.targets)
    globs = "a non-empty list of name globs"
    require(ok, "lora.targets", c.targets, globs, "e.g. ['*.attention.query']")
    alone = f"'{ALL_LINEAR}' alone (it already selects every block linear), or name globs"
    fix = f"write targets={ALL_LINEAR}, or list the globs"
    ok = ALL_LINEAR not in c.targets or len(c.targets) == 1
    require(ok, "lora.targets", c.targets, alone, fix)
