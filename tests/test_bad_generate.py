"""`lmjax.generate` under bad arguments (issue 12, SPEC sections 4 and 11).

tests/test_generate.py pins one message per bad argument. Here hypothesis draws whole calls
(prompts and every option, of any type: floats for ints, bools, NaN, numpy scalars, strings,
ragged and nested prompts, huge ids) and checks the contract of `stream`'s docstring: either an
`lmjax.errors` error (TokenError / ConfigError / ShapeError) whose one-line message names the
argument, raised before any work, or the call reaches the first jitted step with arguments that
satisfy the documented preconditions (checked here independently). The first step is replaced
by a sentinel, so nothing compiles and the property runs in about a second.
"""

from __future__ import annotations

import math
import numbers
from unittest import mock

import jax
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from lmjax import generate as G
from lmjax import models
from lmjax.errors import ConfigError, LMJaxError, ShapeError, TokenError
from lmjax.generate import loop

CFG = models.preset("gpt", vocab_size=27, context_length=16, d_model=32, n_heads=4, n_layers=1,
                    d_ff=64)  # fmt: skip
V, C = CFG.vocab_size, CFG.context_length
PARAMS = jax.tree.map(lambda a: np.zeros(a.shape, a.dtype), models.abstract_params(CFG))
SETTINGS = settings(
    max_examples=200, derandomize=True, deadline=None, suppress_health_check=[HealthCheck.too_slow]
)


class Reached(Exception):
    """Raised by the stand-in for the first jitted step: validation let the call through."""


def reached(*args, **kwargs):
    raise Reached


def is_int(x) -> bool:
    return isinstance(x, numbers.Integral) and not isinstance(x, bool | np.bool_)


def is_real(x) -> bool:
    return isinstance(x, numbers.Real) and not isinstance(x, bool | np.bool_)


def valid_prompts(prompts) -> bool:
    """A non-empty list of non-empty 1-D integer id lists, ids in [0, V), each at most C."""
    if isinstance(prompts, str | bytes) or not isinstance(prompts, list | tuple) or not prompts:
        return False  # (a padded 2-D array is refused: it has no lengths)
    for row in prompts:
        if is_int(row) or isinstance(row, str | bytes):
            return False
        array = np.asarray(row)
        if array.ndim != 1 or not array.size or array.dtype.kind not in "iu":
            return False
        if not all(0 <= int(i) < V for i in array) or array.size > C:
            return False
    return True


def bad_arguments(prompts, o) -> set[str]:
    """The arguments that break `stream`'s documented preconditions, written from its docstring
    (not its code): empty when the call is valid. "longest prompt" is the prompt and
    max_new_tokens together running past the context."""
    bad = set() if valid_prompts(prompts) else {"prompts"}
    n, t, k, p, seed = o["max_new_tokens"], o["temperature"], o["top_k"], o["top_p"], o["seed"]
    stops = o["stop_tokens"]
    if not (is_int(n) and 1 <= n):
        bad.add("max_new_tokens")
    elif not bad and max(len(row) for row in prompts) + n > C:
        bad.add("longest prompt")
    if not (is_real(t) and math.isfinite(t) and t >= 0):
        bad.add("temperature")
    if not (k is None or (is_int(k) and 0 <= k <= V)):
        bad.add("top_k")
    if not (is_real(p) and 0 < p <= 1):
        bad.add("top_p")
    if not (is_int(seed) and -(2**63) <= seed < 2**63):
        bad.add("seed")
    if not (
        stops is None
        or (
            not isinstance(stops, str | bytes)
            and not is_int(stops)
            and all(is_int(s) and 0 <= s < V for s in np.asarray(stops, dtype=object).reshape(-1))
        )
    ):
        bad.add("stop_tokens")
    if o["cache"] not in ("contiguous", "paged"):
        bad.add("cache")
    for size in ("page_size", "num_pages"):
        value = o[size]
        if not (value is None or (o["cache"] == "paged" and is_int(value) and value >= 1)):
            bad.add(size)
    return bad


def contract_holds(prompts, o) -> bool:
    return not bad_arguments(prompts, o)


# ---- strategies: each argument drawn from its valid values and from junk -----------------------

junk = st.one_of(
    st.none(),
    st.booleans(),
    st.floats(),
    st.integers(-(2**70), 2**70),
    st.text(max_size=3),
    st.sampled_from([np.int64(3), np.float32(0.5), np.bool_(True), np.nan, -0.0, [], [1], "1"]),
)
ids = st.one_of(st.integers(0, V - 1), st.integers(-2, V + 2), st.sampled_from([2**63, 2**70]))
row = st.one_of(
    st.lists(st.integers(0, V - 1), min_size=1, max_size=C + 2),
    st.lists(ids, max_size=5),
    st.lists(st.floats(0, V), min_size=1, max_size=3),
    st.lists(st.booleans(), min_size=1, max_size=3),
    st.lists(st.lists(st.integers(0, V - 1), max_size=2), min_size=1, max_size=2),
    st.lists(st.integers(0, V - 1), min_size=1, max_size=4).map(np.array),
    st.integers(0, V - 1),
    st.text(max_size=3),
)


def mostly(good, bad):
    """`good` seven times in eight: a flat `one_of` would be swamped by junk's many branches."""
    return st.integers(0, 7).flatmap(lambda i: bad if i == 0 else good)


good_batch = st.lists(
    st.lists(st.integers(0, V - 1), min_size=1, max_size=6), min_size=1, max_size=3
)
padded = st.lists(st.lists(st.integers(0, V - 1), min_size=2, max_size=2), min_size=1, max_size=2)
prompts = mostly(good_batch, st.one_of(st.lists(row, max_size=3), padded.map(np.array), junk))
options = st.fixed_dictionaries(
    {
        "max_new_tokens": mostly(st.integers(1, 8), st.integers(-2, C + 2) | junk),
        "temperature": mostly(
            st.sampled_from([0.0, 0.8, 1e-40]), st.sampled_from([-0.5, math.inf, math.nan]) | junk
        ),
        "top_k": mostly(st.none() | st.integers(0, V), st.integers(-2, V + 2) | junk),
        "top_p": mostly(st.floats(0.01, 1.0), st.floats(-0.5, 1.5) | junk),
        "seed": mostly(st.integers(0, 2**31), st.integers(-(2**64), 2**64) | junk),
        "stop_tokens": mostly(
            st.none() | st.lists(st.integers(0, V - 1), max_size=3),
            st.lists(ids, max_size=3) | st.lists(junk, max_size=2) | junk,
        ),
        "cache": mostly(st.just("contiguous"), st.sampled_from(["paged", "ring", ""]) | junk),
        "page_size": mostly(st.none(), st.integers(-1, 20) | junk),
        "num_pages": mostly(st.none(), st.integers(-1, 20) | junk),
    }
)


@SETTINGS
@given(prompts=prompts, options=options)
def test_any_call_raises_an_lmjax_error_naming_the_argument_or_meets_the_contract(prompts, options):
    with mock.patch.object(loop, "prefill_sample", reached):
        try:
            next(G.stream(PARAMS, prompts, CFG, **options))
        except Reached:
            assert contract_holds(prompts, options), (prompts, options)
            return
        except (TokenError, ConfigError, ShapeError) as err:
            message = str(err)
        except LMJaxError as err:  # any other member of the family is a wrong category
            raise AssertionError(f"{type(err).__name__}: {err}") from None
    bad = bad_arguments(prompts, options)
    assert bad, (message, prompts, options)
    assert "\n" not in message and "; expected " in message and ". Fix: " in message, message
    # The message starts with the argument at fault (`top_p = ...`, `stop_tokens[1] = ...`), not
    # merely some argument: a valid one named in place of the bad one fails here.
    named = [name for name in bad if message.startswith((f"{name} = ", f"{name}["))]
    assert named or (
        "longest prompt" in bad and message.startswith("longest prompt + max_new_tokens = ")
    ), (message, sorted(bad))


@pytest.mark.parametrize(
    "prompts, options, named",
    [
        # Found: an id past int64 among the stop tokens leaked OverflowError, and a ragged
        # nested prompt numpy's ValueError ("setting an array element with a sequence").
        ([[1, 2]], dict(stop_tokens=[2**70]), "stop_tokens[0] = 1180591620717411303424"),
        ([[1, 2]], dict(stop_tokens=[3, -(2**64)]), "stop_tokens[1] = -18446744073709551616"),
        ([[[9, 23], [15]], [9, 3]], {}, "prompts[0] = [[9, 23], [15]]"),
        ([[1], [[1, 2], 3]], {}, "prompts[1] = [[1, 2], 3]"),
    ],
)
def test_inputs_that_leaked_python_errors(prompts, options, named):
    with mock.patch.object(loop, "prefill_sample", reached), pytest.raises(TokenError) as info:
        next(G.stream(PARAMS, prompts, CFG, max_new_tokens=2, **options))
    assert str(info.value).startswith(named) and "Fix:" in str(info.value), str(info.value)
