"""Small helpers shared by the primitives: dtypes, explicit broadcasting, host-side checks.

The test suite runs with `jax_numpy_rank_promotion="raise"`, so every broadcast of a lower-rank
array (a bias, a mask) is spelt out here rather than left implicit.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np

# Re-exported for the ops modules: the array checks live in lmjax.checks (every layer uses them).
from lmjax.checks import (  # noqa: F401
    check_keep_values,
    check_token_ids,
    is_concrete,
    is_int,
    is_real,
)
from lmjax.errors import ShapeError


def compute_dtype(dtype) -> jnp.dtype:
    """Accumulation dtype: at least float32 (bf16/f16 are upcast, float64 stays)."""
    return jnp.promote_types(dtype, jnp.float32)


def expand_left(a: jax.Array, ndim: int) -> jax.Array:
    """Prepend unit axes so `a` has rank `ndim` (a `[D]` bias becomes `[1, ..., 1, D]`)."""
    return a.reshape((1,) * (ndim - a.ndim) + a.shape)


def sum_to_last(g: jax.Array) -> jax.Array:
    """Reduce every leading axis: `[..., D] -> [D]` (the VJP of broadcasting a `[D]` vector)."""
    return g.reshape(-1, g.shape[-1]).sum(axis=0) if g.ndim > 1 else g


def transposed_gradient_dot(a_NM: jax.Array, b_NK: jax.Array, acc_dtype=None) -> jax.Array:
    """`a^T b` `[M, K]`, contracting the leading (token) axis of both: a weight gradient.

        out[m, k] = sum_n a[n, m] b[n, k]

    On CPU, XLA hands a dot to its fast YNNPACK kernels only when the left operand is
    row-major over the contracted axis; `a^T b` as written goes to Eigen instead, which measured
    up to 40% slower for the reference config's shapes (benchmarks/train_step.py). So on CPU
    the narrower operand is transposed into a row-major copy first, `[M, N]` (or `[K, N]`, then the
    small `[K, M]` product is transposed back). Optimization barriers keep XLA from folding the
    transposes back into the dot, and from fusing the operand's producer into the transposing
    copy (a strided recomputation that cost more than the dot saved in the llama preset's
    SwiGLU). Elsewhere the dot takes transposed operands for free, so it is left to XLA. The
    choice is made when the program is lowered (`lax.platform_dependent`), not from the host's
    default backend: a step lowered for a GPU on a CPU host is the GPU's program.
    """

    def plain(a_NM, b_NK):
        return jnp.einsum("nm,nk->mk", a_NM, b_NK, preferred_element_type=acc_dtype)

    def cpu(a_NM, b_NK):
        barrier = jax.lax.optimization_barrier
        if a_NM.shape[1] <= b_NK.shape[1]:
            return jnp.matmul(barrier(barrier(a_NM).T), b_NK, preferred_element_type=acc_dtype)
        out_KM = jnp.matmul(barrier(barrier(b_NK).T), a_NM, preferred_element_type=acc_dtype)
        return barrier(out_KM).T

    return jax.lax.platform_dependent(a_NM, b_NK, cpu=cpu, default=plain)


def broadcast_mask(mask, shape: tuple[int, ...], what: str = "mask") -> jax.Array:
    """0/1 (or bool) `mask`, broadcastable from the right, -> bool array of exactly `shape`."""
    mask = jnp.asarray(mask)
    if mask.ndim > len(shape) or not _broadcastable(mask.shape, shape):
        raise ShapeError.describe(
            f"{what}.shape",
            mask.shape,
            f"a shape broadcastable from the right to {shape} (e.g. [B,1,1,S] for key padding)",
            "insert size-1 axes where the mask does not vary",
        )
    return jnp.broadcast_to(mask != 0, shape)


def _broadcastable(small: tuple[int, ...], big: tuple[int, ...]) -> bool:
    return all(s in (1, b) for s, b in zip(reversed(small), reversed(big), strict=False))


def require_rank(x, ranks: int | tuple[int, ...], what: str, layout: str) -> None:
    """Trace-time rank check with the message format of `lmjax.errors`."""
    ranks = (ranks,) if isinstance(ranks, int) else ranks
    if np.ndim(x) not in ranks:
        raise ShapeError.describe(
            f"{what}.shape",
            np.shape(x),
            f"rank {' or '.join(map(str, ranks))} ({layout})",
            f"reshape {what} to {layout}",
        )


def require_shape(x, shape: tuple[int, ...], what: str, why: str) -> None:
    """Trace-time exact-shape check."""
    if tuple(np.shape(x)) != tuple(shape):
        raise ShapeError.describe(
            f"{what}.shape",
            np.shape(x),
            f"{tuple(shape)} ({why})",
            f"pass {what} with shape {tuple(shape)}",
        )


def _require_kind(x, kind, kind_name: str, cast_to: str, what: str) -> None:
    if not jnp.issubdtype(jnp.result_type(x), kind):
        raise ShapeError.describe(
            f"{what}.dtype",
            jnp.result_type(x),
            f"{kind_name} dtype",
            f"cast {what} with .astype({cast_to})",
        )


def require_float(x, what: str) -> None:
    _require_kind(x, jnp.floating, "a floating", "jnp.float32", what)


def require_int(x, what: str) -> None:
    _require_kind(x, jnp.integer, "an integer", "jnp.int32", what)


def inv_sqrt(n: int) -> float:
    return 1.0 / math.sqrt(n)
