"""lmjax.io.safetensors: parameter pytrees on disk, checked names/shapes/dtypes, bad files.

Round trips are checked against an outside reader (`safetensors.torch.load_file`) as well as our
own `load`. Every bad file is built deliberately, byte by byte, and must raise
`FileFormatError` naming the file, without allocating what a lying header claims.
"""

from __future__ import annotations

import json
import struct

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import safetensors.numpy
import safetensors.torch
import torch

from lmjax import models
from lmjax import params as ptree
from lmjax.errors import CheckpointError, ConfigError, FileFormatError, ShapeError
from lmjax.io import safetensors as st

CFG = models.preset(
    "gpt2", vocab_size=50, context_length=8, d_model=8, n_heads=2, n_layers=2, d_ff=16
)


@pytest.fixture(scope="module")
def params():
    return models.init(jax.random.PRNGKey(0), CFG)


def test_round_trip_names_values_dtypes_metadata(params, tmp_path):
    path = tmp_path / "p.safetensors"
    st.save(params, path, metadata={"step": "7"})
    back = st.load(path, expected=CFG)
    flat, flat_back = ptree.flatten(params), ptree.flatten(back)
    assert list(flat_back) == list(flat) == list(models.declare(CFG))
    for name, leaf in flat.items():
        assert flat_back[name].dtype == leaf.dtype
        np.testing.assert_array_equal(np.asarray(flat_back[name]), np.asarray(leaf))
    assert st.metadata(path) == {"step": "7"}
    # An outside reader sees the same tensors under the SPEC names.
    theirs = safetensors.torch.load_file(str(path))
    assert set(theirs) == set(flat)
    for name, leaf in flat.items():
        np.testing.assert_array_equal(theirs[name].numpy(), np.asarray(leaf))


def test_bf16_and_adapter_trees_round_trip(tmp_path):
    adapters = {  # a LoRA-style tree: any nested dict of arrays
        "blocks": {
            "0": {"attention": {"query": {"lora_a": jnp.ones((2, 8), jnp.bfloat16) / 3}}},
            "10": {"attention": {"query": {"lora_b": jnp.arange(16.0).reshape(8, 2)}}},
        }
    }
    path = tmp_path / "adapters.safetensors"
    st.save(adapters, path)
    back = st.load(path, expected=jax.eval_shape(lambda: adapters))
    a = back["blocks"]["0"]["attention"]["query"]["lora_a"]
    assert a.dtype == jnp.bfloat16 and bool((a == jnp.ones((2, 8), jnp.bfloat16) / 3).all())
    theirs = safetensors.torch.load_file(str(path))
    assert theirs["blocks.0.attention.query.lora_a"].dtype == torch.bfloat16
    b = np.asarray(back["blocks"]["10"]["attention"]["query"]["lora_b"])
    np.testing.assert_array_equal(b, np.arange(16.0).reshape(8, 2))


def test_load_names_every_mismatch_against_the_model(params, tmp_path):
    flat = dict(ptree.flatten(params))
    del flat["blocks.attention.query.bias"]  # missing
    flat["blocks.attention.key.weight"] = jnp.zeros((2, 3, 8))  # wrong shape
    flat["final_norm.scale"] = flat["final_norm.scale"].astype(jnp.float16)  # wrong dtype
    flat["language_model_head.weight"] = jnp.zeros((50, 8))  # unexpected (the head is tied)
    path = tmp_path / "bad.safetensors"
    st.save(ptree.unflatten(flat), path)
    with pytest.raises(CheckpointError) as err:
        st.load(path, expected=CFG)
    message = str(err.value)
    assert str(path) in message and "4 parameter mismatches" in message
    for expected in (
        "missing blocks.attention.query.bias (2, 8)",
        "blocks.attention.key.weight shape (2, 3, 8) (expected (2, 8, 8))",
        "final_norm.scale dtype float16 (expected float32)",
        "unexpected language_model_head.weight",
    ):
        assert expected in message
    assert "\n" not in message and "per layer" not in message


# ---- files written before the blocks were stacked: per-layer names ---------------------------


def _per_layer(params) -> dict:
    """The flat per-layer view (`blocks.{i}.…`) a model file held before the stacking."""
    return dict(ptree.flatten(ptree.unstack(params)))


def test_a_per_layer_file_loads_stacked(params, tmp_path):
    path = tmp_path / "old.safetensors"
    st.save(ptree.unflatten(_per_layer(params)), path)
    assert "blocks.1.attention.query.weight" in st.read_header(path)[0]
    for expected in (CFG, jax.eval_shape(lambda: params)):  # a config or a tree
        assert st.is_per_layer(path, expected)
        back = st.load(path, expected=expected)
        assert list(ptree.flatten(back)) == list(models.declare(CFG))
        for name, leaf in ptree.flatten(params).items():
            np.testing.assert_array_equal(np.asarray(ptree.flatten(back)[name]), np.asarray(leaf))
    # Without `expected` the tree is the file's, as named; a stacked file is not converted.
    assert set(st.load(path)["blocks"]) == {"0", "1"}
    st.save(params, tmp_path / "new.safetensors")
    assert not st.is_per_layer(tmp_path / "new.safetensors", CFG)


def test_a_per_layer_file_is_checked_layer_by_layer(params, tmp_path):
    flat = _per_layer(params)
    del flat["blocks.0.attention.query.bias"]  # missing in one layer only
    flat["blocks.1.attention.key.weight"] = jnp.zeros((3, 8))  # wrong shape in one layer
    flat["blocks.2.attention.key.weight"] = jnp.zeros((8, 8))  # a layer the model lacks
    path = tmp_path / "bad.safetensors"
    st.save(ptree.unflatten(flat), path)
    with pytest.raises(CheckpointError) as err:
        st.load(path, expected=CFG)
    message = str(err.value)
    assert "3 parameter mismatches" in message and "\n" not in message
    for expected in (
        "missing blocks.0.attention.query.bias (8,)",
        "blocks.1.attention.key.weight shape (3, 8) (expected (8, 8))",
        "unexpected blocks.2.attention.key.weight",
        "(per layer: the file holds blocks.{i}.* names, saved before they were stacked)",
    ):
        assert expected in message


# ---- bad files -------------------------------------------------------------------------------


def _file(header: dict | bytes, data: bytes = b"", length: int | None = None) -> bytes:
    raw = header if isinstance(header, bytes) else json.dumps(header).encode()
    return struct.pack("<Q", len(raw) if length is None else length) + raw + data


GOOD = {"a": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]}}
TWO = {
    "a": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]},
    "b": {"dtype": "F32", "shape": [2], "data_offsets": [4, 12]},
}
BAD_FILES = {
    "empty": (b"", "at least 8"),
    "truncated length": (b"\x10\x00\x00", "at least 8"),
    "truncated header": (_file(GOOD, b"\0" * 8)[:20], "header length"),
    "truncated data": (_file(GOOD, b"\0" * 5), "data size"),
    "header length past the end": (_file(GOOD, b"\0" * 8, length=10_000), "header length"),
    "huge header": (_file(b"{}", length=2**63), "header length"),
    "invalid JSON": (_file(b"{not json", b""), "header"),
    "not an object": (_file(b"[1, 2]", b""), "JSON object"),
    "not utf-8": (_file(b'{"\xff": 1}', b""), "header"),
    "duplicate names": (
        _file(
            b'{"a": '
            + json.dumps(GOOD["a"]).encode()
            + b', "a": '
            + json.dumps(GOOD["a"]).encode()
            + b"}",
            b"\0" * 8,
        ),
        "duplicate names",
    ),  # fmt: skip
    "overlapping offsets": (_file(TWO, b"\0" * 12), "no overlap"),
    "offsets past the data": (
        _file({"a": {"dtype": "F32", "shape": [2], "data_offsets": [8, 16]}}, b"\0" * 8),
        "start at byte 0",
    ),
    "offsets not matching the shape": (
        _file({"a": {"dtype": "F32", "shape": [3], "data_offsets": [0, 8]}}, b"\0" * 8),
        "12 bytes",
    ),
    "wrong dtype string": (
        _file({"a": {"dtype": "float32", "shape": [2], "data_offsets": [0, 8]}}, b"\0" * 8),
        "dtype",
    ),
    "negative shape": (
        _file({"a": {"dtype": "F32", "shape": [-2], "data_offsets": [0, 8]}}, b"\0" * 8),
        "shape",
    ),
    "bad metadata": (_file({"__metadata__": {"x": 1}, **GOOD}, b"\0" * 8), "__metadata__"),
    "deeply nested header": (_file(b"[" * 100_000 + b"]" * 100_000, b""), "nested too deeply"),
}


@pytest.mark.parametrize("case", sorted(BAD_FILES))
def test_bad_files_raise_file_format_errors_naming_the_file(case, tmp_path):
    content, message = BAD_FILES[case]
    path = tmp_path / f"{case.replace(' ', '_')}.safetensors"
    path.write_bytes(content)
    with pytest.raises(FileFormatError, match=message) as err:
        st.load(path)
    assert str(path) in str(err.value)


def test_the_well_formed_baseline_loads(tmp_path):
    # The bad files above are this one with one thing broken, so each failure is that thing.
    path = tmp_path / "ok.safetensors"
    path.write_bytes(_file(GOOD, np.array([1.5, -2.0], np.float32).tobytes()))
    np.testing.assert_array_equal(np.asarray(st.load(path)["a"]), [1.5, -2.0])


def test_missing_file_and_directory(tmp_path):
    with pytest.raises(FileFormatError, match="existing file"):
        st.load(tmp_path / "nope.safetensors")
    with pytest.raises(FileFormatError, match="not a directory"):
        st.load(tmp_path)


def test_writes_are_atomic(params, tmp_path, monkeypatch):
    path = tmp_path / "p.safetensors"
    st.save(params, path)
    before = path.read_bytes()

    import lmjax.files

    real_open = lmjax.files.os.fdopen

    class Failing:
        def __init__(self, handle):
            self.handle = handle

        def __enter__(self):
            self.handle.__enter__()
            return self

        def write(self, data):
            self.handle.write(data[: len(data) // 2])  # half the bytes reach the disk...
            raise OSError("disk full")  # ...then the write fails

        def __exit__(self, *exc):
            return self.handle.__exit__(*exc)

    monkeypatch.setattr(lmjax.files.os, "fdopen", lambda *a, **k: Failing(real_open(*a, **k)))
    with pytest.raises(OSError, match="disk full"):
        st.save({"x": jnp.zeros(1000)}, path)
    monkeypatch.undo()
    assert path.read_bytes() == before  # the old file is intact
    assert [p.name for p in tmp_path.iterdir()] == ["p.safetensors"]  # no temporary left
    with pytest.raises(ShapeError, match="parameter x dtype = dtype.'complex64'"):
        st.save({"x": np.zeros(2, np.complex64)}, path)  # refused before anything is written
    assert path.read_bytes() == before


# ---- review fixes ------------------------------------------------------------------------------


def test_64_bit_tensors_load_without_narrowing(tmp_path):
    # Written by the safetensors package itself; jax without x64 would turn 2**40 into 0.
    tensors = {
        "f64": np.array([1e300, 0.1, -2.5e-310], np.float64),
        "i64": np.array([2**40, -(2**62), 7], np.int64),
        "u64": np.array([2**64 - 1], np.uint64),
        "f32": np.array([1.5], np.float32),
    }
    path = tmp_path / "wide.safetensors"
    safetensors.numpy.save_file(tensors, str(path))
    back = st.load(path, expected=tensors)
    for name, value in tensors.items():
        assert back[name].dtype == value.dtype, name
        np.testing.assert_array_equal(np.asarray(back[name]), value)
    assert isinstance(back["f32"], jax.Array)  # what jax holds exactly stays a jax array


def test_scalars_keep_shape_and_non_arrays_are_refused(tmp_path):
    path = tmp_path / "scalars.safetensors"
    st.save({"step": np.asarray(7, np.int32), "scale": jnp.float32(0.5)}, path)
    theirs = safetensors.numpy.load_file(str(path))
    assert theirs["step"].shape == () and theirs["step"] == 7
    assert theirs["scale"].shape == () and theirs["scale"] == np.float32(0.5)
    back = st.load(path)
    assert back["step"].shape == () and int(back["step"]) == 7
    for leaf in ([1.0, 2.0], (1, 2), 3, 0.5):
        with pytest.raises(ShapeError, match=r"parameter blocks\.0\.w = "):
            st.save({"blocks": {"0": {"w": leaf}}}, tmp_path / "no.safetensors")
    assert not (tmp_path / "no.safetensors").exists()


def test_metadata_must_be_a_mapping_of_strings(tmp_path):
    for bad in (["a"], {"step": 7}, "step=7"):
        with pytest.raises(ConfigError, match="safetensors metadata"):
            st.save({"x": np.zeros(2, np.float32)}, tmp_path / "m.safetensors", metadata=bad)
    assert not (tmp_path / "m.safetensors").exists()


def test_many_names_with_one_duplicate_are_rejected(tmp_path):
    n = 50_000
    entries = [
        f'"k{i}": {{"dtype": "U8", "shape": [1], "data_offsets": [{i}, {i + 1}]}}' for i in range(n)
    ]
    entries.append(f'"k0": {{"dtype": "U8", "shape": [1], "data_offsets": [{n}, {n + 1}]}}')
    path = tmp_path / "dup.safetensors"
    path.write_bytes(_file(("{" + ", ".join(entries) + "}").encode(), b"\0" * (n + 1)))
    with pytest.raises(FileFormatError, match=r"duplicate names \['k0'\]") as err:
        st.load(path)
    assert str(path) in str(err.value)


def test_header_over_the_size_cap_is_rejected(tmp_path, monkeypatch):
    path = tmp_path / "big_header.safetensors"
    path.write_bytes(_file(GOOD, b"\0" * 8))
    monkeypatch.setattr(st, "MAX_HEADER_BYTES", 16)  # the header is ~60 bytes, the file larger
    with pytest.raises(FileFormatError, match="header length = .*; expected <= 16 bytes") as err:
        st.load(path)
    assert str(path) in str(err.value)


def test_one_mismatch_is_singular(params, tmp_path):
    flat = dict(ptree.flatten(params))
    del flat["final_norm.bias"]
    path = tmp_path / "one.safetensors"
    st.save(ptree.unflatten(flat), path)
    with pytest.raises(CheckpointError, match=r": 1 parameter mismatch = missing final_norm\.bias"):
        st.load(path, expected=CFG)
