"""Gradient-check harness: hand-written VJPs against `jax.grad` and finite differences.

Two witnesses for every custom VJP:

* `compare_with_reference`: the op and its plain-jnp reference on the same inputs; values must
  agree, and so must the VJPs of one random cotangent (the op's hand-written backward against
  `jax.grad` through the reference).
* `finite_difference_error`: in float64, the directional derivative `<grad L, v>` of
  `L(x) = sum(w * op(x))` (hand-written VJP) against the centered difference
  `(L(x + h v) - L(x - h v)) / 2h`, for a few random directions v.

`OP_CASES` lists every primitive with small inputs (rank 3 and rank 4 where the op cares);
the test suite and `lmjax gradcheck` both run over it. Inputs, cotangents and directions come
from numpy (integer seeds): eager jax ops would compile a program per shape, per tiny op.
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Callable, Sequence
from functools import partial

import jax
import jax.numpy as jnp
import numpy as np

from lmjax import ops
from lmjax.ops.attention import causal_block

# Tolerances, stated once. float32 comparisons are relative to max(1, largest reference
# magnitude); the float64 finite-difference error is already relative (see below).
# F32_RTOL is `f32_rtol(chain=386)`: the OP_CASES reduce over at most a few dozen entries, so
# it bounds their rounding on any CPU (vector width changes only the order of the sums).
F32_RTOL = 1e-5
FD_RTOL = 1e-6
# bf16 inputs (computed in float32 inside, rounded once on the way out): 4 bf16 ulps, 2^-6.
BF16_RTOL = 2.0**-6
F32_U = 2.0**-24  # float32 unit roundoff: one rounding moves a value by at most this, relatively


def f32_rtol(chain: int) -> float:
    """Bound on max |a - b| / max |b| for two float32 evaluations of one function whose sums run
    in different orders (XLA's CPU code picks its vector width from the host; torch is another
    program), derived, not measured, so that it holds on every CPU.

    `chain` counts the roundings on the longest path from input to output: n for a sum or dot of
    n terms, a few for an elementwise op. With rounding errors modelled as independent and
    mean-zero, each at most u = 2^-24 (Higham and Mary, SIAM J. Sci. Comput. 41(5), 2019, Theorem
    3.1, lambda = 6), n of them stay within 6 u sqrt(n) of the summands' scale except with
    probability n * 3e-8; the two sides' 2 chain errors give 6 u sqrt(2 chain). The worst case,
    chain * u a side, needs every rounding to err the same way. max |b| stands for the summands'
    scale: lmjax's models normalise before every sublayer, so values and errors grow together.
    """
    return 6 * F32_U * float(np.sqrt(2 * chain))


def forward_chain(cfg, t: int, extra: int = 0) -> int:
    """`chain` of `f32_rtol` for logits of `lmjax.models.forward` (or transformers' equivalent)
    over t positions: per block two norms (mean and variance, d each), q/k/v (d), scores (Dh),
    softmax's sum and the p @ v (t each), the output projection (H Dh), the feed-forward (d,
    then d_ff), and 16 elementwise roundings (exp, rsqrt, activation, residual adds); then the
    final norm and the head (d). `extra` adds per block (a LoRA rank r: the x A then B sums)."""
    d, attention = cfg.d_model, cfg.d_head + 2 * t + cfg.n_heads * cfg.d_head
    block = 4 * d + d + attention + d + cfg.d_ff + 16 + extra
    return cfg.n_layers * block + 2 * d + d


def logits_atol(cfg, reference, extra: int = 0, t: int | None = None) -> float:
    """`f32_rtol` of `forward_chain` times max |reference|, for reference logits [..., T, V]
    (attention over t positions: T unless given)."""
    reference = np.asarray(reference)
    chain = forward_chain(cfg, reference.shape[-2] if t is None else t, extra)
    return f32_rtol(chain) * float(np.abs(reference).max())


@dataclasses.dataclass(frozen=True)
class OpCase:
    """One op on one input recipe. `op` and `reference` take exactly `make_args(rng, dtype)`;
    `argnums` are the float arguments to differentiate (the others are ids, masks, keys)."""

    name: str
    op: Callable
    reference: Callable
    make_args: Callable[[np.random.Generator, jnp.dtype], tuple]
    argnums: tuple[int, ...] = (0,)


@dataclasses.dataclass(frozen=True)
class ReferenceReport:
    value_error: float  # max |op - reference|
    value_scale: float  # max |reference|
    grad_error: float  # max over argnums of max |vjp_op - vjp_reference|
    grad_scale: float  # max |vjp_reference|

    @property
    def ok(self) -> bool:
        return self.within(F32_RTOL)

    def within(self, rtol: float) -> bool:
        """Values and VJPs agree to `rtol` relative to max(1, the reference's largest entry)."""
        return self.value_error <= rtol * max(1.0, self.value_scale) and (
            self.grad_error <= rtol * max(1.0, self.grad_scale)
        )


def _as_f64(x) -> np.ndarray:
    return np.asarray(x).astype(np.float64)


def _tree_max_abs(tree) -> float:
    leaves = [leaf for leaf in jax.tree.leaves(tree) if np.size(leaf)]
    return max((float(np.max(np.abs(_as_f64(leaf)))) for leaf in leaves), default=0.0)


def _tree_max_abs_diff(a, b) -> float:
    return _tree_max_abs(jax.tree.map(lambda x, y: _as_f64(x) - _as_f64(y), a, b))


def _with(args: Sequence, argnums: Sequence[int], diff_args: Sequence) -> list:
    """`args` with `args[argnums[j]]` replaced by `diff_args[j]`."""
    full = list(args)
    for i, a in zip(argnums, diff_args, strict=True):
        full[i] = a
    return full


def random_like(seed: int, tree):
    """A standard-normal pytree with the structure, shapes and dtypes of `tree`."""
    rng = np.random.default_rng(seed)
    return jax.tree.map(lambda x: jnp.asarray(rng.standard_normal(x.shape), x.dtype), tree)


def vjp_of(fn: Callable, args: Sequence, argnums: Sequence[int], cotangent_seed: int):
    """(fn(*args), VJP of a random cotangent w.r.t. `args[i]` for i in argnums).

    The cotangent depends only on the output's structure and `cotangent_seed`, so an op and
    its reference receive the same one.
    """
    out, pullback = jax.vjp(lambda *d: fn(*_with(args, argnums, d)), *(args[i] for i in argnums))
    return out, pullback(random_like(cotangent_seed, out))


def compare_with_reference(
    case: OpCase, seed: int = 0, dtype=jnp.float32, transform: Callable = lambda f: f
) -> ReferenceReport:
    """The op (through `transform`: `jax.jit`, a chex variant...) against its reference."""
    with _strict_numerics():
        return _compare(case, seed, dtype, transform)


@contextlib.contextmanager
def _strict_numerics():
    """Full-precision float32 matmuls (GPUs default to TF32, which a 1e-5 check would fail) and
    no implicit rank promotion (a silent broadcast is an error), whoever calls the harness."""
    with jax.default_matmul_precision("highest"), jax.numpy_rank_promotion("raise"):
        yield


_REFERENCE_RESULTS: dict = {}  # a case's yardstick, the same under every transform compared


def _reference_result(case, seed, dtype, args):
    """The reference's value and VJP, computed once, jitted: eager dispatch of its many small
    ops costs more compile time than one fused program."""
    key = (case.reference, case.make_args, tuple(case.argnums), seed, jnp.dtype(dtype).name)
    if key not in _REFERENCE_RESULTS:
        vjp = jax.jit(lambda *a: vjp_of(case.reference, a, case.argnums, seed + 1))
        _REFERENCE_RESULTS[key] = vjp(*args)
    return _REFERENCE_RESULTS[key]


def _compare(case, seed, dtype, transform):
    args = case.make_args(np.random.default_rng(seed), dtype)
    out, grads = transform(lambda *a: vjp_of(case.op, a, case.argnums, seed + 1))(*args)
    ref_out, ref_grads = _reference_result(case, seed, dtype, args)
    return ReferenceReport(
        value_error=_tree_max_abs_diff(out, ref_out),
        value_scale=_tree_max_abs(ref_out),
        grad_error=_tree_max_abs_diff(grads, ref_grads),
        grad_scale=_tree_max_abs(ref_grads),
    )


def finite_difference_error(
    case: OpCase, seed: int = 0, *, step: float = 1e-6, directions: int = 3
) -> float:
    """Worst relative error of the op's VJP against centered differences, in float64.

    Relative to `max(|AD|, |FD|, 1e-3 * scale)`, where scale is the largest |AD| seen, so a
    direction that happens to be nearly orthogonal to the gradient cannot pass vacuously.
    """
    with jax.enable_x64(True), _strict_numerics():
        args = case.make_args(np.random.default_rng(seed), jnp.float64)
        out, grads = jax.jit(lambda *a: vjp_of(case.op, a, case.argnums, seed + 1))(*args)
        weights = random_like(seed + 1, out)

        @jax.jit
        def loss(diff_args):
            result = case.op(*_with(args, case.argnums, diff_args))
            pairs = zip(jax.tree.leaves(weights), jax.tree.leaves(result), strict=True)
            return sum(jnp.sum(w * o) for w, o in pairs)

        base = jax.tree.map(np.asarray, tuple(args[i] for i in case.argnums))
        analytic, numeric = [], []
        for k in range(directions):
            v = jax.tree.map(np.asarray, random_like(seed + 2 + k, base))
            plus = loss(jax.tree.map(lambda a, d: a + step * d, base, v))
            minus = loss(jax.tree.map(lambda a, d: a - step * d, base, v))
            numeric.append(float((plus - minus) / (2 * step)))
            pairs = zip(jax.tree.leaves(grads), jax.tree.leaves(v), strict=True)
            analytic.append(float(sum(np.vdot(np.asarray(g), d) for g, d in pairs)))
    scale = max(max(abs(a) for a in analytic), 1e-12)
    return max(
        abs(a - n) / max(abs(a), abs(n), 1e-3 * scale)
        for a, n in zip(analytic, numeric, strict=True)
    )


# ---- the cases ---------------------------------------------------------------------------------


def _normal(rng, shape, dtype, scale=1.0):
    return jnp.asarray(scale * rng.standard_normal(shape), dtype)


def _linear_args(shape, bias):
    def make(rng, dtype):
        params = {"weight": _normal(rng, (5, shape[-1]), dtype)}
        if bias:
            params["bias"] = _normal(rng, (5,), dtype)
        return params, _normal(rng, shape, dtype)

    return make


def _linear_ce_args(rng, dtype):
    (params, x), targets = _linear_args((2, 3, 4), True)(rng, dtype), rng.integers(0, 5, (2, 3))
    targets[..., 1] = -100  # ignored positions must get no gradient
    return params, x, jnp.asarray(targets, jnp.int32)


def _padded_ce_args(rng, dtype):
    """`_linear_ce_args` with targets below 3: head rows 3 and 4 are a padded vocabulary's."""
    params, x, targets = _linear_ce_args(rng, dtype)
    return params, x, jnp.where(targets >= 0, targets % 3, targets)


def _norm_args(shape, with_bias):
    def make(rng, dtype):
        x = _normal(rng, shape, dtype, 2.0) + 1.0
        args = (x, 1.0 + _normal(rng, shape[-1:], dtype, 0.3))
        return args + ((_normal(rng, shape[-1:], dtype),) if with_bias else ())

    return make


def _unary(shape, scale=2.0):
    return lambda rng, dtype: (_normal(rng, shape, dtype, scale),)


def _binary(shape, second=lambda rng, s, d: _normal(rng, s, d)):
    return lambda rng, dtype: (_normal(rng, shape, dtype, 2.0), second(rng, shape, dtype))


def _embedding_args(rng, dtype):
    # Repeated ids on purpose: the scatter-add must accumulate them.
    return _normal(rng, (7, 4), dtype), jnp.array([[1, 3, 1], [6, 1, 0]], jnp.int32)


def _softmax_args(shape, masked):
    def make(rng, dtype):
        x = _normal(rng, shape, dtype, 3.0)
        if not masked:
            return (x,)
        mask = rng.random(shape) < 0.6
        mask[..., 0] = True  # every slice keeps at least one entry
        return x, jnp.asarray(mask)

    return make


def _ce_args(shape, ignore_index=-100):
    def make(rng, dtype):
        targets = rng.integers(0, shape[-1], shape[:-1])
        targets[..., 1] = ignore_index
        return _normal(rng, shape, dtype, 2.0), jnp.asarray(targets, jnp.int32)

    return make


def _attention_args(t, s, mask=False):
    def make(rng, dtype):
        args = tuple(_normal(rng, (2, n, 2, 4), dtype) for n in (t, s, s))
        if mask:
            # Key padding [B, 1, 1, S]: batch row 1 hides its last two keys.
            args += (jnp.ones((2, 1, 1, s), bool).at[1, ..., -2:].set(False),)
        return args

    return make


def _rope_args(rng, dtype):
    return (_normal(rng, (2, 5, 3, 8), dtype),)


def _dropout_args(rng, dtype):
    return _normal(rng, (3, 4, 5), dtype), jax.random.PRNGKey(7)


def _prob_targets(rng, shape, dtype):
    e = np.exp(rng.standard_normal(shape))
    return jnp.asarray(e / e.sum(-1, keepdims=True), dtype)


def _unit_targets(rng, shape, dtype):
    return jnp.asarray(rng.random(shape), dtype)


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
            "layer_norm_nobias",
            lambda x, s: o.layer_norm(x, s, None),
            lambda x, s: o.layer_norm_reference(x, s, None),
            _norm_args((2, 3, 6), False),
            (0, 1),
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
        OpCase(
            # chunk=4 over 6 rows: one full chunk and one ragged one.
            "linear_cross_entropy",
            partial(o.linear_cross_entropy, chunk=4),
            o.linear_cross_entropy_reference,
            _linear_ce_args,
            (0, 1),
        ),
        OpCase(  # models.loss_fn on a padded vocabulary: the fused loss over a sliced head
            "linear_cross_entropy_padded_head",
            lambda p, x, y: o.linear_cross_entropy({k: w[:3] for k, w in p.items()}, x, y, chunk=4),
            lambda p, x, y: o.cross_entropy_reference(o.linear_reference(p, x)[..., :3], y),
            _padded_ce_args,
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
            # The query-block path long causal self-attention takes (T > causal_block(T)), at
            # T = two full blocks of the smallest size plus a ragged block of 3 rows.
            "attention_causal_blocked",
            partial(o.attention, causal=True),
            partial(o.attention_reference, causal=True),
            _attention_args(2 * causal_block(1) + 3, 2 * causal_block(1) + 3),
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
