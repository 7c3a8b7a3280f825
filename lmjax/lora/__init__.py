"""LoRA: low-rank adapters on chosen linear projections (docs/fine-tuning.md).

For a frozen projection `y = x W^T (+ b)`, `W [out, in]`, an adapter adds

    y = base_linear(x) + s * (dropout(x) A^T) B^T        A [r, in], B [out, r]
    s = alpha / r   (rsLoRA: alpha / sqrt(r))

`A` starts Kaiming-uniform as peft does (`kaiming_uniform_(a=sqrt(5))`, i.e. `U(-1/sqrt(in),
1/sqrt(in))`) or Gaussian `N(0, 1/r^2)` (peft's "gaussian"); `B` starts at zero, so an adapted
model starts equal to its base. Dropout acts on the adapter's input only.

    lcfg = LoraConfig(r=8, alpha=16)                         # targets: query and value
    adapters = init(key, params_or_model_cfg, lcfg)          # {"blocks": {"attention": {"query":
                                                             #   {"lora_a", "lora_b"}, ...}}}
    logits = models.forward(attach(params, adapters, lcfg), tokens, model_cfg)

Integration. `attach` returns the base tree with each adapted layer's dict extended by a
`"lora"` entry, an `Adapter` pytree (A, B, optional dropout key and gate; scale and rate static).
`lmjax.models.project` recognises that entry and computes `linear(base) + adapter(x)`, so the base
weight may be a float array or an NF4 `QuantizedWeight` (QLoRA): the adapter never touches it,
and the float weight of a quantized layer is never materialized. Gradients are taken with
respect to the adapters only (`jax.grad` of a function of `adapters` with the base an ordinary,
non-differentiated argument); the model code, the KV-cache decoder and evaluation all accept an
attached tree unchanged.

Targets are globs (`lmjax.params.matches`) over the per-layer names of the linear layers
(`lmjax.models.declare_layers(cfg)`), i.e. weight names without `.weight`
(`blocks.3.attention.query`; a glob over the weight name, `*.query.weight`, selects the same
layer); `"all-linear"` selects every
linear layer of the blocks (as peft's "all-linear": not the embeddings, norms or output head).
The Hugging Face / peft module names of Llama-family projections are aliases (`HF_TARGETS`),
so peft's `target_modules=["q_proj", "v_proj"]` is `targets=q_proj|v_proj` here:

    q_proj k_proj v_proj o_proj   ->  *.attention.query  .key  .value  .output
    gate_proj up_proj down_proj   ->  *.feed_forward.gate  .up  .down

Stacked layers. The model's blocks are stored stacked (`lmjax.params`: `blocks.attention.query.
weight [N, out, in]`), and so are the adapters: `blocks.attention.query.lora_a [N, r, in]` and
`lora_b [N, out, r]`, attached beside the weight so that the scan over the blocks hands layer i
its `A [r, in]`, `B [out, r]`. A target that selects a projection in some layers only
(`blocks.3.attention.query`, or `blocks.0.attention.value` with `blocks.1.attention.key`) still
stacks it over all N layers; the others hold A = B = 0 and are gated off (`targeted`: a bool per
layer, from the targets): they add exactly nothing, get exactly zero gradient, so stay zero, and
are not counted (`count(adapters, lcfg)`), saved (`save_adapters` writes those layers alone,
under their per-layer names) or merged. Their cost is memory only: r (in + out) zeros per
skipped layer, and as much optimizer state. Per-layer names (`blocks.3.attention.query.lora_a
[r, in]`, as adapters were stored before the blocks were stacked) are read everywhere and
stacked (`stack_adapters`).

With grouped-query attention the key/value adapters are `A [r, D]`, `B [Hkv*Dh, r]`, as peft's.
"""

from lmjax.lora.apply import (
    Adapter,
    attach,
    count,
    delta,
    load_adapters,
    merge,
    objective,
    save_adapters,
    unmerge,
)
from lmjax.lora.config import (
    ALL_LINEAR,
    DEFAULT_TARGETS,
    HF_TARGETS,
    INITS,
    LoraConfig,
)
from lmjax.lora.layers import (
    adapter_layers,
    adapter_shapes,
    init,
    kaiming_bound,
    linear_layers,
    stack_adapters,
    target_layers,
    targeted,
)

__all__ = [
    "DEFAULT_TARGETS",
    "INITS",
    "ALL_LINEAR",
    "Adapter",
    "HF_TARGETS",
    "LoraConfig",
    "adapter_layers",
    "adapter_shapes",
    "attach",
    "count",
    "delta",
    "init",
    "kaiming_bound",
    "linear_layers",
    "load_adapters",
    "merge",
    "objective",
    "save_adapters",
    "stack_adapters",
    "target_layers",
    "targeted",
    "unmerge",
]
