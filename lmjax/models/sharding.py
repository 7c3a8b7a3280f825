"""Activations on a device mesh: each device keeps its own rows of the batch.

    x_BTD on a mesh in context  ->  x_BTD laid out as PartitionSpec(("data", "fsdp"), None, None)

The model carries no sharding of its own; the train and eval steps trace it with their mesh in
context (`lmjax.train.step`), and `features` pins the residual stream, between blocks, to the
batch axes. Without that pin XLA's partitioner followed the weights' FSDP split and sharded the
activations along d_model, so every device held the whole micro-batch's float32 attention
scores: GPT-2 124M's step on v5e:2x2 (fsdp=4) needed 14.0 GiB a device, 4.6 GiB with the pin
(tests/test_compile_tpu.py). The pin changes where values live, never what they are.

A batch the batch axes do not divide is left to XLA (correct, only not pinned); no mesh, or a
mesh of one device, is a no-op. The axis names are `lmjax.parallel.mesh`'s (models/ sits below
parallel/, so they are stated here; tests/test_flash_on_a_mesh.py checks they agree).
"""

from __future__ import annotations

import math
from collections.abc import Mapping

import jax
from jax.sharding import PartitionSpec

BATCH_AXES = ("data", "fsdp")  # split a batch's rows
HEAD_AXIS = "model"  # splits attention heads and MLP columns (tensor parallelism)


def context_mesh_shape() -> dict[str, int] | None:
    """`{axis: size}` of the mesh in context, or None without one (or with one device)."""
    mesh = jax.sharding.get_abstract_mesh()
    if mesh.empty or math.prod(mesh.shape.values()) == 1:
        return None
    return dict(mesh.shape)


def batch_axes(mesh_shape: Mapping[str, int]) -> tuple[str, ...]:
    """The batch axes of a mesh that split something (size > 1), in mesh order."""
    return tuple(a for a in BATCH_AXES if mesh_shape.get(a, 1) > 1)


def rows_on_mesh(x_B: jax.Array, *, rest: str = "replicated") -> jax.Array:
    """`x_B` (batch first, any rank) pinned to the context mesh's batch axes; else itself.

    `rest="free"` pins the batch axis only and leaves the others to XLA (a projection's output
    may stay split over heads or MLP columns on a "model" axis)."""
    shape = context_mesh_shape()
    if shape is None:
        return x_B
    axes = batch_axes(shape)
    if not axes or x_B.shape[0] % math.prod(shape[a] for a in axes):
        return x_B
    other = None if rest == "replicated" else PartitionSpec.UNCONSTRAINED
    spec = PartitionSpec(axes, *([other] * (x_B.ndim - 1)))
    return jax.lax.with_sharding_constraint(x_B, spec)
