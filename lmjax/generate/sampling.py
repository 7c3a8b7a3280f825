"""Next-token sampling (docs/decoding.md): greedy, temperature, top-k, top-p; seeded.

For logits z [B, V] and `Sampling(temperature T, top_k k, top_p p)`:

    T == 0:  argmax z (greedy; ties go to the lowest id). No division happens, and k and p
             play no part. So is any T whose float32 value is below `np.finfo(float32).tiny`
             (~1.2e-38, e.g. 1e-40): such a T is subnormal or 0 in float32, which XLA flushes to
             0, and 0 / 0 would be NaN; the limit T -> 0 of sampling is greedy anyway.
    T > 0:   s = (z - max z) / T                     (shifted first, so a tiny T cannot overflow)
             top-k (k >= 1): keep the k largest s (ties to the lower id), the rest get -inf
             top-p (p < 1):  over the kept tokens sorted by s, with q = softmax of the kept s,
                             keep token j iff sum_{i < j} q_i < p  (the smallest prefix whose
                             mass reaches p; the most likely token always stays)
             draw from softmax(s) restricted to the kept tokens (Gumbel-max, `jax.random`)

The order (temperature, then top-k, then top-p renormalised over the top-k) is Hugging Face's.
`top_k` None or 0 and `top_p == 1` switch a filter off. A `Sampling` is static (hashed into the
compiled step): each distinct setting compiles once, and the greedy step contains no sort.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

from lmjax.checks import is_finite_real, is_nonnegative_int, is_real, require
from lmjax.errors import ConfigError

_TINY = float(np.finfo(np.float32).tiny)  # the smallest normal float32


@dataclasses.dataclass(frozen=True)
class Sampling:
    """How the next token is chosen; validated on construction (see the module docstring)."""

    temperature: float = 0.0
    top_k: int | None = None
    top_p: float = 1.0

    def __post_init__(self):
        t, k, p = self.temperature, self.top_k, self.top_p
        fix = "use 0 for greedy or e.g. 0.8 to sample"
        ok = is_finite_real(t) and t >= 0
        require(ok, "temperature", t, "a finite float >= 0", fix)
        fix = "use e.g. 50, or None for no top-k"
        ok = k is None or is_nonnegative_int(k)
        require(ok, "top_k", k, "None, 0 (off) or an int >= 1", fix)
        fix = "use e.g. 0.9, or 1.0 for no nucleus filter"
        require(is_real(p) and 0 < p <= 1, "top_p", p, "a float in (0, 1]", fix)

    @property
    def greedy(self) -> bool:
        """T == 0, or a T too small for a float32 division (see the module docstring)."""
        t = self.temperature
        # A double >= tiny never rounds below tiny, so np.float32 only sees t < tiny (no overflow).
        return t < _TINY and float(np.float32(t)) < _TINY

    def check_vocab(self, vocab_size: int) -> None:
        """`top_k` must not exceed the vocabulary it chooses from."""
        if self.top_k is not None and self.top_k > vocab_size:
            raise ConfigError.describe(
                "top_k",
                self.top_k,
                f"<= vocab_size = {vocab_size}",
                f"use at most {vocab_size}, or None for no top-k",
            )


jax.tree_util.register_static(Sampling)


def sample(logits_BV: jax.Array, key: jax.Array, sampling: Sampling) -> jax.Array:
    """One token id per row, int32 `[B]`, from logits `[B, V]` (see the module docstring)."""
    if sampling.greedy:
        return jnp.argmax(logits_BV, axis=-1).astype(jnp.int32)
    z_BV = logits_BV.astype(jnp.float32)
    s_BV = (z_BV - jnp.max(z_BV, axis=-1, keepdims=True)) / sampling.temperature
    if not sampling.top_k and sampling.top_p == 1:
        return jax.random.categorical(key, s_BV, axis=-1).astype(jnp.int32)
    # lax.top_k sorts descending with ties to the lower index; k = V is a full sort. The one
    # sort (and top-p's prefix sum) in the library, and a legitimate one: the order is the
    # logits', known only at run time, so no compiler folds it (tests/test_gpu_lowering.py).
    s_BK, ids_BK = jax.lax.top_k(s_BV, sampling.top_k or s_BV.shape[-1])
    if sampling.top_p < 1:
        q_BK = jax.nn.softmax(s_BK, axis=-1)
        # An exclusive prefix sum: the first token's mass-before is exactly 0 < p, so the
        # nucleus is never empty.
        cumulative_BK = jnp.cumsum(q_BK, axis=-1)
        mass_before_BK = jnp.pad(cumulative_BK[:, :-1], ((0, 0), (1, 0)))
        s_BK = jnp.where(mass_before_BK < sampling.top_p, s_BK, -jnp.inf)
    choice_B = jax.random.categorical(key, s_BK, axis=-1)
    return jnp.take_along_axis(ids_BK, choice_B[:, None], axis=-1)[:, 0].astype(jnp.int32)


__all__ = ["Sampling", "sample"]
