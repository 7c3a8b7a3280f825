"""Grouped-query attention, sliding windows and segment ids (issues 23, 24; SPEC section 2):
`lmjax.models.dot_product_attention` for every impl (materialized and xla are
`lmjax.ops.attention`; flash is the Pallas kernel, interpreted on CPU).

Three witnesses per case and impl, as for every op (tests/test_ops_gradients.py):
1. values and the VJP of one random cotangent against `ops.attention_reference` (which repeats
   K and V to H heads and builds its own mask) differentiated by `jax.grad`;
2. the VJP against centered finite differences of the impl itself: float64 for materialized,
   float32 for xla (its softmax is float32 whatever the inputs) and flash (the kernel takes no
   float64); tolerance below;
3. torch's `scaled_dot_product_attention(enable_gqa=True)` with a bool mask built in torch.

Shapes are tiny (B=2, T, S <= 6, H=4, Dh=4); each (impl, case) compiles one program per
witness, and the reference's values and VJP are computed once per case for all impls. Cost:
about 45 s of CPU cold (no compile cache, 2 loaded cores), most of it the interpreted flash
kernel.
"""

from __future__ import annotations

import functools
import importlib
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
import torch.nn.functional as F

from lmjax import models, ops, testing
from lmjax.errors import ConfigError, ShapeError
from lmjax.models import attention as models_attention
from lmjax.models import dot_product_attention
from lmjax.testing import F32_RTOL, FD_RTOL, OpCase

B, H, D = 2, 4, 4
IMPLS = ["materialized", "xla", "flash"]
# Against torch: float32 rounding of either side, derived (lmjax.testing.f32_rtol, any CPU). The
# longest chain: scores (Dh), softmax and p @ v (S each), then dp (Dh), its row sum and ds @ k
# (S each), dk and dv summed over T queries of H / Hkv heads, a dozen elementwise roundings each
# way: 2 (4 + 12 + 24) + 24 = 104 at most here; 128 of max(1, max |torch|), 5.6e-6.
TORCH_CHAIN = 128
# Float32 centered differences at step 1e-2 of a loss of magnitude ~10: rounding adds about
# 1e-7 * 10 / 1e-2 = 1e-4 to a derivative of magnitude ~1-10, truncation h^2 |f'''| / 6 about
# as much; 2e-3 relative leaves a 10x margin, and a VJP off by 1% (the smallest error worth
# catching here) is still 5x over it.
FD32_STEP, FD32_RTOL = 1e-2, 2e-3
FD32_CASES = [
    "window_offset",
    "segments_pair_offset",
    "gqa_window_segments",
    "all_with_padding_mask",
]


class Case(NamedTuple):
    t: int
    s: int
    h_kv: int
    kwargs: dict


def _segments(*rows):
    return np.asarray(rows, np.int32)


_PAD_LAST_TWO = np.ones((B, 1, 1, 6), bool)
_PAD_LAST_TWO[1, ..., -2:] = False

CASES = {
    "gqa2_causal": Case(6, 6, 2, dict(causal=True)),
    "mqa_key_padding": Case(3, 6, 1, dict(causal=False, mask=_PAD_LAST_TWO)),
    "window_causal": Case(6, 6, 2, dict(causal=True, window=2)),
    "window_offset": Case(3, 6, 1, dict(causal=True, offset=3, window=3)),
    "window_not_causal": Case(6, 6, 4, dict(causal=False, window=2)),
    # Row 0: two documents and one padding token; row 1: one document, then two padding.
    "segments_self": Case(
        6, 6, 2, dict(causal=True, segment_ids=_segments([1, 1, 1, 2, 2, 0], [3, 3, 3, 3, 0, 0]))
    ),
    # Decoding 3 queries after 3 cached keys; query id 5 matches no key (its row is empty).
    "segments_pair_offset": Case(
        3,
        6,
        1,
        dict(
            causal=True,
            offset=3,
            segment_ids=(
                _segments([2, 2, 0], [1, 5, 1]),
                _segments([1, 1, 2, 2, 2, 0], [1, 1, 1, 1, 0, 0]),
            ),
        ),
    ),
    "gqa_window_segments": Case(
        6,
        6,
        2,
        dict(causal=True, window=3, segment_ids=_segments([1, 1, 1, 1, 2, 2], [1, 1, 0, 1, 1, 1])),
    ),
    "all_with_padding_mask": Case(
        3,
        6,
        2,
        dict(
            causal=True,
            offset=3,
            window=4,
            mask=_PAD_LAST_TWO,
            segment_ids=(_segments([1, 1, 1], [2, 2, 2]), _segments([1] * 6, [1, 1, 2, 2, 2, 2])),
        ),
    ),
}


def _qkv(case: Case, rng, dtype):
    shapes = ((B, case.t, H, D), (B, case.s, case.h_kv, D), (B, case.s, case.h_kv, D))
    return tuple(jnp.asarray(rng.standard_normal(s), dtype) for s in shapes)


def _op_case(name: str, impl: str) -> OpCase:
    case = CASES[name]
    return OpCase(
        f"{name}_{impl}",
        lambda q, k, v: dot_product_attention(q, k, v, impl=impl, **case.kwargs),
        lambda q, k, v: ops.attention_reference(q, k, v, **case.kwargs),
        lambda rng, dtype: _qkv(case, rng, dtype),
        (0, 1, 2),
    )


@pytest.mark.parametrize("name", list(CASES))
def test_materialized_gradients_match_float64_finite_differences(name):
    assert testing.finite_difference_error(_op_case(name, "materialized"), seed=0) <= FD_RTOL


def _fd32_error(op, args, seed=0, directions=2) -> float:
    """`finite_difference_error`'s measure in float32, for the kernel (no float64 there)."""
    weights = testing.random_like(seed + 1, jax.eval_shape(op, *args))

    @jax.jit  # one program for the gradient and the differenced losses, not one each
    def loss_and_grads(*a):
        out, pull = jax.vjp(op, *a)
        return jnp.sum(weights * out), pull(weights)

    def loss(*a):
        return loss_and_grads(*a)[0]

    grads = loss_and_grads(*args)[1]
    errors = []
    for k in range(directions):
        step = testing.random_like(seed + 2 + k, args)
        plus = loss(*(a + FD32_STEP * d for a, d in zip(args, step, strict=True)))
        minus = loss(*(a - FD32_STEP * d for a, d in zip(args, step, strict=True)))
        numeric = float(plus - minus) / (2 * FD32_STEP)
        analytic = float(sum(jnp.vdot(g, d) for g, d in zip(grads, step, strict=True)))
        errors.append(abs(analytic - numeric) / max(abs(analytic), abs(numeric)))
    return max(errors)


@pytest.mark.parametrize("name", FD32_CASES)
@pytest.mark.parametrize("impl", ["xla", "flash"])
def test_gradients_match_float32_finite_differences(impl, name):
    """xla (whose softmax runs in float32 whatever the inputs) and the kernel (float32 at
    most) against float32 differences, on the cases that combine the new masks."""
    case = _op_case(name, impl)
    args = case.make_args(np.random.default_rng(0), jnp.float32)
    with jax.default_matmul_precision("highest"):
        assert _fd32_error(case.op, args) <= FD32_RTOL


def _torch_keep(case: Case) -> torch.Tensor:
    """bool [B, 1 or H, T, S], built in torch from the case's definition (not lmjax's code)."""
    kw = case.kwargs
    query_pos = torch.arange(case.t)[:, None] + kw.get("offset", 0)
    key_pos = torch.arange(case.s)[None, :]
    keep = torch.ones(case.t, case.s, dtype=torch.bool)
    if kw["causal"]:
        keep &= key_pos <= query_pos
    if kw.get("window") is not None:
        keep &= query_pos - key_pos < kw["window"]
    keep = keep.expand(B, 1, case.t, case.s)
    if kw.get("segment_ids") is not None:
        ids = kw["segment_ids"]
        q_ids, kv_ids = (torch.tensor(x) for x in (ids if isinstance(ids, tuple) else (ids, ids)))
        keep = keep & (q_ids[:, None, :, None] == kv_ids[:, None, None, :])
    if kw.get("mask") is not None:
        keep = keep & torch.tensor(kw["mask"])
    return keep


def _torch_sdpa(case: Case, q, k, v, g):
    """(out, (dq, dk, dv)) of torch's attention in lmjax's [B, time, heads, Dh] layout."""
    tq, tk, tv = (torch.tensor(np.asarray(a)).transpose(1, 2).requires_grad_() for a in (q, k, v))
    out = F.scaled_dot_product_attention(tq, tk, tv, attn_mask=_torch_keep(case), enable_gqa=True)
    out.backward(torch.tensor(np.asarray(g)).transpose(1, 2))
    return out.detach().transpose(1, 2).numpy(), [
        t.grad.transpose(1, 2).numpy() for t in (tq, tk, tv)
    ]


def _out_and_vjp(f, q, k, v, g):
    """(out, dq, dk, dv) of `f` for the cotangent g: one jitted program."""
    with jax.default_matmul_precision("highest"), jax.numpy_rank_promotion("raise"):
        out, pull = jax.vjp(f, q, k, v)
        return (out, *pull(g))


@functools.cache
def _reference_out_and_vjp(name: str):
    """The reference's side of `test_values_and_gradients_match_the_reference_and_torch`:
    computed once per case, not once per impl (three compiles of the same program)."""
    op_case = _op_case(name, "materialized")  # any impl: only the reference is used
    q, k, v = op_case.make_args(np.random.default_rng(0), jnp.float32)
    return jax.jit(functools.partial(_out_and_vjp, op_case.reference))(
        q, k, v, testing.random_like(1, q)
    )


@pytest.mark.parametrize("name", list(CASES))
@pytest.mark.parametrize("impl", IMPLS)
def test_values_and_gradients_match_the_reference_and_torch(impl, name):
    """The impl's values and VJP of one cotangent (one jitted program) against the
    reference's (the same inputs, computed once per case) and torch's."""
    op_case, case = _op_case(name, impl), CASES[name]
    q, k, v = op_case.make_args(np.random.default_rng(0), jnp.float32)
    g = testing.random_like(1, q)
    got = jax.jit(functools.partial(_out_and_vjp, op_case.op))(q, k, v, g)
    want = _reference_out_and_vjp(name)
    t_out, t_grads = _torch_sdpa(case, q, k, v, g)
    for what, a, r, t in zip(("out", "dq", "dk", "dv"), got, want, (t_out, *t_grads), strict=True):
        scale = float(np.abs(r).max())
        assert scale > 0, what
        np.testing.assert_allclose(a, r, rtol=0, atol=F32_RTOL * max(1.0, scale), err_msg=what)
        atol = testing.f32_rtol(TORCH_CHAIN) * max(1.0, float(np.abs(t).max()))
        np.testing.assert_allclose(a, t, rtol=0, atol=atol, err_msg=f"{what} vs torch")


# ---- no repeated copy of K and V ------------------------------------------------------------


def _shapes(jaxpr) -> set[tuple[int, ...]]:
    """Every intermediate's shape in `jaxpr` and the jaxprs nested in it (custom VJPs, jit)."""
    found = set()
    for eqn in jaxpr.eqns:
        found |= {tuple(v.aval.shape) for v in eqn.outvars if hasattr(v.aval, "shape")}
        for param in eqn.params.values():
            for sub in param if isinstance(param, tuple | list) else (param,):
                inner = getattr(sub, "jaxpr", sub)
                if hasattr(inner, "eqns"):
                    found |= _shapes(inner)
    return found


@pytest.mark.parametrize("impl", ["materialized", "xla"])
@pytest.mark.parametrize("h_kv", [1, 2])
def test_grouped_heads_never_repeat_k_or_v(impl, h_kv):
    """Neither the forward nor the backward forms K or V at H heads: no [B, S, H, Dh] or
    [B, H, S, Dh] value in the traced program (T = 3 != S = 6, so q's shape cannot pass for
    one). The reference, which does repeat them, shows that the search finds such a copy."""
    case = Case(3, 6, h_kv, dict(causal=True, offset=3, window=4))
    q, k, v = _qkv(case, np.random.default_rng(0), jnp.float32)
    repeated = {(B, case.s, H, D), (B, H, case.s, D)}

    def program(fn):
        return jax.make_jaxpr(lambda *a: jax.vjp(fn, *a)[1](jnp.ones(q.shape)))(q, k, v)

    op = program(lambda *a: dot_product_attention(*a, impl=impl, **case.kwargs))
    assert not _shapes(op.jaxpr) & repeated
    reference = program(lambda *a: ops.attention_reference(*a, **case.kwargs))
    assert _shapes(reference.jaxpr) & repeated


# ---- the query-block path of the materialized impl -------------------------------------------


def test_query_blocks_skip_key_blocks_below_the_window():
    """Block [i, e) with window W sees keys from i - W + 1 on: at W = 2 and blocks of 2 rows over
    6 positions, rows 2.. never need key 0 and rows 4.. never keys 0..2."""
    module = importlib.import_module("lmjax.ops.attention")
    assert module._causal_spans(6, 2, 2) == ((0, 2, 0), (2, 4, 1), (4, 6, 3))
    assert module._causal_spans(6, 2, None) == ((0, 2, 0), (2, 4, 0), (4, 6, 0))


@pytest.mark.parametrize(
    "name", ["gqa2_causal", "window_causal", "segments_self", "gqa_window_segments"]
)
def test_the_query_block_path_keeps_windows_and_segments(monkeypatch, name):
    """With 2-row blocks the causal self-attention cases take `_attention_causal_blocked` (a
    spy says so); its values and VJP still equal the reference's."""
    module = importlib.import_module("lmjax.ops.attention")
    blocked, calls = module._attention_causal_blocked, []

    def spy(*args):
        calls.append(args[3])
        return blocked(*args)

    monkeypatch.setattr(module, "CAUSAL_BLOCK_MIN", 2)
    monkeypatch.setattr(module, "_attention_causal_blocked", spy)
    report = testing.compare_with_reference(_op_case(name, "materialized"), transform=jax.jit)
    assert calls == [2]
    assert report.within(F32_RTOL), report


# ---- the model's dispatch --------------------------------------------------------------------


@pytest.mark.parametrize("ops_set", ["custom", "reference"])
def test_attend_applies_the_configs_sliding_window(ops_set):
    cfg = models.ModelConfig(
        vocab_size=8, context_length=8, d_model=16, n_heads=4, n_kv_heads=2, n_layers=1,
        d_ff=16, sliding_window=2, ops=ops_set,
    )  # fmt: skip
    case = CASES["segments_self"]
    q, k, v = _qkv(case, np.random.default_rng(2), jnp.float32)
    ids = case.kwargs["segment_ids"]

    @jax.jit  # one program, not an eager compile of every primitive
    def run(q, k, v):
        return (
            models_attention.attend(cfg, q, k, v, segment_ids=ids),
            ops.attention_reference(q, k, v, causal=True, window=2, segment_ids=ids),
            ops.attention_reference(q, k, v, causal=True, segment_ids=ids),
        )

    out, expected, unwindowed = run(q, k, v)
    np.testing.assert_allclose(out, expected, rtol=1e-5, atol=1e-6)
    assert np.abs(np.asarray(out) - np.asarray(unwindowed)).max() > 1e-3


# ---- bad inputs: one line each, before anything compiles -------------------------------------


def _bad(**overrides):
    t, s, h_kv = overrides.pop("t", 3), overrides.pop("s", 3), overrides.pop("h_kv", 2)
    q, k, v = _qkv(Case(t, s, h_kv, {}), np.random.default_rng(0), jnp.float32)
    return q, k, v, dict(dict(causal=True), **overrides)


BAD = {
    "heads_not_a_multiple": (_bad(h_kv=3), ShapeError, r"\(4, 3\).*H a multiple of Hkv"),
    "window_zero": (_bad(window=0), ConfigError, r"attention window = 0.*int >= 1"),
    "window_negative": (_bad(window=-2), ConfigError, r"attention window = -2"),
    "window_float": (_bad(window=2.0), ConfigError, r"attention window = 2\.0"),
    "window_bool": (_bad(window=True), ConfigError, r"attention window = True"),
    "window_traced_array": (_bad(window=jnp.asarray(2)), ConfigError, "static Python int"),
    "segments_float": (
        _bad(segment_ids=np.zeros((B, 3), np.float32)),
        ShapeError,
        r"q_segment_ids\.dtype.*integer",
    ),
    "segments_wrong_shape": (
        _bad(segment_ids=np.zeros((B, 4), np.int32)),
        ShapeError,
        r"q_segment_ids\.shape = \(2, 4\); expected \(2, 3\)",
    ),
    "segments_self_form_with_t_not_s": (
        _bad(s=5, segment_ids=np.zeros((B, 3), np.int32)),
        ShapeError,
        r"T == S.*\(q_segment_ids \[B, T\], kv_segment_ids \[B, S\]\) pair",
    ),
    "segments_pair_kv_wrong_shape": (
        _bad(s=5, segment_ids=(np.zeros((B, 3), np.int32), np.zeros((B, 3), np.int32))),
        ShapeError,
        r"kv_segment_ids\.shape = \(2, 3\); expected \(2, 5\)",
    ),
    "segments_triple": (
        _bad(segment_ids=(np.zeros((B, 3), np.int32),) * 3),
        ShapeError,
        r"len\(segment_ids\) = 3",
    ),
}


@pytest.mark.parametrize("name", list(BAD))
@pytest.mark.parametrize("impl", IMPLS)
def test_bad_gqa_window_and_segment_arguments_are_one_line_errors(impl, name):
    (q, k, v, kwargs), error, message = BAD[name]
    with pytest.raises(error, match=message) as info:
        dot_product_attention(q, k, v, impl=impl, **kwargs)
    assert "\n" not in str(info.value)


def test_a_mesh_must_split_the_key_value_heads_too():
    mesh = {"data": 1, "fsdp": 1, "model": 2}
    assert models_attention.mesh_split(mesh, 2, 4, 2) == ((), "model")
    with pytest.raises(ConfigError, match=r"key/value heads .* = 1; expected a multiple of model"):
        models_attention.mesh_split(mesh, 2, 4, 1)
