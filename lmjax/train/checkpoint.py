"""Checkpoints of a run with orbax (SPEC section 5).

A checkpoint is `RUN/checkpoints/<step>/` with two items: `state` (the `TrainState`: params,
optimizer state, step and PRNG key) and `meta` (JSON: the resolved run config, the step and the
data position). orbax writes a step into a temporary directory and renames it into place only
when every file is written, so a process killed mid-save leaves the previous checkpoints intact
and the half-written one is never listed. `keep` bounds how many stay on disk.

Restoring checks the checkpoint's model config against the expected one first (a checkpoint from
another architecture is a `CheckpointError` naming the differing fields) and then every array's
shape and dtype against the expected state.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path
from typing import Any

import jax

from lmjax.errors import CheckpointError

# orbax logs every save and restore at INFO through absl; a progress bar is enough for users.
logging.getLogger("absl").setLevel(logging.WARNING)


def _ocp():
    import orbax.checkpoint as ocp

    return ocp


class Checkpoints:
    """The checkpoints under one directory (usually `RUN/checkpoints`)."""

    def __init__(self, directory: str | os.PathLike, keep: int = 3, create: bool = True):
        ocp = _ocp()
        self.directory = Path(directory).absolute()
        if not create and not self.directory.is_dir():
            raise CheckpointError.describe(
                "checkpoint directory",
                str(self.directory),
                "an existing directory",
                "check the run path",
            )
        options = ocp.CheckpointManagerOptions(
            max_to_keep=keep, enable_async_checkpointing=False, create=create
        )
        # Handlers named per item, so a manager that has not saved yet can read metadata too.
        registry = ocp.handlers.DefaultCheckpointHandlerRegistry()
        state_handler, meta_handler = ocp.StandardCheckpointHandler(), ocp.JsonCheckpointHandler()
        for item, handler, arg_types in (
            ("state", state_handler, (ocp.args.StandardSave, ocp.args.StandardRestore)),
            ("meta", meta_handler, (ocp.args.JsonSave, ocp.args.JsonRestore)),
        ):
            for arg_type in arg_types:
                registry.add(item, arg_type, handler)
        self._manager = ocp.CheckpointManager(
            self.directory, options=options, handler_registry=registry
        )

    def steps(self) -> list[int]:
        return list(self._manager.all_steps())

    def latest_step(self) -> int | None:
        return self._manager.latest_step()

    def save(self, state, meta: dict[str, Any]) -> int:
        ocp = _ocp()
        step = int(state.step)
        args = ocp.args.Composite(
            state=ocp.args.StandardSave(state), meta=ocp.args.JsonSave({**meta, "step": step})
        )
        self._manager.save(step, args=args, force=True)
        self._manager.wait_until_finished()
        return step

    def read_meta(self, step: int | None = None) -> dict[str, Any]:
        ocp = _ocp()
        step = self._require_step(step)
        try:
            restored = self._manager.restore(
                step, args=ocp.args.Composite(meta=ocp.args.JsonRestore())
            )
        except Exception as err:  # noqa: BLE001 - orbax raises many kinds; all mean "unreadable"
            raise _unreadable(self.directory / str(step), err) from None
        if not isinstance(restored.meta, dict):
            raise _unreadable(self.directory / str(step), "meta is not a JSON object")
        return restored.meta

    def restore(self, abstract_state, step: int | None = None):
        """The state saved at `step` (default: the latest), in the structure of `abstract_state`.

        `abstract_state` is the expected state (arrays or `jax.ShapeDtypeStruct`s); any
        difference in a leaf's shape or dtype is a `CheckpointError` naming the leaf. Each leaf
        is restored with the leaf's `sharding` (default: the first local device), so a state
        saved on one mesh restores onto another (`lmjax.parallel`).
        """
        ocp = _ocp()
        step = self._require_step(step)
        where = self.directory / str(step)
        _check_structure(where, self._stored_leaves(step), abstract_state)
        abstract = jax.tree.map(
            lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=_target_sharding(a)),
            abstract_state,
        )
        try:
            restored = self._manager.restore(
                step, args=ocp.args.Composite(state=ocp.args.StandardRestore(abstract))
            )
        except Exception as err:  # noqa: BLE001
            raise _unreadable(where, err) from None
        leaves = jax.tree.leaves(restored.state)
        return jax.tree.unflatten(jax.tree.structure(abstract_state), leaves)

    def _stored_leaves(self, step: int) -> dict[str, tuple]:
        try:
            meta = self._manager.item_metadata(step)["state"]
            tree = meta.tree if hasattr(meta, "tree") else meta
        except Exception as err:  # noqa: BLE001
            raise _unreadable(self.directory / str(step), err) from None
        out = {}
        for path, leaf in jax.tree_util.tree_flatten_with_path(tree)[0]:
            out[_path_name(path)] = (tuple(leaf.shape), str(leaf.dtype))
        return out

    def _require_step(self, step: int | None) -> int:
        steps = self.steps()
        if not steps:
            raise CheckpointError.describe(
                "checkpoints in",
                str(self.directory),
                "at least one saved step",
                "train first, or pass the run directory of a run that saved one",
            )
        if step is None:
            return max(steps)
        if step not in steps:
            raise CheckpointError.describe(
                "checkpoint step", step, f"one of {steps}", "pick a saved step"
            )
        return step


def _target_sharding(leaf):
    # Never the saved sharding: it names the devices of the mesh that wrote the checkpoint.
    sharding = getattr(leaf, "sharding", None)
    return sharding or jax.sharding.SingleDeviceSharding(jax.local_devices()[0])


def _path_name(path) -> str:
    parts = []
    for entry in path:
        for attr in ("key", "idx", "name"):
            if hasattr(entry, attr):
                parts.append(str(getattr(entry, attr)))
                break
    return ".".join(parts)


def _check_structure(where: Path, stored: dict[str, tuple], abstract_state) -> None:
    expected = {
        _path_name(path): (tuple(leaf.shape), str(leaf.dtype))
        for path, leaf in jax.tree_util.tree_flatten_with_path(abstract_state)[0]
    }
    # NamedTuple fields are saved by name and restored by position, so compare leaf lists in
    # order as well as by name where the names agree.
    stored_specs = list(stored.values())
    expected_specs = list(expected.values())
    if len(stored_specs) != len(expected_specs):
        raise CheckpointError.describe(
            f"checkpoint {where}",
            f"{len(stored_specs)} arrays",
            f"{len(expected_specs)} arrays for this model and optimizer",
            "restore it with the config it was trained with",
        )
    bad = [
        f"{name}: {got[0]} {got[1]} vs {want[0]} {want[1]}"
        for (name, want), got in zip(expected.items(), _align(stored, expected), strict=True)
        if got != want
    ]
    if bad:
        raise CheckpointError.describe(
            f"checkpoint {where}",
            "; ".join(bad[:4]) + (f" (+{len(bad) - 4} more)" if len(bad) > 4 else ""),
            "arrays of the shapes and dtypes this config makes",
            "restore it with the config it was trained with",
        )


def _align(stored: dict, expected: dict) -> list:
    if set(stored) == set(expected):
        return [stored[name] for name in expected]
    return list(stored.values())


def _unreadable(where: Path, err) -> CheckpointError:
    text = " ".join(str(err).split())[:200]
    return CheckpointError.describe(
        f"checkpoint {where}",
        f"unreadable ({type(err).__name__}: {text})",
        "a complete orbax checkpoint written by lmjax",
        "restore an earlier step, or delete this step directory",
    )


def check_same_model(meta: dict, model, where) -> None:
    """A checkpoint's model config must equal the run's: name every field that differs."""
    saved = meta.get("model")
    if not isinstance(saved, dict):
        raise CheckpointError.describe(
            f"checkpoint {where} meta.model", saved, "the model config",
            "use a checkpoint written by lmjax train",
        )  # fmt: skip
    expected = model.to_dict()
    differs = [
        f"{k}={saved.get(k)!r} (expected {v!r})" for k, v in expected.items() if saved.get(k) != v
    ]
    if differs:
        raise CheckpointError.describe(
            f"checkpoint {where}", "a different architecture: " + ", ".join(differs),
            "a checkpoint of this model config", "restore it with the config it was trained with",
        )  # fmt: skip
