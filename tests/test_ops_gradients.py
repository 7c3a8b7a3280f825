"""Every op case of `lmjax.testing.OP_CASES` against its two numerical witnesses.

1. Values and the hand-written VJP equal the plain-jnp reference differentiated by `jax.grad`
   (float32, `F32_RTOL`), jitted and not jitted (chex variants).
2. The hand-written VJP equals centered finite differences in float64 (`FD_RTOL`).

The third witness, an outside implementation, is tests/test_torch_parity.py.
"""

import importlib

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from absl.testing import parameterized

from lmjax import testing
from lmjax.testing import BF16_RTOL, F32_RTOL, FD_RTOL, OP_CASES

CASE_PARAMS = [(c.name, c) for c in OP_CASES]


class ReferenceTest(chex.TestCase):
    @chex.variants(with_jit=True, without_jit=True)
    @parameterized.named_parameters(*CASE_PARAMS)
    def test_matches_reference(self, case):
        report = testing.compare_with_reference(case, seed=0, transform=self.variant)
        assert report.within(F32_RTOL), report
        assert report.grad_scale > 0, "a case whose gradient is all zero checks nothing"


@pytest.mark.parametrize("case", OP_CASES, ids=lambda c: c.name)
def test_bf16_inputs_match_reference_within_bf16_rounding(case):
    report = testing.compare_with_reference(case, seed=0, dtype=jnp.bfloat16, transform=jax.jit)
    assert report.within(BF16_RTOL), report


@pytest.mark.parametrize("case", OP_CASES, ids=lambda c: c.name)
def test_matches_finite_differences(case):
    assert testing.finite_difference_error(case, seed=0) <= FD_RTOL


def _with_wrong_vjp(op, factor):
    """`op` with its VJP scaled by `factor`: a deliberately broken backward."""

    @jax.custom_vjp
    def wrong(*args):
        return op(*args)

    def fwd(*args):
        out, pullback = jax.vjp(op, *args)
        return out, pullback

    def bwd(pullback, g):
        grads = pullback(g)
        return jax.tree.map(
            lambda d: d * factor if jnp.issubdtype(d.dtype, jnp.inexact) else d, grads
        )

    wrong.defvjp(fwd, bwd)
    return wrong


@pytest.mark.parametrize(
    "name", ["layer_norm_rank3", "cross_entropy_time_range", "attention_key_padding", "rope"]
)
def test_harness_catches_a_wrong_vjp(name):
    """Both witnesses must reject a backward that is off by 10% (values stay right)."""
    case = testing.case(name)
    broken = testing.OpCase(
        case.name, _with_wrong_vjp(case.op, 1.1), case.reference, case.make_args, case.argnums
    )
    report = testing.compare_with_reference(broken, seed=0, transform=jax.jit)
    assert report.value_error <= F32_RTOL * max(1.0, report.value_scale)
    assert report.grad_error > 100 * F32_RTOL * max(1.0, report.grad_scale)
    assert testing.finite_difference_error(broken, seed=0) > 1e3 * FD_RTOL


def test_the_blocked_attention_case_runs_by_query_blocks(monkeypatch):
    """ "attention_causal_blocked" goes through the public `ops.attention`; this pins that its
    length really takes the query-block path (two full blocks and a ragged one), so the case
    checks the blocked VJP and not the full form. About 2 s (eager)."""
    module = importlib.import_module("lmjax.ops.attention")  # ops.attention is the function
    blocked, calls = module._attention_causal_blocked, []

    def spy(q, k, v, block, *window_segments):
        calls.append((q.shape[1], block))
        return blocked(q, k, v, block, *window_segments)

    monkeypatch.setattr(module, "_attention_causal_blocked", spy)
    case = testing.case("attention_causal_blocked")
    case.op(*case.make_args(np.random.default_rng(0), jnp.float32))
    ((t, block),) = calls
    assert 2 * block < t < 3 * block
