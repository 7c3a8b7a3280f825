"""Sharded training over device meshes, multi-host (docs/scale.md).

    mesh = lmjax.parallel.make_mesh({"data": 2, "fsdp": 4})
    specs = lmjax.parallel.state_specs(state, model_cfg, lmjax.parallel.mesh_shape(mesh))
    state = jax.device_put(state, lmjax.parallel.shardings(specs, mesh))
    train_step = lmjax.train.make_train_step(model_cfg, tx, lr, state_sharding=...)

`mesh.py`: the mesh and the batch sharding; `rules.py`: parameter name -> PartitionSpec from the
parameter declaration; `multihost.py`: `jax.distributed`, per-host batches, the one writer, the
watchdog of lost and hung processes; `witness.py`: the line of a process jax aborts.
"""

from lmjax.parallel.mesh import (
    AXES,
    BATCH_AXES,
    batch_sharding,
    batch_spec,
    check_batch,
    check_mesh_shape,
    make_mesh,
    mesh_shape,
    parse_mesh_arg,
    replicated,
    run_mesh_shape,
)
from lmjax.parallel.multihost import (
    barrier,
    host_batch,
    host_copy,
    initialize_from_env,
    is_main,
    place,
)
from lmjax.parallel.rules import (
    LOGICAL_TO_MESH,
    describe,
    param_specs,
    per_device_bytes,
    shard_shape,
    shardings,
    spec_for,
    state_specs,
)

__all__ = [
    "AXES",
    "BATCH_AXES",
    "LOGICAL_TO_MESH",
    "barrier",
    "batch_sharding",
    "batch_spec",
    "check_batch",
    "check_mesh_shape",
    "describe",
    "host_batch",
    "host_copy",
    "initialize_from_env",
    "is_main",
    "make_mesh",
    "mesh_shape",
    "param_specs",
    "parse_mesh_arg",
    "per_device_bytes",
    "place",
    "replicated",
    "run_mesh_shape",
    "shard_shape",
    "shardings",
    "spec_for",
    "state_specs",
]
