"""The custom VJP over padded inputs: forward saves (q, k, v, mask, segment ids, out, lse), the
backward recomputes p block by block (package docstring); `flash_padded` pads to the plan and
crops.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from pallas_kernels.flash_attention import gpu, tpu
from pallas_kernels.flash_attention.plan import LOG2E, Plan


def _forward(plan: Plan, q, k, v, kmask, qseg, kvseg):
    """Padded [B,T',H,Dh'] q and [B,S',Hkv,Dh'] k, v -> (out [B,T',H,Dh'], lse [B,H,T',1] f32)."""
    run = gpu.forward if plan.kernel == "gpu" else tpu.forward
    return run(plan, q, k, v, kmask, qseg, kvseg)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _flash(plan: Plan, q, k, v, kmask, qseg, kvseg):
    return _forward(plan, q, k, v, kmask, qseg, kvseg)


def _flash_fwd(plan: Plan, q, k, v, kmask, qseg, kvseg):
    out, lse = _forward(plan, q, k, v, kmask, qseg, kvseg)
    return (out, lse), (q, k, v, kmask, qseg, kvseg, out, lse)


def _flash_bwd(plan: Plan, res, cotangents):
    q, k, v, kmask, qseg, kvseg, out, lse = res
    do, dlse = cotangents
    out_f32, do_f32 = out.astype(jnp.float32), do.astype(jnp.float32)
    # delta = rowsum(o * do) in float32: a multiply and a reduce, which XLA fuses with the
    # upcasts into one pass over o and do; as a batched dot (einsum) it was a float32 matmul
    # whose operands a GPU materializes first (benchmarks/gpu_structure.py).
    delta = jnp.sum(out_f32 * do_f32, axis=-1).transpose(0, 2, 1)[..., None] - dlse
    # The kernels recompute p = exp2(s log2e - lse log2e). A row that saw no key gets
    # lse = +inf there, so its p is exactly 0 in every block: the mask already zeroes it in the
    # blocks such a row meets, this keeps it zero should an unmasked block ever meet one.
    lse2 = jnp.where(jnp.isneginf(lse), jnp.inf, lse * LOG2E)
    run = gpu.backward if plan.kernel == "gpu" else tpu.backward
    dq, dk, dv = run(plan, q, k, v, kmask, qseg, kvseg, do.astype(q.dtype), lse2, delta)
    return dq, dk, dv, None, None, None


_flash.defvjp(_flash_fwd, _flash_bwd)


def _pad_bthd(x, n: int, d: int):
    """Zero-pad [B, T, H, Dh] to [B, n, H, d]."""
    return jnp.pad(x, ((0, 0), (0, n - x.shape[1]), (0, 0), (0, d - x.shape[3])))


def _pad_segments(qseg, kvseg, plan: Plan):
    """Pad [B, T] and [B, S] int32 segment ids to the plan's T' and S'.

    A padded query row gets (min of the real key ids) - 1 and a padded key (min of the real
    query ids) - 1, so neither matches anything real (unless an id is INT32_MIN, where the
    subtraction wraps: harmless, as padded keys are masked by position as well and padded rows
    are dropped with zero cotangents).
    """
    if qseg is None:
        return None, None
    q_fill, kv_fill = jnp.min(kvseg) - 1, jnp.min(qseg) - 1
    qseg = jnp.pad(qseg, ((0, 0), (0, plan.t_pad - plan.t)), constant_values=q_fill)
    kvseg = jnp.pad(kvseg, ((0, 0), (0, plan.s_pad - plan.s)), constant_values=kv_fill)
    return qseg, kvseg


@functools.partial(jax.jit, static_argnums=(0,))
def flash_padded(plan: Plan, q, k, v, kmask, qseg=None, kvseg=None):
    """Pad to the plan, run the custom VJP, crop: (out [B,T,H,Dh], lse [B,H,T])."""
    q_p, k_p, v_p = (
        _pad_bthd(x, n, plan.d_pad) for x, n in ((q, plan.t_pad), (k, plan.s_pad), (v, plan.s_pad))
    )
    if kmask is not None:
        kmask = jnp.pad(kmask, ((0, 0), (0, plan.s_pad - plan.s)))  # padded keys: masked
    qseg, kvseg = _pad_segments(qseg, kvseg, plan)
    out, lse = _flash(plan, q_p, k_p, v_p, kmask, qseg, kvseg)
    return out[:, : plan.t, :, : plan.d], lse[:, :, : plan.t, 0]
