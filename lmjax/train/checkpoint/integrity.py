"""What a checkpoint step must be: this model's arrays, the bytes that were saved, finite.

`digest` is the checksum of every array recorded in a step's meta at save time; `verify`
recomputes it on restore, so a flipped byte that the storage format would decode without
complaint is a `DamagedCheckpointError`, never a silently different model. `check_structure`
compares the stored shapes and dtypes with the expected state's, `check_same_model` the saved
model config with the run's (both plain `CheckpointError`s: the file is whole but not this
run's).
"""

from __future__ import annotations

import dataclasses
import os
import re
from pathlib import Path

import jax
import jax.numpy as jnp
import tensorstore as ts  # orbax's storage layer (loaded with it in any case)

from lmjax.errors import CheckpointError

DAMAGED_FIX = (
    "load an earlier step (--step), or continue training with lmjax train --resume, which "
    "sets a damaged newest step aside"
)


class DamagedCheckpointError(CheckpointError):
    """A checkpoint step that is incomplete or inconsistent with itself (see the package doc)."""


def path_name(path) -> str:
    parts = []
    for entry in path:
        for attr in ("key", "idx", "name"):
            if hasattr(entry, attr):
                parts.append(str(getattr(entry, attr)))
                break
    return ".".join(parts)


def check_structure(where: Path, stored: dict[str, tuple], abstract_state) -> None:
    """The stored `{leaf name: (shape, dtype)}` against the expected state's: as many, alike."""
    expected = {
        path_name(path): (tuple(leaf.shape), str(leaf.dtype))
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


def error_text(err) -> str:
    """One line, at most ~200 characters, about `err`; tensorstore's long messages end in the
    OS error that caused them, which goes first."""
    if isinstance(err, str):
        return err
    text = " ".join(str(err).split())
    code = re.search(r"os_error_code='?(\d+)", text)
    if code is not None:
        text = f"{os.strerror(int(code.group(1)))}: {text}"
    return f"{type(err).__name__}: {text[:200]}"


def unreadable(where: Path, err) -> DamagedCheckpointError:
    return DamagedCheckpointError.describe(
        f"checkpoint {where}",
        f"unreadable ({error_text(err)})",
        "a complete orbax checkpoint written by lmjax",
        DAMAGED_FIX,
    )


def check_index(where: Path, state_dir: Path) -> None:
    """The step's OCDBT index (its manifest and b-tree: a few kB whatever the model's size) read
    whole, synchronously, before orbax reads the step: unreadable is a `DamagedCheckpointError`.

    Why first: orbax opens every array of the state at once, and each open reads the index they
    share. When it is damaged, orbax raises at the first failed open and closes its event loop
    while the other opens are still running in tensorstore's threads; they finish afterwards
    and call back into the closed loop ("Event loop is closed": 10 for one damaged manifest of
    a 61-array state, measured), while the process goes on with its next command. A whole-suite
    process on Python 3.12.1 and jax 0.12.0.1 crashed in a background thread doing that (issue
    43). Read here, the damage is one error with nothing left running. A state that is not an
    OCDBT database (no manifest.ocdbt) is left to orbax.
    """
    if not (state_dir / "manifest.ocdbt").is_file():
        return
    try:
        store = ts.KvStore.open({"driver": "ocdbt", "base": state_dir.as_uri()}).result()
        store.list().result()
    except Exception as err:  # noqa: BLE001 - tensorstore's errors are all "unreadable" here
        raise unreadable(where, err) from None


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
        out.setdefault(path_name(path[:-1]), []).append(value.item())
    return {name: (int(s), bool(f)) for name, (s, f) in out.items()}


def digest(state) -> dict[str, int]:
    """`{leaf name: checksum}` of a state (`_fingerprints`), as saved in a checkpoint's meta."""
    return {name: s for name, (s, _) in _fingerprint_table(state).items()}


def verify(where: Path, step: int, state, meta) -> None:
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


# How the blocks run, not what they compute: a checkpoint restores whatever these say. (The
# meta of a step holds the resolved config: a run saved when `remat` defaulted to "none" reads
# its config.yaml with today's default.)
EXECUTION_FIELDS = ("remat", "scan_layers")


def check_same_model(meta: dict, model, where) -> None:
    """A checkpoint's model config must equal the run's, `EXECUTION_FIELDS` aside: name every
    field that differs. A field the step's meta lacks (added to ModelConfig since) has its
    default there."""
    saved = meta.get("model")
    if not isinstance(saved, dict):
        raise CheckpointError.describe(
            f"checkpoint {where} meta.model",
            saved,
            "the model config",
            "use a checkpoint written by lmjax train",
        )
    expected = {k: v for k, v in model.to_dict().items() if k not in EXECUTION_FIELDS}
    fields = dataclasses.fields(model)
    saved = {f.name: f.default for f in fields if f.default is not dataclasses.MISSING} | saved
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
