"""The device mesh (docs/scale.md): named axes `data`, `fsdp`, `model`.

    parallel:
      mesh: {data: 2, fsdp: 4}        # model defaults to 1; the product = the device count

`data` replicates the parameters and splits the batch; `fsdp` splits the batch too and shards
parameters and optimizer state (ZeRO-3 style: XLA all-gathers a weight where it is used);
`model` splits the attention heads and the MLP features (tensor parallel).

Axis types: the mesh is built with `AxisType.Auto` on every axis, deliberately. `jax.make_mesh`
defaults to `Explicit` axes (it does in jax 0.10.2, checked), under which every op whose output
sharding is ambiguous (the embedding gather `table[ids]`, our custom-VJP ops' scatter-add) must
be given an explicit `out_sharding`. With `Auto` the shardings we pin (parameters, optimizer
state, the batch) propagate through the model by XLA's partitioner, so the model code stays
free of sharding annotations and is identical on one device and on a mesh; the cost is that
XLA, not us, picks the layout of intermediates.
"""

from __future__ import annotations

import math
from collections.abc import Mapping

import jax
from jax.sharding import AxisType, Mesh, NamedSharding, PartitionSpec

from lmjax.checks import is_positive_int, require
from lmjax.errors import ConfigError

AXES = ("data", "fsdp", "model")
# The batch dimension is split over both data-parallel axes.
BATCH_AXES = ("data", "fsdp")


def check_mesh_shape(
    shape: Mapping[str, int], n_devices: int | None = None, where: str = "parallel.mesh"
) -> dict[str, int]:
    """`{"data": 2, "fsdp": 4}` -> `{"data": 2, "fsdp": 4, "model": 1}`, validated.

    Unknown axis names, sizes that are not positive ints, and (when `n_devices` is given) a
    product other than the device count are `ConfigError`s naming the value and the fix.
    """
    if not isinstance(shape, Mapping):
        raise ConfigError.describe(
            where,
            shape,
            f"a mapping of axis sizes over {AXES}",
            "write e.g. parallel: {mesh: {data: 2, fsdp: 4}}",
        )
    for name, size in shape.items():
        fix = "fix the spelling or remove it"
        require(name in AXES, f"{where} axis", name, f"one of {AXES}", fix)
        fix = "use a positive device count"
        require(is_positive_int(size), f"{where}.{name}", size, "an int >= 1", fix)
    full = {name: int(shape.get(name, 1)) for name in AXES}
    product = math.prod(full.values())
    if n_devices is not None and product != n_devices:
        raise ConfigError.describe(
            where,
            _text(full),
            f"axis sizes whose product equals the {n_devices} devices jax sees (got {product})",
            f"resize the axes so data x fsdp x model = {n_devices}",
        )
    return full


def run_mesh_shape(shape: Mapping[str, int] | None, batch_rows: int) -> dict[str, int] | None:
    """The mesh `lmjax train` runs on, from its `parallel.mesh` (None: the section is null).

    Given: checked against the device count and returned in full. Null: no mesh in one process
    (one device, as always), and `{"data": every device}` over several processes, where one
    device cannot train for all and a host-local state cannot be checkpointed collectively.
    `data`, not `fsdp`: each device holds the whole state, as the one device of a
    one-process run does; the batch is split over all devices, its mean the same.
    `batch_rows`: sequences per micro-batch, which must split evenly over the devices.
    """
    if shape is not None:
        return check_mesh_shape(shape, jax.device_count())
    if jax.process_count() == 1:
        return None
    full = check_mesh_shape({"data": jax.device_count()})
    n, where = jax.process_count(), "train.batch_size"
    check_batch(batch_rows, full, f"{where} (parallel.mesh null over {n} processes: data only)")
    return full


def parse_mesh_text(text: str, where: str = "--mesh") -> dict[str, int]:
    """`"data=2,fsdp=4"` -> `{"data": 2, "fsdp": 4}` (as written; not yet validated)."""
    out: dict[str, int] = {}
    for item in filter(None, (part.strip() for part in text.split(","))):
        name, sep, value = item.partition("=")
        if not sep or not value.strip().lstrip("-").isdigit():
            raise ConfigError.describe(
                f"{where} item", item, "axis=size (e.g. data=2,fsdp=4)", "write name=int pairs"
            )
        if name.strip() in out:
            raise ConfigError.describe(
                f"{where} axis", name.strip(), "each axis at most once", "give each size once"
            )
        out[name.strip()] = int(value)
    return out


def parse_mesh_arg(text: str) -> dict[str, int]:
    """`"data=2,fsdp=4"` -> `{"data": 2, "fsdp": 4, "model": 1}` (the CLI's `--mesh`)."""
    return check_mesh_shape(parse_mesh_text(text), where="--mesh")


def make_mesh(shape: Mapping[str, int], devices=None) -> Mesh:
    """A `Mesh` over `devices` (default: all of jax's devices) with `Auto` axes (see above)."""
    devices = list(jax.devices() if devices is None else devices)
    full = check_mesh_shape(shape, len(devices))
    sizes = tuple(full[name] for name in AXES)
    return jax.make_mesh(sizes, AXES, axis_types=(AxisType.Auto,) * len(AXES), devices=devices)


def mesh_shape(mesh: Mesh) -> dict[str, int]:
    return {name: int(mesh.shape[name]) for name in AXES}


def batch_spec(rank: int, batch_dim: int = 0) -> PartitionSpec:
    """A batch array's spec: `batch_dim` over data x fsdp, every other dim replicated."""
    dims: list = [None] * rank
    dims[batch_dim] = BATCH_AXES
    return PartitionSpec(*dims)


def batch_sharding(mesh: Mesh, rank: int, batch_dim: int = 0) -> NamedSharding:
    return NamedSharding(mesh, batch_spec(rank, batch_dim))


def replicated(mesh: Mesh) -> NamedSharding:
    return NamedSharding(mesh, PartitionSpec())


def check_batch(batch_rows: int, shape: Mapping[str, int], where: str = "train.batch_size") -> None:
    """The batch dim must split evenly over data x fsdp (a ragged split would change the mean)."""
    ways = shape["data"] * shape["fsdp"]
    if batch_rows % ways:
        raise ConfigError.describe(
            where,
            batch_rows,
            f"a multiple of data x fsdp = {ways} (per micro-batch)",
            f"use a batch of sequences per micro-batch divisible by {ways}, or change the mesh",
        )


def _text(shape: Mapping[str, int]) -> str:
    return ",".join(f"{k}={v}" for k, v in shape.items())
