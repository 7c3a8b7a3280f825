"""The TPU (Mosaic) kernels compiled by the real TPU compiler, on this CPU host (issue 22).

libtpu (the test extra) compiles for named TPU topologies with no TPU present:
`jax.experimental.topologies.get_topology_desc(topology_name=..., platform="tpu")` gives
compile-only devices, and `jax.jit(f).lower(*abstract_args).compile()` under
`jax.default_device(device)` runs Mosaic and XLA's TPU backend for real (the kernels follow the
default device's platform, `pallas_kernels._backend.platform()`, so `backend=None` picks the TPU
kernel, as it will inside a model). Nothing runs: a case passes when the compiler accepts it and
the executable holds the kernel's own custom calls, with the outputs' dtypes and shapes of the
contract. tests/conftest.py sets JAX_PLATFORMS=cpu, so jax itself stays on the CPU.

Flash attention: forward and backward (jax.grad compiles the forward, dq and dk/dv kernels)
over a covering set, not the product: every level of each factor (topology v4/v5e/v6e; causal
or not; causal offset 0, > 0 and < 0; key-padding mask or none; T and S multiples of the blocks
or not; head dims 64, 80, 128, 256; float32, bfloat16, float16; the default BlockSizes and two
others) appears in at least one case. NF4 matmul: forward and input gradient, odd M, O and I
(I an odd number of 64-blocks: the kernel needs I % 64 == 0, other I are refused before Mosaic).

Float16 (found here): Mosaic refuses float16 vectors in both kernels ("Invalid vector type for
load", "failed to legalize operation 'tpu.pack_subelements'"), so the TPU path computes float16
in float32 and rounds the results once (the kernels' docstrings); the last tests check those
numerics with the TPU kernels interpreted, against the float32 reference.

Cost: about 1-2 s per compile on 2 cores (13 compiles, plus libtpu's start of about 1 s).
"""

from __future__ import annotations

import dataclasses
import importlib.util
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental import topologies

from lmjax.errors import ShapeError
from lmjax.quant import nf4
from lmjax.train import tpu_compile  # its compiles keep out of jax's persistent cache
from pallas_kernels import _backend
from pallas_kernels import flash_attention as fa
from pallas_kernels.flash_attention import BlockSizes as FlashBlocks
from pallas_kernels.flash_attention import attention_reference, flash_attention_with_lse
from pallas_kernels.nf4_matmul import BlockSizes as NF4Blocks
from pallas_kernels.nf4_matmul import nf4_matmul, nf4_matmul_reference
from pallas_kernels.nf4_matmul import pallas as nm

pytestmark = pytest.mark.needs("libtpu")  # tests/conftest.py: LMJAX_TEST_WITHOUT
TOPOLOGIES = {"v4": "v4:2x2x1", "v5e": "v5e:2x2", "v6e": "v6e:2x2"}
DEVICE_KIND = {"v4": "TPU v4", "v5e": "TPU v5 lite", "v6e": "TPU v6 lite"}
FLASH_KERNELS = ("flash_attention_fwd_tpu", "flash_attention_dq_tpu", "flash_attention_dkdv_tpu")
NF4_KERNELS = ("nf4_matmul_fwd_tpu", "nf4_matmul_dx_tpu")
# The dtype (HLO spelling) the TPU kernels compute inputs of each dtype in.
KERNEL_DTYPE = {"float32": "f32", "bfloat16": "bf16", "float16": "f32"}


@pytest.fixture(scope="module")
def tpu_device():
    """name -> the first compile-only device of that topology (libtpu, no TPU needed)."""
    assert importlib.util.find_spec("libtpu") is not None, (
        "libtpu is missing: it comes with the test extra, pip install -e '.[test]'"
    )
    cache = {}

    def get(name: str):
        if name not in cache:
            topo = topologies.get_topology_desc(topology_name=TOPOLOGIES[name], platform="tpu")
            cache[name] = topo.devices[0]
            assert cache[name].device_kind == DEVICE_KIND[name]
        return cache[name]

    return get


def _compile_for(device, f, *args):
    """f jitted, lowered for `device` (the default device, so the kernels pick the TPU path) and
    compiled by libtpu; -> the compiled executable."""
    with jax.default_device(device), tpu_compile.no_persistent_cache():
        assert _backend.platform() == "tpu"
        return jax.jit(f).lower(*args).compile()


def _custom_calls(compiled, names) -> dict[str, list[str]]:
    """name -> the compiled HLO lines that define that kernel's custom call."""
    lines = compiled.as_text().splitlines()
    return {
        n: [ln for ln in lines if f"%{n}" in ln.split("=")[0] and "tpu_custom_call" in ln]
        for n in names
    }


# ---- flash attention -------------------------------------------------------------------------

DEFAULT = None
SMALL = FlashBlocks(64, 128, 32, 128)  # forward q blocks of 64, backward of 32
LARGE = FlashBlocks(256, 256, 128, 256)


@dataclasses.dataclass(frozen=True)
class FlashCase:
    topology: str
    t: int
    s: int
    d: int
    dtype: str
    causal: bool
    offset: int = 0
    mask: bool = False
    sizes: FlashBlocks | None = DEFAULT

    def __str__(self):
        causal = f"causal{self.offset:+d}" if self.causal else "full"
        blocks = "default" if self.sizes is None else "-".join(map(str, self.sizes.blocks.values()))
        mask = "mask" if self.mask else "nomask"
        return f"{self.topology}-t{self.t}s{self.s}d{self.d}-{causal}-{mask}-{self.dtype}-{blocks}"


# Ragged: 200, 300, 130, 390, 333 are not multiples of any block used (128, 256, 64, 32).
FLASH_CASES = [
    FlashCase("v5e", 256, 256, 64, "float32", causal=True),
    FlashCase("v6e", 200, 300, 80, "bfloat16", causal=True, offset=100, mask=True, sizes=SMALL),
    FlashCase("v4", 300, 200, 128, "bfloat16", causal=False, mask=True, sizes=LARGE),
    FlashCase("v5e", 130, 390, 256, "float32", causal=False, sizes=SMALL),
    FlashCase("v6e", 200, 180, 64, "float16", causal=True, offset=-20, mask=True),
    FlashCase("v4", 512, 512, 256, "bfloat16", causal=True, sizes=LARGE),
    FlashCase("v5e", 333, 333, 80, "float16", causal=True, offset=7, sizes=LARGE),
    FlashCase("v4", 64, 333, 128, "float32", causal=True, offset=269, mask=True, sizes=SMALL),
]


def test_flash_cases_cover_every_factor_level():
    """The covering set leaves no level out (the cases are chosen by hand, this keeps them so)."""
    ragged = lambda c: c.t % 128 != 0 or c.s % 128 != 0  # noqa: E731
    seen = {
        "topology": {c.topology for c in FLASH_CASES},
        "d": {c.d for c in FLASH_CASES},
        "dtype": {c.dtype for c in FLASH_CASES},
        "causal": {c.causal for c in FLASH_CASES},
        "offset": {int(np.sign(c.offset)) for c in FLASH_CASES if c.causal},
        "mask": {c.mask for c in FLASH_CASES},
        "ragged": {ragged(c) for c in FLASH_CASES},
        "sizes": {c.sizes for c in FLASH_CASES},
    }
    assert seen == {
        "topology": set(TOPOLOGIES),
        "d": {64, 80, 128, 256},
        "dtype": {"float32", "bfloat16", "float16"},
        "causal": {True, False},
        "offset": {-1, 0, 1},
        "mask": {True, False},
        "ragged": {True, False},
        "sizes": {DEFAULT, SMALL, LARGE},
    }


def _flash_loss(case: FlashCase):
    def loss(q, k, v, mask):
        out, lse = flash_attention_with_lse(
            q, k, v, causal=case.causal, mask=mask, offset=case.offset, block_sizes=case.sizes
        )
        # lse enters too, so its cotangent path (delta - dlse) is compiled; -inf rows drop out.
        finite_lse = jnp.where(jnp.isfinite(lse), lse, 0.0)
        return out.astype(jnp.float32).sum() + finite_lse.sum()

    return loss


@pytest.mark.parametrize("case", FLASH_CASES, ids=str)
def test_flash_attention_compiles_for_tpu(case, tpu_device):
    dtype = jnp.dtype(case.dtype)
    q = jax.ShapeDtypeStruct((1, case.t, 2, case.d), dtype)
    k = jax.ShapeDtypeStruct((1, case.s, 2, case.d), dtype)
    mask = jax.ShapeDtypeStruct((1, case.s), jnp.bool_) if case.mask else None
    grad = jax.grad(_flash_loss(case), argnums=(0, 1, 2))
    compiled = _compile_for(tpu_device(case.topology), grad, q, k, k, mask)

    calls = _custom_calls(compiled, FLASH_KERNELS)
    assert {n: len(c) for n, c in calls.items()} == dict.fromkeys(FLASH_KERNELS, 1)
    # The forward kernel's output [B, H, T', D']: float16 runs as float32 on the TPU, and the
    # head dim is padded to 128 lanes.
    out_type = calls["flash_attention_fwd_tpu"][0].split("=", 1)[1].lstrip(" (").split("{")[0]
    d_pad = -(-case.d // 128) * 128
    assert out_type.startswith(f"{KERNEL_DTYPE[case.dtype]}[1,2,") and out_type.endswith(
        f",{d_pad}]"
    ), out_type
    dq, dk, dv = compiled.out_info
    assert (dq.shape, dk.shape, dv.shape) == (q.shape, k.shape, k.shape)
    assert {dq.dtype, dk.dtype, dv.dtype} == {dtype}


def test_flash_attention_forward_alone_compiles_for_tpu(tpu_device):
    """Inference (no grad): only the forward kernel, explicit backend, float16 out."""
    q = jax.ShapeDtypeStruct((2, 1, 4, 128), jnp.float16)  # one decode step over a cache
    k = jax.ShapeDtypeStruct((2, 300, 4, 128), jnp.float16)
    mask = jax.ShapeDtypeStruct((2, 300), jnp.bool_)

    def attend(q, k, v, mask):
        return flash_attention_with_lse(
            q, k, v, causal=True, offset=299, mask=mask, backend="tpu", interpret=False
        )

    compiled = _compile_for(tpu_device("v6e"), attend, q, k, k, mask)
    calls = _custom_calls(compiled, FLASH_KERNELS)
    assert [len(calls[n]) for n in FLASH_KERNELS] == [1, 0, 0]
    out, lse = compiled.out_info
    assert (out.shape, out.dtype, lse.shape, lse.dtype) == (q.shape, q.dtype, (2, 4, 1), "float32")


def test_flash_attention_gqa_window_segments_compile_for_tpu(tpu_device):
    """Grouped-query attention (8 query heads on 2 key/value heads), a sliding window and
    segment ids, forward and backward, on v5e: the dk/dv grid's five axes (B, Hkv, key blocks,
    G, query blocks), the segment blocks ([Q, 1] rows, [1, K] lanes) and T = S = 300 ragged
    (padded ids) all pass Mosaic; dk and dv come back with Hkv heads."""
    q = jax.ShapeDtypeStruct((1, 300, 8, 64), jnp.bfloat16)
    k = jax.ShapeDtypeStruct((1, 300, 2, 64), jnp.bfloat16)
    ids = jax.ShapeDtypeStruct((1, 300), jnp.int32)

    def loss(q, k, v, ids):
        out, lse = flash_attention_with_lse(
            q, k, v, causal=True, window=160, q_segment_ids=ids, kv_segment_ids=ids
        )
        return out.astype(jnp.float32).sum() + jnp.where(jnp.isfinite(lse), lse, 0.0).sum()

    grad = jax.grad(loss, argnums=(0, 1, 2))
    compiled = _compile_for(tpu_device("v5e"), grad, q, k, k, ids)
    calls = _custom_calls(compiled, FLASH_KERNELS)
    assert {n: len(c) for n, c in calls.items()} == dict.fromkeys(FLASH_KERNELS, 1)
    dq, dk, dv = compiled.out_info
    assert (dq.shape, dk.shape, dv.shape) == (q.shape, k.shape, k.shape)


# ---- NF4 matmul --------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class NF4Case:
    topology: str
    lead: tuple[int, ...]
    o: int
    i: int
    dtype: str
    sizes: NF4Blocks | None = None


NF4_CASES = [
    NF4Case("v4", (7,), 129, 320, "float32"),  # M 7, O 129, I 5 blocks of 64
    NF4Case("v5e", (3, 11), 333, 576, "bfloat16", NF4Blocks(16, 128, 256)),  # M 33, I 9 blocks
    NF4Case("v6e", (5,), 77, 192, "float16"),  # float16 runs as float32 (module docstring)
]


@pytest.mark.parametrize("case", NF4_CASES, ids=lambda c: f"{c.topology}-{c.dtype}")
def test_nf4_matmul_forward_and_input_gradient_compile_for_tpu(case, tpu_device):
    x = jax.ShapeDtypeStruct((*case.lead, case.i), jnp.dtype(case.dtype))
    qw = jax.eval_shape(nf4.quantize, jax.ShapeDtypeStruct((case.o, case.i), jnp.float32))
    bias = jax.ShapeDtypeStruct((case.o,), jnp.float32)

    def loss(x, qw, bias):
        y = nf4_matmul(x, qw, bias, block_sizes=case.sizes)
        return y.astype(jnp.float32).sum(), y

    run = jax.value_and_grad(loss, argnums=(0, 2), has_aux=True)
    compiled = _compile_for(tpu_device(case.topology), run, x, qw, bias)

    calls = _custom_calls(compiled, NF4_KERNELS)
    assert {n: len(c) for n, c in calls.items()} == dict.fromkeys(NF4_KERNELS, 1)
    y_type = calls["nf4_matmul_fwd_tpu"][0].split("=", 1)[1].lstrip(" (")
    assert y_type.startswith(KERNEL_DTYPE[case.dtype] + "["), y_type
    (_, y), (dx, db) = compiled.out_info
    assert (y.shape, y.dtype) == ((*case.lead, case.o), x.dtype)
    assert (dx.shape, dx.dtype, db.shape) == (x.shape, x.dtype, bias.shape)


def test_nf4_matmul_refuses_in_features_off_the_64_blocks_before_mosaic():
    """Odd I (blocks straddling rows) is a ShapeError naming the fallback, not a Mosaic error."""
    qw = nf4.quantize(jnp.ones((3, 101), jnp.float32))
    with pytest.raises(ShapeError, match="nf4_matmul_reference"):
        nf4_matmul(jnp.ones((5, 101), jnp.float32), qw, backend="tpu", interpret=False)


# ---- float16 on the TPU path: computed in float32, rounded once ---------------------------------
# Bound: the float32 kernel is within F32_RTOL of the float32 reference (relative to
# max(1, max |ref|), as in test_flash_attention / test_nf4_matmul), and rounding to float16 adds
# at most half an ulp, 2^-11 relative. Float16 operands inside the kernel (p, ds and the decoded
# weight rounded to float16) would miss this bound by far.
F32_RTOL = 1e-5
F16_HALF_ULP = 2.0**-11


def _assert_float32_rounded_once(got, want_f32, what: str):
    got, want = np.asarray(got, np.float64), np.asarray(want_f32, np.float64)
    assert got.dtype == want.dtype and got.shape == want.shape
    bound = F16_HALF_ULP * np.abs(want) + 1.001 * F32_RTOL * max(1.0, np.abs(want).max())
    excess = np.abs(got - want) - bound
    assert excess.max() <= 0, f"{what}: {np.sum(excess > 0)} entries off by {excess.max():.3g}"


def test_float16_flash_on_the_tpu_kernel_is_float32_rounded_once():
    """TPU kernel interpreted; causal with an offset, key padding, ragged T and S; out, lse and
    dq, dk, dv against the float32 reference on the same (exactly upcast) inputs."""
    rng = np.random.default_rng(0)
    b, t, s, h, d = 1, 24, 40, 2, 16
    q, k, v = (
        jnp.asarray(rng.standard_normal(shape) * scale, jnp.float16)
        for shape, scale in (((b, t, h, d), 2.0), ((b, s, h, d), 1.0), ((b, s, h, d), 1.0))
    )
    mask = jnp.asarray(np.arange(s)[None, :] % 7 != 3)
    g_out = jnp.asarray(rng.standard_normal((b, t, h, d)), jnp.float16)
    g_lse = jnp.asarray(rng.standard_normal((b, h, t)), jnp.float32)
    options = dict(causal=True, offset=s - t, mask=mask)

    def flash(q, k, v):
        blocks = FlashBlocks(8, 16, 16, 8)
        return flash_attention_with_lse(
            q, k, v, **options, block_sizes=blocks, backend="tpu", interpret=True
        )

    def reference(q, k, v):
        return attention_reference(q, k, v, **options, return_lse=True)

    (out, lse), pull = jax.vjp(flash, q, k, v)
    grads = pull((g_out, g_lse))
    f32 = [x.astype(jnp.float32) for x in (q, k, v)]
    (out_r, lse_r), pull_r = jax.vjp(reference, *f32)
    grads_r = pull_r((g_out.astype(jnp.float32), g_lse))
    assert out.dtype == jnp.float16 and {g.dtype for g in grads} == {jnp.dtype(jnp.float16)}
    _assert_float32_rounded_once(out, out_r, "out")
    np.testing.assert_allclose(lse, lse_r, rtol=F32_RTOL, atol=F32_RTOL)  # lse stays float32
    for name, g, g_r in zip(("dq", "dk", "dv"), grads, grads_r, strict=True):
        _assert_float32_rounded_once(g, g_r, name)


def test_float16_nf4_on_the_tpu_kernel_is_float32_rounded_once():
    """TPU kernel interpreted, odd M and O, two k steps: y and dx against the float32 reference
    (which decodes the weight in float32, exactly lmjax.quant.dequantize's values)."""
    rng = np.random.default_rng(1)
    m, o, i = 7, 24, 128
    qw = nf4.quantize(jnp.asarray(rng.standard_normal((o, i)), jnp.float32))
    x = jnp.asarray(rng.standard_normal((m, i)), jnp.float16)
    g = jnp.asarray(rng.standard_normal((m, o)), jnp.float16)
    blocks = NF4Blocks(8, 8, 64)

    def kernel(x):
        return nf4_matmul(x, qw, block_sizes=blocks, backend="tpu", interpret=True)

    y, pull = jax.vjp(kernel, x)
    (dx,) = pull(g)
    y_r, pull_r = jax.vjp(lambda x: nf4_matmul_reference(x, qw), x.astype(jnp.float32))
    (dx_r,) = pull_r(g.astype(jnp.float32))
    assert (y.dtype, dx.dtype) == (jnp.float16, jnp.float16)
    _assert_float32_rounded_once(y, y_r, "y")
    _assert_float32_rounded_once(dx, dx_r, "dx")


def test_other_dtypes_and_kernels_compute_as_themselves():
    """Only float16 on the TPU kernel is upcast; the GPU kernel keeps float16 operands."""
    for module in (nm, fa):
        assert module._compute_dtype("tpu", jnp.float16) == jnp.float32
        assert module._compute_dtype("gpu", jnp.float16) == jnp.float16
        for dtype in (jnp.float32, jnp.bfloat16):
            assert module._compute_dtype("tpu", dtype) == dtype
    assert math.isclose(F16_HALF_ULP, float(jnp.finfo(jnp.float16).eps) / 2)
