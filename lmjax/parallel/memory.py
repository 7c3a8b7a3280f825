"""Per-device memory of a training step on a mesh, from sizes alone (`lmjax inspect --mesh`).

Each parameter and optimizer-state leaf is split by its sharding rule (`rules.py`), so a device
holds `prod(shard_shape)` elements of it; gradients are laid out like the parameters. The
activations are `lmjax.models.residual_bytes` for the per-device share of the micro-batch,
`batch / (data x fsdp)` (with a remat policy, plus `recompute_bytes`: one block recomputed),
and the fused head's working set on an accelerator: two float32 `[chunk, V]` tiles (the
logits' exponentials and their gradient; `lmjax.ops.fused_head.accelerator_chunk` rows, up to
1 GiB each), which the TPU compiler's buffer assignment showed as the largest temporaries of a
GPT-2 124M step. Tensor parallelism (`model`) splits some of them further, which this leaves
out, so the activation figure is an upper bound when model > 1.
"""

from __future__ import annotations

from collections.abc import Mapping

from lmjax.models import ModelConfig, abstract_params, residual_bytes
from lmjax.models.summary import MemoryEstimate, human_bytes, memory_rows, recompute_bytes
from lmjax.ops.fused_head import accelerator_chunk
from lmjax.parallel.mesh import check_batch
from lmjax.parallel.rules import per_device_bytes, state_specs


def device_memory(
    cfg: ModelConfig, opt_state, batch: int, seq_len: int, mesh_shape: Mapping[str, int]
) -> MemoryEstimate:
    """Bytes on one device (the single-device estimate's fields, each for one shard);
    `opt_state` is the (abstract) optimizer state of `cfg`'s params."""
    check_batch(batch, mesh_shape, where="batch (sequences per micro-batch)")
    params = abstract_params(cfg)
    param_bytes = per_device_bytes(params, state_specs(params, cfg, mesh_shape), mesh_shape)
    opt_bytes = per_device_bytes(opt_state, state_specs(opt_state, cfg, mesh_shape), mesh_shape)
    rows = batch // (mesh_shape["data"] * mesh_shape["fsdp"])
    activations = residual_bytes(cfg, rows, seq_len) + recompute_bytes(cfg, rows, seq_len)
    head = 2 * 4 * cfg.vocab_size * accelerator_chunk(rows * seq_len, cfg.vocab_size)
    return MemoryEstimate(param_bytes, param_bytes, opt_bytes, activations + head)


def format_device_memory(
    cfg: ModelConfig,
    opt_state,
    batch: int,
    seq_len: int,
    mesh_shape: Mapping[str, int],
    optimizer_label: str,
) -> str:
    """The per-device table `lmjax inspect --mesh` prints (exact bytes and a readable size)."""
    mem = device_memory(cfg, opt_state, batch, seq_len, mesh_shape)
    ways = mesh_shape["data"] * mesh_shape["fsdp"]
    rows = memory_rows(
        cfg, mem, optimizer_label, f"activations ({batch // ways} of {batch} sequences)"
    )
    width = max(len(text) for text, _ in rows)
    n = mesh_shape["data"] * mesh_shape["fsdp"] * mesh_shape["model"]
    mesh = ",".join(f"{k}={v}" for k, v in mesh_shape.items())
    lines = [f"per device on mesh {mesh} ({n} devices):"]
    lines += [f"  {text:{width}}  {human_bytes(b):>10}  ({b:,} B)" for text, b in rows]
    if mesh_shape["model"] > 1:
        lines.append("  (activations: an upper bound; tensor parallelism splits some further)")
    return "\n".join(lines)
