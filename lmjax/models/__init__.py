"""Decoder-only transformers (GPT, GPT-2, Llama-style) as pure functions over pytrees
(docs/models.md).

    cfg = lmjax.models.preset("llama", vocab_size=65)
    params = lmjax.models.init(jax.random.key(0), cfg)
    logits_BTV = lmjax.models.forward(params, tokens_BT, cfg)

`declare(cfg)` lists every parameter (name, shape, initializer, logical axes) once; `init`,
`abstract_params` and `check_params` derive from it. `format_summary(cfg)` is what
`lmjax inspect` prints. `project` (projection.py) is the one place that chooses how a projection
runs, `attend` / `dot_product_attention` (attention.py) the one that chooses the attention impl.

Shape legend: array names end in their axes (x_BTD, q_BTHDh, logits_BTV), in these letters,
here and in ops/, generate/ and train/:

    B  batch rows                 T  query positions (time)      S  key positions
    H  attention heads            Dh head size (d_head)          D  model width (d_model)
    F  feed-forward width         V  vocabulary size             C  context length
    N  rows flattened (B*T)       A  micro-batches               I, O  in-, out-features

A trailing 1 is a kept unit axis. The Pallas kernels name a block's rows Q (queries) and K
(keys); their package docstrings say so.
"""

from lmjax.models.attention import attend, dot_product_attention
from lmjax.models.config import (
    ACTIVATIONS,
    ATTENTION_IMPLS,
    DTYPES,
    NORMS,
    OPS,
    POSITIONS,
    PRESETS,
    REMAT_POLICIES,
    ModelConfig,
    preset,
)
from lmjax.models.layout import (
    ParamSpec,
    abstract_params,
    check_params,
    declare,
    declare_layers,
    init,
)
from lmjax.models.projection import project
from lmjax.models.segments import segment_positions
from lmjax.models.summary import (
    MemoryEstimate,
    format_summary,
    memory_estimate,
    param_count,
    param_table,
    residual_bytes,
)
from lmjax.models.transformer import (
    block,
    cached_block,
    check_tokens,
    embed,
    features,
    forward,
    head,
    head_params,
    project_qkv,
)

__all__ = [
    "ACTIVATIONS",
    "ATTENTION_IMPLS",
    "DTYPES",
    "NORMS",
    "OPS",
    "POSITIONS",
    "PRESETS",
    "REMAT_POLICIES",
    "MemoryEstimate",
    "ModelConfig",
    "ParamSpec",
    "abstract_params",
    "attend",
    "block",
    "cached_block",
    "check_params",
    "check_tokens",
    "declare",
    "declare_layers",
    "dot_product_attention",
    "embed",
    "features",
    "format_summary",
    "forward",
    "head",
    "head_params",
    "init",
    "memory_estimate",
    "param_count",
    "param_table",
    "preset",
    "project",
    "project_qkv",
    "residual_bytes",
    "segment_positions",
]
