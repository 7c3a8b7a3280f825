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

Stacked layers. A model's blocks are stored as one sub-tree, `blocks`, whose leaves carry a
leading layer axis: `blocks.attention.query.weight [N, out, in]` holds layer i's weight at
index i (so one `lax.scan` runs them all; docs/models.md). Their *per-layer names* are the
names with the index after `blocks`, `blocks.3.attention.query.weight`: what users read and
write in globs (LoRA targets, freezing, quantization), in `lmjax inspect` and in Hugging Face
files. `layer_names` gives them, `layer_matches` matches a glob against them, and
`stack` / `unstack` convert a whole tree between the two layouts (`unstack` is a per-layer
view for tools; programs use the stacked tree).
"""

from __future__ import annotations

import fnmatch
import math
import re
import sys
from collections.abc import Iterable, Mapping
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

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
    """Total number of scalars over all leaves (works on `jax.eval_shape` output). A leaf with a
    `lead_shape` (a stacked NF4 weight, whose `shape` is one layer's) counts every layer."""
    return sum(
        math.prod(leaf.shape) * math.prod(getattr(leaf, "lead_shape", ()))
        for leaf in flatten(params).values()
    )


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

    A stacked leaf (see the module docstring) matches by its per-layer names, and must match
    in every layer or in none: a glob that picks some layers of it raises `ShapeError` (use
    `layer_matches` where a per-layer choice is meant, as freezing does). With
    `require_match=True` a pattern that selects nothing raises `ShapeError` naming it, which
    catches typos in user configs (a misspelt LoRA target would otherwise train nothing).
    """
    patterns = (patterns,) if isinstance(patterns, str) else tuple(patterns)
    flat = flatten(params)
    if require_match:
        for pattern in patterns:
            if not any(any(layers_matched(n, a, pattern)) for n, a in flat.items()):
                raise ShapeError.describe(
                    "pattern",
                    pattern,
                    f"a glob matching at least one of {len(flat)} parameter names "
                    f"(e.g. {next(iter(flat), '<none>')!r})",
                    "check the spelling against lmjax.params.flatten(params).keys()",
                )
    return map_with_names(
        lambda name, leaf: _whole(name, layer_matches(name, leaf, patterns)), params
    )


def _whole(name: str, chosen) -> bool:
    """One bool for a leaf: every layer or none of a stacked leaf."""
    if not isinstance(chosen, tuple):
        return bool(chosen)
    if all(chosen) or not any(chosen):
        return all(chosen)
    picked = [i for i, c in enumerate(chosen) if c]
    raise ShapeError.describe(
        f"pattern over {name} (stacked layers)",
        f"layers {picked} of {len(chosen)}",
        "every layer or none",
        f"match the layers by a glob such as {STACKED}.*.{name.removeprefix(STACKED + '.')}",
    )


def map_with_names(fn, params: Tree, prefix: str = "") -> dict:
    """`fn(name, leaf)` at every leaf, keeping the exact structure (empty sub-dicts too)."""
    out = {}
    for key, value in params.items():
        name = f"{prefix}.{_check_key(key, prefix)}" if prefix else _check_key(key, prefix)
        out[key] = (
            map_with_names(fn, value, name) if isinstance(value, Mapping) else fn(name, value)
        )
    return out


# ---- stacked layers ----------------------------------------------------------------------------

STACKED = "blocks"  # the sub-tree whose leaves carry a leading layer axis


def stacked_size(leaf) -> int:
    """N, the layer count of a stacked leaf: the leading axis of its (first) array.

    A leaf may be a pytree such as an NF4 `QuantizedWeight`, whose arrays all lead with N."""
    return int(jax.tree.leaves(leaf)[0].shape[0])


def is_stacked(name: str) -> bool:
    """Whether the flat name is a stacked block leaf (`blocks.x`, not a per-layer `blocks.3.x`)."""
    parts = name.split(".")
    return len(parts) > 1 and parts[0] == STACKED and not parts[1].isdecimal()


def layer_names(name: str, n: int) -> list[str]:
    """Per-layer names of stacked leaf `name`: `blocks.x` -> `[blocks.0.x .. blocks.{n-1}.x]`."""
    rest = name.removeprefix(STACKED + ".")
    return [f"{STACKED}.{i}.{rest}" for i in range(n)]


def layer_matches(name: str, leaf, patterns: str | Iterable[str]) -> tuple[bool, ...] | bool:
    """`matches` for any leaf: a plain leaf gives one bool; a stacked leaf gives one bool per
    layer, matching each per-layer name (or the stacked name itself, which selects every layer:
    `blocks.attention.query.weight` and `blocks.*.attention.query.weight` mean the same)."""
    if not is_stacked(name):
        return matches(name, patterns)
    n = stacked_size(leaf)
    if matches(name, patterns):
        return (True,) * n
    return tuple(matches(each, patterns) for each in layer_names(name, n))


def layers_matched(name: str, leaf, patterns: str | Iterable[str]) -> tuple[bool, ...]:
    """`layer_matches` as a tuple always: one bool per layer of a stacked leaf, a 1-tuple for a
    plain leaf (so `all` / `any` read "every layer" / "some layer" for both)."""
    chosen = layer_matches(name, leaf, patterns)
    return chosen if isinstance(chosen, tuple) else (chosen,)


def stored_name(name: str) -> str:
    """The inverse of `layer_names`: `blocks.3.x` -> `blocks.x`, the stacked leaf holding that
    layer's value; any other name as it is."""
    parts = name.split(".")
    if len(parts) > 2 and parts[0] == STACKED and parts[1].isdecimal():
        return ".".join(parts[:1] + parts[2:])
    return name


def blocks_layout(node) -> str | None:
    """How a mapping holds a model's blocks: `"stacked"` (`blocks.x` leaves `[N, ...]`),
    `"layers"` (per-layer `blocks.0`, `blocks.1`, ...), or None (no non-empty `blocks`, or not a
    mapping): the one test `stack`, `unstack` and checkpoint conversion share."""
    blocks = node.get(STACKED) if isinstance(node, Mapping) else None
    if not isinstance(blocks, Mapping) or not blocks:
        return None
    return "layers" if all(key.isdecimal() for key in blocks) else "stacked"


def stack(params: Tree) -> dict:
    """Per-layer blocks `{"blocks": {"0": t0, "1": t1, ...}}` -> stacked `{"blocks": t}`, each
    leaf of `t` the layers' leaves stacked on a new leading axis (numpy stays numpy; abstract
    `jax.ShapeDtypeStruct`s stay abstract). The layers must have the same structure and shapes;
    a tree without per-layer blocks is returned as it is."""
    if blocks_layout(params) != "layers":
        return dict(params)
    blocks = params[STACKED]
    n = len(blocks)
    if sorted(blocks, key=int) != [str(i) for i in range(n)]:
        raise ShapeError.describe(
            "per-layer blocks",
            sorted(blocks, key=natural_key)[:4],
            f"blocks 0 .. {n - 1}, each once",
            "pass every layer of the model",
        )
    layers = [blocks[str(i)] for i in range(n)]
    names = [set(flatten(layer)) for layer in layers]
    for i, layer_set in enumerate(names):
        if layer_set != names[0]:
            odd = sorted(layer_set ^ names[0], key=natural_key)[0]
            raise ShapeError.describe(
                f"blocks.{i}", odd, "the same parameters in every layer", "pass complete layers"
            )

    def one(*leaves):
        if all(isinstance(a, np.ndarray) for a in leaves):
            return np.stack(leaves)
        if all(isinstance(a, jax.ShapeDtypeStruct) for a in leaves):
            return jax.ShapeDtypeStruct((n, *leaves[0].shape), leaves[0].dtype)
        return jnp.stack(leaves)

    return {**params, STACKED: jax.tree.map(one, *layers)}


def note_converted(where) -> None:
    """The one line (stderr, main process) that says a checkpoint step or a file `where` held
    per-layer blocks (written before they were stacked) and was stacked on load."""
    if jax.process_index() == 0:
        print(
            f"lmjax: {where} was saved with per-layer blocks; converted to the stacked layout "
            "on load (the files are unchanged; what lmjax saves from it is stacked)",
            file=sys.stderr,
            flush=True,
        )


def unstack(params: Tree) -> dict:
    """The inverse of `stack`: stacked `{"blocks": t}` -> `{"blocks": {"0": t[0], ...}}`, each
    layer's leaves sliced from the stacked ones (a per-layer view for tools and files)."""
    blocks = params.get(STACKED)
    if blocks_layout(params) != "stacked" or not jax.tree.leaves(blocks):
        return dict(params)
    n = stacked_size(blocks)

    def take(i):
        def one(a):
            if isinstance(a, jax.ShapeDtypeStruct):
                return jax.ShapeDtypeStruct(a.shape[1:], a.dtype)
            return a[i]

        return jax.tree.map(one, blocks)

    return {**params, STACKED: {str(i): take(i) for i in range(n)}}


__all__ = [
    "STACKED",
    "blocks_layout",
    "is_stacked",
    "layer_matches",
    "layer_names",
    "layers_matched",
    "stack",
    "stacked_size",
    "stored_name",
    "unstack",
    "flatten",
    "unflatten",
    "count",
    "mask",
    "map_with_names",
    "matches",
    "natural_key",
    "note_converted",
]
