"""The Pallas NF4 matmul (SPEC section 7) against its reference and against x @ dequantize(W)^T.

On CPU both kernels (GPU-style and TPU-style) run interpreted. With `LMJAX_PALLAS_INTERPRET=0`
the kernel of the machine's own backend runs compiled and the other kernel's tests are skipped.

Every case runs forward and backward in one jit and checks y, dx (the kernel's own dx kernel)
and db against (a) `nf4_matmul_reference` (jax.grad through plain jnp) and (b) numpy in float64
on the dequantized weight (`lmjax.quant.dequantize`, checked against bitsandbytes in
tests/test_quant_nf4.py), so the kernels are tied to an outside witness through that chain.
"""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from _benchmarks import load_benchmark
from _pallas import (
    CUSTOM_CALL,
    INTERPRET,
    PLATFORM,
    lowered_text,
    skip_unless_runnable,
)

from lmjax import models
from lmjax.errors import ConfigError, ShapeError
from lmjax.quant import dequantize, quantize
from pallas_kernels import nf4_matmul as nm
from pallas_kernels.nf4_matmul import BlockSizes, nf4_matmul, nf4_matmul_reference
from pallas_kernels.nf4_matmul import pallas as nm_pallas
from pallas_kernels.nf4_matmul import plan as nm_plan

# float32: the kernel sums the same products as the reference in another order (tiles of
# block_k, even and odd columns apart), so results differ by a few float32 ulps of the largest
# partial sums: 1e-5 of max(1, max |expected|) bounds that with room and no more.
F32_RTOL = 1e-5
# bfloat16 x: both sides round the decoded weight to bf16 identically and accumulate in f32;
# only the final rounding of y (or dx) to bf16 can differ, by one bf16 ulp (2^-8 relative) of the
# largest entry, plus the f32 order effects: 1e-2 of the scale.
BF16_RTOL = 1e-2
RTOL = {"float32": F32_RTOL, "bfloat16": BF16_RTOL}


@dataclasses.dataclass(frozen=True)
class Case:
    lead: tuple[int, ...]  # leading axes of x
    o: int
    i: int
    bias: bool
    dtype: str
    kernel: str
    sizes: BlockSizes

    def __str__(self):
        lead = "x".join(map(str, self.lead))
        bias = "bias" if self.bias else "nobias"
        s = self.sizes
        blocks = f"{s.block_m}-{s.block_n}-{s.block_k}"
        return f"{lead}-o{self.o}-i{self.i}-{bias}-{self.dtype}-{self.kernel}-{blocks}"


def sizes_for(case: Case) -> BlockSizes:
    """Compiled TPU tiles follow its tiling (16, 128, 256); interpreted, small ones do."""
    if case.kernel == "tpu" and not INTERPRET:
        return BlockSizes(16, 128, 256)
    return case.sizes


def inputs(case: Case, seed: int = 0):
    rng = np.random.default_rng(seed)
    dtype = jnp.dtype(case.dtype)
    w = (rng.standard_normal((case.o, case.i)) * 0.1).astype(np.float32)
    x = jnp.asarray(rng.standard_normal((*case.lead, case.i)), dtype)
    bias = jnp.asarray(rng.standard_normal((case.o,)), dtype) if case.bias else None
    g = jnp.asarray(rng.standard_normal((*case.lead, case.o)), dtype)
    return quantize(w), x, bias, g


def _value_and_grads(matmul, qw, x, bias, g):
    """y and the VJP of g for x, bias and the quantized weight's float leaves (absmax2, offset),
    which must come back zero: the weight is frozen."""

    def run(x, bias, absmax2, offset, g):
        def f(x, b, absmax2, offset):
            return matmul(x, dataclasses.replace(qw, absmax2=absmax2, offset=offset), b)

        y, pull = jax.vjp(f, x, bias, absmax2, offset)
        return y, *pull(g)

    return jax.jit(run)(x, bias, qw.absmax2, qw.offset, g)


def assert_close(actual, expected, rtol: float, what: str):
    a, e = np.asarray(actual, np.float64), np.asarray(expected, np.float64)
    assert a.shape == e.shape, f"{what}: shape {a.shape} != {e.shape}"
    assert np.isfinite(a).all(), f"{what}: non-finite"
    err = float(np.max(np.abs(a - e)))
    scale = max(1.0, float(np.max(np.abs(e))))
    assert err <= rtol * scale, f"{what}: max error {err:.3g} > {rtol:g} * {scale:.3g}"


def assert_matches(case: Case):
    qw, x, bias, g = inputs(case)
    options = dict(block_sizes=sizes_for(case), backend=case.kernel, interpret=INTERPRET)
    y, dx, db, d_absmax2, d_offset = _value_and_grads(
        lambda x, w, b: nf4_matmul(x, w, b, **options), qw, x, bias, g
    )
    assert not np.asarray(d_absmax2).any() and float(d_offset) == 0.0  # frozen weight
    with jax.default_matmul_precision("highest"):
        y_ref, dx_ref, *_ = _value_and_grads(nf4_matmul_reference, qw, x, bias, g)
    rtol = RTOL[case.dtype]
    assert y.dtype == dx.dtype == x.dtype
    assert_close(y, y_ref, rtol, "y vs reference")
    assert_close(dx, dx_ref, rtol, "dx vs reference")
    # Float64 on the dequantized weight (rounded to x's dtype, as both sides use it).
    w = np.asarray(dequantize(qw, x.dtype), np.float64)
    x64, g64 = np.asarray(x, np.float64), np.asarray(g, np.float64)
    y64 = x64 @ w.T + (0.0 if bias is None else np.asarray(bias, np.float64))
    assert_close(y, y64, rtol, "y vs float64 x @ W^T")
    assert_close(dx, g64 @ w, rtol, "dx vs float64 g @ W")
    if bias is None:
        assert db is None
    else:
        assert_close(db, g64.reshape(-1, case.o).sum(axis=0), rtol, "db")


G16 = BlockSizes(16, 16, 64)
G32 = BlockSizes(16, 32, 128)  # two quantization blocks per tile
T8 = BlockSizes(8, 16, 128)
T16 = BlockSizes(16, 8, 64)

FAST_CASES = [
    # M = 5, O = 40, I = 192: every axis ragged against its tile; three block_k steps.
    Case((5,), 40, 192, True, "float32", "gpu", G16),
    # Two leading axes; I = 320 pads to 384; two quantization blocks decoded per tile.
    Case((2, 3), 33, 320, False, "float32", "gpu", G32),
    Case((3, 4), 24, 128, True, "bfloat16", "gpu", G32),
    Case((2, 5), 20, 192, True, "bfloat16", "tpu", T16),
]


@pytest.mark.parametrize("case", FAST_CASES, ids=str)
def test_matches_reference_and_dequantized_matmul(case):
    skip_unless_runnable(case.kernel)
    assert_matches(case)


def _slow_cases():
    """Each shape on both kernels, the dtype and block sizes alternating: 6 cases (many K steps,
    every axis ragged, a long reduction over 1024 in-features)."""
    shapes = [((7,), 24, 256), ((4, 9), 130, 320), ((33,), 8, 1024)]
    for n, ((lead, o, i), kernel) in enumerate((s, k) for s in shapes for k in ("gpu", "tpu")):
        dtype = ("float32", "bfloat16")[(n + n // 2) % 2]
        sizes = (G16, G32)[n // 2 % 2] if kernel == "gpu" else (T8, T16)[n // 2 % 2]
        yield Case(lead, o, i, n % 3 != 0, dtype, kernel, sizes)


@pytest.mark.slow
@pytest.mark.parametrize("case", list(_slow_cases()), ids=str)
def test_matches_reference_product(case):
    skip_unless_runnable(case.kernel)
    assert_matches(case)


# ---- the frozen weight and lmjax.models.project -------------------------------------------------


def test_linear_dispatches_quantized_weights():
    """On CPU, models.project runs nf4_matmul_tiled for a QuantizedWeight (the kernel runs
    compiled on GPU/TPU only); values and gradients against float64 on the dequantized weight."""
    qw, x, bias, g = inputs(Case((2, 3), 24, 128, True, "float32", "gpu", G16), seed=2)
    y, dx, db, d_absmax2, _ = _value_and_grads(
        lambda x, w, b: models.project({"weight": w, "bias": b}, x), qw, x, bias, g
    )
    w = np.asarray(dequantize(qw), np.float64)
    x64, g64 = np.asarray(x, np.float64), np.asarray(g, np.float64)
    assert_close(y, x64 @ w.T + np.asarray(bias, np.float64), F32_RTOL, "y")
    assert_close(dx, g64 @ w, F32_RTOL, "dx")
    assert_close(db, g64.sum(axis=(0, 1)), F32_RTOL, "db")
    assert not np.asarray(d_absmax2).any()
    params = {"weight": qw, "bias": bias}
    assert_close(models.project(params, x, reference=True), y, F32_RTOL, "linear_reference")
    # In-features that are not a multiple of 64 take the reference path (blocks span rows).
    ragged = quantize(np.asarray(jax.random.normal(jax.random.key(0), (8, 100))))
    x100 = jnp.ones((3, 100))
    expected = np.asarray(x100, np.float64) @ np.asarray(dequantize(ragged), np.float64).T
    assert_close(models.project({"weight": ragged}, x100), expected, F32_RTOL, "ragged")
    with pytest.raises(ShapeError, match="linear params keys"):
        models.project({"weight": qw, "scale": bias}, x)


# ---- the compiled paths at least lower on this host --------------------------------------------


@pytest.mark.parametrize("kernel, platform", [("gpu", "cuda"), ("tpu", "tpu")])
def test_compiled_kernels_lower_for_their_platform(kernel, platform):
    """Forward and dx lowered to Triton / Mosaic (no device needed), bf16, every axis ragged
    (M 200, O 300, I 768 against the default tiles); running them compiled is
    scripts/gpu_check.sh's job on a GPU."""
    sizes = BlockSizes.default(kernel)
    plan = nm_plan.make_plan(200, 300, 768, sizes, kernel, False)

    def loss(x, packed, scales):
        return nm_pallas._nf4_padded(plan, x, packed, scales).astype(jnp.float32).sum()

    args = (
        jax.ShapeDtypeStruct((200, 768), jnp.bfloat16),
        jax.ShapeDtypeStruct((300, 384), jnp.uint8),
        jax.ShapeDtypeStruct((300, 12), jnp.float32),
    )
    # value_and_grad: from jax 0.12 the lowering drops a forward whose value is unused, and
    # the forward kernel is one of the two this test looks for.
    text = lowered_text(jax.value_and_grad(loss), *args, platform=platform)
    assert text.count(CUSTOM_CALL[kernel]) == 2  # forward, dx
    # ... and they are the two kernels (not the forward twice): each by its pallas_call name.
    assert f"nf4_matmul_fwd_{kernel}" in text and f"nf4_matmul_dx_{kernel}" in text


# ---- plan and configuration ---------------------------------------------------------------------


def test_padding_plan_follows_each_backend():
    gpu = nm_plan.make_plan(5, 40, 192, BlockSizes(), "gpu", True)
    # Default 64 x 64 x 128 tiles shrink to the axis' power of two (M 5 -> 16, O 40 -> 64) ...
    assert (gpu.bm, gpu.bn, gpu.bk) == (16, 64, 128)
    assert (gpu.m_pad, gpu.o_pad, gpu.i_pad, gpu.nk, gpu.nq) == (16, 64, 256, 2, 2)
    tpu = nm_plan.make_plan(5, 40, 192, BlockSizes.default("tpu"), "tpu", True)
    # ... or, on TPU interpreted, to a multiple of 8 (and of 64 for block_k) ...
    assert (tpu.bm, tpu.bn, tpu.bk, tpu.m_pad, tpu.o_pad, tpu.i_pad) == (8, 40, 192, 8, 40, 192)
    # ... and compiled, to its tiling: 16 rows, 128 output lanes, 256 in-features.
    tpu = nm_plan.make_plan(5, 40, 192, BlockSizes.default("tpu"), "tpu", False)
    assert (tpu.bm, tpu.bn, tpu.bk, tpu.m_pad, tpu.o_pad, tpu.i_pad) == (16, 128, 256, 16, 128, 256)


def test_default_backend_choice_is_explicit():
    if PLATFORM == "cpu":
        assert nm.resolve_backend(None, None) == ("gpu", True)
    else:
        assert nm.resolve_backend(None, None) == (PLATFORM, False)
    assert nm.resolve_backend("tpu", True) == ("tpu", True)
    with pytest.raises(ConfigError, match=r"backend = 'cuda'; expected one of \('gpu', 'tpu'\)"):
        nm.resolve_backend("cuda", None)
    other = "tpu" if PLATFORM != "tpu" else "gpu"
    qw, x = abstract_weight(16, 128), jnp.ones((2, 128))
    with pytest.raises(ConfigError, match=f"backend='{other}' compiled.*interpret=True"):
        nf4_matmul(x, qw, backend=other, interpret=False)


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(block_m=0), "BlockSizes.block_m = 0; expected a positive int"),
        (dict(block_k=96), "block_k = 96; expected a multiple of 64"),
        (dict(block_n=16.0), "positive int"),
        (dict(num_warps=0), "BlockSizes.num_warps"),
    ],
)
def test_block_sizes_must_be_positive_ints(kwargs, message):
    with pytest.raises(ConfigError, match=message):
        BlockSizes(**kwargs)


def test_block_sizes_are_frozen_and_must_fit_the_backend():
    with pytest.raises(dataclasses.FrozenInstanceError):
        BlockSizes().block_m = 32
    qw, x = abstract_weight(16, 128), jnp.ones((2, 128))
    cases = [
        ("gpu", True, BlockSizes(block_m=24), "block_m = 24; expected a power of two"),
        ("gpu", True, BlockSizes(block_k=192), "block_k = 192; expected a power of two"),
        ("tpu", True, BlockSizes(12, 16, 64), "block_m = 12; expected a multiple of 8"),
        ("tpu", False, BlockSizes(8, 128, 256), "block_m = 8; expected a multiple of 16"),
        ("tpu", False, BlockSizes(16, 64, 256), "block_n = 64; expected a multiple of 128"),
    ]
    for kernel, interpret, sizes, message in cases:
        with pytest.raises(ConfigError, match=message):
            nf4_matmul(x, qw, block_sizes=sizes, backend=kernel, interpret=interpret)
    with pytest.raises(ConfigError, match="block_sizes"):
        nf4_matmul(x, qw, block_sizes=(64, 64, 64))


# ---- bad input -----------------------------------------------------------------------------------


def abstract_weight(*shape):
    """A QuantizedWeight of ShapeDtypeStructs: the checks read only shapes, nothing compiles."""
    return jax.eval_shape(quantize, jax.ShapeDtypeStruct(shape, jnp.float32))


def test_rejects_bad_inputs():
    qw = abstract_weight(16, 128)
    x = jnp.ones((2, 128))
    bad = [
        (lambda: nf4_matmul(x, jnp.ones((16, 128))), "weight = 'ArrayImpl'; expected a Quant"),
        (lambda: nf4_matmul(x[:, :64], qw), r"x.shape = \(2, 64\); expected \[..., 128\]"),
        (lambda: nf4_matmul(x.astype(jnp.int32), qw), "x.dtype = 'int32'"),
        (lambda: nf4_matmul(x, qw, jnp.ones(8)), r"bias.shape = \(8,\); expected \(16,\)"),
        (lambda: nf4_matmul(jnp.ones((0, 128)), qw), "non-empty"),
        (lambda: nf4_matmul(x, abstract_weight(4, 4, 64)), r"expected \[out, in\]"),
        (
            lambda: nf4_matmul(jnp.ones((2, 96)), abstract_weight(8, 96)),
            "in-features = 96; expected a multiple of 64.*nf4_matmul_reference",
        ),
    ]
    for call, message in bad:
        with pytest.raises(ShapeError, match=message):
            call()


# ---- the GPU benchmark script runs its argument handling here -------------------------------


def test_gpu_benchmark_script_parses_and_skips_without_a_gpu(capsys):
    bench = load_benchmark("nf4_matmul_gpu")
    assert bench.parse_shape("768x3072") == (768, 3072)
    for bad in ("768", "768x100", "0x64"):
        with pytest.raises(Exception, match="OUTxIN|multiple of 64"):
            bench.parse_shape(bad)
    if PLATFORM != "gpu":
        assert bench.main([]) == 0
        assert bench.main(["--require-gpu"]) == 1
        assert "no GPU" in capsys.readouterr().out


def test_gpu_benchmark_points_and_target_verdicts():
    """Issue 32's shapes and rows are the defaults; a verdict needs a measured, compiled value,
    and a point the budget skipped counts as not measured for each of its three targets."""
    bench = load_benchmark("nf4_matmul_gpu")
    assert bench.SHAPES == ((768, 768), (3072, 768), (4096, 4096), (11008, 4096))
    assert set(bench.TOKENS) == {16, 4096}
    assert bench.TARGETS["ratio_bf16_over_nf4"] == {16: 2.5, 4096: 0.8}
    assert bench.verdict(2.6, 2.5, True, False) == "met"
    assert bench.verdict(2.4, 2.5, True, False) == "not met"
    assert bench.verdict(6.0, 5.0, False, False) == "not met"
    assert bench.verdict(4.0, 5.0, False, False) == "met"
    assert bench.verdict(None, 2.5, True, False) == "not measured"
    assert bench.verdict(9.0, 2.5, True, True) == "not measured"  # an interpreted kernel
    assert bench.verdict(9.0, None, True, False) == "no target"
    row = {"tokens": 16, "out": 8, "in": 64, "nf4": {"compile_s": {"fwd": 1.5, "fwd_dx": 2.0}},
           "ratio_bf16_over_nf4_fwd": 3.0, "ratio_bf16_over_nf4_fwd_dx": 2.0}  # fmt: skip
    row["targets"] = bench.targets(row, interpreted=False)
    assert row["targets"]["nf4_compile_s"] == {"value": 3.5, "at_most": 5.0, "verdict": "met"}
    summary = bench.target_verdicts([row], [(16, 8, 64), (4096, 8, 64)])
    assert summary["counts"] == {"met": 2, "not met": 1, "not measured": 3}


@pytest.mark.slow
def test_gpu_benchmark_script_runs_interpreted_on_a_tiny_shape(tmp_path):
    """The whole flow with --allow-cpu (kernel interpreted): every candidate block size timed,
    the three impls measured, and the kernel's output equal to the XLA path's."""
    import json

    bench = load_benchmark("nf4_matmul_gpu")
    args = ["--allow-cpu", "--tokens", "16", "--shapes", "64x128", "--calls", "1"]
    assert bench.main([*args, "--samples", "1", "--results-dir", str(tmp_path)]) == 0
    result = json.loads((tmp_path / "nf4_matmul_gpu.json").read_text())
    assert result["status"] == "done" and result["nf4_interpreted"]
    [row] = result["rows"]
    assert all(row[f"t_{impl}_fwd_dx_ms"] > 0 for impl in bench.IMPLS)
    assert len(row["nf4_candidates"]) == len(bench.CANDIDATES)
    assert row["max_abs_diff_nf4_vs_nf4_xla"] <= 1e-2  # bf16 outputs below 1: a few bf16 ulps
    assert row["nf4"]["compile_s"]["fwd"] > 0 and row["nf4"]["compile_s"]["fwd_dx"] > 0
    assert {t["verdict"] for t in row["targets"].values()} == {"not measured"}  # interpreted
    assert row["targets"]["ratio_bf16_over_nf4_fwd"]["at_least"] == 2.5
    assert result["target_verdicts"]["counts"] == {"not measured": 3}


def test_gradients_over_a_tree_holding_a_quantized_weight():
    """QLoRA code differentiates trees that hold QuantizedWeights: jax.vjp / grad(allow_int=True)
    give float0 for the uint8 leaves and zeros for absmax2/offset; value_and_grad over another
    argument works under jit; plain jax.grad over the tree is JAX's usual integer-input error."""
    qw, x, bias, _ = inputs(Case((3,), 16, 64, True, "float32", "gpu", G16), seed=3)
    params = {"weight": qw, "bias": bias}

    def loss(p, x):
        return jnp.sum(models.project(p, x) ** 2)

    grads = jax.grad(loss, allow_int=True)(params, x)
    assert grads["weight"].packed.dtype == grads["weight"].qabsmax.dtype == jax.dtypes.float0
    assert not np.asarray(grads["weight"].absmax2).any() and float(grads["weight"].offset) == 0
    y = models.project(params, x)
    np.testing.assert_allclose(grads["bias"], 2 * np.asarray(y).sum(axis=0), rtol=1e-6)
    value, dx = jax.jit(jax.value_and_grad(loss, argnums=1))(params, x)
    assert float(value) == pytest.approx(float(loss(params, x)), rel=1e-6)
    w = np.asarray(dequantize(qw), np.float64)
    y64 = np.asarray(x, np.float64) @ w.T + np.asarray(bias, np.float64)
    assert_close(dx, 2 * y64 @ w, F32_RTOL, "dx under jit")
    with pytest.raises(TypeError, match="allow_int"):
        jax.grad(loss)(params, x)


def test_ops_linear_refuses_an_nf4_weight_and_points_at_models_project():
    """ops.linear is the dense primitive only: an NF4 weight (or a LoRA entry) is one ShapeError
    naming models.project, the one place that runs adapted and quantized layers."""
    from lmjax import ops

    qw, x, _, _ = inputs(Case((2,), 8, 64, False, "float32", "gpu", G16), seed=4)
    with pytest.raises(ShapeError, match="models.project"):
        ops.linear({"weight": qw}, x)
    with pytest.raises(ShapeError, match="models.project"):
        ops.linear({"weight": jnp.ones((8, 64)), "lora": None}, x)
