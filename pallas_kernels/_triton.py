"""The one place that imports Pallas' Triton backend, which the GPU kernels lower through.

A jax without `jax.experimental.pallas.triton` still imports every kernel module: `available()`
is then False, a compiled GPU kernel call is one ConfigError (`require`), and interpret mode,
which needs no Triton, gets no launch parameters (`params` returns None). Everything else
(`_backend`, the kernels' `plan` and `blocks`) is backend-neutral (docs/kernels.md, "Without
Triton"). Tests simulate a jax without it by setting `_pltriton` to None.
"""

from __future__ import annotations

from lmjax.errors import ConfigError

try:
    from jax.experimental.pallas import triton as _pltriton
except ImportError:
    _pltriton = None


def available() -> bool:
    """Whether this jax has the Pallas Triton backend (`jax.experimental.pallas.triton`)."""
    return _pltriton is not None


def require(what: str, fix: str) -> None:
    """A compiled GPU kernel needs the Triton backend: one ConfigError naming `what` if this jax
    lacks it."""
    if not available():
        expected = "a jax with the Pallas Triton backend (jax.experimental.pallas.triton)"
        raise ConfigError.describe(what, "gpu compiled", expected + ", missing in this jax", fix)


def params(num_warps: int, num_stages: int):
    """The Triton launch settings of a pallas_call, or None where this jax has no Triton backend
    (interpret mode needs none; a compiled call was refused by `require`)."""
    if _pltriton is None:
        return None
    return _pltriton.CompilerParams(num_warps=num_warps, num_stages=num_stages)
