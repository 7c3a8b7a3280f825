"""Parameter tables and memory estimates for a config, computed without allocating a model."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from lmjax.models.config import ModelConfig
from lmjax.models.layout import abstract_params, declare

# AdamW keeps two float32 moments per parameter (optax.adamw's mu and nu).
ADAMW_BYTES_PER_PARAM = 8


@dataclasses.dataclass(frozen=True)
class MemoryEstimate:
    """Bytes for parameters, AdamW state, and what the backward pass keeps for one batch."""

    params: int
    optimizer: int
    activations: int

    @property
    def total(self) -> int:
        return self.params + self.optimizer + self.activations


def param_table(cfg: ModelConfig) -> list[tuple[str, tuple[int, ...], int]]:
    """`[(name, shape, count)]` in natural name order."""
    return [(name, spec.shape, spec.size) for name, spec in declare(cfg).items()]


def param_count(cfg: ModelConfig) -> int:
    return sum(count for _, _, count in param_table(cfg))


def _nbytes(tree) -> int:
    return sum(leaf.size * jnp.dtype(leaf.dtype).itemsize for leaf in jax.tree.leaves(tree))


def residual_bytes(cfg: ModelConfig, batch: int, seq_len: int) -> int:
    """Bytes the VJP of `forward` keeps for a `[batch, seq_len]` batch, traced, not run.

    It counts the leaves of `jax.vjp`'s residuals (under `jax.eval_shape`) minus the master
    parameters they reference, so it reflects the attention impl and the remat policy.
    """
    from lmjax.models.transformer import forward

    tokens = jax.ShapeDtypeStruct((batch, seq_len), jnp.int32)

    def residuals(params, tokens_BT):
        return jax.vjp(lambda p: forward(p, tokens_BT, cfg), params)[1]

    shapes = jax.eval_shape(residuals, abstract_params(cfg), tokens)
    return max(_nbytes(shapes) - _nbytes(abstract_params(cfg)), 0)


def memory_estimate(cfg: ModelConfig, batch: int = 1, seq_len: int | None = None) -> MemoryEstimate:
    """Parameters (in `param_dtype`), AdamW moments, and backward residuals for one batch."""
    seq_len = cfg.context_length if seq_len is None else seq_len
    n = param_count(cfg)
    return MemoryEstimate(
        params=n * cfg.params_dtype.itemsize,
        optimizer=n * ADAMW_BYTES_PER_PARAM,
        activations=residual_bytes(cfg, batch, seq_len),
    )


def _human(nbytes: int) -> str:
    size = float(nbytes)
    for unit in ("B", "KiB", "MiB", "GiB"):
        if size < 1024 or unit == "GiB":
            return f"{size:.1f} {unit}" if unit != "B" else f"{nbytes} B"
        size /= 1024
    raise AssertionError("unreachable")


def format_summary(cfg: ModelConfig, batch: int = 1, seq_len: int | None = None) -> str:
    """The parameter table (name, shape, count), the total, and the memory estimate."""
    rows = param_table(cfg)
    width = max(len(name) for name, _, _ in rows)
    lines = [f"{'name':{width}}  {'shape':>14}  {'count':>12}"]
    lines += [
        f"{name:{width}}  {str(list(shape)):>14}  {count:>12,}" for name, shape, count in rows
    ]
    lines.append(f"{'total':{width}}  {'':>14}  {param_count(cfg):>12,}")
    seq_len = cfg.context_length if seq_len is None else seq_len
    mem = memory_estimate(cfg, batch, seq_len)
    lines += [
        "",
        f"memory estimate (batch {batch}, sequence {seq_len}, attention {cfg.attention}, "
        f"remat {cfg.remat}):",
        f"  parameters ({cfg.param_dtype})      {_human(mem.params):>12}",
        f"  AdamW state (2 x float32)   {_human(mem.optimizer):>12}",
        f"  activations kept for grad   {_human(mem.activations):>12}",
        f"  total                       {_human(mem.total):>12}",
    ]
    return "\n".join(lines)
