"""Parameter pytrees as safetensors files, under the `.`-joined names docs/models.md lists.

    save(params, path, metadata=None)      nested dict -> one tensor per leaf, atomically
    load(path, expected=None) -> params    nested dict of jax arrays; `expected` (a ModelConfig
                                           or a tree of arrays / ShapeDtypeStructs, e.g. a LoRA
                                           adapter tree) is checked name by name
    is_per_layer(path, expected) -> bool   whether `load` will stack the file's per-layer blocks

A model's blocks are stored stacked (`lmjax.params`: `blocks.attention.query.weight [N, ...]`),
and `save` writes whatever tree it is given, so a model file holds the stacked names. A file
written before the blocks were stacked holds per-layer names (`blocks.0.attention.query.weight`):
loaded against a stacked `expected`, it is checked against the per-layer names and shapes and
its layers are stacked (`lmjax.params.stack`), so both kinds of file load into the same tree.
    read_header(path) -> (entries, metadata)   the validated header alone

64-bit tensors (F64, I64, U64) load as numpy arrays while jax runs without x64
(`jax_enable_x64` off): jax would silently narrow them to 32 bits (an int64 2**40 becomes 0), and
a loader must return what the file holds. With x64 on they are jax arrays like the rest.

File layout (https://github.com/huggingface/safetensors): 8 bytes little-endian header length
N, N bytes of JSON `{name: {"dtype", "shape", "data_offsets": [begin, end]}, "__metadata__":
{str: str}}`, then the data; offsets are relative to the end of the header. Before anything is
allocated from a file, the header is validated here: N against the file size (so a huge claimed
header is never read), JSON with duplicate keys rejected, known dtypes, shapes whose byte size
equals their offsets, and offsets that tile the data exactly (no overlap, no gap, none past the
end). `load` also needs names that form a tree (no `a` beside `a.b`, no empty part), which the
format itself allows. Every failure is a `FileFormatError` naming the file; the `safetensors`
package then reads the tensors. Writes go through `lmjax.files.atomic_open`: a crash leaves the
old file or none.
"""

from __future__ import annotations

import json
import math
import os
import re
import stat
import struct
from collections import Counter
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import safetensors
import safetensors.numpy

from lmjax import params as ptree
from lmjax.checks import is_nonnegative_int
from lmjax.errors import CheckpointError, ConfigError, FileFormatError, ShapeError
from lmjax.files import atomic_write_bytes
from lmjax.models import ModelConfig, declare

DTYPES: dict[str, np.dtype] = {
    "F64": np.dtype(np.float64),
    "F32": np.dtype(np.float32),
    "F16": np.dtype(np.float16),
    "BF16": np.dtype(ml_dtypes.bfloat16),
    "I64": np.dtype(np.int64),
    "I32": np.dtype(np.int32),
    "I16": np.dtype(np.int16),
    "I8": np.dtype(np.int8),
    "U64": np.dtype(np.uint64),
    "U32": np.dtype(np.uint32),
    "U16": np.dtype(np.uint16),
    "U8": np.dtype(np.uint8),
    "BOOL": np.dtype(np.bool_),
}
MAX_HEADER_BYTES = 100_000_000  # the safetensors package's own limit
_FIX = "re-save the parameters with lmjax.io.safetensors.save (the file is damaged or not one)"


def _bad(path: Path, what: str, value: Any, expected: str) -> FileFormatError:
    return FileFormatError.describe(f"{path}: {what}", value, expected, _FIX)


def _unreadable(path: Path, err: OSError) -> FileFormatError:
    """The one-line error for a file that could not be opened or read: missing, a directory,
    or anything else the OS refused (no permission, a parent that is a file, an I/O error)."""
    if isinstance(err, FileNotFoundError):
        expected, fix = "an existing file", "check the path"
    elif isinstance(err, IsADirectoryError):
        expected, fix = "a file, not a directory", "check the path"
    else:
        expected = f"a readable file ({err.strerror or err})"
        fix = "check the path and its permissions"
    return FileFormatError.describe("safetensors file", str(path), expected, fix)


def _no_duplicates(pairs: list[tuple[str, Any]]) -> dict:
    counts = Counter(k for k, _ in pairs)
    if len(counts) != len(pairs):
        raise ValueError(f"duplicate names {sorted(k for k, n in counts.items() if n > 1)}")
    return dict(pairs)


def _read_raw_header(path: Path) -> tuple[dict, int]:
    """The header JSON and the data size, read without trusting any length in the file."""
    try:
        info = path.stat()
        if not (stat.S_ISREG(info.st_mode) or stat.S_ISDIR(info.st_mode)):
            raise _bad(
                path,
                "kind",
                "a pipe, socket or device",
                "a regular file (reading a pipe could block forever)",
            )
        size = info.st_size
        with open(path, "rb") as handle:
            prefix = handle.read(8)
            if size < 8:
                raise _bad(path, "size", f"{size} bytes", "at least 8 (the header length)")
            (n,) = struct.unpack("<Q", prefix)
            if n > size - 8:
                raise _bad(
                    path, "header length", n, f"<= {size - 8} (file size {size} minus 8 bytes)"
                )
            if n > MAX_HEADER_BYTES:
                raise _bad(path, "header length", n, f"<= {MAX_HEADER_BYTES} bytes")
            raw = handle.read(n)
    except OSError as err:
        raise _unreadable(path, err) from None
    try:
        header = json.loads(raw.decode("utf-8"), object_pairs_hook=_no_duplicates)
    except (UnicodeDecodeError, ValueError) as err:
        raise _bad(
            path, "header", str(err), "a UTF-8 JSON object without duplicate names"
        ) from None
    except RecursionError:  # `[[[[...` nested deeper than the JSON parser's recursion limit
        raise _bad(path, "header", "nested too deeply to parse", "a flat JSON object") from None
    if not isinstance(header, dict):
        raise _bad(path, "header", type(header).__name__, "a JSON object")
    return header, size - 8 - n


def _check_entry(path: Path, name: str, entry: Any) -> tuple[np.dtype, tuple, int, int]:
    if not isinstance(entry, dict) or set(entry) != {"dtype", "shape", "data_offsets"}:
        raise _bad(path, f"entry {name!r}", entry, "{dtype, shape, data_offsets}")
    dtype, shape, offsets = entry["dtype"], entry["shape"], entry["data_offsets"]
    if dtype not in DTYPES:
        raise _bad(path, f"{name!r} dtype", dtype, f"one of {sorted(DTYPES)}")
    ints = lambda xs, k: (  # noqa: E731
        isinstance(xs, list)
        and (k is None or len(xs) == k)
        and all(is_nonnegative_int(x) for x in xs)
    )
    if not ints(shape, None):
        raise _bad(path, f"{name!r} shape", shape, "a list of non-negative ints")
    if not ints(offsets, 2) or offsets[0] > offsets[1]:
        raise _bad(path, f"{name!r} data_offsets", offsets, "[begin, end] with 0 <= begin <= end")
    nbytes = math.prod(shape) * DTYPES[dtype].itemsize
    if offsets[1] - offsets[0] != nbytes:
        raise _bad(
            path, f"{name!r} data_offsets", offsets, f"{nbytes} bytes for {dtype} {tuple(shape)}"
        )
    return DTYPES[dtype], tuple(shape), offsets[0], offsets[1]


def read_header(path: str | os.PathLike) -> tuple[dict[str, tuple[np.dtype, tuple]], dict]:
    """`({name: (dtype, shape)}, metadata)` of a validated file (see the module docstring)."""
    path = Path(path)
    header, data_size = _read_raw_header(path)
    metadata = header.pop("__metadata__", None)
    metadata = {} if metadata is None else metadata  # null is valid: the format's Option<...>
    if not isinstance(metadata, dict) or not all(
        isinstance(k, str) and isinstance(v, str) for k, v in metadata.items()
    ):
        raise _bad(path, "__metadata__", metadata, "a JSON object of strings")
    entries = {name: _check_entry(path, name, e) for name, e in header.items()}
    spans = sorted((begin, end, name) for name, (_, _, begin, end) in entries.items())
    at, previous = 0, None
    for begin, end, name in spans:
        if begin < at:
            raise _bad(
                path, f"{name!r} data_offsets", [begin, end], f"no overlap with {previous!r}"
            )
        if begin > at:
            raise _bad(path, f"{name!r} data_offsets", [begin, end], f"to start at byte {at}")
        at, previous = end, name
    if at != data_size:
        raise _bad(
            path,
            "data size",
            f"{data_size} bytes after the header",
            f"{at} bytes (what the header's offsets cover)",
        )
    return {name: (e[0], e[1]) for name, e in entries.items()}, metadata


def _to_numpy(name: str, leaf) -> np.ndarray:
    if not hasattr(leaf, "dtype") or not hasattr(leaf, "shape"):  # list, tuple, int, float...
        raise ShapeError.describe(
            f"parameter {name}",
            leaf,
            "an array (numpy or jax) with a dtype",
            "wrap it with np.asarray(value, dtype) so its dtype is explicit",
        )
    array = np.asarray(leaf, order="C")  # keeps a 0-d scalar's shape () (ascontiguousarray: (1,))
    if array.dtype not in DTYPES.values():
        raise ShapeError.describe(
            f"parameter {name} dtype", array.dtype, f"one of {sorted(DTYPES)}", "cast it first"
        )
    return array


def _check_metadata(metadata) -> dict[str, str] | None:
    if metadata is None:
        return None
    if not isinstance(metadata, Mapping) or not all(
        isinstance(k, str) and isinstance(v, str) for k, v in metadata.items()
    ):
        raise ConfigError.describe(
            "safetensors metadata",
            metadata,
            "a mapping {str: str}",
            "pass e.g. {'step': str(step)}",
        )
    return dict(metadata)


def save(params: Mapping, path: str | os.PathLike, metadata: Mapping[str, str] | None = None):
    """Write every leaf of `params` under its `.`-joined name; `metadata` is `{str: str}`."""
    path = Path(path)
    metadata = _check_metadata(metadata)
    tensors = {name: _to_numpy(name, leaf) for name, leaf in ptree.flatten(params).items()}
    data = safetensors.numpy.save(tensors, metadata=metadata or None)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        atomic_write_bytes(path, data)  # on failure: the old file (or none), no temporary left
    except OSError as err:  # CheckpointError is an OSError too: `except OSError` still works
        raise CheckpointError.describe(
            f"writing {path}",
            err.strerror or str(err),
            "a writable directory with free space",
            "check the path, its permissions and the free disk space (nothing was replaced)",
        ) from err


def _expected_specs(expected) -> dict[str, tuple[np.dtype, tuple]]:
    """`{name: (dtype, shape)}` of a ModelConfig's declared parameters or of a tree's leaves."""
    if isinstance(expected, ModelConfig):
        dtype = np.dtype(expected.params_dtype)
        return {name: (dtype, spec.shape) for name, spec in declare(expected).items()}
    return {
        name: (np.dtype(leaf.dtype), tuple(leaf.shape))
        for name, leaf in ptree.flatten(expected).items()
    }


def report_mismatches(
    where: str | os.PathLike,
    found: Mapping[str, tuple[Any, tuple]],
    want: Mapping[str, tuple[Any, tuple]],
    expected: str,
    fix: str,
    unexpected: str = "unexpected",
) -> None:
    """Raise `CheckpointError` naming every missing, unexpected, mis-shaped or mis-typed name.

    `found` and `want` map names to `(dtype, shape)`; a wanted dtype of None is not checked.
    `unexpected` is the label of a name in `found` that `want` lacks.
    """
    problems = [(n, f"missing {n} {want[n][1]}") for n in want if n not in found]
    problems += [(n, f"{unexpected} {n}") for n in found if n not in want]
    for n in want.keys() & found.keys():
        (wd, ws), (fd, fs) = want[n], found[n]
        if tuple(ws) != tuple(fs):
            problems.append((n, f"{n} shape {tuple(fs)} (expected {tuple(ws)})"))
        if wd is not None and np.dtype(wd) != np.dtype(fd):
            problems.append((n, f"{n} dtype {np.dtype(fd)} (expected {np.dtype(wd)})"))
    if problems:
        problems.sort(key=lambda p: ptree.natural_key(p[0]))
        count = f"{len(problems)} parameter mismatch" + ("es" if len(problems) != 1 else "")
        # Not `describe`: it shortens the value to one screen line, and every name matters here.
        raise CheckpointError(
            f"{where}: {count} = "
            + "; ".join(text for _, text in problems)
            + f"; expected {expected}. Fix: {fix}."
        )


_LAYER_NAME = re.compile(re.escape(ptree.STACKED) + r"\.\d+\.")  # blocks.{i}.…


def _stacks_layers(found: Mapping, want: Mapping) -> bool:
    """Whether a file of names `found` holds per-layer blocks where `want` has stacked ones."""
    stacked = any(ptree.is_stacked(name) for name in want)
    return stacked and any(_LAYER_NAME.match(name) for name in found)


def _per_layer_specs(want: Mapping[str, tuple]) -> dict[str, tuple]:
    """`want` with each stacked `(dtype, [N, *shape])` as N per-layer `(dtype, shape)` entries
    under `blocks.{i}.…` (a `ModelConfig`'s: `declare_layers`)."""
    out = {}
    for name, (dtype, shape) in want.items():
        if ptree.is_stacked(name) and shape:
            out |= {each: (dtype, tuple(shape[1:])) for each in ptree.layer_names(name, shape[0])}
        else:
            out[name] = (dtype, shape)
    return out


def check_against(path: Path, found: dict, expected) -> None:
    """Raise `CheckpointError` listing every missing, unexpected or mis-shaped/typed name.

    A file of per-layer blocks is checked against the per-layer names of a stacked `expected`
    (the module docstring)."""
    want = _expected_specs(expected)
    what = "the names, shapes and dtypes of the model being loaded"
    if _stacks_layers(found, want):
        want = _per_layer_specs(want)
        what += " (per layer: the file holds blocks.{i}.* names, saved before they were stacked)"
    report_mismatches(
        path, found, want, what, "load it with the config it was saved from (or convert it first)"
    )


def is_per_layer(path: str | os.PathLike, expected) -> bool:
    """Whether the file at `path` holds per-layer blocks that `load(path, expected)` stacks
    (a file written before the blocks were stacked; the module docstring)."""
    return _stacks_layers(read_header(path)[0], _expected_specs(expected))


def _as_array(value: np.ndarray):
    # jnp.asarray would narrow a 64-bit dtype to 32 bits with x64 off: keep numpy's exact values.
    if jax.dtypes.canonicalize_dtype(value.dtype) != value.dtype:
        return value
    return jnp.asarray(value)


def load(path: str | os.PathLike, expected=None) -> dict:
    """The nested parameter dict in `path` (jax arrays; see the module docstring for 64-bit
    tensors); checked against `expected` if given.

    `expected` is a `ModelConfig` (names and shapes from `declare`, dtype `param_dtype`) or a
    pytree of arrays / `jax.ShapeDtypeStruct`s. A mismatch raises `CheckpointError` naming every
    offending parameter; a malformed file raises `FileFormatError` naming the file. A file of
    per-layer blocks loads stacked when `expected` is stacked (the module docstring); without
    `expected` the tree is the file's, as named.
    """
    path = Path(path)
    found, _ = read_header(path)
    stack = expected is not None and _stacks_layers(found, _expected_specs(expected))
    if expected is not None:
        check_against(path, found, expected)
    try:  # names that no nested dict can hold ("a" and "a.b", "", "a..b"), before any read
        ptree.unflatten(dict.fromkeys(found))
    except ShapeError as err:
        raise _bad(path, "tensor names", str(err), "names that form a parameter tree") from None
    try:
        with safetensors.safe_open(str(path), framework="numpy") as handle:
            flat = {name: _as_array(handle.get_tensor(name)) for name in handle.keys()}
    except (safetensors.SafetensorError, OSError, ValueError) as err:
        raise _bad(path, "contents", str(err), "a readable safetensors file") from None
    return ptree.stack(ptree.unflatten(flat)) if stack else ptree.unflatten(flat)


def metadata(path: str | os.PathLike) -> dict[str, str]:
    """The `__metadata__` strings of a safetensors file."""
    return read_header(path)[1]


__all__ = [
    "DTYPES",
    "check_against",
    "is_per_layer",
    "load",
    "metadata",
    "read_header",
    "report_mismatches",
    "save",
]
