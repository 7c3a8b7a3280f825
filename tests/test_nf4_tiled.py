"""The NF4 matmul's XLA path (`nf4_matmul_tiled`, what `quantized_linear` runs on CPU and for
in-features not a multiple of 64): memory and numerics.

Memory (SPEC section 6, an input-only VJP over a frozen base): across the forward/backward
boundary only the NF4 leaves are kept (the packed codes and the block statistics), never a
float copy of the weight; and in row tiles, so no float array of the weight's size exists at
any time, forward or backward. Checked on the residuals of `jax.vjp` (the leaves of its
pullback, what `jax.ad_checkpoint.print_saved_residuals` lists) and on every intermediate of
the jaxpr of forward + backward, sub-jaxprs included.

Numerics: y and dx equal the plain reference (`nf4_matmul_reference`: dequantize the whole
weight, one matmul, jax.grad), float64 numpy on bitsandbytes' own dequantization of the same
codes (the outside witness) and central finite differences, for ragged shapes (I not a
multiple of 64, odd I, O not a multiple of the tile).

Memory as compiled: the scratch of forward + backward of six NF4 layers against float layers'.

Cost: about 20 s of CPU for the file (small shapes, three compiles a numerics case; the jaxpr
checks only trace, on abstract weights).
"""

from __future__ import annotations

import jax
import jax.extend
import jax.numpy as jnp
import numpy as np
import pytest
from _bnb import bnb_dequantized

from lmjax import models, testing
from lmjax.quant import nf4, quantize
from pallas_kernels import nf4_matmul as nm

# (O, I): I a multiple of 64; I = 100 (quantization blocks straddle rows, tiles of 16 rows);
# I = 53 (odd: rows start mid-byte, tiles of 64 rows); no O a multiple of its tile.
SHAPES = [(40, 192), (37, 100), (130, 53)]


def weight(o: int, i: int, seed: int = 0):
    return quantize(np.random.default_rng(seed).standard_normal((o, i)).astype(np.float32) * 0.1)


def abstract_weight(o: int, i: int):
    """A QuantizedWeight of ShapeDtypeStructs: enough to trace, nothing compiles."""
    return jax.eval_shape(quantize, jax.ShapeDtypeStruct((o, i), jnp.float32))


def residuals(f, *args) -> list[jax.ShapeDtypeStruct]:
    """What jax.vjp keeps for the backward: the array leaves of its pullback (traced only)."""
    return jax.tree.leaves(jax.eval_shape(lambda *a: jax.vjp(f, *a)[1], *args))


def float_avals(jaxpr) -> list:
    """Every float array an equation of `jaxpr` produces, in sub-jaxprs (scan, jit,
    custom_vjp, ...) too."""
    found = []
    for eqn in jaxpr.eqns:
        found += [v.aval for v in eqn.outvars if jnp.issubdtype(v.aval.dtype, jnp.floating)]
        for sub in jax.extend.core.jaxprs_in_params(eqn.params):
            found += float_avals(sub)
    return found


@pytest.mark.parametrize("o, i", SHAPES)
def test_quantized_linear_keeps_no_float_weight_for_the_backward(o, i):
    """On CPU `quantized_linear` runs the XLA path: its residuals are the NF4 leaves alone, not
    the float32 [O, I] weight the dequantize-then-matmul reference keeps."""
    qw = abstract_weight(o, i)
    x = jnp.ones((3, i))
    bias = jnp.zeros(o)
    saved = residuals(lambda x, b: nm.quantized_linear(x, qw, b).sum(), x, bias)
    shown = [(a.shape, str(a.dtype)) for a in saved]
    floats = [a for a in saved if jnp.issubdtype(a.dtype, jnp.floating)]
    assert all(a.size < o * i for a in floats), shown
    # Everything saved together: no more than the NF4 weight itself (codes and statistics).
    nbytes = sum(a.size * a.dtype.itemsize for a in saved)
    assert nbytes <= nf4.storage_bytes(o * i), shown
    # The plain reference does keep it (what this test tells apart).
    plain = residuals(lambda x: nm.nf4_matmul_reference(x, qw).sum(), x)
    assert any(a.shape == (o, i) and a.dtype == jnp.float32 for a in plain)


@pytest.mark.parametrize("o, i", SHAPES)
def test_no_float_array_of_the_weights_size_forward_or_backward(o, i):
    """Decoding in row tiles: no intermediate of forward + backward is a float array as large
    as the weight (x, y and dx are a few rows, far smaller)."""
    qw = abstract_weight(o, i)

    def loss(x):
        return nm.nf4_matmul_tiled(x, qw, tile_rows=8).sum()  # 8 rounds up to 16, 64 rows

    jaxpr = jax.make_jaxpr(jax.value_and_grad(loss))(jnp.ones((2, i)))
    sizes = [a.size for a in float_avals(jaxpr.jaxpr)]
    assert sizes and max(sizes) < o * i, max(sizes)
    plain = jax.make_jaxpr(jax.grad(lambda x: nm.nf4_matmul_reference(x, qw).sum()))
    assert max(a.size for a in float_avals(plain(jnp.ones((2, i))).jaxpr)) >= o * i


def test_default_tiles_through_lmjax_models_project():
    """models.project (what a model runs for an NF4 layer) on CPU with the default tiles
    (TILE_WEIGHTS weights): a weight of 1.1 M weights is never decoded whole (traced only)."""
    o, i = 1100, 1000
    assert o * i > nm.TILE_WEIGHTS
    qw = abstract_weight(o, i)

    def loss(x, qw):
        return models.project({"weight": qw}, x).sum()

    jaxpr = jax.make_jaxpr(jax.grad(loss))(jnp.ones((4, i)), qw)
    assert max(a.size for a in float_avals(jaxpr.jaxpr)) <= nm.TILE_WEIGHTS


def test_compiled_step_holds_no_layer_weights_at_once():
    """What XLA makes of it: the compiled forward + backward of six NF4 layers needs no more
    scratch memory than the float layers' (their activations) plus a few tiles. Guards the
    schedule, which the jaxpr cannot show: XLA's CPU scheduler places work that depends on
    parameters alone (one-step loops, constant loop buffers) at the start, every layer's at
    once. One compile each (~1 s)."""
    o = i = 512  # tiles of 256 rows (two a layer): 0.5 MiB in float32, a layer's weight 1 MiB
    qws = [abstract_weight(o, i) for _ in range(6)]
    ws = [jax.ShapeDtypeStruct((o, i), jnp.float32)] * 6
    x = jax.ShapeDtypeStruct((128, i), jnp.float32)

    def scratch(matmul, weights):
        def loss(x, weights):
            for w in weights:
                x = jnp.tanh(matmul(x, w))
            return x.sum()

        compiled = jax.jit(jax.grad(loss)).lower(x, weights).compile()
        return compiled.memory_analysis().temp_size_in_bytes

    floats = scratch(lambda x, w: x @ w.T, ws)
    tile_bytes = 256 * i * 4
    assert scratch(nm.nf4_matmul_tiled, qws) <= floats + 3 * tile_bytes
    assert scratch(nm.nf4_matmul_reference, qws) >= floats + 6 * o * i * 4  # the plain one


# ---- numerics ------------------------------------------------------------------------------------


def _y_and_dx(matmul, x, g):
    y, pull = jax.vjp(matmul, x)
    return y, pull(g)[0]


@pytest.mark.parametrize("o, i", SHAPES)
@pytest.mark.parametrize("tile_rows", [None, 8])
def test_tiled_equals_reference_and_bitsandbytes(o, i, tile_rows):
    """y and dx (float32, three leading rows x two) against (a) the plain reference, (b) float64
    numpy on bitsandbytes' dequantized weight, (c) central differences of the tiled path."""
    qw = weight(o, i, seed=1)
    rng = np.random.default_rng(2)
    x = jnp.asarray(rng.standard_normal((3, 2, i)), jnp.float32)
    g = jnp.asarray(rng.standard_normal((3, 2, o)), jnp.float32)
    bias = jnp.asarray(rng.standard_normal(o), jnp.float32)

    def tiled(x):
        return nm.nf4_matmul_tiled(x, qw, bias, tile_rows=tile_rows)

    y, dx = jax.jit(_y_and_dx, static_argnums=0)(tiled, x, g)
    y_ref, dx_ref = jax.jit(_y_and_dx, static_argnums=0)(
        lambda x: nm.nf4_matmul_reference(x, qw, bias), x, g
    )
    # Same decoded weights, the same float32 dots but in programs of other shapes, whose sums
    # XLA may order otherwise (by the CPU's vector width too): lmjax.testing.f32_rtol of the
    # dot's length (+ the bias) times the largest entry: 7e-6 of max |y| at i = 192, while one
    # weight decoded one NF4 level off (~0.02 here) moves y by ~0.02 |x|.
    for got, want, n in ((y, y_ref, i + 1), (dx, dx_ref, o)):
        atol = testing.f32_rtol(n) * float(np.abs(want).max())
        np.testing.assert_allclose(got, want, rtol=0, atol=atol)

    w64 = bnb_dequantized(qw).astype(np.float64)
    x64, g64 = np.asarray(x, np.float64), np.asarray(g, np.float64)
    np.testing.assert_allclose(y, x64 @ w64.T + np.asarray(bias, np.float64), rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(dx, g64 @ w64, rtol=1e-5, atol=1e-5)

    # Central differences of <g, y(x)> along a random direction (float32: step 1e-2 on a
    # linear map is exact up to rounding, ~1e-4 relative).
    v = jnp.asarray(rng.standard_normal(x.shape), jnp.float32)
    dot = jax.jit(lambda x: jnp.vdot(g, tiled(x)))
    fd = (float(dot(x + 1e-2 * v)) - float(dot(x - 1e-2 * v))) / 2e-2
    assert fd == pytest.approx(float(jnp.vdot(dx, v)), rel=1e-3)


def test_tiled_bfloat16_follows_the_reference():
    """x in a 16-bit dtype: the weight decoded to that dtype as in the reference, float32
    accumulation; y and dx equal the reference to one bf16 rounding of the result."""
    dtype = jnp.bfloat16
    qw = weight(37, 100, seed=3)
    rng = np.random.default_rng(4)
    x = jnp.asarray(rng.standard_normal((5, 100)), dtype)
    g = jnp.asarray(rng.standard_normal((5, 37)), dtype)
    run = jax.jit(_y_and_dx, static_argnums=0)
    y, dx = run(lambda x: nm.nf4_matmul_tiled(x, qw, tile_rows=8), x, g)
    y_ref, dx_ref = run(lambda x: nm.nf4_matmul_reference(x, qw), x, g)
    assert y.dtype == dx.dtype == jnp.dtype(dtype)
    ulp = float(jnp.finfo(dtype).eps)  # one rounding of results below ~8 in magnitude
    np.testing.assert_allclose(np.float32(y), np.float32(y_ref), rtol=ulp, atol=8 * ulp)
    np.testing.assert_allclose(np.float32(dx), np.float32(dx_ref), rtol=ulp, atol=8 * ulp)


def test_frozen_weight_gets_no_gradient_and_bad_tile_rows_is_a_config_error():
    qw = weight(16, 64)
    x = jnp.ones((2, 64))

    def loss(x, absmax2, offset):
        w = nf4.QuantizedWeight(qw.packed, qw.qabsmax, absmax2, offset, qw.shape, qw.dtype)
        return nm.nf4_matmul_tiled(x, w).sum()

    grads = jax.jit(jax.grad(loss, argnums=(0, 1, 2)))(x, qw.absmax2, qw.offset)
    dx, d_absmax2, d_offset = grads
    assert dx.shape == x.shape
    assert not np.asarray(d_absmax2).any() and float(d_offset) == 0.0
    from lmjax.errors import ConfigError

    for bad in (0, -8, 2.5, True):
        with pytest.raises(ConfigError, match="tile_rows"):
            nm.nf4_matmul_tiled(x, qw, tile_rows=bad)
