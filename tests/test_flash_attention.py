"""The Pallas FlashAttention-2 kernels (SPEC section 7) against plain-jnp and XLA attention.

On CPU both kernels (GPU-style and TPU-style) run in interpret mode. With
`LMJAX_PALLAS_INTERPRET=0` the kernel of the machine's own backend runs compiled instead and the
other kernel's tests are skipped (`scripts/gpu_check.sh` does this on a GPU).

Every case compiles once (forward and backward in one jit) and is compared with the reference in
values, logsumexp and the VJP of random cotangents for (out, lse), so the dq, dk, dv of both
backward kernels are all checked, including the path through the logsumexp.
"""

import dataclasses
import itertools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from _pallas import (
    CUSTOM_CALL,
    INTERPRET,
    PLATFORM,
    kernel_param,
    lowered_text,
    skip_unless_runnable,
)

from lmjax.errors import ConfigError, ShapeError
from pallas_kernels import flash_attention as fa
from pallas_kernels.flash_attention import (
    BlockSizes,
    attention_reference,
    flash_attention,
    flash_attention_with_lse,
)
from pallas_kernels.flash_attention import plan as fa_plan
from pallas_kernels.flash_attention import vjp as fa_vjp

# float32: the kernel sums the same products as the reference in a different order (blocked,
# online rescaling, exp2 with log2(e) folded into the scale), so results differ by a few f32
# ulps of the largest entries; 1e-5 of max(1, max |reference|) leaves room for that and no more.
F32_RTOL = 1e-5
# bfloat16 inputs, float32 accumulation: the kernel rounds p (and ds) to bf16 before the
# p @ v (and ds @ k, ds^T @ q) matmuls, as every bf16 flash kernel does; one bf16 rounding is
# 2^-9 relative, a few of them summed stay well under 1e-2 of the largest entry.
BF16_RTOL = 1e-2
# float16 inputs: the same roundings at 2^-11 (10 mantissa bits against bf16's 7), so the bf16
# bound holds with room (about 1e-3 is seen). Its narrow range (max 65504) does not bite: the
# scores, softmax statistics and every sum are float32; only the inputs, p and ds are float16.
F16_RTOL = 1e-2
RTOL = {"float32": F32_RTOL, "bfloat16": BF16_RTOL, "float16": F16_RTOL}

GPU_BLOCKS = [BlockSizes(16, 16, 16, 16), BlockSizes(32, 16, 16, 32)]
TPU_BLOCKS = [BlockSizes(8, 16, 16, 8), BlockSizes(16, 8, 8, 24)]


KERNEL_PARAMS = [kernel_param("gpu"), kernel_param("tpu")]

# The compiled smoke subset `scripts/gpu_check.sh` runs first on a GPU, before its timings:
# pytest node ids in this file (the script reads this tuple with `ast`, so keep it a literal of
# plain strings; test_gpu_smoke_ids_name_fast_tests checks every id still names a fast test).
# One case per path: causal with ragged T != S and D padded, non-causal with ragged S and key
# padding, bf16 and f16 inputs, rows that see no key, causal block skipping, and the GPU
# backward on tiles of its own (dk/dv wide in keys, dq wide in queries).
GPU_SMOKE = (
    "test_matches_reference[b2t37s50h2d24-causal+0-none-float32-gpu]",
    "test_matches_reference[b2t37s50h2d24-full-padding-float32-gpu]",
    "test_bf16_inputs_accumulate_in_float32[gpu]",
    "test_f16_inputs_accumulate_in_float32[gpu]",
    "test_fully_masked_rows_give_zeros_and_zero_gradients[gpu]",
    "test_causal_skips_key_blocks_above_the_diagonal[gpu]",
    "test_backward_with_its_own_dq_tile[gpu]",
)


def sizes_for(kernel: str, sizes: BlockSizes) -> BlockSizes:
    """Compiled TPU key blocks must span the 128 lanes; interpret mode takes small ones."""
    if kernel == "tpu" and not INTERPRET:
        return dataclasses.replace(sizes, block_k=128, block_k_bwd=128)
    return sizes


@dataclasses.dataclass(frozen=True)
class Case:
    b: int
    t: int
    s: int
    h: int
    d: int
    causal: bool
    offset: int = 0
    mask: str = "none"  # "none", "padding" (a few keys of batch row 0 off), "empty_row"
    dtype: str = "float32"

    def __str__(self):
        causal = f"causal{self.offset:+d}" if self.causal else "full"
        return f"b{self.b}t{self.t}s{self.s}h{self.h}d{self.d}-{causal}-{self.mask}-{self.dtype}"

    def inputs(self, seed: int = 0):
        """q, k, v, mask and cotangents for (out, lse), from numpy (no per-shape compiles)."""
        rng = np.random.default_rng(seed)
        dtype = jnp.dtype(self.dtype)

        def normal(*shape, scale=1.0):
            return jnp.asarray(scale * rng.standard_normal(shape), dtype)

        # Scores of a few units make the online softmax rescale for real across blocks.
        q = normal(self.b, self.t, self.h, self.d, scale=2.0)
        k, v = normal(self.b, self.s, self.h, self.d), normal(self.b, self.s, self.h, self.d)
        mask = None
        if self.mask != "none":
            keep = np.ones((self.b, self.s), bool)
            keep[0, self.s // 3 : self.s // 3 + max(1, self.s // 4)] = False
            keep[-1, -1] = False
            if self.mask == "empty_row":
                keep[-1] = False  # the last batch row sees no key at all
            mask = jnp.asarray(keep)
        g_out = normal(self.b, self.t, self.h, self.d)
        g_lse = jnp.asarray(rng.standard_normal((self.b, self.h, self.t)), jnp.float32)
        return q, k, v, mask, g_out, g_lse


def _vjp_runner(attend):
    """jit(q, k, v, mask, g_out, g_lse -> out, lse, (dq, dk, dv)) for attend(q, k, v, mask)."""

    def run(q, k, v, mask, g_out, g_lse):
        (out, lse), pull = jax.vjp(lambda q, k, v: attend(q, k, v, mask), q, k, v)
        return out, lse, pull((g_out, g_lse))

    return jax.jit(run)


def run_flash(case: Case, kernel: str, sizes: BlockSizes, seed: int = 0):
    options = dict(block_sizes=sizes_for(kernel, sizes), backend=kernel, interpret=INTERPRET)

    def attend(q, k, v, mask):
        return flash_attention_with_lse(
            q, k, v, causal=case.causal, mask=mask, offset=case.offset, **options
        )

    return _vjp_runner(attend)(*case.inputs(seed))


def run_reference(case: Case, seed: int = 0):
    def attend(q, k, v, mask):
        return attention_reference(
            q, k, v, causal=case.causal, mask=mask, offset=case.offset, return_lse=True
        )

    with jax.default_matmul_precision("highest"):
        return _vjp_runner(attend)(*case.inputs(seed))


def assert_close(actual, expected, rtol: float, what: str):
    """|actual - expected| <= rtol * max(1, max |expected|); infinities must match exactly."""
    a, e = np.asarray(actual, np.float64), np.asarray(expected, np.float64)
    assert a.shape == e.shape, f"{what}: shape {a.shape} != {e.shape}"
    finite = np.isfinite(e)
    np.testing.assert_array_equal(a[~finite], e[~finite], err_msg=what)
    assert np.isfinite(a[finite]).all(), f"{what}: non-finite where the reference is finite"
    err = float(np.max(np.abs(a[finite] - e[finite]), initial=0.0))
    scale = max(1.0, float(np.max(np.abs(e[finite]), initial=0.0)))
    assert err <= rtol * scale, f"{what}: max error {err:.3g} > {rtol:g} * {scale:.3g}"


def assert_matches_reference(case: Case, kernel: str, sizes: BlockSizes, flash=None):
    """`flash`: run_flash(case, kernel, sizes) when the caller already has it (one compile)."""
    rtol = RTOL[case.dtype]
    out, lse, grads = run_flash(case, kernel, sizes) if flash is None else flash
    ref_out, ref_lse, ref_grads = run_reference(case)
    assert out.dtype == jnp.dtype(case.dtype) and lse.dtype == jnp.float32
    assert_close(out, ref_out, rtol, "out")
    assert_close(lse, ref_lse, rtol, "lse")
    for name, g, ref_g in zip(("dq", "dk", "dv"), grads, ref_grads, strict=True):
        assert g.dtype == jnp.dtype(case.dtype)
        assert_close(g, ref_g, rtol, name)


def reference_float64(case: Case, seed: int = 0):
    """out, lse and (dq, dk, dv) of `case` in numpy float64: an outside witness with no compile.

    s = q.k^T / sqrt(D) over the visible keys (u <= t + offset if causal, and mask[b, u]);
    lse = log sum_u exp(s), p = exp(s - lse), out = p @ v; rows with no visible key: out 0,
    lse -inf. With cotangents (dO, dlse): dv = p^T dO, ds = p * (dO.v^T - rowsum(dO * out) +
    dlse), dq = ds @ k / sqrt(D), dk = ds^T @ q / sqrt(D).
    """
    q, k, v, mask, g_out, g_lse = case.inputs(seed)
    q, k, v, g_out, g_lse = (np.asarray(x, np.float64) for x in (q, k, v, g_out, g_lse))
    scale = 1.0 / np.sqrt(case.d)
    visible_BHTS = np.ones((case.b, 1, case.t, case.s), bool)
    if case.causal:
        visible_BHTS &= np.arange(case.s)[None, :] <= np.arange(case.t)[:, None] + case.offset
    if mask is not None:
        visible_BHTS &= np.asarray(mask, bool)[:, None, None, :]
    s_BHTS = np.where(visible_BHTS, np.einsum("bthd,bshd->bhts", q, k) * scale, -np.inf)
    m_BHT1 = s_BHTS.max(-1, keepdims=True)
    m_BHT1 = np.where(np.isfinite(m_BHT1), m_BHT1, 0.0)  # empty rows: any finite shift
    e_BHTS = np.where(visible_BHTS, np.exp(s_BHTS - m_BHT1), 0.0)
    l_BHT1 = e_BHTS.sum(-1, keepdims=True)
    seen_BHT1 = l_BHT1 > 0
    lse_BHT = np.where(seen_BHT1, m_BHT1 + np.log(np.where(seen_BHT1, l_BHT1, 1.0)), -np.inf)
    p_BHTS = e_BHTS / np.where(seen_BHT1, l_BHT1, 1.0)
    out = np.einsum("bhts,bshd->bthd", p_BHTS, v)
    dv = np.einsum("bhts,bthd->bshd", p_BHTS, g_out)
    delta_BHT1 = np.einsum("bthd,bthd->bht", g_out, out)[..., None]
    ds_BHTS = p_BHTS * (np.einsum("bthd,bshd->bhts", g_out, v) - delta_BHT1 + g_lse[..., None])
    dq = np.einsum("bhts,bshd->bthd", ds_BHTS, k) * scale
    dk = np.einsum("bhts,bthd->bshd", ds_BHTS, q) * scale
    return out, lse_BHT[..., 0], (dq, dk, dv)


def assert_matches_float64(case: Case, kernel: str, sizes: BlockSizes):
    """The kernel against `reference_float64` (float32 cases), to F32_RTOL as above: the
    kernel's own float32 rounding is all that separates them."""
    assert case.dtype == "float32"
    out, lse, grads = run_flash(case, kernel, sizes)
    ref_out, ref_lse, ref_grads = reference_float64(case)
    assert out.dtype == lse.dtype == jnp.float32
    assert_close(out, ref_out, F32_RTOL, "out")
    assert_close(lse, ref_lse, F32_RTOL, "lse")
    for name, g, ref_g in zip(("dq", "dk", "dv"), grads, ref_grads, strict=True):
        assert g.dtype == jnp.float32
        assert_close(g, ref_g, F32_RTOL, name)


# ---- agreement with the reference: a representative fast subset ----------------------------------

FAST_CASES = [
    Case(1, 16, 16, 1, 16, causal=False),
    Case(2, 37, 50, 2, 24, causal=True),  # T != S, neither a multiple of the block, D = 24
    Case(2, 37, 50, 2, 24, causal=False, mask="padding"),
    Case(1, 20, 45, 2, 40, causal=True, offset=25, mask="padding"),  # decoding-style offset
    Case(2, 45, 20, 1, 8, causal=True, offset=-5),  # T > S; the first rows see no key
]


@pytest.mark.parametrize("kernel", KERNEL_PARAMS)
@pytest.mark.parametrize("case", FAST_CASES, ids=str)
def test_matches_reference(case, kernel):
    blocks = GPU_BLOCKS if kernel == "gpu" else TPU_BLOCKS
    assert_matches_reference(case, kernel, blocks[FAST_CASES.index(case) % len(blocks)])


@pytest.mark.parametrize("kernel", KERNEL_PARAMS)
def test_bf16_inputs_accumulate_in_float32(kernel):
    case = Case(2, 40, 40, 2, 32, causal=True, mask="padding", dtype="bfloat16")
    assert_matches_reference(case, kernel, GPU_BLOCKS[0] if kernel == "gpu" else TPU_BLOCKS[0])


@pytest.mark.parametrize("kernel", KERNEL_PARAMS)
def test_f16_inputs_accumulate_in_float32(kernel):
    # Small, and non-causal with a ragged S and padding: the bf16 test covers the causal path.
    case = Case(1, 24, 40, 2, 16, causal=False, mask="padding", dtype="float16")
    assert_matches_reference(case, kernel, GPU_BLOCKS[1] if kernel == "gpu" else TPU_BLOCKS[1])


# ---- the slow product: shapes x head dims x causal x kernels, the rest cycled --------------------

SEQUENCES = [(8, 8), (17, 45), (45, 17), (64, 64)]
HEAD_DIMS = [8, 40, 64]
CYCLED = [  # (batch, heads, mask, offset) - cycled through the product so each value recurs
    (1, 1, "none", 0),
    (2, 3, "padding", 0),
    (3, 2, "none", 3),
    (2, 1, "empty_row", -2),
]


def _slow_cases():
    product = itertools.product(SEQUENCES, HEAD_DIMS, (False, True), ("gpu", "tpu"))
    for n, ((t, s), d, causal, kernel) in enumerate(product):
        # n % 4 is the (causal, kernel) pair; shifting by n // 4 gives every pair every
        # batch/heads/mask/offset row of CYCLED, and both block-size settings.
        b, h, mask, offset = CYCLED[(n + n // 4) % len(CYCLED)]
        sizes = (GPU_BLOCKS if kernel == "gpu" else TPU_BLOCKS)[n // 8 % 2]
        case = Case(b, t, s, h, d, causal=causal, offset=offset if causal else 0, mask=mask)
        blocks = f"{sizes.block_q}x{sizes.block_k}"
        yield pytest.param(case, kernel, sizes, id=f"{case}-{kernel}-{blocks}")


@pytest.mark.slow
@pytest.mark.parametrize("case, kernel, sizes", list(_slow_cases()))
def test_matches_reference_product(case, kernel, sizes):
    # Against the float64 numpy witness: no reference compile per case (a third of the CPU of
    # a case), and the fast subset above still checks the kernels against the jnp reference.
    skip_unless_runnable(kernel)
    assert_matches_float64(case, kernel, sizes)


# ---- agreement with jax.nn.dot_product_attention (XLA) -------------------------------------------


@pytest.mark.parametrize("kernel", KERNEL_PARAMS)
@pytest.mark.parametrize("causal, masked", [(True, False), (False, True)])
def test_matches_jax_nn_dot_product_attention(kernel, causal, masked):
    # jax.nn's causal mask is top-left aligned (key u <= query t): offset 0 here.
    case = Case(2, 40, 40, 2, 24, causal=causal, mask="padding" if masked else "none")
    q, k, v, mask, g_out, _ = case.inputs(seed=3)

    def xla(q, k, v):
        mask_B11S = None if mask is None else mask[:, None, None, :]
        return jax.nn.dot_product_attention(
            q, k, v, mask=mask_B11S, is_causal=causal, implementation="xla"
        )

    sizes = sizes_for(kernel, GPU_BLOCKS[1] if kernel == "gpu" else TPU_BLOCKS[1])
    options = dict(block_sizes=sizes, backend=kernel, interpret=INTERPRET)

    def flash(q, k, v):
        return flash_attention(q, k, v, causal=causal, mask=mask, **options)

    def out_and_grads(attend):
        out, pull = jax.vjp(attend, q, k, v)
        return out, pull(g_out)

    with jax.default_matmul_precision("highest"):
        expected = jax.jit(lambda: out_and_grads(xla))()
    actual = jax.jit(lambda: out_and_grads(flash))()
    pairs = zip(jax.tree.leaves(actual), jax.tree.leaves(expected), strict=True)
    for name, (a, e) in zip(("out", "dq", "dk", "dv"), pairs, strict=True):
        assert_close(a, e, F32_RTOL, name)


# ---- rows with no visible key, and causal block skipping -----------------------------------------


@pytest.mark.parametrize("kernel", KERNEL_PARAMS)
def test_fully_masked_rows_give_zeros_and_zero_gradients(kernel):
    # offset -3: queries 0..2 see no key; the mask hides every key of the last batch row.
    case = Case(2, 20, 20, 2, 16, causal=True, offset=-3, mask="empty_row")
    sizes = GPU_BLOCKS[0] if kernel == "gpu" else TPU_BLOCKS[0]
    flash = run_flash(case, kernel, sizes)
    out, lse, dq, dk, dv = (np.asarray(x) for x in jax.tree.leaves(flash))
    assert all(np.isfinite(x).all() for x in (out, dq, dk, dv)), "NaN or inf leaked"
    # Batch row 1 has no visible key anywhere; batch row 0 loses its first three queries.
    assert np.all(out[1] == 0.0) and np.all(out[0, :3] == 0.0)
    assert np.all(lse[1] == -np.inf) and np.all(lse[0, :, :3] == -np.inf)
    assert np.all(np.isfinite(lse[0, :, 3:]))
    assert np.all(dq[1] == 0.0) and np.all(dq[0, :3] == 0.0)
    assert np.all(dk[1] == 0.0) and np.all(dv[1] == 0.0)
    # Keys 17.. are seen only by queries >= 20: nobody. Their gradient is exactly zero.
    assert np.all(dk[0, 17:] == 0.0) and np.all(dv[0, 17:] == 0.0)
    assert np.abs(out[0, 3:]).max() > 0  # the visible rows are not zeroed as well
    assert_matches_reference(case, kernel, sizes, flash)  # the same run: compiled once


@pytest.mark.parametrize("kernel", KERNEL_PARAMS)
def test_causal_skips_key_blocks_above_the_diagonal(kernel):
    """NaN keys in blocks no query can see: skipped blocks are never read, so nothing leaks.

    (A block that is computed and merely masked would give p = 0 but 0 * NaN = NaN in p @ v.)
    """
    blk = 128 if kernel == "tpu" and not INTERPRET else 16  # compiled TPU key blocks: 128
    t, s = blk, 4 * blk  # one query block, four key blocks: three lie above the diagonal
    rng = np.random.default_rng(4)
    q = jnp.asarray(rng.standard_normal((1, t, 2, 16)), jnp.float32)
    k, v = (jnp.asarray(rng.standard_normal((1, s, 2, 16)), jnp.float32) for _ in range(2))
    k_nan, v_nan = k.at[:, t:].set(jnp.nan), v.at[:, t:].set(jnp.nan)
    sizes = BlockSizes(blk, blk, blk, blk) if kernel == "gpu" else BlockSizes(8, blk, 8, blk)

    def attend(q, k, v, causal):
        return flash_attention(
            q, k, v, causal=causal, block_sizes=sizes, backend=kernel, interpret=INTERPRET
        )

    out, pull = jax.vjp(lambda q, k, v: attend(q, k, v, True), q, k_nan, v_nan)
    dq, dk, dv = pull(jnp.ones_like(out))
    expected = attention_reference(q, k[:, :t], v[:, :t], causal=True)
    assert_close(out, expected, F32_RTOL, "out")
    assert np.isfinite(np.asarray(dq)).all()
    assert np.all(np.asarray(dk)[:, t:] == 0.0) and np.all(np.asarray(dv)[:, t:] == 0.0)
    # The same NaN keys do poison the output when their blocks are visited (non-causal).
    assert np.isnan(np.asarray(attend(q, k_nan, v_nan, False))).all()


@pytest.mark.parametrize("kernel", [kernel_param("gpu")])
def test_backward_with_its_own_dq_tile(kernel):
    """dk/dv over 64-key blocks in 16-query steps, dq over 64-query blocks in 16-key steps (the
    Hopper head-128 entry's 32 x 128 / 128 x 32, halved): causal, key padding, ragged T != S,
    several blocks of each. In GPU_SMOKE, so a GPU compiles this layout;
    tests/test_flash_backward_tiles.py checks it further, interpreted."""
    sizes = BlockSizes(16, 16, 16, 64, block_q_dq=64, block_k_dq=16)
    assert_matches_reference(Case(2, 100, 90, 2, 24, causal=True, mask="padding"), kernel, sizes)


# ---- the compiled paths at least lower on this host ----------------------------------------------


@pytest.mark.parametrize("kernel, platform", [("gpu", "cuda"), ("tpu", "tpu")])
@pytest.mark.parametrize(
    "causal, s, has_mask",
    [(True, 300, True), (False, 300, False), (False, 256, True), (True, 256, False)],
    ids=["causal-ragged-mask", "full-ragged", "full-even-mask", "causal-even"],
)
def test_compiled_kernels_lower_for_their_platform(kernel, platform, causal, s, has_mask):
    """Lower forward + backward to Triton / Mosaic IR (no device needed); running them
    compiled is scripts/gpu_check.sh's job on a GPU. Ragged S (not a block multiple) and
    non-causal calls take different loop-bound code paths, so both are lowered."""
    q = jax.ShapeDtypeStruct((2, 200, 4, 40), jnp.bfloat16)
    k = jax.ShapeDtypeStruct((2, s, 4, 40), jnp.bfloat16)
    mask = jax.ShapeDtypeStruct((2, s), jnp.int32) if has_mask else None
    sizes = BlockSizes.default(kernel)
    plan = fa_plan.make_plan(q.shape, k.shape, sizes, kernel, False, causal, 5, has_mask)

    def loss(q, k, v, mask):
        out, lse = fa_vjp.flash_padded(plan, q, k, v, mask)
        return out.astype(jnp.float32).sum() + jnp.where(jnp.isfinite(lse), lse, 0.0).sum()

    text = lowered_text(jax.grad(loss, (0, 1, 2)), q, k, k, mask, platform=platform)
    assert text.count(CUSTOM_CALL[kernel]) == 3  # forward, dq, dk/dv


@pytest.mark.parametrize("kernel, platform", [("gpu", "cuda"), ("tpu", "tpu")])
@pytest.mark.parametrize("groups", [1, 4])
def test_gqa_window_segments_lower_for_their_platform(kernel, platform, groups):
    """Grouped-query attention (8 query heads on 8 // groups key/value heads: the dk/dv
    kernels' loop or grid axis over a group), a sliding window, segment ids and a key mask,
    ragged T and S: forward + backward lower to Triton / Mosaic IR (test_flash_gqa runs them
    interpreted; tests/test_tpu_compile.py compiles the TPU one with libtpu)."""
    q = jax.ShapeDtypeStruct((2, 200, 8, 64), jnp.bfloat16)
    k = jax.ShapeDtypeStruct((2, 300, 8 // groups, 64), jnp.bfloat16)
    q_ids, kv_ids = (jax.ShapeDtypeStruct((2, n), jnp.int32) for n in (200, 300))
    mask = jax.ShapeDtypeStruct((2, 300), jnp.int32)
    sizes = BlockSizes.default(kernel)
    plan = fa_plan.make_plan(
        q.shape, k.shape, sizes, kernel, False, True, 100, True, window=96, has_segments=True
    )
    assert plan.groups == groups

    def loss(q, k, v, mask, q_ids, kv_ids):
        out, lse = fa_vjp.flash_padded(plan, q, k, v, mask, q_ids, kv_ids)
        return out.astype(jnp.float32).sum() + jnp.where(jnp.isfinite(lse), lse, 0.0).sum()

    grad = jax.grad(loss, (0, 1, 2))
    text = lowered_text(grad, q, k, k, mask, q_ids, kv_ids, platform=platform)
    assert text.count(CUSTOM_CALL[kernel]) == 3


# ---- the GPU smoke subset is addressable -------------------------------------------------------


def test_gpu_smoke_ids_name_fast_tests():
    """Collect GPU_SMOKE by node id (in process, nothing runs): each id names exactly one test
    of this file and none is slow, so `scripts/gpu_check.sh` cannot lose one to a rename."""

    class Collected:
        def pytest_collection_finish(self, session):
            self.items = list(session.items)

    collected = Collected()
    node_ids = [f"{__file__}::{test_id}" for test_id in GPU_SMOKE]
    args = ["--collect-only", "-q", "-p", "no:cacheprovider", *node_ids]
    assert pytest.main(args, plugins=[collected]) == pytest.ExitCode.OK
    assert sorted(item.name for item in collected.items) == sorted(GPU_SMOKE)
    assert not [item.name for item in collected.items if item.get_closest_marker("slow")]


# ---- configuration: backends, interpret mode, padding --------------------------------------------


def test_default_backend_choice_is_explicit():
    kernel, interpret = fa.resolve_backend(None, None)
    if PLATFORM == "cpu":
        assert (kernel, interpret) == (fa.CPU_KERNEL, True) == ("gpu", True)
    else:
        assert (kernel, interpret) == (PLATFORM, False)
    assert fa.resolve_backend("tpu", True) == ("tpu", True)


def _plan(kernel, t, s, d, sizes=None):
    sizes = sizes or BlockSizes.default(kernel)
    return fa_plan.make_plan((1, t, 1, d), (1, s, 1, d), sizes, kernel, True, True, 0, False)


def test_padding_plan_follows_each_backend():
    gpu, tpu = _plan("gpu", 37, 50, 24), _plan("tpu", 37, 50, 24)
    # Default blocks (128/64) shrink to the sequence rounded up to a power of two (64) ...
    assert (gpu.bq, gpu.bk, gpu.bq_bwd, gpu.bk_bwd) == (64, 64, 64, 64)
    assert (gpu.t_pad, gpu.s_pad, gpu.d_pad) == (64, 64, 32)  # ... and D 24 -> 32
    # ... or, on TPU, to a multiple of 8; D goes to the 128 lanes.
    assert (tpu.bq, tpu.bk, tpu.t_pad, tpu.s_pad, tpu.d_pad) == (40, 56, 40, 56, 128)
    assert gpu.scale == tpu.scale == pytest.approx(1 / np.sqrt(24))  # the unpadded head dim
    # Unequal TPU blocks: 64 shrinks to 48, a multiple of 16, so T = 40 pads to 48 (not 80).
    mixed = _plan("tpu", 40, 8, 8, BlockSizes(16, 8, 64, 8))
    assert (mixed.bq, mixed.bq_bwd, mixed.t_pad) == (16, 48, 48)


# ---- bad input -----------------------------------------------------------------------------------


def _qkv(t=8, s=8, d=16):
    return jnp.zeros((2, t, 2, d)), jnp.zeros((2, s, 2, d)), jnp.zeros((2, s, 2, d))


@pytest.mark.parametrize(
    "make, message",
    [
        (lambda q, k, v: (q[0], k, v), "rank 4"),
        (lambda q, k, v: (q, k, v[:, :4]), r"\(k.shape, v.shape\)"),
        (lambda q, k, v: (q, k[..., :8], v[..., :8]), r"both \[2, S, 2, 16\]"),
        (lambda q, k, v: (q, k[:1], v[:1]), r"both \[2, S, 2, 16\]"),
        (lambda q, k, v: (q, k.astype(jnp.bfloat16), v), "k.dtype"),
        (lambda q, k, v: (q.astype(jnp.int32), k, v), "q.dtype"),
        (lambda q, k, v: (q, k[:, :0], v[:, :0]), "zero-size"),
    ],
)
def test_rejects_bad_shapes_and_dtypes(make, message):
    with pytest.raises(ShapeError, match=message):
        flash_attention(*make(*_qkv()), causal=True)


def test_rejects_a_mask_that_is_not_b_by_s():
    q, k, v = _qkv()
    with pytest.raises(ShapeError, match=r"\[B, S\] key padding"):
        flash_attention(q, k, v, causal=False, mask=jnp.ones((2, 1, 1, 8)))


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(block_q=0), r"BlockSizes.block_q = 0; expected a positive int"),
        (dict(block_k=-16), "BlockSizes.block_k"),
        (dict(block_q_bwd=32.0), "positive int"),
        (dict(num_warps=0), "BlockSizes.num_warps"),
    ],
)
def test_block_sizes_must_be_positive_ints(kwargs, message):
    with pytest.raises(ConfigError, match=message):
        BlockSizes(**kwargs)


def test_block_sizes_are_frozen():
    with pytest.raises(dataclasses.FrozenInstanceError):
        BlockSizes().block_q = 32


@pytest.mark.parametrize(
    "kernel, sizes, interpret, message",
    [
        ("gpu", BlockSizes(block_q=24), True, "block_q = 24; expected a power of two >= 16"),
        ("gpu", BlockSizes(block_k_bwd=8), True, "block_k_bwd = 8; expected a power of two"),
        ("tpu", BlockSizes(12, 16, 16, 16), True, "block_q = 12; expected a multiple of 8"),
        ("tpu", BlockSizes(128, 64, 128, 128), False, "block_k = 64; expected a multiple of 128"),
    ],
)
def test_block_sizes_must_fit_the_backend(kernel, sizes, interpret, message):
    q, k, v = _qkv()
    with pytest.raises(ConfigError, match=message):
        flash_attention(
            q, k, v, causal=True, block_sizes=sizes, backend=kernel, interpret=interpret
        )


def test_unsupported_backends_are_named_not_silently_replaced():
    q, k, v = _qkv()
    with pytest.raises(ConfigError, match=r"backend = 'cuda'; expected one of \('gpu', 'tpu'\)"):
        flash_attention(q, k, v, causal=True, backend="cuda")
    other = "tpu" if PLATFORM != "tpu" else "gpu"
    with pytest.raises(ConfigError, match=f"backend='{other}' compiled.*interpret=True"):
        flash_attention(q, k, v, causal=True, backend=other, interpret=False)
    with pytest.raises(ConfigError, match="block_sizes"):
        flash_attention(q, k, v, causal=True, block_sizes=(64, 64))


@pytest.mark.parametrize("offset", [1.5, True, jnp.asarray(2)])
def test_offset_must_be_a_static_int(offset):
    q, k, v = _qkv()
    with pytest.raises(ConfigError, match="offset = .*a static Python int"):
        flash_attention(q, k, v, causal=True, offset=offset)
