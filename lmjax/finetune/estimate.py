"""Bytes of a LoRA / QLoRA fine-tune's training state, traced with nothing allocated: what
`lmjax inspect --lora / --qlora` prints (`lmjax.finetune.memory` / `format_memory`)."""

from __future__ import annotations

import jax

from lmjax import lora
from lmjax.lora import LoraConfig
from lmjax.models import abstract_params
from lmjax.models.summary import human_bytes
from lmjax.quant.params import quantize_params, weight_bytes


def memory(model, lcfg: LoraConfig, qlora: bool, tx) -> dict[str, int]:
    """Bytes of LoRA/QLoRA training state, traced (`jax.eval_shape`), nothing allocated:

    `params` (the trainable adapters), `gradients` (the same), `optimizer` (`tx`'s state of the
    adapters), `frozen` (the base: float, or NF4 linear weights plus float rest for QLoRA),
    `frozen_nf4` / `frozen_nf4_as_float` / `nf4_weights` (the quantized part, as stored and as
    it would be in the base dtype, and its weight count), `adapter_params` (a count), `total`.
    """
    base = abstract_params(model)
    adapters = jax.eval_shape(lambda: lora.init(jax.random.PRNGKey(0), model, lcfg))
    opt = jax.eval_shape(tx.init, adapters)
    nbytes = lambda tree: sum(a.size * a.dtype.itemsize for a in jax.tree.leaves(tree))  # noqa: E731
    out = {"params": nbytes(adapters), "gradients": nbytes(adapters), "optimizer": nbytes(opt)}
    out |= {"frozen": nbytes(base), "frozen_nf4": 0, "frozen_nf4_as_float": 0, "nf4_weights": 0}
    if qlora:
        counts = weight_bytes(jax.eval_shape(quantize_params, base))
        out |= {
            "frozen": counts["total"],
            "frozen_nf4": counts["quantized"],
            "frozen_nf4_as_float": counts["quantized_as_float"],
            "nf4_weights": counts["quantized_params"],
        }
    out["adapter_params"] = lora.count(adapters, lcfg)  # the targeted layers' (lora: gates)
    out["total"] = out["params"] + out["gradients"] + out["optimizer"] + out["frozen"]
    return out


def format_memory(mem: dict[str, int], lcfg: LoraConfig, qlora: bool, optimizer: str) -> str:
    """The `lmjax inspect --lora / --qlora` block."""
    kind = "QLoRA (NF4 base)" if qlora else "LoRA (float base)"
    rows = [
        (f"adapters, trainable ({mem['adapter_params']:,} params)", mem["params"]),
        ("adapter gradients", mem["gradients"]),
        (f"{optimizer} state (adapters only)", mem["optimizer"]),
        ("frozen base weights" + (" (NF4 linears + float rest)" if qlora else ""), mem["frozen"]),
        ("total (without activations)", mem["total"]),
    ]
    width = max(len(text) for text, _ in rows)
    targets = ", ".join(lcfg.targets)
    lines = [f"{kind}: r={lcfg.r}, alpha={lcfg.alpha:g}, scale={lcfg.scale:g}, targets {targets}"]
    lines += [f"  {text:{width}}  {human_bytes(n):>10}" for text, n in rows]
    if qlora and mem["nf4_weights"]:
        bits = 8 * mem["frozen_nf4"] / mem["nf4_weights"]
        lines.append(
            f"  NF4: {mem['nf4_weights']:,} weights in {human_bytes(mem['frozen_nf4'])} "
            f"({bits:.3f} bits each; {human_bytes(mem['frozen_nf4_as_float'])} unquantized)"
        )
    return "\n".join(lines)


__all__ = ["format_memory", "memory"]
