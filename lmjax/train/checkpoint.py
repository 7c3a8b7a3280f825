"""Checkpoints of a run with orbax (SPEC section 5).

A checkpoint is `RUN/checkpoints/<step>/` with two items: `state` (the `TrainState`: params,
optimizer state, step and PRNG key) and `meta` (JSON: the resolved run config, the step and the
data position). orbax writes a step into a temporary directory and renames it into place only
when every file is written, so a process killed mid-save leaves the previous checkpoints intact
and the half-written one is never listed. `keep` bounds how many stay on disk.

Restoring checks the checkpoint's model config against the expected one first (a checkpoint from
another architecture is a `CheckpointError` naming the differing fields) and then every array's
shape and dtype against the expected state. Every save records a checksum of each array in
`meta` (`digest`, below); a restore recomputes them, so a flipped byte that the storage format
would decode without complaint is an error, never a silently different model. A restored
`params` leaf that holds NaN or infinity is refused too (training never saves one).

Failures come in two kinds. `DamagedCheckpointError` (a `CheckpointError`): a step that is
missing files, truncated, unreadable, or whose arrays, step or checksums disagree with its own
metadata; `restore_complete` (used by `lmjax train --resume`) moves such a newest step aside
to `<step>.corrupt` and continues from the newest complete one. Anything else (another
architecture, another optimizer, non-finite parameters) is a plain `CheckpointError`: the file
is whole but not this run's, and nothing is moved. `remove_temporary` removes the
`<step>.orbax-checkpoint-tmp*` directories killed saves leave behind (the training loop calls
it once resumed), and a save that fails (a full disk, a read-only directory) removes its own
and raises `CheckpointError`.
"""

from __future__ import annotations

import contextlib
import gc
import logging
import os
import re
import shutil
import sys
import time
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp

from lmjax.errors import CheckpointError

# orbax logs every save and restore at INFO through absl; a progress bar is enough for users.
logging.getLogger("absl").setLevel(logging.WARNING)


# The suffix orbax gives a step directory while it is being written (renamed away when done).
TMP_SUFFIX = ".orbax-checkpoint-tmp"
DAMAGED_FIX = (
    "load an earlier step (--step), or continue training with lmjax train --resume, which "
    "sets a damaged newest step aside"
)


class DamagedCheckpointError(CheckpointError):
    """A checkpoint step that is incomplete or inconsistent with itself (see the module doc)."""


def _ocp():
    import orbax.checkpoint as ocp

    return ocp


@contextlib.contextmanager
def _quiet():
    """Silence what orbax and tensorstore print while reading a damaged step.

    A read that fails midway leaves orbax's other reads pending: their tasks and coroutines are
    reported by the asyncio logger and `sys.unraisablehook` (hundreds of lines, some after the
    error is raised), and absl logs each missing metadata file. The error lmjax raises says
    it all in one line.
    """
    loggers = [logging.getLogger(name) for name in ("asyncio", "absl")]
    disabled, hook = [g.disabled for g in loggers], sys.unraisablehook
    for g in loggers:
        g.disabled = True
    sys.unraisablehook = lambda unraisable: None
    try:
        yield
    except BaseException:
        gc.collect()  # the failed read's leftovers are reported now, while silenced
        # ... or later, when the pending reads end: keep dropping those reports.
        if not any(isinstance(f, _OrbaxLeftovers) for f in loggers[0].filters):
            loggers[0].addFilter(_OrbaxLeftovers())
        if not isinstance(hook, _ClosedLoopHook):
            hook = _ClosedLoopHook(hook)
        raise
    finally:
        sys.unraisablehook = hook
        for g, was in zip(loggers, disabled, strict=True):
            g.disabled = was


class _ClosedLoopHook:
    """`sys.unraisablehook` after a failed orbax call: tensorstore threads finishing the
    abandoned reads call back into orbax's event loop, closed by then, and each report lands
    here as "Event loop is closed" (measured: up to hundreds of tracebacks, printed after the
    one-line error). Those are dropped; every other report goes to the previous hook."""

    def __init__(self, previous):
        self.previous = previous

    def __call__(self, unraisable) -> None:
        err = unraisable.exc_value
        if isinstance(err, RuntimeError) and str(err) == "Event loop is closed":
            return
        self.previous(unraisable)


class _OrbaxLeftovers(logging.Filter):
    """Drops asyncio's "exception was never retrieved" reports of orbax's abandoned reads and
    writes (their error was already raised as a `CheckpointError`); keeps everything else."""

    def filter(self, record: logging.LogRecord) -> bool:
        if "never retrieved" not in str(record.msg):
            return True
        text = record.getMessage() + str(record.exc_info[1] if record.exc_info else "")
        return not any(word in text for word in ("orbax", "OCDBT", "tensorstore"))


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
        with _quiet():  # it reads every step's metadata file: a damaged one is reported later
            self._manager = ocp.CheckpointManager(
                self.directory, options=options, handler_registry=registry
            )

    def remove_temporary(self, step: int | None = None) -> list[str]:
        """Remove the temporary directories of unfinished saves (of `step`, or all); their
        names. A writer calls it before its first save: a killed save leaves one behind."""
        prefix = "" if step is None else str(step)
        removed = []
        for path in sorted(self.directory.glob(f"{prefix}*{TMP_SUFFIX}*")):
            if step is None or path.name.split(".")[0] == str(step):
                shutil.rmtree(path, ignore_errors=True)
                removed.append(path.name)
        return removed

    def _remove_failed_save(self, step: int, settle_s: float = 0.2, limit_s: float = 5.0):
        """Remove a failed save's temporary directory, once its abandoned writes are over.

        When one array's write fails, tensorstore's writes of the others go on in the
        background and recreate their folders (seen once in a few runs): remove until nothing
        reappears for `settle_s`.
        """
        start = quiet_since = time.monotonic()
        while time.monotonic() - start < limit_s:
            if self.remove_temporary(step):
                quiet_since = time.monotonic()
            elif time.monotonic() - quiet_since >= settle_s:
                return
            time.sleep(0.02)

    def steps(self) -> list[int]:
        return list(self._manager.all_steps())

    def latest_step(self) -> int | None:
        return self._manager.latest_step()

    def save(self, state, meta: dict[str, Any]) -> int:
        """Write `state` as step `state.step` (with `meta` and the arrays' checksums).

        A save that fails (no space left, a read-only directory) removes its temporary
        directory and raises `CheckpointError`; the steps saved before are untouched.
        """
        ocp = _ocp()
        step = int(state.step)
        meta = {**meta, "step": step, "digest": digest(state)}
        args = ocp.args.Composite(state=ocp.args.StandardSave(state), meta=ocp.args.JsonSave(meta))
        try:
            with _quiet():
                self._manager.save(step, args=args, force=True)
                self._manager.wait_until_finished()
        except BaseException as err:
            self._remove_failed_save(step)
            if not isinstance(err, Exception):  # Ctrl-C: the caller reports it
                raise
            with _quiet():
                self._manager.reload()
            raise CheckpointError.describe(
                f"saving checkpoint step {step} in {self.directory}",
                f"failed ({_text(err)})",
                "a writable directory with free space",
                "free disk space or fix the directory's permissions, then continue with "
                f"--resume (from step {self.latest_step()}; nothing half-written was left)",
            ) from None
        return step

    def read_meta(self, step: int | None = None) -> dict[str, Any]:
        ocp = _ocp()
        step = self._require_step(step)
        try:
            with _quiet():
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
        args = ocp.args.Composite(
            state=ocp.args.StandardRestore(abstract), meta=ocp.args.JsonRestore()
        )
        try:
            with _quiet():
                restored = self._manager.restore(step, args=args)
        except Exception as err:  # noqa: BLE001
            raise _unreadable(where, err) from None
        leaves = jax.tree.leaves(restored.state)
        state = jax.tree.unflatten(jax.tree.structure(abstract_state), leaves)
        _verify(where, step, state, restored.meta)
        return state

    def restore_complete(self, abstract_state, check_meta=None):
        """`(state, set_aside)`: the newest step that restores completely (for a resume).

        Newer steps that are damaged (`DamagedCheckpointError`) are renamed to
        `<step>.corrupt` (kept for inspection, never listed again) and returned as
        `[(step, error, new name)]`. `check_meta(meta, step_dir)` may refuse a step (the model):
        any error but a damaged step stops the search and is raised, with nothing moved, as is
        the newest step's error when no step is complete.
        """
        damaged = []
        for step in sorted(self.steps(), reverse=True):
            try:
                if check_meta is not None:
                    check_meta(self.read_meta(step), self.directory / str(step))
                state = self.restore(abstract_state, step)
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
        with _quiet():
            self._manager.reload()
        return target.name

    def _stored_leaves(self, step: int) -> dict[str, tuple]:
        try:
            with _quiet():
                meta = self._manager.item_metadata(step)["state"]
            tree = meta.tree if hasattr(meta, "tree") else meta
        except Exception as err:  # noqa: BLE001
            raise _unreadable(self.directory / str(step), err) from None
        out = {}
        for path, leaf in jax.tree_util.tree_flatten_with_path(tree)[0]:
            out[_path_name(path)] = (tuple(leaf.shape), str(leaf.dtype))
        if not out:  # orbax reads a missing state/_METADATA as an empty tree
            raise _unreadable(self.directory / str(step), "no arrays listed in state/_METADATA")
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


class _Raw(str):
    """A value shown as is in an error message (not as a quoted repr)."""

    def __repr__(self) -> str:
        return str(self)


def _text(err) -> str:
    """One line, at most ~200 characters, about `err`; tensorstore's long messages end in the
    OS error that caused them, which goes first."""
    if isinstance(err, str):
        return err
    text = " ".join(str(err).split())
    code = re.search(r"os_error_code='?(\d+)", text)
    if code is not None:
        text = f"{os.strerror(int(code.group(1)))}: {text}"
    return f"{type(err).__name__}: {text[:200]}"


def _unreadable(where: Path, err) -> DamagedCheckpointError:
    return DamagedCheckpointError.describe(
        f"checkpoint {where}",
        f"unreadable ({_text(err)})",
        "a complete orbax checkpoint written by lmjax",
        DAMAGED_FIX,
    )


def _words(x) -> jax.Array:
    """A leaf's bits as a flat uint32 vector (one word per element of 4 bytes or fewer)."""
    if jnp.issubdtype(x.dtype, jax.dtypes.prng_key):
        x = jax.random.key_data(x)
    if x.dtype == jnp.bool_:
        x = x.astype(jnp.uint8)
    unsigned = {1: jnp.uint8, 2: jnp.uint16, 4: jnp.uint32, 8: jnp.uint32}[x.dtype.itemsize]
    return jax.lax.bitcast_convert_type(x, unsigned).astype(jnp.uint32).ravel()


@jax.jit
def _fingerprints(tree):
    """Per leaf: `(sum_i w_i * (2 i + 1) mod 2^32, all finite)` over its words `w`.

    Changing any one word changes the sum (its delta times an odd number is non-zero mod
    2^32), and so does swapping two; the integer sum is exact in any order, so it is the same
    on every device and mesh. Not cryptographic: it catches corruption, not tampering.
    """

    def one(x):
        w = _words(x)
        odd = 2 * jnp.arange(w.size, dtype=jnp.uint32) + 1
        finite = jnp.isfinite(x).all() if jnp.issubdtype(x.dtype, jnp.inexact) else True
        return jnp.sum(w * odd, dtype=jnp.uint32), jnp.asarray(finite)

    return jax.tree.map(one, tree)


def _fingerprint_table(state) -> dict[str, tuple[int, bool]]:
    flat = jax.tree_util.tree_flatten_with_path(jax.device_get(_fingerprints(state)))[0]
    out: dict[str, list] = {}
    for path, value in flat:  # each leaf's pair flattens to (..., 0) and (..., 1)
        out.setdefault(_path_name(path[:-1]), []).append(value.item())
    return {name: (int(s), bool(f)) for name, (s, f) in out.items()}


def digest(state) -> dict[str, int]:
    """`{leaf name: checksum}` of a state (`_fingerprints`), as saved in a checkpoint's meta."""
    return {name: s for name, (s, _) in _fingerprint_table(state).items()}


def _verify(where: Path, step: int, state, meta) -> None:
    """The restored state against its own meta: step, checksums, finite parameters."""
    saved_step = getattr(state, "step", step)
    if not isinstance(meta, dict) or meta.get("step") != step or int(saved_step) != step:
        got = meta.get("step") if isinstance(meta, dict) else meta
        raise DamagedCheckpointError.describe(
            f"checkpoint {where}",
            f"a state of step {int(saved_step)} with meta step {got!r}",
            f"step {step}, the directory's name (was it copied or renamed?)",
            DAMAGED_FIX,
        )
    table = _fingerprint_table(state)
    saved = meta.get("digest")
    if isinstance(saved, dict):  # checkpoints written before checksums have none
        bad = [name for name, (s, _) in table.items() if saved.get(name) != s]
        if bad:
            raise DamagedCheckpointError.describe(
                f"checkpoint {where}",
                f"{len(bad)} arrays whose bytes differ from their saved checksums "
                f"({', '.join(bad[:3])}{', ...' if len(bad) > 3 else ''})",
                "the bytes that were saved (the files are corrupt)",
                DAMAGED_FIX,
            )
    nonfinite = [n for n, (_, f) in table.items() if n.startswith("params") and not f]
    if nonfinite:
        raise CheckpointError.describe(
            f"checkpoint {where}",
            f"NaN or infinite values in {', '.join(nonfinite[:3])}",
            "finite parameters (training never saves others)",
            "load an earlier step (--step), or resume from one: delete this step directory",
        )


def check_same_model(meta: dict, model, where) -> None:
    """A checkpoint's model config must equal the run's: name every field that differs."""
    saved = meta.get("model")
    if not isinstance(saved, dict):
        raise CheckpointError.describe(
            f"checkpoint {where} meta.model",
            saved,
            "the model config",
            "use a checkpoint written by lmjax train",
        )
    expected = model.to_dict()
    differs = [
        f"{k}={saved.get(k)!r} (expected {v!r})" for k, v in expected.items() if saved.get(k) != v
    ]
    if differs:
        raise CheckpointError.describe(
            f"checkpoint {where}",
            "a different architecture: " + ", ".join(differs),
            "a checkpoint of this model config",
            "restore it with the config it was trained with",
        )
