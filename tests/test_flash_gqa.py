"""The flash kernels' grouped-query attention, sliding window and segment ids (issues 23, 24).

Both kernels (backend="gpu" and "tpu") run interpreted on CPU (compiled with
LMJAX_PALLAS_INTERPRET=0 on their own device, as in test_flash_attention). Each case compiles
forward and backward once and is compared, in out, lse and the VJP (dq, dk, dv) of random
cotangents for (out, lse), with `attention_reference` differentiated by jax.grad; the
reference's own rules are checked against a numpy visibility matrix written from the contract.

Cost: about 40-60 s on 2 cores (eight interpreted forward+backward compiles, one forward).
"""

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from _pallas import INTERPRET, kernel_param
from test_flash_attention import F32_RTOL, assert_close, sizes_for

from lmjax.errors import ConfigError, ShapeError
from pallas_kernels.flash_attention import (
    BlockSizes,
    attention_reference,
    flash_attention,
    flash_attention_with_lse,
)
from pallas_kernels.flash_attention import plan as fa_plan

KERNELS = [kernel_param("gpu"), kernel_param("tpu")]
# GPU tiles are powers of two >= 16; interpreted TPU blocks need only multiples of 8, so the
# TPU case mixes 8-row query blocks with 16-key blocks (boundaries fall inside and between).
BLOCKS = {"gpu": BlockSizes(16, 16, 16, 16), "tpu": BlockSizes(8, 16, 16, 8)}

# Segment ids of two batch rows of 40 tokens: documents end inside a 16-block (at 10, 20, 35)
# and on a block boundary (at 16, 32); 0 is padding, as the packed batches carry it.
SEGMENTS_40 = np.array(
    [[1] * 10 + [2] * 6 + [3] * 16 + [4] * 5 + [0] * 3, [1] * 20 + [2] * 15 + [0] * 5], np.int32
)


@dataclasses.dataclass(frozen=True)
class Case:
    name: str
    b: int
    t: int
    s: int
    h: int
    h_kv: int
    d: int
    causal: bool
    offset: int = 0
    window: int | None = None
    segments: str = "none"  # "none", "packed" (SEGMENTS_40 both sides), "cross" (see inputs)
    masked: bool = False  # key-padding mask: padding (id 0) keys off, or a few keys off

    def __str__(self):
        return self.name

    def inputs(self, seed: int = 0):
        """q, k, v, mask, (q ids, kv ids) and cotangents for (out, lse), from numpy."""
        rng = np.random.default_rng(seed)

        def normal(*shape, scale=1.0):
            return jnp.asarray(scale * rng.standard_normal(shape), jnp.float32)

        q = normal(self.b, self.t, self.h, self.d, scale=2.0)
        k = normal(self.b, self.s, self.h_kv, self.d)
        v = normal(self.b, self.s, self.h_kv, self.d)
        ids = (None, None)
        if self.segments == "packed":
            ids = (SEGMENTS_40[: self.b, : self.t], SEGMENTS_40[: self.b, : self.s])
        elif self.segments == "cross":
            # Queries 0..9 are document 1, queries 10.. document 5, which no key belongs to.
            q_ids = np.where(np.arange(self.t) < 10, 1, 5)[None].repeat(self.b, 0)
            kv_ids = np.where(np.arange(self.s) < 20, 1, 2)[None].repeat(self.b, 0)
            ids = (q_ids.astype(np.int32), kv_ids.astype(np.int32))
        mask = None
        if self.masked:
            keep = np.ones((self.b, self.s), bool) if ids[1] is None else ids[1] != 0
            keep[0, 3:6] = False
            mask = jnp.asarray(keep)
        ids = tuple(None if x is None else jnp.asarray(x) for x in ids)
        g_out = normal(self.b, self.t, self.h, self.d)
        g_lse = normal(self.b, self.h, self.t)
        return q, k, v, mask, ids, g_out, g_lse

    @property
    def options(self):
        return dict(causal=self.causal, offset=self.offset, window=self.window)


CASES = [
    # GQA 4 -> 2, causal, window 12, packed documents with padding (masked off: rows of padding
    # see no key), T = S = 40 ragged against the blocks.
    Case(
        "gqa2-causal-window-packed-mask",
        2,
        40,
        40,
        4,
        2,
        16,
        True,
        window=12,
        segments="packed",
        masked=True,
    ),
    # MQA 4 -> 1, not causal, window 10 around absolute position t + 12, a few keys off.
    Case(
        "mqa-full-window-offset-mask", 1, 24, 40, 4, 1, 8, False, offset=12, window=10, masked=True
    ),
    # Decoding-style offset, cross segments: queries 10.. have no key of their document.
    Case("gqa2-causal-offset-cross", 1, 20, 36, 4, 2, 16, True, offset=16, segments="cross"),
]


def _attend_kwargs(case: Case, ids):
    return dict(case.options, q_segment_ids=ids[0], kv_segment_ids=ids[1])


def _vjp(attend, case: Case, seed: int = 0):
    """out, lse, (dq, dk, dv) of attend(q, k, v, mask, ids) under one jit."""
    q, k, v, mask, ids, g_out, g_lse = case.inputs(seed)

    @jax.jit
    def run(q, k, v, mask, ids, g_out, g_lse):
        (out, lse), pull = jax.vjp(lambda q, k, v: attend(q, k, v, mask, ids), q, k, v)
        return out, lse, pull((g_out, g_lse))

    return run(q, k, v, mask, ids, g_out, g_lse)


def _flash_attend(case: Case, kernel: str):
    def attend(q, k, v, mask, ids):
        return flash_attention_with_lse(
            q, k, v, mask=mask, **_attend_kwargs(case, ids), **_kernel_options(kernel)
        )

    return attend


def _kernel_options(kernel: str):
    sizes = sizes_for(kernel, BLOCKS[kernel])
    return dict(block_sizes=sizes, backend=kernel, interpret=INTERPRET)


@functools.cache
def _reference(case: Case):
    def attend(q, k, v, mask, ids):
        kwargs = _attend_kwargs(case, ids)
        return attention_reference(q, k, v, mask=mask, return_lse=True, **kwargs)

    with jax.default_matmul_precision("highest"):
        return _vjp(attend, case)


@functools.cache
def _flash(case: Case, kernel: str):
    return _vjp(_flash_attend(case, kernel), case)


def _visible_numpy(case: Case):
    """bool [B, T, S] from the contract, in numpy: who sees whom."""
    _, _, _, mask, ids, _, _ = case.inputs()
    at = np.arange(case.t)[:, None] + case.offset
    key = np.arange(case.s)[None, :]
    seen = np.ones((case.b, case.t, case.s), bool)
    if case.causal:
        seen &= key <= at
    if case.window is not None:
        seen &= at - key < case.window
    if mask is not None:
        seen &= np.asarray(mask)[:, None, :]
    if ids[0] is not None:
        seen &= np.asarray(ids[0])[:, :, None] == np.asarray(ids[1])[:, None, :]
    return seen


# ---- agreement with the reference ---------------------------------------------------------------


@pytest.mark.parametrize("kernel", KERNELS)
@pytest.mark.parametrize("case", CASES, ids=str)
def test_matches_reference(case, kernel):
    out, lse, grads = _flash(case, kernel)
    ref_out, ref_lse, ref_grads = _reference(case)
    assert out.shape == (case.b, case.t, case.h, case.d) and lse.shape == (case.b, case.h, case.t)
    assert grads[1].shape == grads[2].shape == (case.b, case.s, case.h_kv, case.d)
    assert_close(out, ref_out, F32_RTOL, "out")
    assert_close(lse, ref_lse, F32_RTOL, "lse")
    for name, g, ref_g in zip(("dq", "dk", "dv"), grads, ref_grads, strict=True):
        assert_close(g, ref_g, F32_RTOL, name)


@pytest.mark.parametrize("case", CASES, ids=str)
def test_reference_follows_the_visibility_rules(case):
    """The oracle against the contract's rules, written again in numpy: moving the value of
    key u changes exactly the output rows that see u, and the rows that see no key have lse
    -inf and out 0. Every case hides some pairs and shows others, so neither side is vacuous."""
    seen_BTS = _visible_numpy(case)
    assert seen_BTS.any() and not seen_BTS.all()
    q, k, v, mask, ids, _, _ = case.inputs()

    @jax.jit
    def reference(v):
        kwargs = _attend_kwargs(case, ids)
        return attention_reference(q, k, v, mask=mask, return_lse=True, **kwargs)

    out, lse = reference(v)
    empty_BT = ~seen_BTS.any(-1)
    np.testing.assert_array_equal(np.isneginf(lse), empty_BT[:, None, :].repeat(case.h, 1))
    assert np.all(np.asarray(out)[empty_BT] == 0.0)
    for u in range(case.s):
        changed_BT = np.asarray(jnp.any(reference(v.at[:, u].add(10.0))[0] != out, axis=(2, 3)))
        np.testing.assert_array_equal(changed_BT, seen_BTS[:, :, u], err_msg=f"key {u}")


@pytest.mark.parametrize("kernel", KERNELS)
def test_rows_with_no_visible_key_give_zeros(kernel):
    # Cross segments: queries 10.. (document 5) have no key; packed + mask: padding rows none.
    case = CASES[2]
    out, lse, (dq, dk, dv) = _flash(case, kernel)
    out, lse, dq = np.asarray(out), np.asarray(lse), np.asarray(dq)
    assert np.all(out[:, 10:] == 0.0) and np.all(dq[:, 10:] == 0.0)
    assert np.all(np.isneginf(lse[:, :, 10:])) and np.isfinite(lse[:, :, :10]).all()
    assert np.abs(out[:, :10]).max() > 0
    # Keys of document 2 (20..) are seen by nobody: zero dk, dv.
    assert np.all(np.asarray(dk)[:, 20:] == 0.0) and np.all(np.asarray(dv)[:, 20:] == 0.0)
    packed = CASES[0]
    out, lse, (dq, _, _) = _flash(packed, kernel)
    padding_BT = SEGMENTS_40[: packed.b] == 0
    assert np.all(np.asarray(out)[padding_BT] == 0.0)
    assert np.all(np.asarray(dq)[padding_BT] == 0.0)


def test_kernel_gradient_matches_finite_differences():
    """The GPU kernel's VJP (shared with test_matches_reference) against central differences of
    its own forward: d/de f(x + e d) for f = sum(out * g_out) + sum(lse * g_lse), whose gradient
    that VJP is. Every row of this case sees a key, so f is finite. float32 with a step of 1e-2
    along unit-scale directions: the O(step^2) term and the rounding of f (|f| ~ 10^2, ulp
    ~1e-5, over 2 * step) stay well under the 1e-3 relative bound."""
    case = CASES[1]
    q, k, v, mask, ids, g_out, g_lse = case.inputs()
    _, lse, grads = _flash(case, "gpu")
    assert np.isfinite(np.asarray(lse)).all()
    attend = _flash_attend(case, "gpu")

    @jax.jit
    def objective(q, k, v):
        out, lse = attend(q, k, v, mask, ids)
        return jnp.sum(out * g_out) + jnp.sum(lse * g_lse)

    rng = np.random.default_rng(7)
    step = 1e-2
    for n, (name, g) in enumerate(zip(("q", "k", "v"), grads, strict=True)):
        direction = jnp.asarray(rng.standard_normal(g.shape), jnp.float32)
        hi, lo = [q, k, v], [q, k, v]
        hi[n], lo[n] = hi[n] + step * direction, lo[n] - step * direction
        fd = float(objective(*hi) - objective(*lo)) / (2 * step)
        analytic = float(jnp.sum(g * direction))
        assert abs(fd - analytic) <= 1e-3 * max(1.0, abs(analytic)), (name, fd, analytic)


# ---- block skipping -----------------------------------------------------------------------------


def _visited(plan, blocks_q: int, blocks_k: int):
    """(key blocks the forward visits, query blocks the dk/dv kernel visits), summed."""
    kv = [fa_plan.kv_range(plan, i, plan.bq, plan.bk) for i in range(blocks_q)]
    q = [fa_plan.q_range(plan, j, plan.bq_bwd, plan.bk_bwd) for j in range(blocks_k)]
    return sum(int(end - lo) for lo, _, _, end in kv), sum(int(end - lo) for lo, _, _, end in q)


def test_window_visits_fewer_blocks_than_causal():
    sizes = BlockSizes(16, 16, 16, 16)

    def plan(causal, window):
        shape = (1, 256, 4, 16)
        return fa_plan.make_plan(
            shape, (1, 256, 2, 16), sizes, "gpu", True, causal, 0, False, window=window
        )

    full, causal, window = plan(False, None), plan(True, None), plan(True, 32)
    assert window.groups == 2
    counts = [_visited(p, 16, 16) for p in (full, causal, window)]
    assert counts[0] == (256, 256) and counts[1] == (136, 136)  # 16 * 16, 16 * 17 / 2
    # A 32-key window: each query block meets its own key block and the two before it.
    assert counts[2] == (16 + 15 + 14, 16 + 15 + 14)


@pytest.mark.parametrize("kernel", KERNELS)
def test_blocks_outside_the_window_are_never_read(kernel):
    """NaN keys in a block no query's window reaches: out, dq stay finite, dk, dv of those keys
    exactly 0 (a block visited and masked would give 0 * NaN = NaN in p @ v or ds^T q)."""
    t, s = 16, 48  # queries at absolute positions 32..47, window 16: keys 17..47 visible
    rng = np.random.default_rng(5)
    q = jnp.asarray(rng.standard_normal((1, t, 4, 16)), jnp.float32)
    k, v = (jnp.asarray(rng.standard_normal((1, s, 2, 16)), jnp.float32) for _ in range(2))
    k_nan, v_nan = k.at[:, :16].set(jnp.nan), v.at[:, :16].set(jnp.nan)
    options = dict(causal=True, offset=32, window=16)

    def attend(q, k, v):
        return flash_attention(q, k, v, **options, **_kernel_options(kernel))

    out, pull = jax.vjp(attend, q, k_nan, v_nan)
    dq, dk, dv = pull(jnp.ones_like(out))
    expected = attention_reference(q, k, v, **options)
    assert_close(out, expected, F32_RTOL, "out")
    assert np.isfinite(np.asarray(dq)).all()
    assert np.all(np.asarray(dk)[:, :16] == 0.0) and np.all(np.asarray(dv)[:, :16] == 0.0)
    assert np.isfinite(np.asarray(dk)).all() and np.abs(np.asarray(dk)[:, 17:]).max() > 0


def _visited_with_segments(plan, ids):
    """`_visited` of batch row 0 with the segment bounds of ids [1, T] (self-attention)."""
    padded_q = jnp.pad(ids, ((0, 0), (0, plan.t_pad - plan.t)))
    padded_k = jnp.pad(ids, ((0, 0), (0, plan.s_pad - plan.s)))
    sb = fa_plan.segment_bounds(plan, padded_q, padded_k, plan.bq, plan.bk)
    n = plan.t_pad // plan.bq
    kv_at = lambda i: (sb.kv_lo[0, i], sb.kv_end[0, i])  # noqa: E731
    q_at = lambda j: (sb.q_lo[0, j], sb.q_end[0, j])  # noqa: E731
    kv = [fa_plan.kv_range(plan, i, plan.bq, plan.bk, kv_at(i)) for i in range(n)]
    q = [fa_plan.q_range(plan, j, plan.bq, plan.bk, q_at(j)) for j in range(n)]
    return sum(int(end - lo) for lo, _, _, end in kv), sum(int(end - lo) for lo, _, _, end in q)


def test_packed_documents_visit_only_their_own_blocks():
    """256 tokens of eight 32-token documents, 16-blocks, causal: each query block visits the
    blocks of its own document up to the diagonal, 8 * (1 + 2) = 24 of them (136 causal);
    trailing padding (id 0) costs only the blocks that hold it."""
    sizes = BlockSizes(16, 16, 16, 16)
    plan = fa_plan.make_plan(
        (1, 256, 4, 16), (1, 256, 2, 16), sizes, "gpu", True, True, 0, False, has_segments=True
    )
    packed = jnp.asarray(np.repeat(np.arange(1, 9), 32)[None], jnp.int32)
    assert _visited_with_segments(plan, packed) == (24, 24)
    # Documents 1..7, then 32 padding tokens (id 0): the last two query blocks hold only
    # padding, which no earlier key matches, so they visit only each other.
    padded = packed.at[:, 224:].set(0)
    assert _visited_with_segments(plan, padded) == (24, 24)
    # Padding that shares a block with a document (8 is cut to 224..231): block 14 (ids
    # {8, 0}) meets key blocks 14, 15 and block 15 (ids {0}) the same: query side 21 + 1 + 2,
    # key side 21 + 2 + 1. (Compared as plain ints, block 14's interval [0, 8] would meet
    # every block: 122 on the key side.)
    ragged = packed.at[:, 232:].set(0)
    assert _visited_with_segments(plan, ragged) == (24, 24)


def _block_pairs_numpy(q_ids, k_ids, t, s, bq, bk):
    """bool [B, nq, nk]: some real query of block i and real key of block j share an id."""
    same = q_ids[:, :t, None] == k_ids[:, None, :s]
    qp, kp = -(-t // bq) * bq, -(-s // bk) * bk
    same = np.pad(same, ((0, 0), (0, qp - t), (0, kp - s)))
    b = same.shape[0]
    return same.reshape(b, qp // bq, bq, kp // bk, bk).any(axis=(2, 4))


@pytest.mark.parametrize("order", ["packed", "packed-padded", "shuffled", "cross"])
def test_segment_bounds_never_drop_a_visible_pair(order):
    """Against a numpy brute force over every (query, key) pair: every block pair that shares
    an id lies inside both ranges; for packed rows (ids non-decreasing, the same on both sides,
    with or without padding 0 at the end) the ranges are exactly the first and last such
    block."""
    rng = np.random.default_rng(7)
    t, s, bq, bk = 75, 75 if order != "cross" else 53, 8, 16
    if order.startswith("packed"):
        q_ids = np.sort(rng.integers(1, 9, (3, t)), axis=1)
        if order == "packed-padded":  # rows end in 11, 0 and 30 padding tokens (id 0)
            q_ids[0, -11:], q_ids[2, -30:] = 0, 0
        k_ids = q_ids
    else:
        q_ids = rng.integers(0, 6, (3, t))
        k_ids = q_ids if order == "shuffled" else rng.integers(0, 6, (3, s))
    plan = fa_plan.make_plan(
        (3, t, 2, 16),
        (3, s, 2, 16),
        BlockSizes(bq, bk, bq, bk),
        "tpu",
        True,
        False,
        0,
        False,
        has_segments=True,
    )
    fill = lambda x, n: np.pad(x, ((0, 0), (0, n - x.shape[1])), constant_values=-99)  # noqa: E731
    q_pad, k_pad = fill(q_ids, plan.t_pad), fill(k_ids, plan.s_pad)
    sb = fa_plan.segment_bounds(plan, jnp.asarray(q_pad), jnp.asarray(k_pad), plan.bq, plan.bk)
    pairs = _block_pairs_numpy(q_pad, k_pad, t, s, plan.bq, plan.bk)
    kv_lo, kv_end, q_lo, q_end = (np.asarray(x) for x in sb)
    bi, i, j = np.nonzero(pairs)
    assert len(i) > 0
    assert np.all(kv_lo[bi, i] <= j) and np.all(j < kv_end[bi, i])
    assert np.all(q_lo[bi, j] <= i) and np.all(i < q_end[bi, j])
    if order.startswith("packed"):
        nk = pairs.shape[2]
        first = np.where(pairs.any(2), pairs.argmax(2), nk)
        last = np.where(pairs.any(2), nk - pairs[:, :, ::-1].argmax(2), 0)
        np.testing.assert_array_equal(kv_lo, first)
        np.testing.assert_array_equal(kv_end, last)


@pytest.mark.parametrize("kernel", KERNELS)
def test_blocks_of_other_documents_are_never_read(kernel):
    """Two 32-token documents in one 64-token row, 16-blocks, causal (GQA 4 on 2 heads): the
    second document's query blocks never visit the first's key blocks, though causality alone
    would. NaN in the first document's values leaves the second's output finite and equal to
    the reference of the second alone; NaN keys there leave its dq finite; a NaN cotangent on
    the second's rows leaves the first's dk, dv finite (a visited, masked block would spread
    the NaN: 0 * NaN = NaN in p @ v, ds @ k or ds^T q)."""
    t, half = 64, 32
    rng = np.random.default_rng(6)
    q = jnp.asarray(rng.standard_normal((1, t, 4, 16)), jnp.float32)
    k, v = (jnp.asarray(rng.standard_normal((1, t, 2, 16)), jnp.float32) for _ in range(2))
    ids = jnp.asarray(np.repeat([1, 2], half)[None], jnp.int32)
    options = dict(causal=True, q_segment_ids=ids, kv_segment_ids=ids)
    sizes = BlockSizes(16, 16, 16, 16)

    def attend(q, k, v):
        return flash_attention(
            q, k, v, **options, block_sizes=sizes, backend=kernel, interpret=INTERPRET
        )

    out = attend(q, k, v.at[:, :half].set(jnp.nan))
    alone = attention_reference(q[:, half:], k[:, half:], v[:, half:], causal=True)
    assert_close(out[:, half:], alone, F32_RTOL, "out of the second document")
    out, pull = jax.vjp(attend, q, k.at[:, :half].set(jnp.nan), v)
    assert np.isfinite(np.asarray(pull(jnp.ones_like(out))[0])[:, half:]).all(), "dq"
    out, pull = jax.vjp(attend, q, k, v)
    _, dk, dv = pull(jnp.ones_like(out).at[:, half:].set(jnp.nan))
    for name, grad in (("dk", dk), ("dv", dv)):
        first = np.asarray(grad)[:, :half]
        assert np.isfinite(first).all() and np.abs(first).max() > 0, name


# ---- bad input ----------------------------------------------------------------------------------


def _qkv(h=4, h_kv=2, t=8, s=8):
    return jnp.zeros((2, t, h, 16)), jnp.zeros((2, s, h_kv, 16)), jnp.zeros((2, s, h_kv, 16))


IDS = jnp.zeros((2, 8), jnp.int32)


@pytest.mark.parametrize(
    "qkv, kwargs, error, message",
    [
        (_qkv(4, 3), {}, ShapeError, r"k.shape\[2\] \(key/value heads\) = 3; expected a divisor"),
        (_qkv(4, 8), {}, ShapeError, r"k.shape\[2\] \(key/value heads\) = 8"),
        (_qkv(), dict(window=0), ConfigError, "window = 0; expected None or a static Python int"),
        (_qkv(), dict(window=True), ConfigError, "window = True"),
        (_qkv(), dict(window=2.0), ConfigError, "window = 2.0"),
        (_qkv(), dict(q_segment_ids=IDS), ConfigError, "both or neither"),
        (_qkv(), dict(kv_segment_ids=IDS), ConfigError, "both or neither"),
        (
            _qkv(),
            dict(q_segment_ids=IDS[:, :4], kv_segment_ids=IDS),
            ShapeError,
            r"q_segment_ids.shape = \(2, 4\); expected \(2, 8\)",
        ),
        (
            _qkv(s=6),
            dict(q_segment_ids=IDS, kv_segment_ids=IDS),
            ShapeError,
            r"kv_segment_ids.shape = \(2, 8\); expected \(2, 6\)",
        ),
        (
            _qkv(),
            dict(q_segment_ids=IDS * 1.0, kv_segment_ids=IDS),
            ShapeError,
            "q_segment_ids.dtype = 'float32'; expected an integer dtype",
        ),
    ],
)
def test_rejects_bad_heads_windows_and_segments(qkv, kwargs, error, message):
    with pytest.raises(error, match=message) as raised:
        flash_attention(*qkv, causal=True, **kwargs)
    assert "\n" not in str(raised.value)
