"""`lmjax.ops.attention`'s contract through `jax.nn.dot_product_attention(implementation="cudnn")`.

cuDNN's fused attention has causal and left-window masks of its own, and a bias; it has no
causal offset, no segment ids and no mask of lmjax's form. So every case its own masks cannot
express exactly goes in as a boolean keep mask (jax turns it into cuDNN's bias):

    keep[b,m,t,u] = lmjax's keep (`keep_mask`), m over 1 head, or H when `mask` varies by head
    native flags  = is_causal, local_window_size = (window - 1, 0)   only when T == S and the
                    offset is a static 0 (then they equal lmjax's causal and window; cuDNN
                    skips the blocks they drop, the keep mask repeats them harmlessly)
    out[b,t,h]    = 0 where keep[b,m(h),t,:] has no True (cuDNN, like XLA, would spread the
                    row over its keys; lmjax's contract is zeros)

Packed documents are the keep mask's `q_seg == kv_seg` term: a query of one document never
reads a key of another (the bug of a cuDNN path that passes only `is_causal`). cuDNN's
backward with a bias needs even T and S: an odd one gets one more query or key, masked out and
sliced off (a zero query row, a key no query sees).

`implementation` is jax's argument: "cudnn" on a CUDA GPU; the tests run the same arguments
with "xla" on a CPU. Shapes in the legend of `lmjax.models`; Hm is 1 or H (the mask's heads).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from lmjax.ops._common import is_int
from lmjax.ops.attention_mask import keep_mask


def native_masks(q_shape, k_shape, *, causal: bool, offset, window) -> dict:
    """jax's `is_causal` and `local_window_size` where they equal lmjax's causal and window.

    Both masks are aligned to the first key (key u visible to query t iff u <= t), which is
    lmjax's offset 0; T == S keeps every alignment convention in agreement. Elsewhere the keep
    mask carries them and the flags stay off."""
    if not (is_int(offset) and offset == 0 and q_shape[1] == k_shape[1]):
        return {"is_causal": False, "local_window_size": None}
    window_ok = window is not None and causal  # cuDNN windows only the past, with causal
    return {"is_causal": causal, "local_window_size": (window - 1, 0) if window_ok else None}


def needs_keep_mask(native: dict, *, causal, mask, window, segment_ids) -> bool:
    """Whether the `native_masks` flags `native` miss part of lmjax's keep (then a bias is
    needed).

    Every row then sees a key: its own (causal, T == S) or all of them (not causal, no window)."""
    if mask is not None or segment_ids is not None:
        return True
    return (causal and not native["is_causal"]) or (
        window is not None and native["local_window_size"] is None
    )


def mask_heads(mask, heads: int) -> int:
    """Hm: 1 unless `mask` (broadcast from the right to [B, H, T, S]) varies over heads."""
    if mask is None:
        return 1
    shape = jnp.shape(mask)
    return heads if len(shape) >= 3 and shape[-3] == heads and heads > 1 else 1


def cudnn_attention(
    q,
    k,
    v,
    *,
    causal: bool,
    offset=0,
    mask=None,
    window=None,
    segment_ids=None,
    implementation: str = "cudnn",
) -> jax.Array:
    """q `[B, T, H, Dh]`, k and v `[B, S, Hkv, Dh]` (H a multiple of Hkv, passed as they are)
    -> `[B, T, H, Dh]`, `lmjax.ops.attention`'s equations (module docstring for the
    translation). `segment_ids`: None or a checked (q [B, T], kv [B, S]) pair."""
    masks = dict(causal=causal, offset=offset, window=window)
    native = native_masks(q.shape, k.shape, **masks)
    if not needs_keep_mask(
        native, causal=causal, mask=mask, window=window, segment_ids=segment_ids
    ):
        out = jax.nn.dot_product_attention(q, k, v, **native, implementation=implementation)
        return out.astype(q.dtype)
    b, t, h, d = q.shape
    hm = mask_heads(mask, h)
    keep_BMTS = keep_mask((b, t, hm, d), k.shape, **masks, mask=mask, segment_ids=segment_ids)
    q_even, k_even, v_even, keep_even = even_lengths(q, k, v, keep_BMTS)
    out = jax.nn.dot_product_attention(
        q_even, k_even, v_even, mask=keep_even, **native, implementation=implementation
    )[:, :t]
    visible_BTM1 = jnp.any(keep_BMTS, axis=-1).transpose(0, 2, 1)[..., None]
    return jnp.where(visible_BTM1, out, 0.0).astype(q.dtype)


def even_lengths(q, k, v, keep_BMTS):
    """(q, k, v, keep) with T and S rounded up to even: one zero query row and one zero key,
    neither visible (cuDNN's backward with a bias refuses odd lengths)."""
    pad_t, pad_s = q.shape[1] % 2, k.shape[1] % 2
    if not (pad_t or pad_s):
        return q, k, v, keep_BMTS
    pad = lambda x, n: jnp.pad(x, ((0, 0), (0, n), (0, 0), (0, 0)))  # noqa: E731
    keep = jnp.pad(keep_BMTS, ((0, 0), (0, 0), (0, pad_t), (0, pad_s)), constant_values=False)
    return pad(q, pad_t), pad(k, pad_s), pad(v, pad_s), keep
