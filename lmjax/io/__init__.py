"""Interop and files (docs/interop.md): safetensors parameter files, Hugging Face checkpoints.

lmjax.io.safetensors.save(params, path, metadata=None) / load(path, expected=None)
lmjax.io.hf.load(path) -> (params, cfg) / save(params, cfg, out_dir)   every family:
    gpt2 (lmjax.io.hf_gpt2), llama, mistral, qwen2, qwen3 (lmjax.io.hf_llama)
"""

from lmjax.io import hf, hf_gpt2, hf_llama, safetensors

__all__ = ["hf", "hf_gpt2", "hf_llama", "safetensors"]
