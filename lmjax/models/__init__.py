"""Decoder-only transformers (GPT, GPT-2, Llama-style) as pure functions over pytrees (SPEC §3).

    cfg = lmjax.models.preset("llama", vocab_size=65)
    params = lmjax.models.init(jax.random.key(0), cfg)
    logits_BTV = lmjax.models.forward(params, tokens_BT, cfg)

`declare(cfg)` lists every parameter (name, shape, initializer, logical axes) once; `init`,
`abstract_params` and `check_params` derive from it. `format_summary(cfg)` is what
`lmjax inspect` prints.
"""

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
from lmjax.models.layout import ParamSpec, abstract_params, check_params, declare, init
from lmjax.models.projection import project
from lmjax.models.summary import (
    MemoryEstimate,
    format_summary,
    memory_estimate,
    param_count,
    param_table,
    residual_bytes,
)
from lmjax.models.transformer import (
    attend,
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
]
