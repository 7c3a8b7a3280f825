"""Parameter tables and memory estimates for a config, computed without allocating a model."""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp

from lmjax.models.attention_choice import choose, this_machine
from lmjax.models.config import ModelConfig
from lmjax.models.layout import abstract_params, declare_layers
from lmjax.models.transformer import forward

# AdamW keeps two moments per parameter (optax.adamw's mu and nu, in the parameters' dtype).
ADAMW_MOMENTS = 2


@dataclasses.dataclass(frozen=True)
class MemoryEstimate:
    """Bytes of one training step: parameters, their gradients, AdamW state, and what the
    backward pass keeps for one batch (the model's residuals; the loss's own are not counted)."""

    params: int
    gradients: int
    optimizer: int
    activations: int

    @property
    def total(self) -> int:
        return self.params + self.gradients + self.optimizer + self.activations


def memory_rows(
    cfg: ModelConfig, mem: MemoryEstimate, optimizer_label: str, activations_label: str
):
    """`[(label, bytes)]` of a memory table: parameters, gradients, optimizer, activations, total
    (shared by `lmjax inspect`'s single-device estimate and its per-device `--mesh` table)."""
    return [
        (f"parameters ({cfg.param_dtype})", mem.params),
        (f"gradients ({cfg.param_dtype})", mem.gradients),
        (optimizer_label, mem.optimizer),
        (activations_label, mem.activations),
        ("total", mem.total),
    ]


def param_table(cfg: ModelConfig) -> list[tuple[str, tuple[int, ...], int]]:
    """`[(name, shape, count)]` in natural name order."""
    return [(name, spec.shape, spec.size) for name, spec in declare_layers(cfg).items()]


def param_count(cfg: ModelConfig) -> int:
    return sum(count for _, _, count in param_table(cfg))


def residual_bytes(cfg: ModelConfig, batch: int, seq_len: int) -> int:
    """Bytes the VJP of `forward` keeps for a `[batch, seq_len]` batch, traced, not run.

    The residuals are the outputs of the jaxpr that builds `jax.vjp`'s pullback; those that are
    the function's own inputs (the master parameters a linear layer reads back), or slices of
    them (layer i's weights, as unrolled layers read them from the stacked blocks), cost nothing
    extra and are left out, while bf16 copies of f32 weights are counted. So the figure
    reflects the attention impl, the remat policy and the compute dtype; scanned and unrolled
    layers (`cfg.scan_layers`) keep the same residuals under the same policy.
    """

    def residuals(params, tokens_BT):
        return jax.vjp(lambda p: forward(p, tokens_BT, cfg), params)[1]

    tokens = jax.ShapeDtypeStruct((batch, seq_len), jnp.int32)
    jaxpr = jax.make_jaxpr(residuals)(abstract_params(cfg), tokens).jaxpr
    inputs, seen, total = _views_of_inputs(jaxpr), set(), 0
    for var in jaxpr.outvars:
        if id(var) in inputs or id(var) in seen:
            continue
        seen.add(id(var))
        total += math.prod(var.aval.shape) * jnp.dtype(var.aval.dtype).itemsize
    return total


# Primitives whose output is a part of their first operand, read in place (no copy is kept).
_VIEWS = frozenset({"slice", "squeeze", "reshape", "dynamic_slice"})


def _views_of_inputs(jaxpr) -> set[int]:
    """ids of the jaxpr's inputs and of the values that only view them: slices, squeezes."""
    views = {id(v) for v in jaxpr.invars}
    for eqn in jaxpr.eqns:
        if eqn.primitive.name in _VIEWS and id(eqn.invars[0]) in views:
            views.update(id(v) for v in eqn.outvars)
    return views


def memory_estimate(
    cfg: ModelConfig, batch: int = 1, seq_len: int | None = None, optimizer_bytes: int | None = None
) -> MemoryEstimate:
    """Parameters and gradients (in `param_dtype`), optimizer state (default: AdamW's two
    moments), backward residuals (with a remat policy, plus `recompute_bytes`)."""
    seq_len = cfg.context_length if seq_len is None else seq_len
    param_bytes = param_count(cfg) * cfg.params_dtype.itemsize
    if optimizer_bytes is None:
        optimizer_bytes = ADAMW_MOMENTS * param_bytes
    return MemoryEstimate(
        params=param_bytes,
        gradients=param_bytes,
        optimizer=optimizer_bytes,
        activations=residual_bytes(cfg, batch, seq_len) + recompute_bytes(cfg, batch, seq_len),
    )


def recompute_bytes(cfg: ModelConfig, batch: int, seq_len: int) -> int:
    """What the backward holds while it recomputes one block under a remat policy (0 without
    one): that block's residuals without remat, and as much again for the cotangents its
    backward forms from them. `residual_bytes` counts only what the policy keeps between
    blocks; a scanned GPT-2 124M step on v5e:2x2 needed this on top to stay under the estimate
    (tests/test_compile_tpu.py). A one-layer model's residuals stand for one block's (its
    embedding and head add a little: an upper bound)."""
    if cfg.remat_policy == "none":
        return 0
    return 2 * residual_bytes(cfg.replace(n_layers=1, remat="none"), batch, seq_len)


def human_bytes(nbytes: int) -> str:
    """`nbytes` in B, KiB, MiB or GiB (binary units, one decimal): 1536 -> "1.5 KiB"."""
    size = float(nbytes)
    for unit in ("B", "KiB", "MiB", "GiB"):
        if size < 1024 or unit == "GiB":
            return f"{size:.1f} {unit}" if unit != "B" else f"{nbytes} B"
        size /= 1024
    raise AssertionError("unreachable")


def format_summary(
    cfg: ModelConfig,
    batch: int = 1,
    seq_len: int | None = None,
    optimizer: tuple[str, int] | None = None,
) -> str:
    """The parameter table (name, shape, count), the total, and the memory estimate.

    `optimizer`: (label, bytes) of the optimizer state; default AdamW's two moments.
    """
    rows = param_table(cfg)
    width = max(len(name) for name, _, _ in rows)
    lines = [f"{'name':{width}}  {'shape':>14}  {'count':>12}"]
    lines += [
        f"{name:{width}}  {str(list(shape)):>14}  {count:>12,}" for name, shape, count in rows
    ]
    lines.append(f"{'total':{width}}  {'':>14}  {param_count(cfg):>12,}")
    lines.append(layers_line(cfg))
    seq_len = cfg.context_length if seq_len is None else seq_len
    label, nbytes = optimizer or (f"AdamW state (2 x {cfg.param_dtype})", None)
    mem = memory_estimate(cfg, batch, seq_len, nbytes)
    rows = memory_rows(cfg, mem, label, f"activations kept for grad ({cfg.dtype})")
    label = max(len(text) for text, _ in rows)
    lines += [
        "",
        f"memory estimate (batch {batch}, sequence {seq_len}, attention {_attention(cfg)}, "
        f"remat {_remat(cfg)}):",
    ]
    lines += [f"  {text:{label}}  {human_bytes(nbytes):>10}" for text, nbytes in rows]
    return "\n".join(lines)


def layers_line(cfg: ModelConfig) -> str:
    """How the blocks are stored and run: the names above are per layer, the leaves stacked."""
    n = cfg.n_layers
    how = (
        "run as one lax.scan over the layer axis (model.scan_layers=true)"
        if cfg.scan_layers
        else "run unrolled, one block after another (model.scan_layers=false)"
    )
    return f"layers: {n}, stored stacked (each blocks.* leaf [{n}, ...]), {how}"


def _attention(cfg: ModelConfig) -> str:
    """The attention impl the estimate traced: `auto` names what it picks on this machine."""
    if cfg.attention != "auto":
        return cfg.attention
    return f"auto ({choose('auto', this_machine(), cfg.compute_dtype, cfg.d_head)[0]} here)"


def _remat(cfg: ModelConfig) -> str:
    """The remat policy as configured, with what "auto" resolves to."""
    return f"auto ({cfg.remat_policy})" if cfg.remat == "auto" else cfg.remat
