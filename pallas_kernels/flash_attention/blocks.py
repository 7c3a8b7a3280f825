"""The block math both kernels (GPU and TPU) share: masks, the online softmax, the recomputed
probabilities of the backward. Arrays are one block: `[Q, Dh]` query rows, `[K, Dh]` key rows,
`[Q, K]` scores (letters as in the package docstring).
"""

from __future__ import annotations

import jax.numpy as jnp
from jax import lax

from pallas_kernels._backend import dot as _dot
from pallas_kernels.flash_attention.plan import LOG2E, Plan

# Masked scores before the max: finite, so `m - m_new` never forms inf - inf.
_MASKED = -1e30


def fori(lo, hi, body, carry):
    """fori_loop that emits nothing when the range is statically empty."""
    if isinstance(lo, int) and isinstance(hi, int) and lo >= hi:
        return carry
    return lax.fori_loop(lo, hi, body, carry)


def maybe_spec(array, spec):
    """`spec` for an optional input (mask, segment ids), or None when it is absent (the kernel
    then gets None)."""
    return None if array is None else spec


def visible(plan: Plan, rows_Q1, cols_1K, kmask_1K, qseg_Q1=None, kvseg_1K=None):
    """bool [Q, K] (or [1, K]): key u visible to query t. None when nothing is masked.

    keep = mask[u] (or u < S) and (not causal or u <= t + offset)
           and (window is None or (t + offset) - u < window) and q_seg[t] == kv_seg[u]

    Every rule is an elementwise comparison that only broadcasts, so the transposed layout
    comes from transposed arguments: rows [1, Q], query ids [1, Q], keys, key mask and key ids
    [K, 1] give keep [K, Q] (or [K, 1]), the dk/dv kernel's layout (`gpu.py`).
    """
    keep = None
    if kmask_1K is not None:
        keep = kmask_1K != 0  # padded keys carry 0 in the mask already
    elif plan.s_pad != plan.s:
        keep = cols_1K < plan.s
    for rule in _pair_rules(plan, rows_Q1, cols_1K, qseg_Q1, kvseg_1K):
        keep = rule if keep is None else keep & rule
    return keep


def _pair_rules(plan: Plan, rows_Q1, cols_1K, qseg_Q1, kvseg_1K):
    """The [Q, K] rules of `visible` that this plan has (causal, window, segments)."""
    rules = []
    if plan.causal:
        rules.append(cols_1K <= rows_Q1 + plan.offset)
    if plan.window is not None:
        rules.append(rows_Q1 + plan.offset - cols_1K < plan.window)
    if qseg_Q1 is not None:
        rules.append(qseg_Q1 == kvseg_1K)
    return rules


def iota(start, shape, axis):
    return start + lax.broadcasted_iota(jnp.int32, shape, axis)


def online_softmax_step(carry, s_QK, keep, v_KDh):
    """Fold one key block into (acc [Q, Dh], m [Q, 1], l [Q, 1])."""
    acc_QDh, m_Q1, l_Q1 = carry
    if keep is not None:
        s_QK = jnp.where(keep, s_QK, _MASKED)
    m_new = jnp.maximum(m_Q1, jnp.max(s_QK, axis=1, keepdims=True))
    p_QK = jnp.exp2(s_QK - m_new)
    if keep is not None:
        p_QK = jnp.where(keep, p_QK, 0.0)  # a row with nothing kept yet must stay at l = 0
    alpha = jnp.exp2(m_Q1 - m_new)
    l_new = alpha * l_Q1 + jnp.sum(p_QK, axis=1, keepdims=True)
    acc_QDh = alpha * acc_QDh + _dot(p_QK.astype(v_KDh.dtype), v_KDh, (1, 0))
    return acc_QDh, m_new, l_new


def init_carry(bq: int, d: int):
    return (
        jnp.zeros((bq, d), jnp.float32),
        jnp.full((bq, 1), _MASKED, jnp.float32),
        jnp.zeros((bq, 1), jnp.float32),
    )


def finish(acc_QDh, m_Q1, l_Q1):
    """out = acc / l and the natural-log lse = (m + log2 l) ln 2 (m, l are base 2).

    A row that saw no key gives out 0, lse -inf."""
    seen = l_Q1 > 0
    l_safe = jnp.where(seen, l_Q1, 1.0)
    lse = (m_Q1 + jnp.log2(l_safe)) * (1.0 / LOG2E)
    return acc_QDh / l_safe, jnp.where(seen, lse, -jnp.inf)


def probs_and_dscores(
    q_QDh, k_KDh, v_KDh, do_QDh, lse2, delta, keep, scale2, transposed: bool = False
):
    """Recompute p from the saved (base-2) logsumexp; ds = p * (dO v^T - delta), f32.

    [Q, K] with lse2, delta [Q, 1] and keep [Q, K]; `transposed`: p^T, ds^T [K, Q] with lse2,
    delta [1, Q] and keep [K, Q], from the products taken the other way round:
        s^T = k q^T      p^T = exp2(scale2 s^T - lse2)      dp^T = v dO^T
    """
    scores = _dot(k_KDh, q_QDh, (1, 1)) if transposed else _dot(q_QDh, k_KDh, (1, 1))
    p = jnp.exp2(scores * scale2 - lse2)
    if keep is not None:
        p = jnp.where(keep, p, 0.0)
    dp = _dot(v_KDh, do_QDh, (1, 1)) if transposed else _dot(do_QDh, v_KDh, (1, 1))
    return p, p * (dp - delta)
