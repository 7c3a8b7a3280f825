"""The language-model head fused with the token cross-entropy: `mean CE(x W^T + b, y)`.

The head is the widest layer of a small LM (V = 8192 columns against D = 256): computing the
`[N, V]` logits, keeping them for the backward and reading them again for the softmax dominates a
CPU train step. Here the rows are processed in chunks of `chunk` tokens, and when a gradient is
wanted the forward pass already forms it (the loss is a scalar, so the backward is only a scale
by the incoming cotangent): per chunk one matmul for the logits, the softmax in the cache, and two
matmuls for dx and dW. Full logits are never materialized, nothing `[N, V]` is saved, and no
matmul is repeated.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp

from lmjax.checks import is_positive_int, require
from lmjax.errors import ShapeError
from lmjax.ops._common import compute_dtype, transposed_gradient_dot
from lmjax.ops.linear import Params, check_linear_args, linear_reference
from lmjax.ops.losses import check_cross_entropy_args, counted_positions, cross_entropy_reference

DEFAULT_CHUNK = 512  # rows per chunk on a CPU: a [512, 8192] float32 logits tile is 16 MiB
# On a GPU or TPU the tile may be far larger: each chunk re-reads and re-writes the float32
# [D, V] gradient accumulator (GPT-2: 154 MB), and a wider matmul keeps the chip busier.
ACCELERATOR_TILE_BYTES = 2**30  # at most 1 GiB of float32 logits per chunk


def accelerator_chunk(rows: int, vocab: int) -> int:
    """Rows per chunk on a GPU or TPU: the largest power of two whose float32 `[chunk, V]` tile
    fits ACCELERATOR_TILE_BYTES, at least DEFAULT_CHUNK, at most `rows` (GPT-2's V = 50257:
    4096 rows, so a 16 x 1024 micro-batch is 4 chunks, not 32)."""
    fit = 2 ** int(math.log2(max(ACCELERATOR_TILE_BYTES // (4 * vocab), 1)))
    return max(min(fit, rows), min(DEFAULT_CHUNK, rows), 1)


def _chunk_stats(w_VD, b_V, x_cD, y_c, acc_dtype):
    """One chunk's row statistics: (e = exp(z - max z), sum e, log sum e, target ids clamped
    into range, picked z_y - max z, valid target)."""
    z = jnp.einsum("cd,vd->cv", x_cD, w_VD, preferred_element_type=acc_dtype)
    if b_V is not None:
        z = z + b_V.astype(acc_dtype)[None, :]
    m = jnp.max(z, axis=-1, keepdims=True)
    e = jnp.exp(z - m)  # once: the backward's softmax is e / sum(e)
    sum_e = jnp.sum(e, axis=-1, keepdims=True)
    valid = (y_c >= 0) & (y_c < z.shape[-1])
    y_safe = jnp.where(valid, y_c, 0)
    picked = jnp.take_along_axis(z, y_safe[:, None], axis=-1)[:, 0] - m[:, 0]
    return e, sum_e, jnp.log(sum_e), y_safe, picked, valid


def _chunk_nll(stats):
    """-log softmax(z)_y per row; NaN for a target outside the vocabulary."""
    _, _, log_sum, _, picked, valid = stats
    return log_sum[:, 0] - jnp.where(valid, picked, jnp.nan)


def _split(x_ND, y_N, c_N, chunk):
    """Rows padded to a multiple of `chunk` (padding rows uncounted) and cut into `[K, chunk]`."""
    n = x_ND.shape[0]
    k = -(-n // chunk)
    pad = k * chunk - n
    if pad:
        x_ND = jnp.pad(x_ND, ((0, pad), (0, 0)))
        y_N = jnp.pad(y_N, (0, pad))
        c_N = jnp.pad(c_N, (0, pad))
    return (
        x_ND.reshape(k, chunk, x_ND.shape[-1]),
        y_N.reshape(k, chunk),
        c_N.reshape(k, chunk),
        pad,
    )


def _loss_only(w_VD, b_V, x_ND, y_N, c_N, chunk):
    acc = compute_dtype(x_ND.dtype)
    xs = _split(x_ND, y_N, c_N, chunk)[:3]

    def body(total, xyc):
        x_cD, y_c, c_c = xyc
        nll = _chunk_nll(_chunk_stats(w_VD, b_V, x_cD, y_c, acc))
        return total + jnp.sum(jnp.where(c_c, nll, 0.0)), None

    total, _ = jax.lax.scan(body, jnp.zeros((), acc), xs)
    return total / jnp.maximum(jnp.sum(c_N), 1).astype(acc)


def _loss_and_grads(w_VD, b_V, x_ND, y_N, c_N, chunk):
    """Loss and its gradients (for a cotangent of 1) in one pass over the chunks.

    With p = softmax(z) and s_n = c_n / N (NaN for a counted row whose target is out of range):
        dz = s (p - onehot(y)),   dx = dz W,   dW = dz^T x,   db = sum_n dz_n
    """
    acc = compute_dtype(x_ND.dtype)
    n = jnp.maximum(jnp.sum(c_N), 1).astype(acc)
    x_KcD, y_Kc, c_Kc, pad = _split(x_ND, y_N, c_N, chunk)

    def body(carry, xyc):
        total, dw_DV, db_V = carry
        x_cD, y_c, c_c = xyc
        stats = _chunk_stats(w_VD, b_V, x_cD, y_c, acc)
        e, sum_e, _, y_safe, _, valid = stats
        nll = _chunk_nll(stats)
        total = total + jnp.sum(jnp.where(c_c, nll, 0.0))
        scale = jnp.where(c_c, jnp.where(valid, 1.0 / n, jnp.nan), 0.0)
        # The -scale at the target is a select in the same elementwise pass as the softmax
        # scaling (a scatter re-reads and re-writes the whole [chunk, V] tile); same bits.
        hit = jax.lax.broadcasted_iota(jnp.int32, e.shape, 1) == y_safe[:, None]
        dz = e * (scale[:, None] / sum_e) - jnp.where(hit, scale[:, None], 0.0)
        dz_w = dz.astype(w_VD.dtype)
        dx_cD = jnp.einsum("cv,vd->cd", dz_w, w_VD, preferred_element_type=acc)
        # dW accumulated transposed, [D, V] = x^T dz: with x^T materialized (only [D, chunk])
        # it is a plain row-major product for the CPU's fast kernels, where dz^T x into [V, D]
        # would transpose the [chunk, V] tile instead; one transpose of dW at the end.
        dw_DV = dw_DV + transposed_gradient_dot(x_cD, dz_w, acc)
        if db_V is not None:
            db_V = db_V + jnp.sum(dz, axis=0)
        return (total, dw_DV, db_V), dx_cD.astype(x_ND.dtype)

    zero_b = None if b_V is None else jnp.zeros(b_V.shape, acc)
    init = (jnp.zeros((), acc), jnp.zeros(w_VD.shape[::-1], acc), zero_b)
    (total, dw_DV, db_V), dx_KcD = jax.lax.scan(body, init, (x_KcD, y_Kc, c_Kc))
    dx_ND = dx_KcD.reshape(-1, x_ND.shape[-1])[: x_ND.shape[0]]
    return total / n, (dw_DV.T, db_V, dx_ND)


def _make(chunk: int):
    @jax.custom_vjp
    def fused(w_VD, b_V, x_ND, y_N, c_N):
        return _loss_only(w_VD, b_V, x_ND, y_N, c_N, chunk)

    def fwd(w_VD, b_V, x_ND, y_N, c_N):
        loss, grads = _loss_and_grads(w_VD, b_V, x_ND, y_N, c_N, chunk)
        # w and b ride along only for their dtypes (they are live parameters: no copy).
        return loss, (grads, w_VD, b_V)

    def bwd(res, g):
        (dw_VD, db_V, dx_ND), w_VD, b_V = res
        dw = (g * dw_VD).astype(w_VD.dtype)
        db = None if db_V is None else (g * db_V).astype(b_V.dtype)
        dx = (g.astype(dx_ND.dtype) * dx_ND).astype(dx_ND.dtype)
        return dw, db, dx, None, None

    fused.defvjp(fwd, bwd)
    return fused


_FUSED: dict[int, object] = {}


def linear_cross_entropy(
    params: Params,
    x: jax.Array,
    targets: jax.Array,
    ignore_index: int = -100,
    time_range: tuple[int, int] | None = None,
    *,
    loss_mask: jax.Array | None = None,
    chunk: int | None = None,
) -> jax.Array:
    """`cross_entropy(linear(params, x), targets)` without materializing the logits.

    Shapes: params `{"weight": [V, D], "bias": [V]}` (bias optional), x `[..., D]`, integer
    targets `[...]` -> scalar (float32 or wider). With z_n = W x_n + b and counted positions c_n
    (as `cross_entropy`: not `ignore_index`, inside `time_range`, `loss_mask` `[...]` (bool or
    0/1) is 1), N = sum_n c_n:
        L = (1/N) sum_n c_n (logsumexp(z_n) - z_{n, y_n})
    VJP, with dz_n = c_n (softmax(z_n) - onehot(y_n)) / N:
        dx_n = dz_n W,   dW = sum_n dz_n^T x_n,   db = sum_n dz_n
    computed chunk by chunk (`chunk` rows) in the forward pass when a gradient is taken, and
    scaled by the cotangent in the backward. `chunk=None` picks it when the program is lowered
    (`lax.platform_dependent`): DEFAULT_CHUNK rows on a CPU, `accelerator_chunk` elsewhere.
    Matmuls accumulate in float32 (or wider).
    An uncounted row's dx is exactly 0; with nothing counted (N = 0) loss and gradients are 0.
    """
    x, targets = jnp.asarray(x), jnp.asarray(targets)
    raw_targets = targets
    check_linear_args(params, x)
    if chunk is not None:
        fix = "pass chunk >= 1 rows, or None for the platform's"
        require(is_positive_int(chunk), "chunk", chunk, "a positive int", fix, ShapeError)
    v = params["weight"].shape[0]
    check_cross_entropy_args(
        jax.ShapeDtypeStruct(x.shape[:-1] + (v,), jnp.float32),
        targets,
        ignore_index,
        time_range,
        raw_targets,
        loss_mask,
    )
    counted = counted_positions(targets, ignore_index, time_range, loss_mask)
    x_ND = x.reshape(-1, x.shape[-1])
    rows = max(x_ND.shape[0], 1)
    args = (params["weight"], params.get("bias"), x_ND, targets.reshape(-1), counted.reshape(-1))
    if chunk is not None:
        return _fused(min(chunk, rows))(*args)
    on_cpu, elsewhere = _fused(min(DEFAULT_CHUNK, rows)), _fused(accelerator_chunk(rows, v))
    if on_cpu is elsewhere:
        return on_cpu(*args)
    return jax.lax.platform_dependent(*args, cpu=on_cpu, default=elsewhere)


def _fused(chunk: int):
    """The custom-VJP function for `chunk` rows, made once per chunk size."""
    return _FUSED.get(chunk) or _FUSED.setdefault(chunk, _make(chunk))


def linear_cross_entropy_reference(
    params, x, targets, ignore_index=-100, time_range=None, *, loss_mask=None
):
    """`cross_entropy_reference(linear_reference(params, x), targets)`; `jax.grad` does the rest."""
    logits = linear_reference(params, x)
    return cross_entropy_reference(logits, targets, ignore_index, time_range, loss_mask=loss_mask)
