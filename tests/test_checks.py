"""lmjax.checks: the one-line argument check and its number predicates (no JAX work, < 1 s)."""

import math

import numpy as np
import pytest

from lmjax.checks import (
    is_finite_real,
    is_int,
    is_nonnegative_int,
    is_positive_int,
    is_real,
    require,
)
from lmjax.errors import ConfigError, ShapeError


def test_require_passes_silently_when_ok():
    assert require(True, "lora.r", 8, "an int >= 1", "e.g. r=8") is None


def test_require_message_names_value_expectation_and_fix():
    with pytest.raises(ConfigError) as info:
        require(False, "lora.r", 0, "an int >= 1", "e.g. r=8")
    assert str(info.value) == "lora.r = 0; expected an int >= 1. Fix: e.g. r=8."


def test_require_raises_the_given_class_and_shortens_the_value():
    with pytest.raises(ShapeError) as info:
        require(False, "x.shape", "a" * 500, "rank 2", "reshape", error=ShapeError)
    message = str(info.value)
    assert not isinstance(info.value, TypeError) and isinstance(info.value, ValueError)
    assert message.startswith("x.shape = 'aaa") and message.endswith(
        "; expected rank 2. Fix: reshape."
    )
    assert "..." in message and len(message) < 200


@pytest.mark.parametrize("value", [0, -3, 2**70, np.int8(5), np.uint64(7), np.int64(-1)])
def test_is_int_accepts_python_and_numpy_ints(value):
    assert is_int(value) and is_real(value) and is_finite_real(value)


@pytest.mark.parametrize("value", [True, False, np.bool_(True), 1.0, np.float32(2), "3", None, [1]])
def test_is_int_refuses_bools_floats_and_others(value):
    assert not is_int(value)
    assert not is_positive_int(value) and not is_nonnegative_int(value)


@pytest.mark.parametrize("value", [True, np.bool_(False), "1.5", None, 1j])
def test_is_real_refuses_bools_strings_and_complex(value):
    assert not is_real(value) and not is_finite_real(value)


@pytest.mark.parametrize("value", [math.nan, math.inf, -math.inf, np.float32("nan"), np.inf])
def test_nan_and_inf_are_real_but_not_finite(value):
    assert is_real(value) and not is_finite_real(value)


def test_ints_past_float_range_are_not_finite_floats():
    # math.isfinite(10**400) raises OverflowError; such an int cannot become a float parameter.
    assert is_finite_real(2**1023) and not is_finite_real(10**400)
    assert not is_finite_real(-(10**400)) and is_int(10**400)


@pytest.mark.parametrize(
    ("value", "positive", "nonnegative"),
    [(1, True, True), (0, False, True), (-1, False, False), (np.int32(3), True, True)],
)
def test_positive_and_nonnegative_ints(value, positive, nonnegative):
    assert is_positive_int(value) is positive
    assert is_nonnegative_int(value) is nonnegative
