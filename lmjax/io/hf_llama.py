"""Hugging Face llama / mistral / qwen2 / qwen3 checkpoints <-> lmjax (docs/interop.md).

    load(path, hf, files, dtype) -> (params, cfg)     hf: the parsed config.json
    save(params, cfg, out_dir)                         config.json + model.safetensors

Both store linear weights `[out, in]` (torch's nn.Linear and `lmjax.ops.linear`), and both rotate
pairs (i, i + Dh/2) in RoPE (rotate-half), so every tensor maps by name alone. For block i
(D = d_model, Dh = d_head, H heads, Hkv key/value heads, F = d_ff):

    model.embed_tokens.weight [V, D]               -> token_embedding.weight
    model.layers.i.input_layernorm.weight [D]      -> blocks.i.attention_norm.scale
    model.layers.i.self_attn.q_proj.{weight,bias}  -> blocks.i.attention.query  [H*Dh, D]
    model.layers.i.self_attn.k_proj / v_proj       -> blocks.i.attention.key / value [Hkv*Dh, D]
    model.layers.i.self_attn.o_proj                -> blocks.i.attention.output [D, H*Dh]
    model.layers.i.self_attn.q_norm / k_norm [Dh]  -> blocks.i.attention.query_norm / key_norm
    model.layers.i.post_attention_layernorm.weight -> blocks.i.feed_forward_norm.scale
    model.layers.i.mlp.{gate,up,down}_proj         -> blocks.i.feed_forward.{gate,up,down}
    model.norm.weight                              -> final_norm.scale
    lm_head.weight [V, D]                          -> language_model_head.weight (untied only)

`blocks.i.…` are per-layer names: `load` stacks the layers into the model's `[N, ...]` leaves
after the mapping, `save` unstacks them before it (`hf_files.stacked_params`).

A tied checkpoint may store lm_head.weight too; it must equal the embedding. Rotary `inv_freq`
buffers of old checkpoints are ignored. Which biases exist is `hf_llama_config.Layout`.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import numpy as np

from lmjax import params as ptree
from lmjax.files import atomic_write_text
from lmjax.io import hf_files
from lmjax.io import safetensors as st
from lmjax.io.hf_llama_config import Layout, choose_layout, config_from_hf, config_to_hf
from lmjax.models import ModelConfig, check_params, declare_layers

EMBEDDING, HEAD = "model.embed_tokens.weight", "lm_head.weight"
_ATTENTION = {"q_proj": "query", "k_proj": "key", "v_proj": "value"}
_MLP = {"gate_proj": "gate", "up_proj": "up", "down_proj": "down"}
_NORMS = {"input_layernorm": "attention_norm", "post_attention_layernorm": "feed_forward_norm"}


def _rename(key: str) -> str | None:
    """Stored key -> name; None for the rotary buffers old checkpoints saved."""
    return None if key.endswith("rotary_emb.inv_freq") else key


def _linear(hf: str, ours: str, shape: tuple, bias: bool) -> list[tuple[str, str, tuple]]:
    names = [(f"{hf}.weight", f"{ours}.weight", shape)]
    return names + ([(f"{hf}.bias", f"{ours}.bias", shape[:1])] if bias else [])


def _block_names(i: int, cfg: ModelConfig, layout: Layout) -> list[tuple[str, str, tuple]]:
    """(HF name, lmjax name, shape) of block i's tensors in `layout`."""
    h, b, d = f"model.layers.{i}", f"blocks.{i}", cfg.d_model
    names = [(f"{h}.{hf}.weight", f"{b}.{ours}.scale", (d,)) for hf, ours in _NORMS.items()]
    for hf, ours in _ATTENTION.items():
        rows = cfg.q_features if ours == "query" else cfg.kv_features
        names += _linear(f"{h}.self_attn.{hf}", f"{b}.attention.{ours}", (rows, d), layout.qkv_bias)
    out = (d, cfg.q_features)
    names += _linear(f"{h}.self_attn.o_proj", f"{b}.attention.output", out, layout.o_bias)
    if layout.qk_norm:
        for hf, ours in (("q_norm", "query_norm"), ("k_norm", "key_norm")):
            names += [(f"{h}.self_attn.{hf}.weight", f"{b}.attention.{ours}.scale", (cfg.d_head,))]
    for hf, ours in _MLP.items():
        shape = (d, cfg.d_ff) if ours == "down" else (cfg.d_ff, d)
        names += _linear(f"{h}.mlp.{hf}", f"{b}.feed_forward.{ours}", shape, layout.mlp_bias)
    return names


def tensor_names(cfg: ModelConfig, layout: Layout) -> list[tuple[str, str, tuple]]:
    """(HF name, lmjax name, shape) of every tensor the HF state dict of `layout` holds."""
    v, d = cfg.vocab_size, cfg.d_model
    names = [(EMBEDDING, "token_embedding.weight", (v, d))]
    for i in range(cfg.n_layers):
        names += _block_names(i, cfg, layout)
    names += [("model.norm.weight", "final_norm.scale", (d,))]
    if not layout.tied:
        names += [(HEAD, "language_model_head.weight", (v, d))]
    return names


def _check_shapes(shapes: dict, cfg: ModelConfig, layout: Layout, where: Path) -> None:
    want = {hf: (None, shape) for hf, _, shape in tensor_names(cfg, layout)}
    if layout.tied and HEAD in shapes:  # a tied head some checkpoints store anyway
        want[HEAD] = (None, want[EMBEDDING][1])
    st.report_mismatches(
        where,
        {k: (None, shape) for k, shape in shapes.items()},
        want,
        f"the {layout.family} state dict of config.json ({_claims(cfg, layout)})",
        hf_files.FIX_CHECKPOINT,
        unexpected=f"not a {layout.family} key:",
    )


def _claims(cfg: ModelConfig, layout: Layout) -> str:
    """What config.json says of the tensors (defaults applied), to name the key behind a shape."""
    claims = dict(vocab_size=cfg.vocab_size, hidden_size=cfg.d_model)
    claims |= dict(intermediate_size=cfg.d_ff, num_attention_heads=cfg.n_heads)
    claims |= dict(num_key_value_heads=cfg.kv_heads, head_dim=cfg.d_head)
    if layout.family in ("llama", "qwen3"):
        claims["attention_bias"] = layout.o_bias
    if layout.family == "llama":
        claims["mlp_bias"] = layout.mlp_bias
    claims["tie_word_embeddings"] = layout.tied
    return ", ".join(f"{k} {json.dumps(v)}" for k, v in claims.items())


def _to_lmjax(state: dict, cfg: ModelConfig, layout: Layout) -> dict[str, np.ndarray]:
    """Flat lmjax names; a bias lmjax declares and the family lacks is zero (`Layout`)."""
    flat = {ours: state[hf] for hf, ours, _ in tensor_names(cfg, layout)}
    for name, spec in declare_layers(cfg).items():
        if name not in flat:  # only biases: every weight has its HF tensor
            flat[name] = np.zeros(spec.shape, np.float32)
    return flat


def load(path: Path, hf: dict, files: list[Path], dtype: str, where: str):
    """`(params, cfg)` of the checkpoint `files` whose parsed config.json (at `where`) is `hf`."""
    cfg, layout = config_from_hf(hf, dtype, where)
    entries = hf_files.read_headers(files, _rename)
    shapes = {name: shape for name, (_, _, _, shape) in entries.items()}
    # Before the expected names are listed (a dozen per configured layer).
    hf_files.check_layers(shapes, cfg.n_layers, "model.layers.", "num_hidden_layers", path)
    _check_shapes(shapes, cfg, layout, path)  # before any tensor is read
    state = hf_files.read_state(entries)
    hf_files.check_finite(state, path)
    if layout.tied:
        hf_files.check_tied(state, HEAD, EMBEDDING, path)
    params = hf_files.stacked_params(_to_lmjax(state, cfg, layout), dtype)
    check_params(params, cfg)
    return params, cfg


def _nonzero(flat: dict[str, np.ndarray], cfg: ModelConfig) -> dict[str, bool]:
    """Whether any o_proj / MLP / head bias of `flat` is nonzero (see `choose_layout`)."""
    kinds = {"o": (".attention.output.bias",), "head": ("language_model_head.bias",)}
    kinds["mlp"] = tuple(f".feed_forward.{p}.bias" for p in _MLP.values())
    return {
        kind: any(np.any(a != 0) for n, a in flat.items() if n.endswith(suffixes))
        for kind, suffixes in kinds.items()
    }


def save(params: dict, cfg: ModelConfig, out_dir: str | os.PathLike) -> str:
    """Write `out_dir/config.json` and `model.safetensors` that `AutoModelForCausalLM` loads;
    returns the family written. A config no family expresses is a ConfigError."""
    hf_files.check_export_dtypes(params, cfg)
    flat = hf_files.per_layer_flat(params)
    layout = choose_layout(cfg, _nonzero(flat, cfg))
    hf = config_to_hf(cfg, layout)
    dtype = np.dtype(cfg.params_dtype)
    # A bias the family needs and lmjax lacks (llama's attention_bias covers q, k, v and o) is 0.
    state = {
        hf: flat.get(ours, np.zeros(shape, dtype)) for hf, ours, shape in tensor_names(cfg, layout)
    }
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    st.save(ptree.unflatten(state), out_dir / "model.safetensors", metadata={"format": "pt"})
    atomic_write_text(out_dir / "config.json", json.dumps(hf, indent=2) + "\n")
    return layout.family
