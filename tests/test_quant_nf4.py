"""NF4 with double quantization (SPEC section 6) against bitsandbytes, by hand, and by its bounds.

bitsandbytes (CPU) is the outside witness: `quantize_4bit(..., quant_type="nf4",
compress_statistics=True, blocksize=64)` and `dequantize_4bit`. Where the two may differ, and why:

* offset = mean(absmax) is a float32 sum whose rounding depends on the summation order (torch
  sums in a vectorized, machine-dependent order). The exact-parity tensors are therefore drawn
  on a grid of 2^-12 (`on_grid`): every block absmax is a multiple of 2^-12 below 2^3 and at most
  a few hundred of them are summed, so every partial sum is exact in float32 and both sides get
  the same correctly rounded mean. One off-grid tensor checks the offset to 2 float32 ulps.
* The nested 8-bit codes: bitsandbytes' CPU kernel divides by absmax2 and searches a bucketed
  65,536-entry table (`BinAlgo<Direct2>`), then picks the nearer of the two codes next to the
  one it found; we multiply by 1/absmax2 and take the nearest (SPEC). Its code is accepted where
  it differs from ours only if it is at most `TABLE_STEP` = 2/65,536 (one bucket over [-1, 1])
  farther from the scaled value than ours (in the dense part of the map near 0 that may be two
  or more codes away), or if the group's absmax2 is 0 (every code then dequantizes to the
  offset). The number accepted is counted and must stay under 1%.
* bitsandbytes' CPU quantizer overwrites entry 0 of its cached dynamic map with -1.0 (its
  search needs the range closed at -1), and the state it returns carries that copy; SPEC's map
  (`create_dynamic_map(signed=True)`) has -0.99296874 there. So dequantized values are compared
  through bitsandbytes' `dequantize_4bit` on *our* statistics with the fresh map: equal bit for
  bit. On bitsandbytes' own state they must also be equal wherever its nested code equals ours
  and is not 0.
"""

import math

import bitsandbytes.functional as bnbf
import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch

from lmjax import models
from lmjax import params as ptree
from lmjax.errors import NonFiniteError, ShapeError
from lmjax.quant import QuantizedWeight, dequantize, nf4, quantize, storage_bytes
from lmjax.quant.params import LINEAR_WEIGHTS, quantize_params, weight_bytes

TABLE_STEP = 2.0 / 65536
GRID = 2.0**-12


def on_grid(x: np.ndarray) -> np.ndarray:
    return (np.round(x / GRID) * GRID).astype(np.float32)


def normal(shape, seed, scale=0.05):
    return np.random.default_rng(seed).standard_normal(shape) * scale


def heavy_tailed(shape, seed):
    # Student t with 2 degrees of freedom: block maxima vary over orders of magnitude.
    return np.random.default_rng(seed).standard_t(2, shape) * 0.05


def with_ties(shape, seed):
    """Blocks whose absmax is 1 and whose other entries sit exactly on NF4 midpoints that are
    float32 numbers, so the tie rule (lower code) decides them."""
    rng = np.random.default_rng(seed)
    mids64 = (nf4.NF4[:-1].astype(np.float64) + nf4.NF4[1:]) / 2
    exact = mids64[mids64.astype(np.float32) == mids64].astype(np.float32)
    w = rng.choice(exact, size=int(np.prod(shape))).reshape(-1)
    w[::64] = 1.0
    return w.reshape(shape)


# (name, array): exact-parity tensors, several sizes that are not a multiple of 64 (or of 2).
PARITY = [
    ("normal-128x256", on_grid(normal((128, 256), 0))),
    ("normal-37x53-ragged-odd", on_grid(normal((37, 53), 1))),
    ("normal-3x19200-several-groups", on_grid(normal((3, 19200), 2, scale=1.0))),
    ("heavy-300x77-ragged", on_grid(heavy_tailed((300, 77), 3))),
    ("ties-16x64", with_ties((16, 64), 4)),
    ("tiny-5-odd", on_grid(normal((5,), 5))),
    # One block past a double-quantization group (16384 weights) and one short of two groups.
    ("groups-16385", on_grid(normal((16385,), 16))),
    ("groups-32767", on_grid(normal((32767,), 17))),
    ("zero-blocks-4x128", on_grid(np.concatenate([np.zeros((2, 128)), normal((2, 128), 6)]))),
]


@pytest.fixture(autouse=True)
def _eager_torch():
    """bitsandbytes dequantizes odd-width weights with a torch.compile'd function, compiled again
    for every shape (seconds each); run it eagerly, the same torch ops without the compile."""
    with torch.compiler.set_stance("force_eager"):
        yield


def bnb_quantize(w: np.ndarray):
    packed, state = bnbf.quantize_4bit(
        torch.from_numpy(np.asarray(w)),
        quant_type="nf4",
        compress_statistics=True,
        blocksize=64,
    )
    return packed.numpy().reshape(-1), state


def assert_nested_codes_are_nearest(qw: QuantizedWeight, absmax: np.ndarray):
    """SPEC's rule, checked by numpy alone: each nested code is the map value nearest to
    s = (absmax - offset) * (1 / absmax2) computed in float32 (absmax2 = 0: s = 0), to within
    one float32 ulp of s (the float32-rounded midpoints decide exact ties; module docstring of
    lmjax.quant.nf4)."""
    absmax2 = np.repeat(np.asarray(qw.absmax2), nf4.BLOCK2)[: absmax.size]
    inv = np.float32(1) / np.maximum(absmax2, np.finfo(np.float32).tiny)
    s = np.clip((absmax - np.float32(qw.offset)) * inv, -1, 1).astype(np.float64)
    distance = np.abs(nf4.DYNAMIC.astype(np.float64)[None, :] - s[:, None])
    ours = distance[np.arange(s.size), np.asarray(qw.qabsmax).astype(int)]
    excess = ours - distance.min(axis=1)
    assert np.all(excess <= np.spacing(np.abs(s).astype(np.float32))), np.max(excess)


def accepted_nested_differences(qw: QuantizedWeight, absmax: np.ndarray, bnb_codes: np.ndarray):
    """How many of bitsandbytes' nested codes differ from ours in groups with absmax2 > 0;
    asserts each difference is acceptable (module docstring)."""
    assert_nested_codes_are_nearest(qw, absmax)
    ours = np.asarray(qw.qabsmax).astype(int)
    differ = np.nonzero(ours != bnb_codes.astype(int))[0]
    absmax2 = np.repeat(np.asarray(qw.absmax2), nf4.BLOCK2)[: ours.size]
    scaled = (absmax.astype(np.float64) - float(qw.offset)) / np.where(absmax2 > 0, absmax2, 1)
    table = nf4.DYNAMIC.astype(np.float64)
    differ = differ[absmax2[differ] > 0]  # else the group equals the offset: any code does
    for i in differ:
        excess = abs(table[bnb_codes[i]] - scaled[i]) - abs(table[ours[i]] - scaled[i])
        assert excess <= TABLE_STEP, (i, ours[i], bnb_codes[i], scaled[i], excess)
    return differ.size


@pytest.mark.parametrize("name, w", PARITY, ids=[name for name, _ in PARITY])
def test_matches_bitsandbytes(name, w):
    qw = quantize(w)
    packed, state = bnb_quantize(w)
    np.testing.assert_array_equal(np.asarray(qw.packed), packed, err_msg="packed codes")
    assert float(qw.offset) == float(state.offset)
    np.testing.assert_array_equal(np.asarray(qw.absmax2), state.state2.absmax.numpy())
    absmax = np.abs(np.pad(w.reshape(-1), (0, -w.size % 64))).reshape(-1, 64).max(axis=1)
    bnb_codes = state.absmax.numpy()
    assert accepted_nested_differences(qw, absmax, bnb_codes) <= 0.01 * bnb_codes.size

    # Dequantization: bitsandbytes' dequantize_4bit on our statistics, bit for bit ...
    state.absmax = torch.from_numpy(np.asarray(qw.qabsmax))
    state.state2.code = torch.from_numpy(nf4.dynamic_map_signed())
    bnb_on_ours = bnbf.dequantize_4bit(torch.from_numpy(packed[:, None]), state).numpy()
    ours = np.asarray(dequantize(qw))
    assert ours.shape == w.shape and ours.dtype == np.float32
    np.testing.assert_array_equal(ours, bnb_on_ours)


def test_dequantize_equals_bitsandbytes_own_state_where_nested_codes_agree():
    w = on_grid(normal((128, 256), 7))
    qw = quantize(w)
    packed, state = bnb_quantize(w)
    bnb_deq = bnbf.dequantize_4bit(torch.from_numpy(packed[:, None]), state).numpy()
    same = (np.asarray(qw.qabsmax) == state.absmax.numpy()) & (state.absmax.numpy() != 0)
    rows = np.repeat(same, 64).reshape(w.shape)
    assert rows.mean() > 0.98
    np.testing.assert_array_equal(np.asarray(dequantize(qw))[rows], bnb_deq[rows])


def test_off_grid_offset_within_two_ulps_and_codes_identical():
    w = normal((128, 256), 8).astype(np.float32)
    qw = quantize(w)
    packed, state = bnb_quantize(w)
    np.testing.assert_array_equal(np.asarray(qw.packed), packed)
    offset = np.float32(state.offset)
    assert abs(float(qw.offset) - float(offset)) <= 2 * np.spacing(offset)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_precision_weights_match_bitsandbytes(dtype):
    w32 = on_grid(normal((128, 256), 9))
    t = torch.from_numpy(w32).to(dtype)
    qw = quantize(jnp.asarray(t.float().numpy()).astype(str(dtype).removeprefix("torch.")))
    assert qw.dtype == jnp.dtype(str(dtype).removeprefix("torch."))
    packed, state = bnbf.quantize_4bit(t, quant_type="nf4", compress_statistics=True, blocksize=64)
    np.testing.assert_array_equal(np.asarray(qw.packed), packed.numpy().reshape(-1))
    state.absmax = torch.from_numpy(np.asarray(qw.qabsmax))
    state.state2.code = torch.from_numpy(nf4.dynamic_map_signed())
    expected = bnbf.dequantize_4bit(packed, state).float().numpy()
    ours = dequantize(qw)
    assert ours.dtype == qw.dtype
    np.testing.assert_array_equal(np.asarray(ours.astype(jnp.float32)), expected)


def test_dynamic_map_is_bitsandbytes_map():
    ours = nf4.dynamic_map_signed()
    theirs = bnbf.create_dynamic_map(signed=True).numpy()
    assert ours.dtype == np.float32 and ours.shape == (256,)
    np.testing.assert_array_equal(ours, theirs)
    assert np.all(np.diff(ours) > 0)  # sorted, no repeats: "nearest" is well defined


def test_nf4_table_is_bitsandbytes_table():
    np.testing.assert_array_equal(nf4.NF4, bnbf.get_4bit_type("nf4", device="cpu").numpy())


# ---- one block by hand ---------------------------------------------------------------------------


def test_one_block_by_hand():
    """absmax 2: w/2 against the NF4 table (distances worked out below), packed high nibble
    first; one block, so offset = absmax = 2, absmax2 = 0 and the nested code is the 0.0 entry."""
    w = np.zeros(64, np.float32)
    # 2.0 -> s=1 -> code 15.  -2.0 -> s=-1 -> code 0.  1.0 -> s=0.5: |0.5-0.44071| = 0.05929 <
    # |0.5-0.56262| = 0.06262 -> code 12.  -0.1 -> s=-0.05: |-0.05+0.09105| = 0.04105 < 0.05 ->
    # code 6.  0.0795803 (= NF4[8]) -> s = NF4[8]/2, exactly the midpoint of codes 7 and 8 -> tie
    # -> code 7 (lower).  0.16 -> s=0.08: |0.08-0.07958| = 0.00042 -> code 8.  The rest: 0 -> 7.
    w[:7] = [2.0, -2.0, 1.0, -0.1, 0.07958029955625534, 0.16, 0.0]
    qw = quantize(w)
    packed = np.asarray(qw.packed)
    assert packed.shape == (32,)
    assert list(packed[:4]) == [0xF0, 0xC6, 0x78, 0x77]
    assert np.all(packed[4:] == 0x77)
    assert float(qw.offset) == 2.0 and float(qw.absmax2[0]) == 0.0
    assert nf4.DYNAMIC[int(qw.qabsmax[0])] == 0.0
    expected = 2.0 * nf4.NF4[[15, 0, 12, 6, 7, 8, 7]]  # absmax' = 0 * 0 + 2 exactly
    np.testing.assert_array_equal(np.asarray(dequantize(qw))[:7], expected)
    assert float(dequantize(qw)[2]) == pytest.approx(0.8814196586608887, abs=0)


# ---- error bound ---------------------------------------------------------------------------------

# |w - w'| <= |w - NF4[c] a| + |NF4[c]| |a - a'|  with a the block absmax, a' its dequantized value.
# First term: s = w/a lies in [-1, 1] and NF4[c] is its nearest table value, so |s - NF4[c]| is at
# most half the largest gap of the table (between -1 and -0.69619). Second: |NF4[c]| <= 1 and
# a - a' = (x - DYN[q] a2) with x = a - offset, |x| <= a2 and DYN[q] the nearest map value to x/a2:
# at most half the map's largest gap (0.0140625, the top decade's step) times a2. Float32 rounding
# of the scaling and the products adds a few ulps: 8 eps (a + a2 + |offset|) covers them.
NF4_HALF_GAP = float(np.max(np.diff(nf4.NF4.astype(np.float64)))) / 2
DYN_HALF_GAP = float(np.max(np.diff(nf4.DYNAMIC.astype(np.float64)))) / 2


@pytest.mark.parametrize("seed, make", [(10, normal), (11, heavy_tailed)])
def test_error_bound(seed, make):
    w = make((128, 256), seed).astype(np.float32)
    qw = quantize(w)
    err = np.abs(w - np.asarray(dequantize(qw))).reshape(-1, 64)
    a = np.abs(w).reshape(-1, 64).max(axis=1)
    a2 = np.repeat(np.asarray(qw.absmax2), 256)[: a.size]
    eps = np.finfo(np.float32).eps
    bound = NF4_HALF_GAP * a + DYN_HALF_GAP * a2 + 8 * eps * (a + a2 + abs(float(qw.offset)))
    assert NF4_HALF_GAP == pytest.approx(0.1519036, abs=1e-7)  # (1 - 0.6961928) / 2
    assert DYN_HALF_GAP == pytest.approx(0.00703125, abs=1e-7)
    assert np.all(err <= bound[:, None])
    assert np.max(err / bound[:, None]) > 0.5  # and it is nearly reached: not vacuous


# ---- storage ------------------------------------------------------------------------------------


@pytest.mark.parametrize("n", [64, 1000, 16384, 16386, 768 * 768, 768 * 3072])
def test_storage_bytes_formula(n):
    spec = n / 2 + math.ceil(n / 64) + 4 * math.ceil(n / 16384) + 4
    assert storage_bytes(n) == spec
    qw = jax.eval_shape(quantize, jax.ShapeDtypeStruct((n,), jnp.float32))
    assert qw.nbytes == spec
    if n >= 768 * 768:
        assert 8 * storage_bytes(n) / n == pytest.approx(4.127, abs=1e-3)
        assert storage_bytes(n) / (4 * n) == pytest.approx(4.127 / 32, rel=1e-3)


def test_storage_of_a_real_array_and_odd_sizes():
    qw = quantize(normal((33, 65), 12).astype(np.float32))  # 2145 weights: odd
    assert qw.nbytes == storage_bytes(2145) == 1073 + 34 + 4 + 4
    assert qw.packed.shape == (1073,) and qw.qabsmax.shape == (34,) and qw.absmax2.shape == (1,)
    assert int(qw.packed[-1]) & 15 == 7  # the padding element's code (0.0), as bitsandbytes


# ---- the pytree ---------------------------------------------------------------------------------


def test_quantized_weight_is_a_pytree_with_static_shape_and_dtype():
    w = jnp.asarray(normal((8, 128), 13), jnp.bfloat16)
    qw = quantize(w)
    leaves, tree = jax.tree.flatten(qw)
    assert [leaf.dtype for leaf in leaves] == [jnp.uint8, jnp.uint8, jnp.float32, jnp.float32]
    assert (qw.shape, qw.dtype, qw.size, qw.ndim) == ((8, 128), jnp.bfloat16, 1024, 2)
    again = jax.tree.unflatten(tree, leaves)
    assert again.shape == (8, 128) and again.dtype == jnp.bfloat16
    jitted = jax.jit(lambda q: dequantize(q))(qw)
    np.testing.assert_array_equal(np.asarray(jitted), np.asarray(dequantize(qw)))
    in_jit = jax.jit(quantize)(w)
    for a, b in zip(jax.tree.leaves(in_jit), leaves, strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


# ---- quantizing a model's parameters ------------------------------------------------------------


def test_quantize_params_replaces_only_block_projections():
    # d_ff = d_model: every projection is 64 x 64, so quantize compiles once.
    cfg = models.ModelConfig(
        vocab_size=96, context_length=16, d_model=64, n_heads=2, n_layers=2, d_ff=64
    )
    params = models.init(jax.random.key(0), cfg)
    quantized = quantize_params(params)
    flat, before = ptree.flatten(quantized), ptree.flatten(params)
    assert flat.keys() == before.keys()
    nf4_names = sorted(n for n, leaf in flat.items() if isinstance(leaf, QuantizedWeight))
    linear = ptree.flatten(ptree.mask(params, LINEAR_WEIGHTS))  # by per-layer names
    assert nf4_names == sorted(n for n, chosen in linear.items() if chosen)
    assert len(nf4_names) == 6  # q, k, v, output, expand, project, each stacked over 2 blocks
    for name, leaf in flat.items():
        if name not in nf4_names:
            assert leaf is before[name]  # embeddings, norms, biases, head: untouched
    # Stacked: one layer's shape, arrays leading with the layers, each layer the bytes it had
    # as a weight of its own.
    for name in nf4_names:
        qw = flat[name]
        assert qw.shape == before[name].shape[1:] and qw.lead_shape == (cfg.n_layers,)
        for i in range(cfg.n_layers):
            alone = quantize(before[name][i])
            for array, own in zip(jax.tree.leaves(qw), jax.tree.leaves(alone), strict=True):
                np.testing.assert_array_equal(array[i], own, err_msg=f"{name} layer {i}")
        np.testing.assert_array_equal(dequantize(qw)[1], dequantize(quantize(before[name][1])))
    sizes = weight_bytes(quantized)
    n_quant = sum(before[n].size for n in nf4_names)
    assert sizes["quantized_params"] == n_quant
    per_layer = sum(cfg.n_layers * storage_bytes(before[n][0].size) for n in nf4_names)
    assert sizes["quantized"] == per_layer
    assert sizes["quantized_as_float"] == 4 * n_quant
    assert sizes["float"] == 4 * (ptree.count(params) - n_quant)
    assert ptree.count(quantized) == ptree.count(params)  # counts see the original shapes


def test_quantize_params_rejects_patterns_that_miss_or_hit_non_linear_leaves():
    params = {"blocks": {"attention": {"query": {"weight": jnp.ones((2, 4, 64))}}}}
    with pytest.raises(ShapeError, match="pattern = 'blocks.*.attn.*'"):
        quantize_params(params, ["blocks.*.attn.*"])
    # One stacked NF4 weight holds every layer: a glob over some of them is refused.
    with pytest.raises(ShapeError, match=r"layers \[1\] of 2.*'blocks\.\*\.attention"):
        quantize_params(params, ["blocks.1.attention.query.weight"])
    both = quantize_params(params, ["blocks.attention.query.weight"])  # the stacked name: all
    assert isinstance(both["blocks"]["attention"]["query"]["weight"], QuantizedWeight)
    params["token_embedding"] = {"weight": jnp.ones((8, 64))}
    with pytest.raises(ShapeError, match="quantize_params patterns"):
        quantize_params({"token_embedding": params["token_embedding"]})
    bias = {"blocks": {"attention": {"query": {"bias": jnp.ones((2, 4))}}}}
    with pytest.raises(ShapeError, match="2-D"):
        quantize_params(bias, ["*.bias"])
    with pytest.raises(ShapeError, match="not quantized yet"):
        quantize_params(quantize_params(params))


# ---- bad input -----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "w, error, message",
    [
        (np.ones((4, 64), np.int32), ShapeError, "weight.dtype = 'int32'"),
        (np.zeros((0, 64), np.float32), ShapeError, "weight.shape = \\(0, 64\\)"),
        (np.float32(1.0), ShapeError, "at least one axis"),
        (np.array([1.0, np.nan, np.inf], np.float32), NonFiniteError, "2 NaN or infinite of 3"),
    ],
)
def test_rejects_bad_weights(w, error, message):
    with pytest.raises(error, match=message):
        quantize(w)


def test_dequantize_rejects_a_plain_array():
    with pytest.raises(ShapeError, match="a QuantizedWeight"):
        dequantize(jnp.ones((4, 64)))


def test_compute_dtype_cast_keeps_the_nf4_statistics_in_float32():
    """A bf16 forward casts every float leaf to bf16 (models.transformer.cast); a QuantizedWeight's
    absmax2 and offset are part of its format, and rounded to bf16 they decode other weights than
    `dequantize(qw, bfloat16)` (about 12% of them for this tensor): the cast must leave it whole."""
    from lmjax.models.transformer import cast

    qw = quantize(normal((32, 128), 14).astype(np.float32))
    tree = cast({"weight": qw, "bias": jnp.zeros(32)}, jnp.bfloat16)
    assert tree["bias"].dtype == jnp.bfloat16
    assert tree["weight"] is qw


def test_finite_weights_whose_block_scales_overflow_are_rejected():
    """offset = mean(absmax) is a float32 sum: two blocks at 3e38 overflow it to inf, and every
    dequantized weight would be NaN. A finite weight that large is an error, not silent NaNs."""
    w = np.full((2, 64), 3e38, np.float32)
    with pytest.raises(NonFiniteError, match="weight.*3e\\+38.*float32"):
        quantize(w)
    assert np.isfinite(np.asarray(dequantize(quantize(w / 1e4)))).all()


def test_non_finite_weight_under_jit_dequantizes_to_non_finite_everywhere():
    """Under jit nothing can raise: a NaN or inf must not pass for a plausible weight."""
    w = normal((2, 64), 15).astype(np.float32)
    for bad in (np.nan, np.inf):
        w[1, 3] = bad
        assert not np.isfinite(np.asarray(dequantize(jax.jit(quantize)(w)))).any()


def test_a_quantized_weight_has_no_plain_array_form(tmp_path):
    """np.asarray on a QuantizedWeight (e.g. saving quantized params to safetensors) used to make
    an object array and fail with "dtype('O') ... cast it first", a fix that cannot work. It must
    say what the value is and what to do instead."""
    from lmjax.io import safetensors

    qw = abstract_weight_like((8, 64))
    with pytest.raises(ShapeError, match=r"QuantizedWeight.*\(8, 64\).*dequantize"):
        np.asarray(qw)
    with pytest.raises(ShapeError, match="QuantizedWeight.*re-quantize"):
        safetensors.save({"layer": {"weight": qw}}, tmp_path / "q.safetensors")
    assert not list(tmp_path.iterdir())


def abstract_weight_like(shape):
    return jax.eval_shape(quantize, jax.ShapeDtypeStruct(shape, jnp.float32))


def test_quantize_params_keeps_embeddings_and_the_head_float():
    """Explicit patterns could select the embedding tables (gathered by row, never a matmul) or
    the head, and the model then failed far away on a QuantizedWeight; SPEC section 6 keeps them
    float, so quantize_params refuses them by name, saying which."""
    params = {
        "token_embedding": {"weight": jnp.ones((8, 64))},
        "language_model_head": {"weight": jnp.ones((8, 64))},
        "blocks": {"0": {"attention": {"query": {"weight": jnp.ones((4, 64))}}}},
    }
    for name in ("token_embedding.weight", "language_model_head.weight"):
        with pytest.raises(ShapeError, match=f"parameter '{name}'.*stay float"):
            quantize_params(params, [name])
    with pytest.raises(ShapeError, match="token_embedding.weight"):
        quantize_params(params, ["*.weight"])


def test_any_rank_is_its_row_major_flattening():
    """A 3-D weight is quantized as its row-major flattening (the layout bitsandbytes sees) and
    dequantizes back to its own shape and dtype."""
    w = jnp.asarray(on_grid(normal((2, 64, 256), 18)), jnp.bfloat16)  # the size of 128x256
    q3, flat = quantize(w), quantize(w.reshape(-1))
    for a, b in zip(jax.tree.leaves(q3), jax.tree.leaves(flat), strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    back = dequantize(q3)
    assert back.shape == (2, 64, 256) and back.dtype == jnp.bfloat16
    np.testing.assert_array_equal(np.asarray(back).reshape(-1), np.asarray(dequantize(flat)))
