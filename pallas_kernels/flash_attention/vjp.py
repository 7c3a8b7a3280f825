"""The custom VJP over padded inputs: forward saves (q, k, v, mask, out, lse), the backward
recomputes p block by block (package docstring); `flash_padded` pads to the plan and crops.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from pallas_kernels.flash_attention import gpu, tpu
from pallas_kernels.flash_attention.plan import LOG2E, Plan


def _forward(plan: Plan, q, k, v, kmask):
    """Padded [B,T',H,Dh'] inputs -> (out [B,T',H,Dh'], lse [B,H,T',1] f32)."""
    run = gpu.forward if plan.kernel == "gpu" else tpu.forward
    return run(plan, q, k, v, kmask)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _flash(plan: Plan, q, k, v, kmask):
    return _forward(plan, q, k, v, kmask)


def _flash_fwd(plan: Plan, q, k, v, kmask):
    out, lse = _forward(plan, q, k, v, kmask)
    return (out, lse), (q, k, v, kmask, out, lse)


def _flash_bwd(plan: Plan, res, cotangents):
    q, k, v, kmask, out, lse = res
    do, dlse = cotangents
    out_f32, do_f32 = out.astype(jnp.float32), do.astype(jnp.float32)
    delta = jnp.einsum("BTHD,BTHD->BHT", out_f32, do_f32)[..., None] - dlse
    # The kernels recompute p = exp2(s log2e - lse log2e). A row that saw no key gets
    # lse = +inf there, so its p is exactly 0 in every block: the mask already zeroes it in the
    # blocks such a row meets, this keeps it zero should an unmasked block ever meet one.
    lse2 = jnp.where(jnp.isneginf(lse), jnp.inf, lse * LOG2E)
    run = gpu.backward if plan.kernel == "gpu" else tpu.backward
    dq, dk, dv = run(plan, q, k, v, kmask, do.astype(q.dtype), lse2, delta)
    return dq, dk, dv, None


_flash.defvjp(_flash_fwd, _flash_bwd)


def _pad_bthd(x, n: int, d: int):
    """Zero-pad [B, T, H, Dh] to [B, n, H, d]."""
    return jnp.pad(x, ((0, 0), (0, n - x.shape[1]), (0, 0), (0, d - x.shape[3])))


@functools.partial(jax.jit, static_argnums=(0,))
def flash_padded(plan: Plan, q, k, v, kmask):
    """Pad to the plan, run the custom VJP, crop: (out [B,T,H,Dh], lse [B,H,T])."""
    q_p, k_p, v_p = (
        _pad_bthd(x, n, plan.d_pad) for x, n in ((q, plan.t_pad), (k, plan.s_pad), (v, plan.s_pad))
    )
    if kmask is not None:
        kmask = jnp.pad(kmask, ((0, 0), (0, plan.s_pad - plan.s)))  # padded keys: masked
    out, lse = _flash(plan, q_p, k_p, v_p, kmask)
    return out[:, : plan.t, :, : plan.d], lse[:, :, : plan.t, 0]
