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
from jax.sharding import NamedSharding, PartitionSpec, SingleDeviceSharding

from lmjax import params as ptree
from lmjax.errors import CheckpointError

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

__all__ = ["converts", "note_converted", "per_layer_target", "saved_per_layer", "stacked_like"]
