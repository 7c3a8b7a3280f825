"""Scaled dot-product attention: the materialized custom VJP, or XLA's.

The Pallas flash kernel sits above the primitives: `lmjax.models.dot_product_attention` (and a
model's `attention="flash"`) runs it with this module's contract.

Shapes in the legend of `lmjax.models` (B batch, T queries, S keys, H heads, Dh head size); the
einsum strings spell them in lower case, d for Dh.
"""

from __future__ import annotations

from functools import partial

import jax
import jax.numpy as jnp

from lmjax.checks import require
from lmjax.errors import ConfigError, ShapeError
from lmjax.ops._common import (
    broadcast_mask,
    check_keep_values,
    compute_dtype,
    inv_sqrt,
    is_int,
    require_float,
    require_rank,
)
from lmjax.ops.softmax import masked_softmax, masked_softmax_vjp

IMPLS = ("materialized", "xla")


def keep_mask(q_shape, k_shape, *, causal: bool, offset=0, mask=None) -> jax.Array:
    """bool `[B, H, T, S]`: True where query t may attend to key u (see `attention`)."""
    (b, t, h, _), s = q_shape, k_shape[1]
    keep = jnp.ones((1, 1, t, s), bool)
    if causal:
        q_pos = jnp.arange(t)[:, None] + offset
        keep = (jnp.arange(s)[None, :] <= q_pos)[None, None]
    keep = jnp.broadcast_to(keep, (b, h, t, s))
    return keep if mask is None else keep & broadcast_mask(mask, (b, h, t, s))


def _forward(q, k, v, keep):
    dtype = compute_dtype(q.dtype)
    s = jnp.einsum("bthd,bshd->bhts", q, k, preferred_element_type=dtype) * inv_sqrt(q.shape[-1])
    p = masked_softmax(s, keep, axis=-1)
    out = jnp.einsum("bhts,bshd->bthd", p, v.astype(dtype))
    return out.astype(q.dtype), p


def _backward(q, k, v, keep, p, d_out, d_p=None):
    """(dq, dk, dv) in p's dtype from the saved probabilities (see `attention`)."""
    dtype, scale = p.dtype, inv_sqrt(q.shape[-1])
    d_out = d_out.astype(dtype)
    dv = jnp.einsum("bhts,bthd->bshd", p, d_out)
    dp = jnp.einsum("bthd,bshd->bhts", d_out, v.astype(dtype))
    if d_p is not None:
        dp = dp + d_p.astype(dtype)
    ds = masked_softmax_vjp(p, dp, keep, axis=-1) * scale
    dq = jnp.einsum("bhts,bshd->bthd", ds, k.astype(dtype))
    dk = jnp.einsum("bhts,bthd->bshd", ds, q.astype(dtype))
    return dq, dk, dv


@jax.custom_vjp
def _attention_materialized(q, k, v, keep):
    out, p = _forward(q, k, v, keep)
    return out, p.astype(q.dtype)


def _attention_fwd(q, k, v, keep):
    out, p = _forward(q, k, v, keep)
    return (out, p.astype(q.dtype)), (q, k, v, keep, p)


def _attention_bwd(res, cotangents):
    q, k, v, keep, p = res
    d_out, d_p = cotangents
    dq, dk, dv = _backward(q, k, v, keep, p, d_out, d_p)
    return dq.astype(q.dtype), dk.astype(k.dtype), dv.astype(v.dtype), None


_attention_materialized.defvjp(_attention_fwd, _attention_bwd)


# Query blocks of causal self-attention. Query block [i, e) sees keys [0, e) only, so the fully
# masked key blocks above the diagonal are never computed: with n blocks, (n + 1) / 2n of the
# full products and softmax work remain (5/8 at n = 4). Smaller blocks skip more but each is a
# smaller product and one more set of ops to compile and run, so blocks are 64 rows, or longer
# when that would make more than 8 (measured on the reference config at T = 128..1024,
# benchmarks/train_step.py: 64 rows were 2% faster than 128 at T = 256 and 512, 4% slower at 1024).
CAUSAL_BLOCK_MIN = 64
CAUSAL_MAX_BLOCKS = 8


def causal_block(t: int) -> int:
    """Rows per query block for causal self-attention over `t` positions (see above)."""
    rows = -(-t // CAUSAL_MAX_BLOCKS)
    return max(CAUSAL_BLOCK_MIN, -(-rows // CAUSAL_BLOCK_MIN) * CAUSAL_BLOCK_MIN)


def _causal_spans(t: int, block: int) -> tuple[tuple[int, int], ...]:
    """(start, end) of each query block; the last one may be shorter."""
    return tuple((i, min(i + block, t)) for i in range(0, t, block))


def _blocked_fwd(q, k, v, block):
    outs, probs = [], []
    for i, e in _causal_spans(q.shape[1], block):
        # Query block [i, e) against keys [0, e): causal with the block's first row at offset i.
        keep = keep_mask(q[:, i:e].shape, k[:, :e].shape, causal=True, offset=i)
        out, p = _forward(q[:, i:e], k[:, :e], v[:, :e], keep)
        outs.append(out)
        probs.append(p)
    return jnp.concatenate(outs, axis=1), (q, k, v, tuple(probs))


@partial(jax.custom_vjp, nondiff_argnums=(3,))
def _attention_causal_blocked(q, k, v, block):
    """Causal self-attention (offset 0, no mask) by query blocks of `block` rows.

    The same equations as `attention` restricted to the keys each block can see:
        out[:, i:e] = softmax(q[:, i:e] k[:, :e]^T / sqrt(Dh), causal) v[:, :e]
    VJP per block with its saved p: dq[:, i:e] = ds k[:, :e], dk[:, :e] += ds^T q[:, i:e],
    dv[:, :e] += p^T dO[:, i:e]. Entries it skips are exactly 0 in the materialized form (p = 0,
    ds = 0), so only the summation order differs.
    """
    return _blocked_fwd(q, k, v, block)[0]


def _blocked_bwd(block, res, d_out):
    q, k, v, probs = res
    dtype = probs[0].dtype
    dq_blocks, dk, dv = [], jnp.zeros(k.shape, dtype), jnp.zeros(v.shape, dtype)
    for (i, e), p in zip(_causal_spans(q.shape[1], block), probs, strict=True):
        keep = keep_mask(q[:, i:e].shape, k[:, :e].shape, causal=True, offset=i)
        dq_i, dk_i, dv_i = _backward(q[:, i:e], k[:, :e], v[:, :e], keep, p, d_out[:, i:e])
        dq_blocks.append(dq_i)
        dk = dk.at[:, :e].add(dk_i)
        dv = dv.at[:, :e].add(dv_i)
    dq = jnp.concatenate(dq_blocks, axis=1)
    return dq.astype(q.dtype), dk.astype(k.dtype), dv.astype(v.dtype)


_attention_causal_blocked.defvjp(_blocked_fwd, _blocked_bwd)


def check_inputs(q, k, v, impl: str, return_probabilities: bool = False, mask=None) -> None:
    """The contract on (q, k, v, mask) of `attention` and of every impl that keeps it
    (`lmjax.models.dot_product_attention`'s flash): ShapeError or ConfigError naming the first
    argument outside it. `impl` is not checked against `IMPLS` here, only what it requires."""
    for name, a in (("q", q), ("k", k), ("v", v)):
        require_rank(a, 4, name, "[batch, time, heads, d_head]")
        require_float(a, name)
        if 0 in a.shape:
            raise ShapeError.describe(
                f"{name}.shape",
                a.shape,
                "no zero-size axis",
                "attend over at least one key and one query (drop empty batches before the call)",
            )
    if not q.dtype == k.dtype == v.dtype:
        raise ShapeError.describe(
            "(q, k, v) dtypes",
            (str(q.dtype), str(k.dtype), str(v.dtype)),
            "one dtype",
            "cast k and v to q's dtype (e.g. all bf16 with f32 accumulation inside)",
        )
    if k.shape != v.shape:
        raise ShapeError.describe(
            "v.shape",
            v.shape,
            f"equal to k.shape {k.shape}",
            "project keys and values to the same [B, S, H, Dh]",
        )
    b, _, h, d = q.shape
    if (k.shape[0], k.shape[2], k.shape[3]) != (b, h, d):
        raise ShapeError.describe(
            "k.shape",
            k.shape,
            f"[{b}, S, {h}, {d}] to match q.shape {q.shape}",
            "give q, k and v the same batch, heads and head size",
        )
    if impl == "xla" and q.dtype == jnp.float16 and jax.default_backend() == "cpu":
        raise ConfigError.describe(
            "impl='xla' with float16 inputs on CPU",
            str(q.dtype),
            "float32 or bfloat16 (XLA's CPU dot_general has no float16 with float32 accumulation)",
            "use impl='materialized', or bfloat16",
        )
    if return_probabilities and impl != "materialized":
        raise ConfigError.describe(
            "return_probabilities with impl",
            impl,
            "impl='materialized'",
            "only the materialized impl forms the probabilities",
        )
    check_keep_values(mask)


def attention(
    q,
    k,
    v,
    *,
    causal: bool,
    offset=0,
    mask=None,
    impl: str = "materialized",
    return_probabilities: bool = False,
):
    """Scaled dot-product attention in the layout of `jax.nn.dot_product_attention`.

    Shapes: q `[B, T, H, Dh]`, k and v `[B, S, H, Dh]` -> out `[B, T, H, Dh]`.

        s[b,h,t,u] = q[b,t,h,:] . k[b,u,h,:] / sqrt(Dh)
        keep[b,h,t,u] = (not causal or u <= t + offset) and mask[b,h,t,u]
                        (mask bool or 0/1, broadcast from the right, e.g. [B,1,1,S] key padding)
        p = masked softmax of s over u (masked p = 0 exactly)
        out[b,t,h,:] = sum_u p[b,h,t,u] v[b,u,h,:]
      VJP of the materialized form, with dO = dL/dout (and dP = dL/dp when p is returned too):
        dv  = p^T dO                          dP' = dO v^T + dP
        ds  = p * (dP' - rowsum(dP' * p))     (0 where masked)
        dq  = ds k / sqrt(Dh)                 dk  = ds^T q / sqrt(Dh)

    Masks keep where 1: `mask` is bool or 0/1 (True/1 keeps a key). A concrete mask (numpy, or
    a jax array outside jit) holding any other value is a `ShapeError`: an additive mask (0
    keeps, -inf drops, as in Hugging Face and PyTorch) would otherwise be silently inverted;
    convert one with `keep = additive == 0`. A traced mask (inside jit) cannot be checked and
    is read as "nonzero keeps", so under jit pass a bool mask: a bool mask is always safe.

    `offset` places query t at absolute position t + offset, i.e. key 0 sits `offset` positions
    before query 0 (the number of earlier keys): decoding one token against a cache of S keys
    uses `offset = S - 1`. A negative offset is defined the same way: the first -offset queries
    precede every key (bottom-right alignment of T > S queries over S keys, offset = S - T).

    A query row with no visible key (all its keys masked, or before every key) has nothing to
    attend to: its output is exactly 0, its dq is exactly 0, and it adds exactly 0 to dk and dv,
    in every impl, with a concrete or a traced mask (never NaN, never an error). Unlike
    `softmax`, which refuses a concrete fully masked slice (it would have no distribution), an
    empty weighted sum is well defined, and batched decoding with padding produces such rows.

    Impls: "materialized" (the custom VJP above; `return_probabilities=True` also returns p for
    inspection; causal self-attention with offset 0, no mask and T > `causal_block(T)` runs by
    query blocks that skip the all-masked key blocks, `_attention_causal_blocked`) and "xla"
    (`jax.nn.dot_product_attention`, differentiated by JAX). The Pallas flash kernel is
    `lmjax.models.dot_product_attention(..., impl="flash")`: `impl="flash"` here is a
    `ConfigError` pointing there (ops imports nothing above errors and checks).
    """
    fix = "call lmjax.models.dot_product_attention(q, k, v, ..., impl='flash')"
    require(
        impl != "flash", "impl", impl, f"one of {IMPLS} (the Pallas kernel sits above ops)", fix
    )
    require(impl in IMPLS, "impl", impl, f"one of {IMPLS}", "pick a listed impl")
    q, k, v = jnp.asarray(q), jnp.asarray(k), jnp.asarray(v)
    check_inputs(q, k, v, impl, return_probabilities, mask)
    if impl == "xla" and mask is None and (not causal or (is_int(offset) and offset == 0)):
        # Every row sees at least key 0: let XLA build the causal mask itself instead of
        # keeping a [B, H, T, S] boolean for the backward.
        out = jax.nn.dot_product_attention(q, k, v, is_causal=causal, implementation="xla")
        return out.astype(q.dtype)
    if (
        impl == "materialized"
        and causal
        and mask is None
        and is_int(offset)
        and offset == 0
        and not return_probabilities
        and q.shape[1] == k.shape[1] > causal_block(q.shape[1])
    ):
        return _attention_causal_blocked(q, k, v, causal_block(q.shape[1]))
    keep = keep_mask(q.shape, k.shape, causal=causal, offset=offset, mask=mask)
    if impl == "xla":
        out = jax.nn.dot_product_attention(q, k, v, mask=keep, implementation="xla")
        # XLA spreads a fully masked row uniformly over the keys; the contract is zeros.
        visible_BTH1 = jnp.any(keep, axis=-1).transpose(0, 2, 1)[..., None]
        return jnp.where(visible_BTH1, out, 0.0).astype(q.dtype)
    out, p = _attention_materialized(q, k, v, keep)
    return (out, p) if return_probabilities else out


def attention_reference(q, k, v, *, causal: bool, offset=0, mask=None, return_lse=False):
    """Plain jnp: masked logits get the most negative float, rows with no key are zeroed.

    With `return_lse=True` also the per-row logsumexp `[B, H, T]` of the visible scores
    (-inf for a row with no visible key), which the flash kernel saves for its backward.
    """
    check_keep_values(mask)
    dtype = compute_dtype(q.dtype)
    qf, kf, vf = (jnp.asarray(a).astype(dtype) for a in (q, k, v))
    s = jnp.einsum("bthd,bshd->bhts", qf, kf) / jnp.sqrt(jnp.asarray(q.shape[-1], dtype))
    # Its own mask construction (not keep_mask), so a semantic slip there cannot hide.
    t_idx = jax.lax.broadcasted_iota(jnp.int32, s.shape, 2)
    s_idx = jax.lax.broadcasted_iota(jnp.int32, s.shape, 3)
    keep = (s_idx <= t_idx + offset) if causal else jnp.ones(s.shape, bool)
    if mask is not None:
        keep = keep & (jnp.broadcast_to(jnp.asarray(mask), s.shape) != 0)
    s = jnp.where(keep, s, jnp.finfo(dtype).min)
    m = jax.lax.stop_gradient(jnp.max(s, axis=-1, keepdims=True))
    e = jnp.where(keep, jnp.exp(s - m), 0.0)
    total = jnp.sum(e, axis=-1, keepdims=True)
    seen = total > 0
    p = e / jnp.where(seen, total, 1.0)
    out = jnp.einsum("bhts,bshd->bthd", p, vf).astype(q.dtype)
    if not return_lse:
        return out
    lse = jnp.where(seen, m + jnp.log(jnp.where(seen, total, 1.0)), -jnp.inf)[..., 0]
    return out, lse
