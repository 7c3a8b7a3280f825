"""An op linear in its input, with a hand-written backward: `y = apply(x, aux, static)`.

For such an op the VJP is the transposed map, `dx = transpose(g, aux, static)`, so nothing of x
needs saving: the residual is `aux` alone (dropout's keep-mask, rope's positions), which gets no
cotangent, and `static` (the rate, theta) is a hashable non-differentiable argument. Shared by
ops.dropout (its map is its own transpose) and ops.rope (the transpose rotates the other way).
"""

from __future__ import annotations

from collections.abc import Callable
from functools import partial

import jax


def linear_in_x(apply: Callable, transpose: Callable) -> Callable:
    """`op(x, aux, static)`: `apply`'s value, and `transpose(g, aux, static)` as dx."""

    @partial(jax.custom_vjp, nondiff_argnums=(2,))
    def op(x, aux, static):
        return apply(x, aux, static)

    def op_fwd(x, aux, static):
        return apply(x, aux, static), aux

    def op_bwd(static, aux, g):
        return transpose(g, aux, static), None

    op.defvjp(op_fwd, op_bwd)
    return op
