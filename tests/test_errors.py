"""Tests for lmjax.errors: one exception family with three-part messages (SPEC section 11)."""

from __future__ import annotations

import numpy as np
import pytest

from lmjax import errors as E
from lmjax import ops

VALUE_ERRORS = ["ConfigError", "ShapeError", "TokenError", "MaskError", "FileFormatError"]


def test_all_lists_the_family():
    assert set(E.__all__) >= {"LMJaxError", "CheckpointError", *VALUE_ERRORS}


@pytest.mark.parametrize("name", E.__all__)
def test_every_class_derives_from_base(name):
    cls = getattr(E, name)
    assert isinstance(cls, type)
    assert issubclass(cls, E.LMJaxError)
    assert issubclass(cls, Exception)


@pytest.mark.parametrize("name", VALUE_ERRORS)
def test_value_errors(name):
    cls = getattr(E, name)
    assert issubclass(cls, ValueError)
    assert not issubclass(cls, OSError)
    with pytest.raises(ValueError):
        raise cls.describe("x", 1, "2", "use 2")


def test_checkpoint_error_is_oserror():
    assert issubclass(E.CheckpointError, OSError)
    assert not issubclass(E.CheckpointError, ValueError)
    err = E.CheckpointError.describe("step", 7, "an existing step", "list the directory")
    with pytest.raises(OSError) as info:
        raise err
    assert "step = 7" in str(info.value)


@pytest.mark.parametrize("name", E.__all__)
def test_describe_returns_instance_of_the_class(name):
    cls = getattr(E, name)
    err = cls.describe("thing", 3, "something else", "do it right")
    assert type(err) is cls


def test_describe_docstring_example():
    msg = str(E.ShapeError.describe("tokens.ndim", 3, "2 ([batch, time])", "reshape to [B, T]"))
    assert msg == "tokens.ndim = 3; expected 2 ([batch, time]). Fix: reshape to [B, T]."


@pytest.mark.parametrize(
    "value",
    [42, -1.5, "bad_option", (2, 3, 5), None, [1, 2]],
)
def test_describe_message_parts(value):
    msg = str(E.ConfigError.describe("n_heads", value, "a divisor of d_model", "change it"))
    assert repr(value) in msg
    assert "expected" in msg
    assert "Fix:" in msg
    assert "\n" not in msg
    assert msg.index(repr(value)) < msg.index("expected") < msg.index("Fix:")


def test_describe_shortens_long_values():
    value = "z" * 10_000
    msg = str(E.TokenError.describe("prompt", value, "at most 16 characters", "truncate it"))
    assert len(msg) < 250
    assert "zzzz" in msg and "..." in msg
    assert "expected at most 16 characters" in msg and msg.endswith("Fix: truncate it.")


def test_describe_shortens_long_lists():
    value = list(range(5_000))
    msg = str(E.TokenError.describe("ids", value, "ids in [0, 27)", "fix the tokenizer"))
    assert len(msg) < 250
    assert msg.startswith("ids = [0, 1, 2")


def test_describe_array_value_stays_one_line():
    # repr() of a 2-D numpy array spans several lines; the message must still be one line.
    msg = str(E.ShapeError.describe("tokens", np.zeros((3, 3)), "rank 1", "flatten it"))
    assert "\n" not in msg
    assert "expected" in msg and "Fix:" in msg


# ---- bad input to the ops stays inside the lmjax.errors family --------------------------------

_BAD_CALLS = {
    "embedding float ids": lambda: ops.embedding([[0.0, 1.0]], [0.5]),
    "linear list x wrong width": lambda: ops.linear(
        {"weight": np.zeros((2, 3), np.float32)}, [[1.0, 2.0]]
    ),
    "layer_norm scalar": lambda: ops.layer_norm(1.0, np.ones(1), np.zeros(1)),
    "relu of ints": lambda: ops.relu([1, 2]),
    "softmax bad axis": lambda: ops.softmax([1.0, 2.0], axis=1),
    "cross_entropy int time_range": lambda: ops.cross_entropy(
        np.zeros((1, 3, 4), np.float32), np.zeros((1, 3), np.int32), time_range=3
    ),
    "mse lists of different length": lambda: ops.mse([1.0, 2.0], [1.0]),
    "attention empty keys": lambda: ops.attention(
        np.zeros((1, 2, 1, 4), np.float32),
        np.zeros((1, 0, 1, 4), np.float32),
        np.zeros((1, 0, 1, 4), np.float32),
        causal=False,
    ),
    "sinusoidal float size": lambda: ops.sinusoidal_positions(4.0, 2),
}


@pytest.mark.parametrize("call", _BAD_CALLS.values(), ids=_BAD_CALLS.keys())
def test_bad_op_input_raises_an_lmjax_error_with_value_expected_and_fix(call):
    with pytest.raises(E.LMJaxError) as info:
        call()
    message = str(info.value)
    assert "expected" in message and "Fix:" in message and "\n" not in message
