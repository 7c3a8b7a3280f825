"""Gradient-check harness: hand-written VJPs against `jax.grad` and finite differences.

Two witnesses for every custom VJP:

* `compare_with_reference`: the op and its plain-jnp reference on the same inputs; values must
  agree, and so must the VJPs of one random cotangent (the op's hand-written backward against
  `jax.grad` through the reference).
* `finite_difference_error`: in float64, the directional derivative `<grad L, v>` of
  `L(x) = sum(w * op(x))` (hand-written VJP) against the centered difference
  `(L(x + h v) - L(x - h v)) / 2h`, for a few random directions v.

`OP_CASES` lists every primitive with small inputs (rank 3 and rank 4 where the op cares);
the test suite and `lmjax gradcheck` both run over it.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from functools import partial

import jax
import jax.numpy as jnp
import numpy as np

from lmjax import ops


@dataclasses.dataclass(frozen=True)
class OpCase:
    """One op on one input recipe. `op` and `reference` take exactly `make_args(key, dtype)`;
    `argnums` are the float arguments to differentiate (others are ids, masks, keys)."""

    name: str
    op: Callable
    reference: Callable
    make_args: Callable[[jax.Array, jnp.dtype], tuple]
    argnums: tuple[int, ...] = (0,)


@dataclasses.dataclass(frozen=True)
class ReferenceReport:
    value_error: float  # max |op - reference|
    grad_error: float  # max over argnums of max |vjp_op - vjp_reference|
    grad_scale: float  # max |vjp_reference|, to judge grad_error against


def _as_f64(x) -> np.ndarray:
    return np.asarray(x).astype(np.float64)


def _tree_max_abs(tree) -> float:
    return max(
        (float(np.max(np.abs(_as_f64(leaf)))) for leaf in jax.tree.leaves(tree) if np.size(leaf)),
        default=0.0,
    )


def _tree_max_abs_diff(a, b) -> float:
    return _tree_max_abs(jax.tree.map(lambda x, y: _as_f64(x) - _as_f64(y), a, b))


def _with(args: Sequence, argnums: Sequence[int], diff_args: Sequence) -> list:
    """`args` with `args[argnums[j]]` replaced by `diff_args[j]`."""
    full = list(args)
    for i, a in zip(argnums, diff_args, strict=True):
        full[i] = a
    return full


def _random_like(key: jax.Array, tree):
    """A standard-normal pytree with the structure, shapes and dtypes of `tree`."""
    leaves, treedef = jax.tree.flatten(tree)
    keys = jax.random.split(key, max(len(leaves), 1))
    return jax.tree.unflatten(
        treedef,
        [
            jax.random.normal(k, leaf.shape, leaf.dtype)
            for k, leaf in zip(keys, leaves, strict=False)
        ],
    )


def vjp_of(fn: Callable, args: Sequence, argnums: Sequence[int], cotangent_key: jax.Array):
    """(fn(*args), VJP of a fixed random cotangent w.r.t. `args[i]` for i in argnums).

    The cotangent depends only on the output's structure and `cotangent_key`, so an op and its
    reference receive the same one.
    """
    out, pullback = jax.vjp(lambda *d: fn(*_with(args, argnums, d)), *(args[i] for i in argnums))
    return out, pullback(_random_like(cotangent_key, out))


def compare_with_reference(
    case: OpCase, key: jax.Array, dtype=jnp.float32, transform: Callable = lambda f: f
) -> ReferenceReport:
    """Op (run through `transform`, e.g. `jax.jit`) against its reference on one input set."""
    arg_key, cot_key = jax.random.split(key)
    args = case.make_args(arg_key, dtype)
    out, grads = transform(lambda *a: vjp_of(case.op, a, case.argnums, cot_key))(*args)
    ref_out, ref_grads = vjp_of(case.reference, args, case.argnums, cot_key)
    return ReferenceReport(
        value_error=_tree_max_abs_diff(out, ref_out),
        grad_error=_tree_max_abs_diff(grads, ref_grads),
        grad_scale=_tree_max_abs(ref_grads),
    )


def finite_difference_error(
    case: OpCase, key: jax.Array, *, step: float = 1e-6, directions: int = 3
) -> float:
    """Worst relative error of the op's VJP against centered differences, in float64.

    Relative to `max(|AD|, |FD|, 1e-3 * scale)`, where scale is the largest |AD| seen, so a
    direction that happens to be nearly orthogonal to the gradient cannot pass vacuously.
    """
    with jax.enable_x64(True):
        arg_key, cot_key, dir_key = jax.random.split(key, 3)
        args = case.make_args(arg_key, jnp.float64)
        out, grads = vjp_of(case.op, args, case.argnums, cot_key)
        weights = _random_like(cot_key, out)

        @jax.jit
        def loss(diff_args):
            result = case.op(*_with(args, case.argnums, diff_args))
            return sum(
                jnp.sum(w * o)
                for w, o in zip(jax.tree.leaves(weights), jax.tree.leaves(result), strict=True)
            )

        base = tuple(args[i] for i in case.argnums)
        analytic, numeric = [], []
        for k in jax.random.split(dir_key, directions):
            v = _random_like(k, base)
            plus = loss(jax.tree.map(lambda a, d: a + step * d, base, v))
            minus = loss(jax.tree.map(lambda a, d: a - step * d, base, v))
            numeric.append(float((plus - minus) / (2 * step)))
            analytic.append(
                float(
                    sum(
                        jnp.vdot(g, d)
                        for g, d in zip(jax.tree.leaves(grads), jax.tree.leaves(v), strict=True)
                    )
                )
            )
    scale = max(max(abs(a) for a in analytic), 1e-12)
    return max(
        abs(a - n) / max(abs(a), abs(n), 1e-3 * scale)
        for a, n in zip(analytic, numeric, strict=True)
    )


# ---- the cases ---------------------------------------------------------------------------------


def _normal(key, shape, dtype, scale=1.0):
    return scale * jax.random.normal(key, shape, dtype)


def _keys(key, n):
    return jax.random.split(key, n)


def _linear_args(shape, bias):
    def make(key, dtype):
        k1, k2, k3 = _keys(key, 3)
        params = {"weight": _normal(k1, (5, shape[-1]), dtype)}
        if bias:
            params["bias"] = _normal(k2, (5,), dtype)
        return params, _normal(k3, shape, dtype)

    return make


def _norm_args(shape, with_bias):
    def make(key, dtype):
        k1, k2, k3 = _keys(key, 3)
        args = (_normal(k1, shape, dtype, 2.0) + 1.0, 1.0 + _normal(k2, shape[-1:], dtype, 0.3))
        return args + ((_normal(k3, shape[-1:], dtype),) if with_bias else ())

    return make


def _unary(shape, scale=2.0):
    return lambda key, dtype: (_normal(key, shape, dtype, scale),)


def _binary(shape, second=lambda k, s, d: _normal(k, s, d)):
    def make(key, dtype):
        k1, k2 = _keys(key, 2)
        return _normal(k1, shape, dtype, 2.0), second(k2, shape, dtype)

    return make


def _embedding_args(key, dtype):
    # Repeated ids on purpose: the scatter-add must accumulate them.
    return _normal(key, (7, 4), dtype), jnp.array([[1, 3, 1], [6, 1, 0]], jnp.int32)


def _softmax_args(shape, masked):
    def make(key, dtype):
        x = _normal(key, shape, dtype, 3.0)
        if not masked:
            return (x,)
        mask = jax.random.bernoulli(jax.random.fold_in(key, 1), 0.6, shape).at[..., 0].set(True)
        return x, mask

    return make


def _ce_args(shape, ignore_index=-100):
    def make(key, dtype):
        k1, k2 = _keys(key, 2)
        logits = _normal(k1, shape, dtype, 2.0)
        targets = jax.random.randint(k2, shape[:-1], 0, shape[-1])
        return logits, targets.at[..., 1].set(ignore_index)

    return make


def _attention_args(t, s, mask=False):
    def make(key, dtype):
        kq, kk, kv, km = _keys(key, 4)
        args = (
            _normal(kq, (2, t, 2, 4), dtype),
            _normal(kk, (2, s, 2, 4), dtype),
            _normal(kv, (2, s, 2, 4), dtype),
        )
        if mask:
            # Key padding [B, 1, 1, S]: batch row 1 hides its last two keys.
            pad = jnp.ones((2, 1, 1, s), bool).at[1, ..., -2:].set(False)
            args += (pad,)
        return args

    return make


def _rope_args(key, dtype):
    return (_normal(key, (2, 5, 3, 8), dtype),)


def _dropout_args(key, dtype):
    return _normal(key, (3, 4, 5), dtype), jax.random.PRNGKey(7)


def _prob_targets(key, shape, dtype):
    return jax.nn.softmax(_normal(key, shape, dtype), axis=-1)


def _unit_targets(key, shape, dtype):
    return jax.random.uniform(key, shape, dtype)


def _cases() -> list[OpCase]:
    o = ops
    cases = [
        OpCase("embedding", o.embedding, o.embedding_reference, _embedding_args),
        OpCase("linear_rank3", o.linear, o.linear_reference, _linear_args((2, 3, 4), True), (0, 1)),
        OpCase(
            "linear_rank4_nobias",
            o.linear,
            o.linear_reference,
            _linear_args((2, 2, 3, 4), False),
            (0, 1),
        ),
        OpCase(
            "layer_norm_rank3",
            o.layer_norm,
            o.layer_norm_reference,
            _norm_args((2, 3, 6), True),
            (0, 1, 2),
        ),
        OpCase(
            "layer_norm_rank4",
            o.layer_norm,
            o.layer_norm_reference,
            _norm_args((2, 2, 3, 6), True),
            (0, 1, 2),
        ),
        OpCase(
            "rms_norm_rank3", o.rms_norm, o.rms_norm_reference, _norm_args((2, 3, 6), False), (0, 1)
        ),
        OpCase(
            "rms_norm_rank4",
            o.rms_norm,
            o.rms_norm_reference,
            _norm_args((2, 2, 3, 6), False),
            (0, 1),
        ),
    ]
    for name in ("gelu", "gelu_tanh", "relu", "silu", "sigmoid", "tanh", "leaky_relu"):
        op, ref = getattr(o, name), getattr(o, f"{name}_reference")
        cases.append(OpCase(f"{name}_rank3", op, ref, _unary((2, 3, 4))))
    cases += [
        OpCase("gelu_rank4", o.gelu, o.gelu_reference, _unary((2, 2, 3, 4))),
        OpCase("swiglu", o.swiglu, o.swiglu_reference, _binary((2, 3, 4)), (0, 1)),
        OpCase("softmax_rank3", o.softmax, o.softmax_reference, _softmax_args((2, 3, 5), False)),
        OpCase(
            "softmax_axis1_rank4",
            lambda x: o.softmax(x, axis=1),
            lambda x: o.softmax_reference(x, axis=1),
            _softmax_args((2, 4, 3, 2), False),
        ),
        OpCase(
            "softmax_masked",
            lambda x, m: o.softmax(x, mask=m),
            lambda x, m: o.softmax_reference(x, mask=m),
            _softmax_args((2, 3, 5), True),
        ),
        OpCase(
            "cross_entropy_rank3", o.cross_entropy, o.cross_entropy_reference, _ce_args((2, 4, 6))
        ),
        OpCase(
            "cross_entropy_time_range",
            lambda z, y: o.cross_entropy(z, y, time_range=(1, 2)),
            lambda z, y: o.cross_entropy_reference(z, y, time_range=(1, 2)),
            _ce_args((2, 4, 6)),
        ),
        OpCase(
            "cross_entropy_rank4_ignore0",
            lambda z, y: o.cross_entropy(z, y, ignore_index=0),
            lambda z, y: o.cross_entropy_reference(z, y, ignore_index=0),
            _ce_args((2, 2, 3, 5), ignore_index=0),
        ),
        OpCase(
            "softmax_cross_entropy",
            o.softmax_cross_entropy,
            o.softmax_cross_entropy_reference,
            _binary((2, 3, 5), _prob_targets),
            (0, 1),
        ),
        OpCase("mse", o.mse, o.mse_reference, _binary((2, 3, 4)), (0, 1)),
        OpCase(
            "binary_cross_entropy_with_logits",
            o.binary_cross_entropy_with_logits,
            o.binary_cross_entropy_with_logits_reference,
            _binary((2, 3, 4), _unit_targets),
            (0, 1),
        ),
        OpCase(
            "attention_causal",
            partial(o.attention, causal=True),
            partial(o.attention_reference, causal=True),
            _attention_args(5, 5),
            (0, 1, 2),
        ),
        OpCase(
            "attention_causal_offset",
            partial(o.attention, causal=True, offset=3),
            partial(o.attention_reference, causal=True, offset=3),
            _attention_args(2, 5),
            (0, 1, 2),
        ),
        OpCase(
            "attention_key_padding",
            lambda q, k, v, m: o.attention(q, k, v, causal=False, mask=m),
            lambda q, k, v, m: o.attention_reference(q, k, v, causal=False, mask=m),
            _attention_args(3, 5, mask=True),
            (0, 1, 2),
        ),
        OpCase(
            "attention_probabilities",
            lambda q, k, v: o.attention(q, k, v, causal=True, return_probabilities=True),
            lambda q, k, v: _reference_with_probabilities(q, k, v),
            _attention_args(4, 4),
            (0, 1, 2),
        ),
        OpCase("rope", o.rope, o.rope_reference, _rope_args),
        OpCase(
            "rope_offset",
            partial(o.rope, offset=11),
            partial(o.rope_reference, offset=11),
            _rope_args,
        ),
        OpCase(
            "dropout",
            lambda x, k: o.dropout(k, x, 0.3, False),
            lambda x, k: o.dropout_reference(k, x, 0.3, False),
            _dropout_args,
        ),
    ]
    return cases


def _reference_with_probabilities(q, k, v):
    """(out, p) from the reference, for the case that differentiates through p as well."""
    out = ops.attention_reference(q, k, v, causal=True)
    s = jnp.einsum("BTHD,BSHD->BHTS", q, k) / jnp.sqrt(jnp.asarray(q.shape[-1], q.dtype))
    keep = jnp.tril(jnp.ones((q.shape[1], k.shape[1]), bool))[None, None]
    keep = jnp.broadcast_to(keep, s.shape)
    p = jax.nn.softmax(jnp.where(keep, s, -jnp.inf), axis=-1)
    return out, p


OP_CASES: tuple[OpCase, ...] = tuple(_cases())


def case(name: str) -> OpCase:
    """Look one case up by name."""
    for c in OP_CASES:
        if c.name == name:
            return c
    raise KeyError(f"no op case {name!r}; known: {[c.name for c in OP_CASES]}")
