"""Checkpoints saved before the blocks were stacked: read per layer, stacked on load.

A model's blocks are stored stacked (`lmjax.params`: one `blocks` sub-tree whose leaves lead
with the layer axis). Checkpoints written before that hold `blocks: {"0": ..., "1": ...}`
wherever a tree of the model's shape sits: the params, and the optimizer states that mirror them
(AdamW's `mu` and `nu`), a fine-tune's adapters. Such a step is recognized from its stored tree
(`saved_per_layer`), restored against the per-layer view of the expected state
(`per_layer_target`), checked against its own checksums as saved, and then stacked
(`stacked_like`): one conversion on load, with one line saying so (`note_converted`). The files
are left as they are; the next checkpoint a resumed run writes is stacked. While it stacks, the
state is held twice (per layer and stacked), once.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterable

import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding, PartitionSpec, SingleDeviceSharding

from lmjax import params as ptree
from lmjax.errors import CheckpointError
from lmjax.train.checkpoint.integrity import path_name

# A stored leaf name (`lmjax.train.checkpoint.integrity.path_name`) inside per-layer blocks.
_PER_LAYER = re.compile(r"(^|\.)" + re.escape(ptree.STACKED) + r"\.\d+(\.|$)")


def saved_per_layer(stored_names: Iterable[str]) -> bool:
    """Whether a step's stored leaf names (`params.blocks.0.attention.query.weight`) hold
    per-layer blocks."""
    return any(_PER_LAYER.search(name) for name in stored_names)


def _holds_stacked(node) -> bool:
    return ptree.blocks_layout(node) == "stacked"


def _holds_layers(node) -> bool:
    return ptree.blocks_layout(node) == "layers"


def _layer_sharding(sharding):
    """The sharding of one layer of a stacked leaf: its spec without the (never split) layer
    axis. None (the restore's default placement) for a sharding without a spec."""
    if isinstance(sharding, NamedSharding):
        return NamedSharding(sharding.mesh, PartitionSpec(*sharding.spec[1:]))
    return sharding if isinstance(sharding, SingleDeviceSharding) else None


def _layer_leaf(leaf) -> jax.ShapeDtypeStruct:
    """`[N, ...]` (an array or a ShapeDtypeStruct) -> one layer's `[...]`, abstract."""
    sharding = _layer_sharding(getattr(leaf, "sharding", None))
    return jax.ShapeDtypeStruct(leaf.shape[1:], leaf.dtype, sharding=sharding)


def _unstack_node(node):
    if not _holds_stacked(node):
        return node
    blocks = node[ptree.STACKED]
    n = ptree.stacked_size(blocks)
    layers = {str(i): jax.tree.map(_layer_leaf, blocks) for i in range(n)}
    return {**node, ptree.STACKED: layers}


def per_layer_target(abstract_state):
    """`abstract_state` with every stacked `blocks` sub-tree, wherever it sits (params,
    optimizer moments, adapters), as per-layer blocks `{"0": ..., "N-1": ...}` of
    `jax.ShapeDtypeStruct`s: what a step saved before the blocks were stacked restores into.
    Each leaf keeps its sharding without the layer axis, so a sharded state restores sharded."""
    return jax.tree.map(_unstack_node, abstract_state, is_leaf=_holds_stacked)


# `prefix.blocks.<i>.rest`: the tree a stored name sits in, its layer, and its per-layer name.
_LAYER_NAME = re.compile(r"^(?:(.*)\.)?" + re.escape(ptree.STACKED) + r"\.(\d+)\.(.+)$")


def absent_layers(target, stored_names: Iterable[str], absent: Callable[[str], bool]) -> set:
    """`{(prefix, i)}`: the layers of `per_layer_target` that a step lacks whole and may lack,
    every missing leaf's per-layer name (`blocks.0.attention.query.weight`) passing `absent`
    (a full fine-tune's frozen layers, which per-layer states did not hold). Empty when any
    other leaf is missing: the structure check then names it."""
    stored, missing = set(stored_names), {}
    for path, _ in jax.tree_util.tree_flatten_with_path(target)[0]:
        match = _LAYER_NAME.match(path_name(path))
        if match is None or path_name(path) in stored:
            continue
        prefix, i, rest = match.groups()
        if not absent(f"{ptree.STACKED}.{i}.{rest}"):
            return set()
        missing.setdefault((prefix or "", int(i)), set()).add(path_name(path))
    present: dict[str, set] = {}
    for m in filter(None, map(_LAYER_NAME.match, stored)):
        present.setdefault(m.group(1) or "", set()).add(int(m.group(2)))
    whole = {key for key in missing if key[1] not in present.get(key[0], set())}
    return whole if whole == set(missing) else set()


def _each_layered(tree, fn):
    """`fn(prefix, node)` in place of every node holding per-layer blocks."""
    return jax.tree_util.tree_map_with_path(
        lambda path, node: fn(path_name(path), node) if _holds_layers(node) else node,
        tree,
        is_leaf=_holds_layers,
    )


def without_layers(target, layers: set):
    """`target` without the `(prefix, i)` layers (`absent_layers`), to restore a step into."""

    def drop(prefix, node):
        kept = {k: v for k, v in node[ptree.STACKED].items() if (prefix, int(k)) not in layers}
        return {**node, ptree.STACKED: kept}

    return _each_layered(target, drop)


def with_zero_layers(state, target, layers: set):
    """`state` (restored `without_layers`) with those layers back, zeros of `target`'s shapes:
    what the stacked layout holds in a trained leaf's frozen layers."""
    full = {
        path_name(path): node[ptree.STACKED]
        for path, node in jax.tree_util.tree_flatten_with_path(target, is_leaf=_holds_layers)[0]
        if _holds_layers(node)
    }

    def fill(prefix, node):
        blocks = dict(node[ptree.STACKED])
        for key, layer in full.get(prefix, {}).items():
            if (prefix, int(key)) in layers:
                blocks[key] = jax.tree.map(lambda a: jnp.zeros(a.shape, a.dtype), layer)
        return {**node, ptree.STACKED: blocks}

    return _each_layered(state, fill)


def _stack_all(tree):
    """Every per-layer `blocks` sub-tree of `tree` stacked (`lmjax.params.stack`)."""
    return jax.tree.map(
        lambda node: ptree.stack(node) if _holds_layers(node) else node,
        tree,
        is_leaf=_holds_layers,
    )


def stacked_like(state, abstract_state, sharding_of: Callable):
    """The per-layer `state` (restored into `per_layer_target(abstract_state)`) in the structure
    of `abstract_state`, its blocks stacked, each leaf placed with `sharding_of(abstract leaf)`."""
    structure = jax.tree.structure(abstract_state)
    shardings = jax.tree.map(sharding_of, abstract_state)

    def stack(tree):
        leaves = jax.tree.leaves(_stack_all(tree))
        if len(leaves) != structure.num_leaves:  # the target came from `abstract_state`
            raise CheckpointError.describe(
                "per-layer checkpoint state",
                f"{len(leaves)} arrays once stacked",
                f"{structure.num_leaves} (the expected state's)",
                "restore it with the config it was trained with",
            )
        return jax.tree.unflatten(structure, leaves)

    return jax.jit(stack, out_shardings=shardings)(state)


def converts(abstract_state) -> bool:
    """Whether `abstract_state` has stacked blocks that a per-layer step must be stacked into."""
    leaves = jax.tree.leaves(abstract_state, is_leaf=_holds_stacked)
    return any(_holds_stacked(leaf) for leaf in leaves)


note_converted = ptree.note_converted  # where the blocks are stacked, beside stack and unstack

__all__ = [
    "absent_layers",
    "with_zero_layers",
    "without_layers",
    "converts",
    "note_converted",
    "per_layer_target",
    "saved_per_layer",
    "stacked_like",
]
