"""The GPU backward's own tiles and layout (issue 33 item 2), interpreted on CPU.

The dk/dv kernel holds a wide key block and steps over narrow query blocks, the dq kernel the
transpose (`BlockSizes.block_q_dq`, `block_k_dq`), and the dk/dv kernel forms its tiles as
[K, Q] (s^T = k q^T). Checked here at CPU scale (dk/dv 16 queries x 64 keys, dq 64 x 16: the
Hopper head-128 entry's 32 x 128 / 128 x 32 halved, several blocks per sequence), with causal,
window, segment ids, a key-padding mask and grouped-query attention: against a float64 numpy
witness, and against the same kernels on one square backward tile (the shape of the 64 x 64
backward issue 33 measured) to float32 rounding. Then the plan and checks of the new fields,
and the dk/dv kernel's structure (its dots give [K, Q] tiles and nothing is transposed).

Cost: about 10 s on 2 cores (four interpreted forward+backward compiles, one trace).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.extend.core as jax_core
import jax.numpy as jnp
import numpy as np
import pytest
from test_flash_attention import F32_RTOL, assert_close
from test_flash_gqa import Case as GqaCase
from test_flash_gqa import _visible_numpy as visible_numpy

from lmjax.errors import ConfigError
from pallas_kernels.flash_attention import BlockSizes, flash_attention_with_lse
from pallas_kernels.flash_attention import plan as fa_plan
from pallas_kernels.flash_attention.plan import check_blocks

# dk/dv: 16 queries x 64 keys; dq: 64 queries x 16 keys. The forward's tile is the same in both
# settings, so out and lse are too, and only the backward's blocking differs.
ASYMMETRIC = BlockSizes(16, 16, 16, 64, block_q_dq=64, block_k_dq=16)
SQUARE = BlockSizes(16, 16, 32, 32)  # both backward kernels on one 32 x 32 tile
EPS32 = float(np.finfo(np.float32).eps)


@dataclasses.dataclass(frozen=True)
class Case(GqaCase):
    """test_flash_gqa's case, with documents long enough for these tiles (`segments="long"`)
    and its arrays in numpy (the witness below reads them too)."""

    def inputs(self, seed: int = 7):
        """q, k, v, mask, (q ids, kv ids), cotangents (dO, dlse): float32."""
        rng = np.random.default_rng(seed)

        def normal(*shape, scale=1.0):
            return (scale * rng.standard_normal(shape)).astype(np.float32)

        q = normal(self.b, self.t, self.h, self.d, scale=2.0)
        k, v = (normal(self.b, self.s, self.h_kv, self.d) for _ in range(2))
        ids = (None, None)
        if self.segments == "long":
            # Documents end inside 16-blocks and on them (32, 64), then padding (id 0).
            ends = ([0, 11, 32, 47, 70, 90], [0, 40, 64, 85, 90])
            rows = np.zeros((self.b, max(self.t, self.s)), np.int32)
            for row, cut in zip(rows, ends, strict=True):
                for n, (lo, hi) in enumerate(zip(cut, cut[1:], strict=False)):
                    row[lo:hi] = n + 1
            ids = (rows[:, : self.t], rows[:, : self.s])
        mask = None
        if self.masked:
            mask = np.ones((self.b, self.s), bool) if ids[1] is None else ids[1] != 0
            mask[0, 5:9] = False
        g_out, g_lse = normal(self.b, self.t, self.h, self.d), normal(self.b, self.h, self.t)
        return q, k, v, mask, ids, g_out, g_lse


CASES = [
    # GQA 4 -> 2, causal, window 40, packed documents with padding (masked), T = S = 100:
    # ragged against every tile (padded to 128: two 64-key blocks, eight 16-query steps).
    Case(
        "gqa-causal-window-packed-mask",
        2,
        100,
        100,
        4,
        2,
        16,
        True,
        window=40,
        segments="long",
        masked=True,
    ),
    # Multi-head, not causal, a decoding-style offset with no rule using it, key padding,
    # T != S, D = 24 padded to 32.
    Case("mha-full-mask-ragged", 2, 72, 120, 2, 2, 24, False, offset=9, masked=True),
]


def witness(case: Case):
    """float64 (out, lse, (dq, dk, dv)) and the accumulated magnitudes (A_dq, A_dk, A_dv): the
    sums of |term| each gradient element adds up, for the rounding bound below.

    Query head h reads key/value head h // G; dk, dv sum over the G heads of a group.
    ds = p * (dp - delta), delta = rowsum(dO * out) - dlse; its terms' magnitude is taken as
    p * (|dp| + |delta|), what the kernel rounds before the subtraction cancels anything.
    """
    q, k, v, _, _, g_out, g_lse = case.inputs()
    g = case.h // case.h_kv
    q, g_out, g_lse = (np.asarray(x, np.float64) for x in (q, g_out, g_lse))
    k, v = (np.repeat(np.asarray(x, np.float64), g, axis=2) for x in (k, v))
    c = 1.0 / np.sqrt(case.d)
    seen = visible_numpy(case)[:, None]  # [B, 1, T, S]
    s = np.where(seen, np.einsum("bthd,bshd->bhts", q, k) * c, -np.inf)
    m = np.max(s, -1, keepdims=True)
    m = np.where(np.isfinite(m), m, 0.0)  # rows that see no key: any finite shift
    e = np.where(seen, np.exp(s - m), 0.0)
    l_sum = e.sum(-1, keepdims=True)
    l_safe = np.where(l_sum > 0, l_sum, 1.0)
    p = e / l_safe
    lse = np.where(l_sum > 0, m + np.log(l_safe), -np.inf)[..., 0]
    out = np.einsum("bhts,bshd->bthd", p, v)
    delta = np.einsum("bthd,bthd->bht", g_out, out)[..., None] - g_lse[..., None]
    dp = np.einsum("bthd,bshd->bhts", g_out, v)
    ds, ds_abs = p * (dp - delta), p * (np.abs(dp) + np.abs(delta))

    def per_kv(x):  # [B, S, H, D] -> [B, S, Hkv, D], summing each group
        return x.reshape(*x.shape[:2], case.h_kv, g, x.shape[-1]).sum(3)

    grads = (
        np.einsum("bhts,bshd->bthd", ds, k) * c,
        per_kv(np.einsum("bhts,bthd->bshd", ds, q)) * c,
        per_kv(np.einsum("bhts,bthd->bshd", p, g_out)),
    )
    magnitudes = (
        np.einsum("bhts,bshd->bthd", ds_abs, np.abs(k)) * c,
        per_kv(np.einsum("bhts,bthd->bshd", ds_abs, np.abs(q))) * c,
        per_kv(np.einsum("bhts,bthd->bshd", p, np.abs(g_out))),
    )
    return out, lse, grads, magnitudes


def run_flash(case: Case, sizes: BlockSizes):
    q, k, v, mask, ids, g_out, g_lse = case.inputs()
    options = dict(causal=case.causal, offset=case.offset, window=case.window)
    options |= dict(block_sizes=sizes, backend="gpu", interpret=True)

    @jax.jit
    def run(q, k, v, mask, ids, g_out, g_lse):
        def attend(q, k, v):
            return flash_attention_with_lse(
                q, k, v, mask=mask, q_segment_ids=ids[0], kv_segment_ids=ids[1], **options
            )

        (out, lse), pull = jax.vjp(attend, q, k, v)
        return out, lse, pull((g_out, g_lse))

    return run(q, k, v, mask, ids, g_out, g_lse)


def rounding_bound(case: Case, sizes: tuple[BlockSizes, BlockSizes]) -> list[float]:
    """Relative bound (a multiple of float32's eps) on |one - other| / A for dq, dk, dv of two
    backward tilings of the same forward, A the accumulated magnitude (`witness`).

    A float32 sum of n terms taken as dots over tiles of b terms, whose results an accumulator
    adds up one tile after another, is within (b + n / b) eps A of exact (first order, worst
    case: b roundings inside a dot, n / b in the accumulator); the two tilings are each that
    far from exact. Their p and ds also differ by rounding: the scores come from dots of other
    shapes (Dh terms each), and exp2 turns the exponent's rounding (|exponent| < 64 here) into
    a relative error of p below 64 eps; Dh + 64 covers both.
    dq sums over keys (n = S, tiles of block_k_dq); dk, dv over queries of G heads (n = G * T,
    tiles of block_q_bwd).
    """
    g = case.h // case.h_kv

    def cost(b: int, n: int) -> int:
        return b + -(-n // b)

    recompute = 32 + 64  # Dh padded to at most 32 here, and the exponent's 64
    bounds = []
    for n, tile in ((case.s, lambda x: x.dq_blocks[1]), (g * case.t, lambda x: x.block_q_bwd)):
        bounds.append((sum(cost(tile(x), n) for x in sizes) + recompute) * EPS32)
    return [bounds[0], bounds[1], bounds[1]]


@pytest.mark.parametrize("case", CASES, ids=str)
def test_asymmetric_tiles_match_float64_and_the_square_tile(case):
    """dk/dv 16 x 64 with dq 64 x 16 against the float64 witness (to F32_RTOL, as every
    float32 case of test_flash_attention) and against one 32 x 32 backward tile (to the
    rounding bound of `rounding_bound`, element by element)."""
    out, lse, grads = run_flash(case, ASYMMETRIC)
    square_out, square_lse, square_grads = run_flash(case, SQUARE)
    ref_out, ref_lse, ref_grads, magnitudes = witness(case)
    assert_close(out, ref_out, F32_RTOL, "out")
    assert_close(lse, ref_lse, F32_RTOL, "lse")
    for name, grad, ref in zip(("dq", "dk", "dv"), grads, ref_grads, strict=True):
        assert_close(grad, ref, F32_RTOL, name)
    # The forward tiles are the same: out and lse are the same numbers.
    np.testing.assert_array_equal(np.asarray(out), np.asarray(square_out))
    np.testing.assert_array_equal(np.asarray(lse), np.asarray(square_lse))
    bounds = rounding_bound(case, (ASYMMETRIC, SQUARE))
    pairs = zip(grads, square_grads, magnitudes, bounds, strict=True)
    for name, (grad, square, magnitude, bound) in zip(("dq", "dk", "dv"), pairs, strict=True):
        diff = np.abs(np.asarray(grad, np.float64) - np.asarray(square, np.float64))
        excess = diff - bound * magnitude
        assert np.max(excess) <= 0, f"{name}: {np.max(diff):.3g} off, bound {bound:.3g} x A"
        assert np.max(np.abs(np.asarray(grad))) > 0, name  # not a vacuous comparison


# ---- the plan and the checks of the dq tile ------------------------------------------------------


def _plan(kernel, t, s, sizes):
    return fa_plan.make_plan((1, t, 2, 16), (1, s, 2, 16), sizes, kernel, True, True, 0, False)


def test_the_plan_pads_to_every_tile():
    """T and S pad to a multiple of every tile used (forward, dk/dv, dq); unset dq tiles are
    the backward's; a tile longer than its sequence shrinks to the sequence's power of two."""
    plan = _plan("gpu", 40, 50, BlockSizes(16, 16, 16, 16, block_q_dq=32, block_k_dq=64))
    assert (plan.bq_dq, plan.bk_dq, plan.t_pad, plan.s_pad) == (32, 64, 64, 64)
    plan = _plan("gpu", 40, 300, BlockSizes(16, 16, 16, 128, block_q_dq=128, block_k_dq=32))
    assert (plan.bq_dq, plan.bk_dq, plan.t_pad, plan.s_pad) == (64, 32, 64, 384)
    plan = _plan("gpu", 200, 200, BlockSizes(128, 64, 32, 128))
    assert (plan.bq_dq, plan.bk_dq) == (plan.bq_bwd, plan.bk_bwd) == (32, 128)
    assert BlockSizes().blocks["block_q_dq"] == BlockSizes().block_q_bwd
    # The TPU kernel ignores the dq tile: its dq kernel runs on the backward's.
    tpu = _plan("tpu", 40, 48, BlockSizes(8, 16, 16, 8, block_q_dq=24, block_k_dq=24))
    assert (tpu.bq_dq, tpu.bk_dq, tpu.t_pad, tpu.s_pad) == (16, 8, 48, 48)
    check_blocks(BlockSizes(8, 16, 16, 8, block_q_dq=24, block_k_dq=12), "tpu", True)


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(block_q_dq=24), "BlockSizes.block_q_dq = 24; expected a power of two >= 16"),
        (dict(block_k_dq=8), "BlockSizes.block_k_dq = 8; expected a power of two >= 16"),
    ],
)
def test_the_dq_tile_follows_the_gpu_rules(kwargs, message):
    with pytest.raises(ConfigError, match=message) as caught:
        check_blocks(BlockSizes(**kwargs), "gpu", True)
    assert len(str(caught.value).splitlines()) == 1


@pytest.mark.parametrize("value", [0, -32, 32.0, True])
def test_the_dq_tile_is_a_positive_int_or_none(value):
    with pytest.raises(ConfigError, match="BlockSizes.block_k_dq = .*positive int"):
        BlockSizes(block_k_dq=value)


# ---- the dk/dv kernel's layout -------------------------------------------------------------------


def _kernel_eqns(jaxpr, name: str):
    """Every equation inside the pallas_call named `name` (loops and branches opened)."""
    found = []

    def inner(j):
        for eqn in j.eqns:
            if eqn.primitive.name == "pallas_call":
                # The kernel's name: "name" here, "name_and_src_info" in some jax versions.
                label = eqn.params.get("name") or eqn.params.get("name_and_src_info")
                if name in str(label):
                    walk(eqn.params["jaxpr"])
                continue
            for sub in jax_core.jaxprs_in_params(eqn.params):
                inner(sub)

    def walk(j):
        for eqn in j.eqns:
            found.append(eqn)
            for sub in jax_core.jaxprs_in_params(eqn.params):
                walk(sub)

    inner(jaxpr)
    return found


def test_the_dkdv_kernel_forms_key_by_query_tiles():
    """Traced (not run): in the dk/dv kernel every matmul gives [K, Q] (scores, dp^T) or
    [K, Dh] (dk, dv), none gives [Q, K], and no tile is transposed; the dq kernel keeps
    [Q, K]. Causal with a mask, GQA: both the masked and the unmasked sweep are traced."""
    bq, bk, d = 16, 64, 32
    sizes = BlockSizes(16, 16, bq, bk, block_q_dq=bk, block_k_dq=bq)
    q = jax.ShapeDtypeStruct((1, 128, 4, d), jnp.float32)
    k = jax.ShapeDtypeStruct((1, 128, 2, d), jnp.float32)

    def loss(q, k, v):
        out = flash_attention_with_lse(
            q, k, v, causal=True, block_sizes=sizes, backend="gpu", interpret=True
        )[0]
        return out.sum()

    jaxpr = jax.make_jaxpr(jax.grad(loss, (0, 1, 2)))(q, k, k).jaxpr
    dkdv = _kernel_eqns(jaxpr, "dkdv")
    shapes = [e.outvars[0].aval.shape for e in dkdv if e.primitive.name == "dot_general"]
    assert sorted(set(shapes)) == sorted({(bk, bq), (bk, d)}), shapes
    assert shapes.count((bk, bq)) >= 4  # s^T and dp^T, in the masked and unmasked sweeps
    assert not [e for e in dkdv if e.primitive.name == "transpose"]
    dq = _kernel_eqns(jaxpr, "flash_attention_dq")
    shapes = {e.outvars[0].aval.shape for e in dq if e.primitive.name == "dot_general"}
    assert shapes == {(64, 16), (64, d)}  # its [Q, K] tiles (64 queries x 16 keys), dq [Q, Dh]
