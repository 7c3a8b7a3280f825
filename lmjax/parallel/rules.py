"""Sharding rules: parameter name -> `PartitionSpec`, derived from the parameter declaration.

`lmjax.models.declare(cfg)` gives every parameter's logical axes (`vocab`, `context`, `embed`,
`heads`, `kv_heads`, `head_dim`, `mlp`, `layers`); `LOGICAL_TO_MESH` maps each logical axis to a
mesh axis, so the rules are one table, not a second list of parameter names:

    embed -> fsdp     every weight, embedding and norm scale is split along d_model (FSDP)
    heads -> model    query/key/value rows and output columns: tensor parallel attention
    kv_heads -> model key/value rows when grouped-query (Hkv * Dh features)
    head_dim -> replicated (the q/k norm scales)
    mlp   -> model    expand/gate/up rows and project/down columns: tensor parallel MLP
    vocab, context -> replicated
    layers -> replicated (the stacked blocks' leading axis: a scan slices it on every device)

e.g. `blocks.attention.query.weight [layers, heads, embed]` -> `P(None, "model", "fsdp")` and
`blocks.feed_forward.project.weight [layers, embed, mlp]` -> `P(None, "fsdp", "model")`, the
Megatron column/row split, so a block needs one reduction over `model` per projection pair.

A dimension that its mesh axis does not divide evenly (d_model 100 on fsdp=8) is replicated
instead of padded: the tensor stays correct and only that dimension loses the memory saving;
`describe` lists such leaves. A mesh axis of size 1 is left out of the spec. The optimizer
state (AdamW's mu and nu mirror the parameter tree) gets its parameter's spec by path; other
leaves (step counters) are replicated, as are parameters the declaration does not know (e.g.
adapters added on top).

An NF4 weight (a QLoRA base's `QuantizedWeight`: its codes flattened row-major, two a byte, and
one 8-bit scale per block of 64) is split along its flat axis instead, over every axis of its
float weight's spec (`fsdp` and `model`), when that divides the blocks evenly:

    packed [ceil(N/2)] -> P(axes)   qabsmax [ceil(N/64)] -> P(axes)   absmax2, offset -> P()

so each device holds whole blocks and their scales (N/n weights at 4.127 bits); the few
double-quantization scales are replicated. A stacked NF4 weight (the blocks': each array leads
with the layer axis) keeps that axis whole and splits each layer's flat axis the same way,
`packed [L, ceil(N/2)] -> P(None, axes)`. Dequantization is elementwise per block, so XLA
gathers the float weight where it is used, as it gathers an FSDP float weight.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping

import jax
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from lmjax.models import ModelConfig, declare
from lmjax.quant.nf4 import BLOCK, QuantizedWeight

LOGICAL_TO_MESH: dict[str, str | None] = {
    "vocab": None,
    "context": None,
    "embed": "fsdp",
    "heads": "model",
    "kv_heads": "model",
    "head_dim": None,
    "mlp": "model",
    "layers": None,  # the stacked blocks' layer axis: every device holds every layer's slice
}


def spec_for(shape, axes, mesh_shape: Mapping[str, int]) -> PartitionSpec:
    """One leaf's spec from its logical axes; indivisible dims and size-1 axes replicate."""
    dims, used = [], set()
    for size, logical in zip(shape, axes, strict=True):
        mesh_axis = LOGICAL_TO_MESH[logical]
        n = mesh_shape.get(mesh_axis, 1) if mesh_axis else 1
        if n == 1 or size % n or mesh_axis in used:
            dims.append(None)
        else:
            dims.append(mesh_axis)
            used.add(mesh_axis)
    return PartitionSpec(*dims)


def param_specs(cfg: ModelConfig, mesh_shape: Mapping[str, int]) -> dict[str, PartitionSpec]:
    """`{parameter name: PartitionSpec}` for every leaf of `declare(cfg)`."""
    return {
        name: spec_for(spec.shape, spec.axes, mesh_shape) for name, spec in declare(cfg).items()
    }


def _param_name(path) -> str:
    """The dotted parameter name at the end of a tree path (the trailing dict keys)."""
    keys = []
    for entry in reversed(path):
        if not isinstance(entry, jax.tree_util.DictKey):
            break
        keys.append(str(entry.key))
    return ".".join(reversed(keys))


def tree_specs(
    tree,
    named: Mapping[str, PartitionSpec],
    shapes: Mapping[str, tuple],
    mesh_shape: Mapping[str, int] | None = None,
):
    """Specs for any tree holding parameter-shaped leaves (params, AdamW moments, gradients).

    A leaf whose path ends in a parameter's name and has that parameter's shape gets its spec;
    every other leaf is replicated. An NF4 `QuantizedWeight` gets `nf4_specs` (`mesh_shape`
    needed to split it; None: replicated).
    """

    def leaf_spec(path, leaf):
        name = _param_name(path)
        if name in named and _stored_shape(leaf) == tuple(shapes[name]):
            if isinstance(leaf, QuantizedWeight):
                return nf4_specs(leaf, named[name], mesh_shape)
            return named[name]
        if isinstance(leaf, QuantizedWeight):  # not a parameter of the declaration: replicated
            return nf4_specs(leaf, PartitionSpec(), mesh_shape)
        return PartitionSpec()

    is_nf4 = lambda x: isinstance(x, QuantizedWeight)  # noqa: E731  (one leaf, four arrays)
    return jax.tree_util.tree_map_with_path(leaf_spec, tree, is_leaf=is_nf4)


def _stored_shape(leaf) -> tuple[int, ...]:
    """A leaf's shape as `declare` states it: a stacked NF4 weight's layers, then one layer's."""
    if isinstance(leaf, QuantizedWeight):
        return (*leaf.lead_shape, *leaf.shape)
    return tuple(leaf.shape)


def nf4_specs(qw, float_spec: PartitionSpec, mesh_shape: Mapping[str, int] | None):
    """The specs of an NF4 weight's four arrays (module docstring): its flat codes and block
    scales split over the mesh axes of `float_spec` (its float weight's spec) when n = their
    product divides the blocks (ceil(N/64) % n == 0 and N % 64 == 0, so no block straddles two
    devices), else replicated; absmax2 and offset replicated. A stacked weight's leading layer
    axis is never split (`layers`): each layer's flat axis is split as one weight's would be."""
    lead = len(qw.lead_shape)
    axes = tuple(a for entry in tuple(float_spec)[lead:] if entry for a in _names(entry))
    n = math.prod((mesh_shape or {}).get(a, 1) for a in axes)
    blocks = -(-qw.size // BLOCK)
    split = n > 1 and qw.size % BLOCK == 0 and blocks % n == 0
    layers = (None,) * lead
    flat = PartitionSpec(*layers, axes if len(axes) > 1 else axes[0]) if split else PartitionSpec()
    return dataclasses.replace(
        qw, packed=flat, qabsmax=flat, absmax2=PartitionSpec(), offset=PartitionSpec()
    )


def _names(entry) -> tuple[str, ...]:
    return (entry,) if isinstance(entry, str) else tuple(entry)


def state_specs(state, cfg: ModelConfig, mesh_shape: Mapping[str, int]):
    """A `TrainState`'s (or any tree's) specs: parameters and optimizer state by the rules."""
    named = param_specs(cfg, mesh_shape)
    shapes = {name: spec.shape for name, spec in declare(cfg).items()}
    return tree_specs(state, named, shapes, mesh_shape)


def shardings(specs, mesh: Mesh):
    """A tree of `PartitionSpec`s -> the same tree of `NamedSharding`s on `mesh`."""
    return jax.tree.map(
        lambda s: NamedSharding(mesh, s), specs, is_leaf=lambda x: isinstance(x, PartitionSpec)
    )


def shard_shape(shape, spec: PartitionSpec, mesh_shape: Mapping[str, int]) -> tuple[int, ...]:
    """The per-device block of a leaf, computed from sizes alone (no devices needed)."""
    out = []
    for i, size in enumerate(shape):
        entry = spec[i] if i < len(spec) else None
        names = () if entry is None else (entry,) if isinstance(entry, str) else tuple(entry)
        out.append(size // math.prod(mesh_shape[n] for n in names))
    return tuple(out)


def per_device_bytes(tree, specs, mesh_shape: Mapping[str, int]) -> int:
    """Bytes one device holds of `tree` (arrays or ShapeDtypeStructs) sharded by `specs`."""
    leaves = jax.tree.leaves(tree)
    spec_leaves = jax.tree.leaves(specs, is_leaf=lambda x: isinstance(x, PartitionSpec))
    return sum(
        math.prod(shard_shape(leaf.shape, spec, mesh_shape)) * leaf.dtype.itemsize
        for leaf, spec in zip(leaves, spec_leaves, strict=True)
    )


def describe(cfg: ModelConfig, mesh_shape: Mapping[str, int]) -> list[str]:
    """One line per parameter: name, shape, spec, and the dims replicated for indivisibility."""
    lines = []
    for name, spec in declare(cfg).items():
        ps = spec_for(spec.shape, spec.axes, mesh_shape)
        ragged = [
            f"{logical}={size} not divisible by {axis}={mesh_shape[axis]}"
            for size, logical in zip(spec.shape, spec.axes, strict=True)
            if (axis := LOGICAL_TO_MESH[logical]) and size % mesh_shape.get(axis, 1)
        ]
        note = f"  (replicated: {'; '.join(ragged)})" if ragged else ""
        lines.append(f"{name} {list(spec.shape)} -> {tuple(ps)}{note}")
    return lines
