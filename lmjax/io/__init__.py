"""Interop and files (SPEC section 8): safetensors parameter files, Hugging Face GPT-2.

lmjax.io.safetensors.save(params, path, metadata=None) / load(path, expected=None)
lmjax.io.hf_gpt2.load(path) -> (params, cfg) / save(params, cfg, out_dir)
"""

from lmjax.io import hf_gpt2, safetensors

__all__ = ["hf_gpt2", "safetensors"]
