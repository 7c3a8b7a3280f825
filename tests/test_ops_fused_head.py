"""`ops.linear_cross_entropy` (the head fused with the loss) against its three witnesses.

1. `jax.grad` through `linear_cross_entropy_reference` (linear then cross-entropy, plain jnp),
   float32, `F32_RTOL`, for several chunk sizes (one chunk, chunks that divide N, and a ragged
   last chunk that is padded).
2. Centered finite differences in float64, `FD_RTOL`.
3. PyTorch: `F.cross_entropy(F.linear(x, W, b), y, ignore_index)`, values and gradients,
   float32, `F32_RTOL`.
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
import torch.nn.functional as F

from lmjax import compat, ops, testing
from lmjax.errors import ShapeError, TokenError
from lmjax.testing import F32_RTOL, FD_RTOL, OpCase

V, D = 7, 4


def _args(shape_BT, bias=True, ignore=True):
    def make(rng, dtype):
        params = {"weight": jnp.asarray(rng.standard_normal((V, D)), dtype)}
        if bias:
            params["bias"] = jnp.asarray(rng.standard_normal(V), dtype)
        x = jnp.asarray(1.5 * rng.standard_normal((*shape_BT, D)), dtype)
        y = rng.integers(0, V, shape_BT)
        if ignore:
            y[..., 1] = -100
        return params, x, jnp.asarray(y, jnp.int32)

    return make


def _case(name, make, chunk, time_range=None):
    op = functools.partial(ops.linear_cross_entropy, chunk=chunk, time_range=time_range)
    ref = functools.partial(ops.linear_cross_entropy_reference, time_range=time_range)
    return OpCase(name, op, ref, make, argnums=(0, 1))


CASES = [
    _case("ragged_last_chunk", _args((2, 5)), chunk=3),  # 4 chunks, the last one padded
    _case("one_chunk_rank1", _args((9,)), chunk=64),
    _case("no_bias_time_range", _args((2, 6), bias=False), chunk=4, time_range=(2, 3)),
]


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.name)
def test_matches_jax_grad_of_reference(case):
    report = testing.compare_with_reference(case, seed=0, transform=jax.jit)
    assert report.within(F32_RTOL), report
    assert report.grad_scale > 0


def test_matches_finite_differences():
    assert testing.finite_difference_error(CASES[0], seed=0) <= FD_RTOL


def test_harness_rejects_a_wrong_gradient():
    """The same check fails for a backward scaled by 1.1 (so the tests above can fail)."""
    case = CASES[0]

    @jax.custom_vjp
    def wrong(p, x, y):
        return case.op(p, x, y)

    def fwd(p, x, y):
        out, pull = jax.vjp(lambda p, x: case.op(p, x, y), p, x)
        return out, pull

    def bwd(pull, g):
        dp, dx = pull(g)
        return jax.tree.map(lambda a: 1.1 * a, dp), 1.1 * dx, None

    wrong.defvjp(fwd, bwd)
    report = testing.compare_with_reference(
        OpCase("wrong", wrong, case.reference, case.make_args, (0, 1)), seed=0, transform=jax.jit
    )
    assert report.grad_error > 100 * F32_RTOL * max(1.0, report.grad_scale)


def test_matches_torch(bias=True):
    params, x, y = _args((3, 5), bias=bias)(np.random.default_rng(1), jnp.float32)
    with jax.default_matmul_precision("highest"):
        loss, (dp, dx) = jax.value_and_grad(
            lambda p, x: ops.linear_cross_entropy(p, x, y, chunk=4), argnums=(0, 1)
        )(params, x)
    tw = torch.tensor(np.asarray(params["weight"]), requires_grad=True)
    tb = torch.tensor(np.asarray(params["bias"]), requires_grad=True) if bias else None
    tx = torch.tensor(np.asarray(x), requires_grad=True)
    logits = F.linear(tx, tw, tb)
    tloss = F.cross_entropy(
        logits.reshape(-1, V), torch.tensor(np.asarray(y), dtype=torch.long).reshape(-1)
    )
    tloss.backward()
    scale = max(1.0, abs(tloss.item()))
    assert abs(float(loss) - tloss.item()) <= F32_RTOL * scale
    pairs = [(dp["weight"], tw.grad), (dx, tx.grad)] + ([(dp["bias"], tb.grad)] if bias else [])
    for mine, theirs in pairs:
        theirs = theirs.numpy()
        err = np.max(np.abs(np.asarray(mine) - theirs))
        assert err <= F32_RTOL * max(1.0, np.max(np.abs(theirs))), err


def test_loss_without_gradient_equals_loss_with_it():
    """The primal path (no gradient, e.g. evaluation) and the forward that forms the gradient."""
    params, x, y = _args((2, 5))(np.random.default_rng(2), jnp.float32)
    f = jax.jit(lambda p, x: ops.linear_cross_entropy(p, x, y, chunk=3))
    plain = f(params, x)
    with_grad = jax.jit(jax.value_and_grad(lambda p, x: ops.linear_cross_entropy(p, x, y, chunk=3)))
    assert float(plain) == pytest.approx(float(with_grad(params, x)[0]), rel=F32_RTOL)


def test_out_of_range_target_under_jit_is_nan_not_clamped():
    params, x, y = _args((2, 5), ignore=False)(np.random.default_rng(3), jnp.float32)
    bad = y.at[0, 2].set(V)
    loss, (dp, dx) = jax.jit(
        jax.value_and_grad(lambda p, x, y: ops.linear_cross_entropy(p, x, y, chunk=3), (0, 1))
    )(params, x, bad)
    assert np.isnan(float(loss))
    assert np.isnan(np.asarray(dx)[0, 2]).all() and np.isfinite(np.asarray(dx)[1]).all()


def test_bad_inputs_are_named():
    params, x, y = _args((2, 5))(np.random.default_rng(4), jnp.float32)
    with pytest.raises(TokenError, match="targets"):
        ops.linear_cross_entropy(params, x, y.at[0, 0].set(V))
    with pytest.raises(ShapeError, match="targets.shape"):
        ops.linear_cross_entropy(params, x, y[:, :3])
    with pytest.raises(ShapeError, match="x.shape"):
        ops.linear_cross_entropy(params, x[..., :3], y)
    with pytest.raises(ShapeError, match="chunk"):
        ops.linear_cross_entropy(params, x, y, chunk=0)


def _lowered(fn, args, platform: str) -> str:
    return compat.lowering_for(jax.jit(fn), *args, platform=platform)[1].as_text()


def test_the_chunk_and_the_weight_gradient_are_chosen_for_the_platform_lowered_for():
    """With `chunk=None` the head is lowered per platform, not per host: for a CPU, 512-row
    chunks and the weight gradient's transposing copies held apart by optimization barriers
    (YNNPACK's row-major dots); for CUDA, `accelerator_chunk` rows and plain dots. A GPU step
    lowered on this CPU host is the one a GPU runs (it was the CPU's before)."""
    from lmjax.ops.fused_head import DEFAULT_CHUNK, accelerator_chunk

    v, d, rows = 1024, 8, 4096
    params = {"weight": jnp.zeros((v, d), jnp.float32), "bias": jnp.zeros((v,), jnp.float32)}
    x, y = jnp.zeros((rows, d), jnp.float32), jnp.zeros((rows,), jnp.int32)
    step = jax.grad(lambda p, x: ops.linear_cross_entropy(p, x, y), argnums=(0, 1))
    assert accelerator_chunk(rows, v) == 4096 > DEFAULT_CHUNK  # 2^30 B / (4 B x 1024) = 2^18
    assert accelerator_chunk(16384, 50257) == 4096 and accelerator_chunk(100, 50257) == 100
    # The chunks, [K, chunk, D]: 8 x 512 rows for a CPU, 1 x 4096 for CUDA, and not the other.
    chunks = {
        "cpu": ("tensor<8x512x8xf32>", "x4096x8xf32>"),
        "cuda": ("1x4096x8xf32>", "x512x8xf32>"),
    }
    for platform, (present, absent) in chunks.items():
        text = _lowered(step, (params, x), platform)
        assert present in text and absent not in text, platform
        barriers = text.count("stablehlo.optimization_barrier")
        assert (barriers > 0) == (platform == "cpu"), (platform, barriers)
    # And the value on this CPU is the 512-row one's, bit for bit.
    loss = jax.jit(lambda p, x: ops.linear_cross_entropy(p, x, y))(params, x)
    assert float(loss) == float(ops.linear_cross_entropy(params, x, y, chunk=DEFAULT_CHUNK))
