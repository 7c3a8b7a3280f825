"""Parameter pytrees addressed by `.`-joined names (docs/models.md).

A parameter tree is a nested `dict[str, ...]` whose leaves are arrays (or `jax.ShapeDtypeStruct`
under `jax.eval_shape`). Its flat view maps names such as `blocks.0.attention.query.weight` to
leaves. Everything that selects parameters by name (weight decay, freezing, LoRA targets,
sharding rules) goes through `mask`, so a pattern means the same thing everywhere.

Order. Keys are visited in *natural* order at every level: digit runs compare as numbers, so
`blocks.2` comes before `blocks.10`, and the order never depends on dict insertion order (which
`jax.tree.map` does not preserve). Flattening the same tree twice always gives the same order.
This is not `jax.tree.leaves` order (JAX sorts keys as strings, so `blocks.10` precedes
`blocks.2`): pair names with leaves through `flatten` or `map_with_names`, never by zipping
`flatten(p).values()` with `jax.tree.leaves(p)`. An empty sub-dict has no leaves, so it has no
flat name and `unflatten(flatten(t))` drops it; `mask` and `map_with_names` keep the structure
exactly.
"""

from __future__ import annotations

import fnmatch
import math
import re
from collections.abc import Iterable, Mapping
from typing import Any

from lmjax.errors import ShapeError

Tree = Mapping[str, Any]

_DIGITS = re.compile(r"(\d+)")


def natural_key(name: str) -> tuple:
    """Sort key that orders `"10"` after `"2"`: digit runs compare as integers.

    The name itself is the last element, so names that compare equal as numbers ("1" and "01")
    still have one fixed order.
    """
    parts = tuple(int(p) if p.isdecimal() else p for p in _DIGITS.split(name))
    return parts, name


def _check_key(key: Any, prefix: str) -> str:
    if not isinstance(key, str) or not key or "." in key:
        where = prefix or "<root>"
        raise ShapeError.describe(
            f"parameter key under {where}",
            key,
            "a non-empty str without '.'",
            "name sub-trees with plain strings, e.g. blocks['0'] instead of blocks[0]",
        )
    return key


def flatten(params: Tree, prefix: str = "") -> dict[str, Any]:
    """Nested dict -> `{"a.b.c": leaf}` in natural key order (see module docstring)."""
    flat: dict[str, Any] = {}
    for key in sorted(params, key=lambda k: natural_key(str(k))):
        name = f"{prefix}.{_check_key(key, prefix)}" if prefix else _check_key(key, prefix)
        value = params[key]
        if isinstance(value, Mapping):
            flat.update(flatten(value, name))
        else:
            flat[name] = value
    return flat


def unflatten(flat: Mapping[str, Any]) -> dict[str, Any]:
    """Inverse of `flatten`: `{"a.b": x}` -> `{"a": {"b": x}}`.

    Raises `ShapeError` when one name is both a leaf and the prefix of another, e.g.
    `"a.b"` and `"a.b.c"`, since no nested dict can hold both.
    """
    tree: dict[str, Any] = {}
    for name in sorted(flat, key=natural_key):
        parts = name.split(".")
        if any(not p for p in parts):
            raise ShapeError.describe(
                "parameter name", name, "dot-separated non-empty parts", "remove empty parts"
            )
        node = tree
        for depth, part in enumerate(parts[:-1]):
            child = node.setdefault(part, {})
            if not isinstance(child, dict):
                raise _leaf_prefix_error(".".join(parts[: depth + 1]), name)
            node = child
        if parts[-1] in node:
            raise _leaf_prefix_error(name, name)
        node[parts[-1]] = flat[name]
    return tree


def _leaf_prefix_error(leaf: str, name: str) -> ShapeError:
    return ShapeError.describe(
        "parameter names",
        (leaf, name),
        "no name that is both a leaf and a prefix of another name",
        "rename one of the two parameters",
    )


def count(params: Tree) -> int:
    """Total number of scalars over all leaves (works on `jax.eval_shape` output)."""
    return sum(math.prod(leaf.shape) for leaf in flatten(params).values())


def matches(name: str, patterns: str | Iterable[str]) -> bool:
    """True when `name` matches any glob in `patterns` (`*`, `?`, `[...]`, case-sensitive).

    `*` crosses dots, so `"*.bias"` matches every bias and `"blocks.*.attention.*"` every
    attention leaf of every block.
    """
    if isinstance(patterns, str):
        patterns = (patterns,)
    return any(fnmatch.fnmatchcase(name, p) for p in patterns)


def mask(params: Tree, patterns: str | Iterable[str], *, require_match: bool = False) -> dict:
    """Pytree of bools with the structure of `params`: True where the leaf name matches.

    With `require_match=True` a pattern that selects nothing raises `ShapeError` naming it,
    which catches typos in user configs (a misspelt LoRA target would otherwise train nothing).
    """
    patterns = (patterns,) if isinstance(patterns, str) else tuple(patterns)
    flat = flatten(params)
    if require_match:
        for pattern in patterns:
            if not any(fnmatch.fnmatchcase(name, pattern) for name in flat):
                raise ShapeError.describe(
                    "pattern",
                    pattern,
                    f"a glob matching at least one of {len(flat)} parameter names "
                    f"(e.g. {next(iter(flat), '<none>')!r})",
                    "check the spelling against lmjax.params.flatten(params).keys()",
                )
    return map_with_names(lambda name, _: matches(name, patterns), params)


def map_with_names(fn, params: Tree, prefix: str = "") -> dict:
    """`fn(name, leaf)` at every leaf, keeping the exact structure (empty sub-dicts too)."""
    out = {}
    for key, value in params.items():
        name = f"{prefix}.{_check_key(key, prefix)}" if prefix else _check_key(key, prefix)
        out[key] = (
            map_with_names(fn, value, name) if isinstance(value, Mapping) else fn(name, value)
        )
    return out


__all__ = ["flatten", "unflatten", "count", "mask", "map_with_names", "matches", "natural_key"]
