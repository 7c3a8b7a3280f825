"""Adversarial safetensors files (SPEC section 11): `lmjax.io.safetensors` on bytes it never wrote.

tests/test_safetensors.py holds the hand-built bad files; this module fuzzes. Every outcome of
`load` must be either the tensors or a one-line `FileFormatError` naming the file: any other
exception fails the test, and a crash or a hang would take the test run down with it.

The witness is the `safetensors` package's own parser (Rust, `safetensors.torch.load` on the
raw bytes): whatever it rejects, lmjax must reject; whatever both accept must give equal
tensors. lmjax is stricter only where its module docstring says so (duplicate names, the
dtypes of `DTYPES`, names that form a parameter tree), and each such case is named below.
Memory: a header may claim terabytes; the loader checks sizes against the file before
allocating, which the memory tests measure (tracemalloc sees numpy's allocations; ru_maxrss
sees everything, including the Rust reader's).
"""

from __future__ import annotations

import json
import resource
import struct
import time
import tracemalloc

import ml_dtypes
import numpy as np
import pytest
import safetensors
import safetensors.numpy
import safetensors.torch
import torch
from _fifo import fifo
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as hs

from lmjax.errors import CheckpointError, FileFormatError, ShapeError
from lmjax.io import safetensors as st

FUZZ = settings(
    max_examples=150,
    deadline=None,
    derandomize=True,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)


def _pack(header: dict | bytes, data: bytes = b"", length: int | None = None) -> bytes:
    raw = header if isinstance(header, bytes) else json.dumps(header).encode()
    return struct.pack("<Q", len(raw) if length is None else length) + raw + data


def _ours(path):
    """`(tensors, None)` or `(None, error)`; anything but FileFormatError propagates."""
    try:
        return st.load(path), None
    except FileFormatError as err:
        message = str(err)
        assert str(path) in message and "\n" not in message, message
        assert "expected" in message and "Fix:" in message, message
        return None, err


def _theirs(raw: bytes):
    """The witness' tensors as numpy (bfloat16 widened to float32), or None if it refuses."""
    try:
        tensors = safetensors.torch.load(raw)  # the torch view: numpy has no bfloat16
    except Exception:  # SafetensorError, or the Rust parser's other complaints
        return None
    return {name: _numpy(t) for name, t in tensors.items()}


def _numpy(t: torch.Tensor):
    if t.dtype == torch.bfloat16:
        return t.float().numpy()
    try:
        return t.numpy()
    except TypeError:  # float8 and other dtypes outside lmjax's DTYPES: lmjax refuses them
        return None


def _flat(tree, prefix=""):
    out = {}
    for key, value in tree.items():
        if isinstance(value, dict):
            out |= _flat(value, f"{prefix}{key}.")
        else:
            out[prefix + key] = np.asarray(value)
    return out


def _lmjax_is_stricter(raw: bytes) -> bool:
    """The documented cases where lmjax refuses what the Rust parser accepts."""
    n = struct.unpack("<Q", raw[:8])[0]
    pairs = json.loads(raw[8 : 8 + n], object_pairs_hook=lambda p: p)
    names = [k for k, _ in pairs if k != "__metadata__"]
    entries = [v for k, v in pairs if k != "__metadata__"]
    dtypes = [dict(v).get("dtype") for v in entries]
    names_ok = all(name and all(name.split(".")) for name in names) and not any(
        a.startswith(b + ".") for a in names for b in names
    )
    return len(set(names)) != len(names) or not names_ok or any(d not in st.DTYPES for d in dtypes)


def _agree_with_the_witness(path, raw: bytes):
    path.write_bytes(raw)
    ours, err = _ours(path)
    theirs = _theirs(raw)
    if theirs is None:
        assert err is not None, "lmjax loaded a file the safetensors package rejects"
        return err
    if ours is None:
        assert _lmjax_is_stricter(raw), f"lmjax refused a valid file: {err}"
        return err
    flat = _flat(ours)
    assert flat.keys() == theirs.keys()
    for name, value in theirs.items():
        ours_value = flat[name]
        if ours_value.dtype == ml_dtypes.bfloat16:
            ours_value = ours_value.astype(np.float32)  # exact: bfloat16 is a float32 prefix
        assert ours_value.dtype == value.dtype and ours_value.shape == value.shape
        np.testing.assert_array_equal(ours_value, value)
    return None


# ---- fuzzing -----------------------------------------------------------------------------------


@FUZZ
@given(raw=hs.binary(max_size=300))
def test_random_bytes_raise_file_format_errors(tmp_path, raw):
    # Arbitrary bytes, and the same bytes behind a header length that fits the file (so the
    # JSON parser and the validator see them, not only the length check).
    for content in (raw, _pack(raw[: len(raw) // 2], raw[len(raw) // 2 :])):
        path = tmp_path / "random.safetensors"
        path.write_bytes(content)
        ours, err = _ours(path)
        assert err is not None or _theirs(content) is not None


_NAMES = hs.sampled_from(["a", "b", "a.b", "a.b.c", "", ".a", "a..b", "blocks.0.w", "é", "__x"])
# Each strategy is mostly valid (a branch repeated is drawn more often), so the fuzz reaches
# the checks after the first one as well as the first.
_GOOD_DTYPE = hs.sampled_from(list(st.DTYPES))
_DTYPES = hs.one_of(
    _GOOD_DTYPE, _GOOD_DTYPE, _GOOD_DTYPE,
    hs.sampled_from(["F8_E4M3", "float32", "f32", "", None, 0, -1]),
)  # fmt: skip
_GOOD_DIM = hs.integers(0, 4)
_DIM = hs.one_of(
    _GOOD_DIM, _GOOD_DIM, _GOOD_DIM,
    hs.sampled_from([-1, 2**31, 2**40, 2**64, 10**30, 1.0, True, None, "2", [2]]),
)  # fmt: skip


@hs.composite
def _headers(draw):
    """A header that is mostly well-formed: consistent offsets and data, then some lies."""
    header, data, at = {}, b"", 0
    for name in draw(hs.lists(_NAMES, max_size=4)):
        dtype = draw(_DTYPES)
        shape = draw(hs.lists(_DIM, max_size=3))
        try:
            count = int(np.prod([int(d) for d in shape], dtype=object))
            nbytes = count * st.DTYPES[dtype].itemsize
        except (KeyError, TypeError, ValueError):
            nbytes = draw(hs.integers(0, 16))
        if not 0 <= nbytes <= 1024:
            nbytes = draw(hs.integers(0, 64))  # a lying shape: the data can't be that big
        offsets = draw(
            hs.one_of(
                hs.just([at, at + nbytes]),  # consistent
                hs.just([at, at + nbytes]),
                hs.just([at, at + nbytes]),
                hs.lists(hs.integers(-2, at + nbytes + 2), min_size=0, max_size=3),
                hs.just([at + nbytes, at]),  # reversed
                hs.just([at, 2**64]),
            )
        )
        header[name] = {"dtype": dtype, "shape": shape, "data_offsets": offsets}
        at += nbytes
        data += bytes(draw(hs.binary(min_size=nbytes, max_size=nbytes)))
    if draw(hs.booleans()):
        header["__metadata__"] = draw(
            hs.one_of(
                hs.dictionaries(hs.text(max_size=3), hs.text(max_size=3), max_size=2),
                hs.dictionaries(hs.text(max_size=3), hs.integers(), min_size=1, max_size=2),
                hs.lists(hs.text(max_size=2), max_size=2),
                hs.none(),
            )
        )
    slack = draw(hs.sampled_from([0, 0, 0, 0, 0, -1, 1, 7]))
    data = data[: max(0, len(data) + slack)] if slack < 0 else data + b"\0" * slack
    return header, data


# A header length one past the JSON takes the data's first byte into the header: a space there
# is JSON whitespace (the writer pads headers with spaces), so with one spare byte at the end the
# file is valid and both parsers read it.
_SWALLOWED_SPACE = ({"a": {"dtype": "U8", "shape": [4], "data_offsets": [0, 4]}}, b" abc\0")


@FUZZ
@given(case=_headers(), length_lie=hs.sampled_from([None, None, None, 0, 1, -1, 2**63]))
@example(case=_SWALLOWED_SPACE, length_lie=1)
def test_generated_headers_agree_with_the_safetensors_parser(tmp_path, case, length_lie):
    header, data = case
    raw = json.dumps(header).encode()
    length = None
    if length_lie is not None:
        length = length_lie if length_lie in (0, 2**63) else len(raw) + length_lie
    content = _pack(raw, data, length)
    # A lying header length is mostly refused by both; where the bytes it covers still parse,
    # both read the same tensors.
    _agree_with_the_witness(tmp_path / "generated.safetensors", content)


def _valid_file() -> bytes:
    tensors = {
        "blocks.0.w": np.arange(6, dtype=np.float32).reshape(2, 3),
        "blocks.0.b": np.array([1, -2, 3, -4], np.int8),
        "norm.scale": np.array([1.5], ml_dtypes.bfloat16),
        "step": np.array(7, np.int64),
    }
    return safetensors.numpy.save(tensors, metadata={"format": "lmjax"})


VALID = _valid_file()
HEADER_END = 8 + struct.unpack("<Q", VALID[:8])[0]


@FUZZ
@given(
    edits=hs.lists(
        hs.tuples(
            hs.sampled_from(["set", "insert", "delete"]),
            hs.integers(0, len(VALID) - 1),
            hs.integers(0, 255),
        ),
        min_size=1,
        max_size=4,
    )
)
def test_mutated_valid_files_agree_with_the_safetensors_parser(tmp_path, edits):
    raw = bytearray(VALID)
    for op, at, value in edits:
        at = min(at, len(raw) - 1)
        if op == "set":
            raw[at] = value
        elif op == "insert":
            raw.insert(at, value)
        elif len(raw) > 1:
            del raw[at]
    _agree_with_the_witness(tmp_path / "mutated.safetensors", bytes(raw))


def test_every_truncation_and_extension_of_a_valid_file_is_refused(tmp_path):
    path = tmp_path / "cut.safetensors"
    assert _ours_ok(path, VALID)
    for cut in range(len(VALID)):  # every prefix: length field, header, each tensor's bytes
        path.write_bytes(VALID[:cut])
        assert _ours(path)[1] is not None, cut
    for extra in (b"\0", b"junk", b"\0" * 4096):  # trailing bytes no offset covers
        path.write_bytes(VALID + extra)
        assert "data size" in str(_ours(path)[1])


def _ours_ok(path, raw) -> bool:
    path.write_bytes(raw)
    return _ours(path)[1] is None


# ---- named lies ----------------------------------------------------------------------------------

_A = {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]}
_B = {"dtype": "F32", "shape": [2], "data_offsets": [8, 16]}
NAMED = {
    "reversed offsets": ({"a": {**_A, "data_offsets": [8, 0]}}, 8, "0 <= begin <= end"),
    "gap between tensors": ({"a": _A, "b": {**_B, "data_offsets": [12, 20]}}, 20, "at byte 8"),
    "three offsets": ({"a": {**_A, "data_offsets": [0, 8, 8]}}, 8, "data_offsets"),
    "negative offset": ({"a": {**_A, "data_offsets": [-8, 0]}}, 8, "data_offsets"),
    "string offsets": ({"a": {**_A, "data_offsets": ["0", "8"]}}, 8, "data_offsets"),
    "offsets past 2**64": ({"a": {**_A, "data_offsets": [0, 2**64 + 8]}}, 8, "bytes for F32"),
    "float shape": ({"a": {**_A, "shape": [2.0]}}, 8, "list of non-negative ints"),
    "bool shape": ({"a": {**_A, "shape": [True, True]}}, 8, "list of non-negative ints"),
    "nested shape": ({"a": {**_A, "shape": [[2]]}}, 8, "list of non-negative ints"),
    "null shape": ({"a": {**_A, "shape": None}}, 8, "list of non-negative ints"),
    "dtype F8 (not in DTYPES)": ({"a": {**_A, "dtype": "F8_E4M3"}}, 8, "dtype"),
    "dtype null": ({"a": {**_A, "dtype": None}}, 8, "dtype"),
    "entry is a list": ({"a": [1, 2]}, 8, "entry 'a'"),
    "entry with an extra key": ({"a": {**_A, "x": 1}}, 8, "entry 'a'"),
    "entry without offsets": ({"a": {"dtype": "F32", "shape": [2]}}, 8, "entry 'a'"),
    "metadata a list": ({"__metadata__": ["a"], "a": _A}, 8, "__metadata__"),
    "metadata a string": ({"__metadata__": "format=pt", "a": _A}, 8, "__metadata__"),
    "metadata nested": ({"__metadata__": {"a": {"b": "c"}}, "a": _A}, 8, "__metadata__"),
    "leaf and prefix names": ({"a": _A, "a.b": _B}, 16, "tensor names"),
    "empty name": ({"": _A}, 8, "tensor names"),
    "empty name part": ({"a..b": _A}, 8, "tensor names"),
    "shape product of 2**96 elements": (
        {"a": {"dtype": "F64", "shape": [2**32, 2**32, 2**32], "data_offsets": [0, 8]}},
        8,
        "bytes for F64",
    ),
    "shape claiming 8 TiB, offsets agreeing": (
        {"a": {"dtype": "F64", "shape": [2**40], "data_offsets": [0, 2**43]}},
        8,
        "data size",
    ),
}
RAW_NAMED = {
    "header is null": (b"null", "JSON object"),
    "header is a string": (b'"abc"', "JSON object"),
    "header length 0": (b"", "header"),
    "header in UTF-16": ('{"a": 1}'.encode("utf-16"), "header"),
    "int of 5,000 digits": (b'{"a": {"dtype": "F32", "shape": [1' + b"0" * 5000 + b"]}}", "header"),
    "Infinity in a shape": (
        b'{"a": {"dtype": "F32", "shape": [Infinity], "data_offsets": [0, 8]}}',
        "shape",
    ),
    "NaN offsets": (b'{"a": {"dtype": "F32", "shape": [2], "data_offsets": [NaN, 8]}}', "offsets"),
}


@pytest.mark.parametrize("case", sorted(NAMED))
def test_named_lies_raise_file_format_errors(case, tmp_path):
    header, data_size, message = NAMED[case]
    path = tmp_path / "lie.safetensors"
    path.write_bytes(_pack(header, b"\0" * data_size))
    ours, err = _ours(path)
    assert err is not None and message in str(err), err


@pytest.mark.parametrize("case", sorted(RAW_NAMED))
def test_named_malformed_headers_raise_file_format_errors(case, tmp_path):
    raw, message = RAW_NAMED[case]
    path = tmp_path / "raw.safetensors"
    path.write_bytes(_pack(raw, b"\0" * 8))
    ours, err = _ours(path)
    assert err is not None and message in str(err), err


def test_a_path_under_a_file_is_a_file_format_error(tmp_path):
    (tmp_path / "plain").write_bytes(b"x")
    with pytest.raises(FileFormatError, match="a readable file"):
        st.load(tmp_path / "plain" / "p.safetensors")


# ---- memory: lies about size are caught before anything is allocated --------------------------

HUGE = [
    ({"a": {"dtype": "F64", "shape": [2**20, 2**20, 4], "data_offsets": [0, 2**45]}}, 64),
    ({"a": {"dtype": "U8", "shape": [2**33], "data_offsets": [0, 2**33]}}, 64),
    ({"a": {"dtype": "F32", "shape": [2**30], "data_offsets": [0, 2**32]}}, 2**20),
]


def test_huge_claims_allocate_nothing(tmp_path):
    # 1 MiB of tracemalloc peak and 64 MiB of process peak RSS are the bounds; the claims are
    # 32 TiB, 8 GiB and 4 GiB. The first load warms the imports so they are not counted.
    paths = []
    for i, (header, data_size) in enumerate(HUGE):
        paths.append(tmp_path / f"huge{i}.safetensors")
        paths[-1].write_bytes(_pack(header, b"\0" * data_size))
    with pytest.raises(FileFormatError):
        st.load(paths[0])
    rss_before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # KiB on Linux
    tracemalloc.start()
    try:
        for path in paths:
            with pytest.raises(FileFormatError, match="data size"):
                st.load(path)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    rss_growth_kib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - rss_before
    assert peak < 2**20, peak
    assert rss_growth_kib < 64 * 1024, rss_growth_kib


class _Handle:
    """A file handle stand-in for the spies below: a context manager that closes the real one."""

    def __init__(self, handle):
        self.handle = handle

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.handle.close()


def test_a_huge_header_length_is_never_read(tmp_path, monkeypatch):
    # A file of 16 bytes claiming a 2**63-byte header: the length is checked against the file
    # size, so `read` is never asked for more than the 8-byte prefix.
    path = tmp_path / "claims.safetensors"
    path.write_bytes(_pack(b"{}", b"\0" * 6, length=2**63 - 1))
    sizes = []
    real_open = open

    class Spy(_Handle):
        def read(self, n=-1):
            sizes.append(n)
            return self.handle.read(n)

    monkeypatch.setattr(st, "open", lambda *a, **k: Spy(real_open(*a, **k)), raising=False)
    with pytest.raises(FileFormatError, match="header length"):
        st.load(path)
    assert sizes == [8]


# ---- writing: a failed save leaves the old file, or none, and no temporary ---------------------


def _tree_of(directory):
    return sorted(
        (str(p.relative_to(directory)), p.read_bytes() if p.is_file() else None)
        for p in directory.rglob("*")
    )


@pytest.fixture
def saved(tmp_path):
    path = tmp_path / "p.safetensors"
    st.save({"x": np.arange(4, dtype=np.float32)}, path, metadata={"step": "1"})
    return path


@pytest.mark.parametrize(
    "value, error",
    [
        (np.array(["a", "b"]), ShapeError),  # a string array
        (np.array([object()]), ShapeError),  # object dtype
        (np.zeros(2, np.complex128), ShapeError),
        ("text", ShapeError),  # not an array
        ({"nested": [1, 2]}, ShapeError),
    ],
)
def test_unserializable_values_are_refused_before_writing(saved, value, error):
    before = _tree_of(saved.parent)
    with pytest.raises(error):
        st.save({"x": value}, saved)
    assert _tree_of(saved.parent) == before


def test_unwritable_targets_leave_everything_as_it_was(saved, monkeypatch):
    import lmjax.files

    # The parent is a file; the target is a directory; the temporary can't be created (what an
    # unwritable directory does: the tests run as root, for whom chmod changes nothing).
    (saved.parent / "file").write_bytes(b"keep")
    (saved.parent / "dir").mkdir()
    before = _tree_of(saved.parent)
    with pytest.raises(CheckpointError, match="writing .*file/p.safetensors"):
        st.save({"x": np.zeros(2, np.float32)}, saved.parent / "file" / "p.safetensors")
    assert _tree_of(saved.parent) == before
    with pytest.raises(CheckpointError, match=r"writing .*dir = ") as err:
        st.save({"x": np.zeros(2, np.float32)}, saved.parent / "dir")
    assert isinstance(err.value, OSError) and "\n" not in str(err.value)
    assert _tree_of(saved.parent) == before

    def no_space(*args, **kwargs):
        raise PermissionError(13, "Permission denied")

    monkeypatch.setattr(lmjax.files, "_new_file", no_space)
    with pytest.raises(CheckpointError, match="Permission denied"):
        st.save({"x": np.zeros(2, np.float32)}, saved)
    assert _tree_of(saved.parent) == before
    assert st.metadata(saved) == {"step": "1"}


def test_an_interrupt_during_the_write_leaves_the_old_file(saved, monkeypatch):
    import lmjax.files

    before = _tree_of(saved.parent)
    real_fdopen = lmjax.files.os.fdopen

    class Interrupted(_Handle):
        def write(self, data):
            self.handle.write(data[:10])
            raise KeyboardInterrupt  # Ctrl-C between two writes

    monkeypatch.setattr(lmjax.files.os, "fdopen", lambda *a, **k: Interrupted(real_fdopen(*a, **k)))
    with pytest.raises(KeyboardInterrupt):
        st.save({"x": np.zeros(1000, np.float32)}, saved)
    assert _tree_of(saved.parent) == before  # old bytes, no temporary


def test_a_named_pipe_is_refused_without_blocking(tmp_path):
    timer = fifo(tmp_path / "pipe.safetensors")
    start = time.perf_counter()
    with pytest.raises(FileFormatError, match="a pipe, socket or device"):
        st.load(tmp_path / "pipe.safetensors")
    assert time.perf_counter() - start < 2.0
    timer.cancel()
