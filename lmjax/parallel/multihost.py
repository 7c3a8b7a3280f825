"""Several processes (hosts), one run: `jax.distributed`, per-host batches, one writer.

Start-up (`initialize_from_env`, called by `lmjax train` before jax touches a device), chosen by
environment variables:

    LMJAX_COORDINATOR=host:port  LMJAX_NUM_PROCESSES=N  LMJAX_PROCESS_ID=i
        explicit: `jax.distributed.initialize(host:port, N, i)` (any cluster, e.g. GPU hosts)
    LMJAX_DISTRIBUTED=auto
        `jax.distributed.initialize()` with no arguments: jax detects Cloud TPU slices, SLURM
        and Open MPI itself (scripts/tpu/ sets this on every worker)
    none of them
        one process; nothing is initialized (the default)

Anything else (ranks without a coordinator, both modes, another LMJAX_DISTRIBUTED value, an
address without a port) is a `ConfigError`: a half-configured host would otherwise train alone
as process 0 and write the shared run directory. If a process dies, the others block at their
next collective until jax's coordination service declares it dead (no heartbeat for
`heartbeat_timeout_seconds`, 100 s by default; not tested here: one machine, one process).

Data: every host computes the same random crop starts (a pure function of seed and step) but
reads only the rows its own devices hold (`host_batch`), then the global batch is assembled
from the per-device pieces; concatenated over hosts it is exactly the single-host batch.
Writing: only process 0 writes the run's config, metrics, samples and plots (`is_main`);
orbax checkpoint writes are collective (every process calls save; each writes its shards),
so the checkpoint directory must be one all hosts share (e.g. an NFS or gcsfuse mount).
"""

from __future__ import annotations

import os

import jax
import numpy as np

from lmjax.errors import ConfigError

ENV_COORDINATOR = "LMJAX_COORDINATOR"
ENV_NUM_PROCESSES = "LMJAX_NUM_PROCESSES"
ENV_PROCESS_ID = "LMJAX_PROCESS_ID"
ENV_AUTO = "LMJAX_DISTRIBUTED"


def distributed_args(env: dict[str, str] | None = None) -> dict | None:
    """The `jax.distributed.initialize` keyword arguments the environment asks for, or None."""
    env = os.environ if env is None else env
    auto, address = env.get(ENV_AUTO), env.get(ENV_COORDINATOR)
    ranks = [name for name in (ENV_NUM_PROCESSES, ENV_PROCESS_ID) if env.get(name)]
    if auto:
        if auto.lower() != "auto":
            raise ConfigError.describe(
                ENV_AUTO, auto, "auto (jax finds the hosts) or unset",
                f"export {ENV_AUTO}=auto, or unset it and set {ENV_COORDINATOR} and the ranks",
            )  # fmt: skip
        others = [ENV_COORDINATOR] * bool(address) + ranks
        if others:
            raise ConfigError.describe(
                ENV_AUTO, auto, f"not both it and {', '.join(others)}",
                f"unset {ENV_AUTO} to name the coordinator yourself, or unset the others",
            )  # fmt: skip
        return {}
    if not address:
        if ranks:  # a rank without a coordinator would silently train alone, as process 0
            raise ConfigError.describe(
                ENV_COORDINATOR, None, f"host:port of process 0 (since {' and '.join(ranks)} set)",
                f"export {ENV_COORDINATOR}=<process 0's host>:<port>, or unset "
                f"{' and '.join(ranks)} for one process",
            )  # fmt: skip
        return None
    host, _, port = address.rpartition(":")
    if not host or not port.isdigit():
        raise ConfigError.describe(
            ENV_COORDINATOR, address, "host:port (e.g. 10.0.0.2:1234)",
            "give process 0's address and a free port",
        )  # fmt: skip
    values = {}
    for name in (ENV_NUM_PROCESSES, ENV_PROCESS_ID):
        text = env.get(name, "")
        if not text.isdigit():
            raise ConfigError.describe(
                name, text or None, f"a non-negative int (set with {ENV_COORDINATOR})",
                f"export {ENV_NUM_PROCESSES}=<hosts> {ENV_PROCESS_ID}=<this host's rank>",
            )  # fmt: skip
        values[name] = int(text)
    n, i = values[ENV_NUM_PROCESSES], values[ENV_PROCESS_ID]
    if not 0 <= i < n:
        raise ConfigError.describe(
            ENV_PROCESS_ID, i, f"in [0, {ENV_NUM_PROCESSES} = {n})", "number hosts 0..N-1"
        )
    return {"coordinator_address": address, "num_processes": n, "process_id": i}


def initialize_from_env(env: dict[str, str] | None = None) -> bool:
    """Call `jax.distributed.initialize` if the environment says so; True if it did."""
    kwargs = distributed_args(env)
    if kwargs is None:
        return False
    jax.distributed.initialize(**kwargs)
    return True


def barrier(name: str) -> None:
    """Wait until every process gets here (nothing to wait for with one process)."""
    if jax.process_count() > 1:
        from jax.experimental import multihost_utils

        multihost_utils.sync_global_devices(name)


def is_main() -> bool:
    """True on the process that writes logs, samples and plots (process 0)."""
    return jax.process_index() == 0


def batch_rows(sharding, shape: tuple[int, ...], devices) -> list[int]:
    """The rows of dim 1 (the batch dim of `[A, B, T]`) that `devices` hold, in order."""
    index_map = sharding.devices_indices_map(tuple(shape))
    rows = set()
    for device in devices:
        rows.update(range(*index_map[device][1].indices(shape[1])))
    return sorted(rows)


def host_batch(read_rows, shape: tuple[int, ...], sharding):
    """Global `[A, B, T]` arrays of which this process reads only its own rows.

    `read_rows(rows)` returns a pytree of `[A, len(rows), T]` arrays for the given batch rows
    (the same rows in every micro-batch); it is called once, with the rows this process's
    devices hold. Returns the same pytree of global `jax.Array`s laid out by `sharding`.
    """
    rows = batch_rows(sharding, shape, jax.local_devices())
    where = {row: i for i, row in enumerate(rows)}

    def assemble(local):
        local = np.asarray(local)

        def piece(index):
            picked = [where[r] for r in range(*index[1].indices(shape[1]))]
            return local[index[0]][:, picked][..., index[2]]

        return jax.make_array_from_callback(tuple(shape), sharding, piece)

    return jax.tree.map(assemble, read_rows(rows))
