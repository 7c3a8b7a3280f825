"""Hugging Face causal-LM checkpoints in and out, one entry point for every family
(docs/interop.md).

load(path, dtype="float32") -> (params, cfg)
    path: a directory with config.json and model.safetensors (or sharded
    model-0000x-of-0000y.safetensors with model.safetensors.index.json), or one
    .safetensors file. model_type gpt2 (also: no config.json, no model_type) goes to
    `hf_gpt2`; llama, mistral, qwen2 and qwen3 (SmolLM is llama) to `hf_llama`. Another
    model_type is one FileFormatError naming it.
save(params, cfg, out_dir) -> model_type
    writes what `transformers.AutoModelForCausalLM.from_pretrained(out_dir)` loads: gpt2
    for a LayerNorm / learned-position config, else the llama family that expresses it
    (qk_norm -> qwen3, q/k/v biases -> qwen2, a sliding window -> mistral, else llama).
"""

from __future__ import annotations

import os
from pathlib import Path

from lmjax.errors import FileFormatError
from lmjax.io import hf_files, hf_gpt2, hf_llama
from lmjax.io.hf_llama_config import FAMILIES
from lmjax.models import ModelConfig

MODEL_TYPES = ("gpt2", *FAMILIES)


def model_type(path: str | os.PathLike) -> str:
    """The checkpoint's model_type ("gpt2" when config.json is absent or names none)."""
    _, config_path = hf_files.weight_files(Path(path))
    if config_path is None:
        return "gpt2"  # hf_gpt2 infers a GPT-2 from its tensors (given n_heads)
    hf = hf_files.read_json(config_path)
    kind = hf.get("model_type", "gpt2") if isinstance(hf, dict) else "gpt2"
    if kind not in MODEL_TYPES:
        raise FileFormatError.describe(
            f"{config_path} model_type",
            kind,
            f"one of {MODEL_TYPES}",
            "convert the model to one of these families (lmjax reads no other architecture)",
        )
    return kind


def load(path: str | os.PathLike, dtype: str = "float32") -> tuple[dict, ModelConfig]:
    """`(params, cfg)` of a Hugging Face checkpoint; tensors are cast to `dtype`."""
    path = Path(path)
    if model_type(path) == "gpt2":  # its own errors for a config.json that is no JSON object
        return hf_gpt2.load(path, dtype=dtype)
    files, config_path = hf_files.weight_files(path)
    hf = hf_files.read_json(config_path)
    return hf_llama.load(path, hf, files, dtype, where=str(config_path))


def is_gpt2_like(cfg: ModelConfig) -> bool:
    """A config `hf_gpt2` exports (LayerNorm, learned positions); the others are llama-like."""
    return cfg.norm == "layernorm" or cfg.positions == "learned" or cfg.activation != "swiglu"


def save(params: dict, cfg: ModelConfig, out_dir: str | os.PathLike) -> str:
    """Write a directory `AutoModelForCausalLM.from_pretrained` loads; returns its model_type.

    A config no family expresses is one ConfigError line, before anything is written.
    """
    if is_gpt2_like(cfg):
        hf_gpt2.save(params, cfg, out_dir)
        return "gpt2"
    return hf_llama.save(params, cfg, out_dir)


__all__ = ["MODEL_TYPES", "is_gpt2_like", "load", "model_type", "save"]
