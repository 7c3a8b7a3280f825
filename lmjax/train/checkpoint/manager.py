"""`Checkpoints`: the orbax steps under one directory (`lmjax.train.checkpoint`)."""

from __future__ import annotations

import logging
import os
import shutil
from pathlib import Path
from typing import Any

import jax
import orbax.checkpoint as ocp

from lmjax.checks import require
from lmjax.errors import CheckpointError
from lmjax.files import fsync_dir, fsync_tree
from lmjax.parallel import multihost
from lmjax.train.checkpoint import layers
from lmjax.train.checkpoint.integrity import (
    DamagedCheckpointError,
    check_index,
    check_structure,
    digest,
    error_text,
    path_name,
    unreadable,
    verify,
)
from lmjax.train.checkpoint.quiet import quiet, settle

# orbax logs every save and restore at INFO through absl; a progress bar is enough for users.
logging.getLogger("absl").setLevel(logging.WARNING)

# The suffix orbax gives a step directory while it is being written (renamed away when done).
TMP_SUFFIX = ".orbax-checkpoint-tmp"
# The suffix a step beyond `keep` is renamed to before it is removed (never listed again).
DROPPED_SUFFIX = ".dropped"


class Checkpoints:
    """The checkpoints under one directory (usually `RUN/checkpoints`)."""

    def __init__(self, directory: str | os.PathLike, keep: int = 3, create: bool = True):
        self.directory, self.keep = Path(directory).absolute(), keep
        ok, where = create or self.directory.is_dir(), str(self.directory)
        fix = "check the run path"
        require(ok, "checkpoint directory", where, "an existing directory", fix, CheckpointError)
        # lmjax drops the steps beyond `keep` itself, once the new step is on disk (`save`).
        options = ocp.CheckpointManagerOptions(
            max_to_keep=None, enable_async_checkpointing=False, create=create
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
        with quiet():  # it reads every step's metadata file: a damaged one is reported later
            self._manager = ocp.CheckpointManager(
                self.directory, options=options, handler_registry=registry
            )

    def remove_temporary(self, step: int | None = None) -> list[str]:
        """Remove the temporary directories of unfinished saves (of `step`, or all); their
        names. A writer calls it before its first save: a killed save leaves one behind. The
        rest of a dropped step whose removal was killed goes too, unnamed (it was dropped)."""
        prefix = "" if step is None else str(step)
        if step is None:
            for path in self.directory.glob(f"*{DROPPED_SUFFIX}"):
                shutil.rmtree(path, ignore_errors=True)
        removed = []
        for path in sorted(self.directory.glob(f"{prefix}*{TMP_SUFFIX}*")):
            if step is None or path.name.split(".")[0] == str(step):
                shutil.rmtree(path, ignore_errors=True)
                removed.append(path.name)
        return removed

    def _remove_failed_save(self, step: int):
        """Remove a failed save's temporary directory, once its abandoned writes are over.

        When one array's write fails, tensorstore's writes of the others go on in the
        background and recreate their folders (seen once in a few runs): remove until nothing
        reappears for `quiet.SETTLE_S`.
        """
        settle(lambda: bool(self.remove_temporary(step)))

    def steps(self) -> list[int]:
        return list(self._manager.all_steps())

    def latest_step(self) -> int | None:
        return self._manager.latest_step()

    def save(self, state, meta: dict[str, Any]) -> int:
        """Write `state` as step `state.step` (with `meta` and the arrays' checksums).

        A save that fails (no space left, a read-only directory) removes its temporary
        directory and raises `CheckpointError`; the steps saved before are untouched.
        """
        step = int(state.step)
        meta = {**meta, "step": step, "digest": digest(state)}
        args = ocp.args.Composite(state=ocp.args.StandardSave(state), meta=ocp.args.JsonSave(meta))
        try:
            with quiet():
                self._manager.save(step, args=args, force=True)
                self._manager.wait_until_finished()
            if jax.process_index() == 0:
                fsync_tree(self.directory / str(step))  # on disk before an older step goes
        except BaseException as err:
            self._remove_failed_save(step)
            if not isinstance(err, Exception):  # Ctrl-C: the caller reports it
                raise
            with quiet():
                self._manager.reload()
            raise CheckpointError.describe(
                f"saving checkpoint step {step} in {self.directory}",
                f"failed ({error_text(err)})",
                "a writable directory with free space",
                "free disk space or fix the directory's permissions, then continue with "
                f"--resume (from step {self.latest_step()}; nothing half-written was left)",
            ) from None
        self._drop_beyond_keep()
        return step

    def _drop_beyond_keep(self) -> None:
        """Remove the oldest steps beyond `keep`: process 0 renames each `<step>.dropped` first
        (one atomic step off the list; a kill during the removal leaves only that name, which
        `remove_temporary` removes), makes the renames durable, and removes them once every
        process has listed the steps again (none reads a directory while it is renamed)."""
        old = sorted(self.steps())[: -self.keep]
        if not old:
            return
        dropped = [self.directory / f"{step}{DROPPED_SUFFIX}" for step in old]
        if jax.process_index() == 0:
            for step, path in zip(old, dropped, strict=True):
                shutil.rmtree(path, ignore_errors=True)  # one a kill left (rare)
                os.rename(self.directory / str(step), path)
            fsync_dir(self.directory)
        self._reload_after("lmjax_checkpoint_drop")
        if jax.process_index() == 0:
            for path in dropped:
                shutil.rmtree(path, ignore_errors=True)

    def _reload_after(self, name: str) -> None:
        """List the steps again once every process is here (after process 0 renamed some)."""
        multihost.barrier(name)
        with quiet():
            self._manager.reload()

    def read_meta(self, step: int | None = None) -> dict[str, Any]:
        step = self._require_step(step)
        try:
            with quiet():
                restored = self._manager.restore(
                    step, args=ocp.args.Composite(meta=ocp.args.JsonRestore())
                )
        except Exception as err:  # noqa: BLE001 - orbax raises many kinds; all mean "unreadable"
            raise unreadable(self.directory / str(step), err) from None
        if not isinstance(restored.meta, dict):
            raise unreadable(self.directory / str(step), "meta is not a JSON object")
        return restored.meta

    def restore(self, abstract_state, step: int | None = None, absent=None):
        """The state saved at `step` (default: the latest), in the structure of `abstract_state`.

        `abstract_state` is the expected state (arrays or `jax.ShapeDtypeStruct`s); any
        difference in a leaf's shape or dtype is a `CheckpointError` naming the leaf. Each leaf
        is restored with the leaf's `sharding` (default: the first local device), so a state
        saved on one mesh restores onto another (`lmjax.parallel`). A step saved before the
        blocks were stacked is restored per layer and stacked, with one line on stderr
        (`layers`); `absent(per-layer name)` says which layers such a step may lack whole (a
        full fine-tune's frozen ones: restored as the zeros they are stacked), none by default.
        """
        step = self._require_step(step)
        where = self.directory / str(step)
        stored = self._stored_leaves(step)
        if not (layers.saved_per_layer(stored) and layers.converts(abstract_state)):
            return self._read(step, stored, abstract_state)
        target = layers.per_layer_target(abstract_state)
        lacking = set() if absent is None else layers.absent_layers(target, stored, absent)
        state = self._read(step, stored, layers.without_layers(target, lacking))
        state = layers.with_zero_layers(state, target, lacking)
        state = layers.stacked_like(state, abstract_state, _target_sharding)
        layers.note_converted(where)
        return state

    def _read(self, step: int, stored: dict[str, tuple], abstract_state):
        """Step `step` (its `_stored_leaves`) restored into `abstract_state`'s structure and
        checked against its own meta (`restore`)."""
        where = self.directory / str(step)
        check_structure(where, stored, abstract_state)
        abstract = jax.tree.map(
            lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=_target_sharding(a)),
            abstract_state,
        )
        args = ocp.args.Composite(
            state=ocp.args.StandardRestore(abstract), meta=ocp.args.JsonRestore()
        )
        try:
            with quiet():
                restored = self._manager.restore(step, args=args)
        except Exception as err:  # noqa: BLE001
            raise unreadable(where, err) from None
        leaves = jax.tree.leaves(restored.state)
        state = jax.tree.unflatten(jax.tree.structure(abstract_state), leaves)
        verify(where, step, state, restored.meta)
        return state

    def restore_complete(self, abstract_state, check_meta=None, absent=None):
        """`(state, set_aside)`: the newest step that restores completely (for a resume).

        Newer steps that are damaged (`DamagedCheckpointError`) are renamed to
        `<step>.corrupt` (kept for inspection, never listed again) and returned as
        `[(step, error, new name)]`. `check_meta(meta, step_dir)` may refuse a step (the model):
        any error but a damaged step stops the search and is raised, with nothing moved, as is
        the newest step's error when no step is complete. `absent`: as `restore`'s.
        """
        damaged = []
        for step in sorted(self.steps(), reverse=True):
            try:
                if check_meta is not None:
                    check_meta(self.read_meta(step), self.directory / str(step))
                state = self.restore(abstract_state, step, absent)
            except DamagedCheckpointError as err:
                damaged.append((step, err))
                continue
            moved = [(s, err, self._set_aside(s)) for s, err in damaged]
            return state, moved
        if damaged:  # nothing to fall back on: say so, with the newest step's problem
            newest = str(damaged[0][1]).split("; expected")[0]
            raise DamagedCheckpointError.describe(
                f"checkpoints in {self.directory}",
                _Raw(f"no complete step to resume from (damaged: {sorted(s for s, _ in damaged)})"),
                f"a complete step (the newest: {newest})",
                "restore the checkpoints from a copy, or start a new run (run.dir=OTHER); "
                "nothing was changed",
            )
        self._require_step(None)  # no steps at all: its error
        raise AssertionError("unreachable")

    def _set_aside(self, step: int) -> str:
        source = self.directory / str(step)
        target, n = self.directory / f"{step}.corrupt", 1
        while target.exists():
            n += 1
            target = self.directory / f"{step}.corrupt{n}"
        if jax.process_index() == 0:
            os.rename(source, target)
        self._reload_after("lmjax_checkpoint_set_aside")
        return target.name

    def _stored_leaves(self, step: int) -> dict[str, tuple]:
        check_index(self.directory / str(step), self.directory / str(step) / "state")
        try:
            with quiet():
                meta = self._manager.item_metadata(step)["state"]
            tree = meta.tree if hasattr(meta, "tree") else meta
        except Exception as err:  # noqa: BLE001
            raise unreadable(self.directory / str(step), err) from None
        out = {}
        for path, leaf in jax.tree_util.tree_flatten_with_path(tree)[0]:
            out[path_name(path)] = (tuple(leaf.shape), str(leaf.dtype))
        if not out:  # orbax reads a missing state/_METADATA as an empty tree
            raise unreadable(self.directory / str(step), "no arrays listed in state/_METADATA")
        return out

    def _require_step(self, step: int | None) -> int:
        steps, where = self.steps(), str(self.directory)
        fix = "train first, or pass the run directory of a run that saved one"
        require(
            bool(steps), "checkpoints in", where, "at least one saved step", fix, CheckpointError
        )
        if step is None:
            return max(steps)
        ok, expected = step in steps, f"one of {steps}"
        require(ok, "checkpoint step", step, expected, "pick a saved step", CheckpointError)
        return step


def _target_sharding(leaf):
    # Never the saved sharding: it names the devices of the mesh that wrote the checkpoint.
    sharding = getattr(leaf, "sharding", None)
    return sharding or jax.sharding.SingleDeviceSharding(jax.local_devices()[0])


class _Raw(str):
    """A value shown as is in an error message (not as a quoted repr)."""

    def __repr__(self) -> str:
        return str(self)
