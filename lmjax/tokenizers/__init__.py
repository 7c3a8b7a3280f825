"""Tokenizers: text <-> token ids (docs/interop.md).

Every tokenizer has `encode(text) -> list[int]`, `decode(ids) -> str`, `vocab_size`, a `kind`
string and `save(directory)`; `load(directory)` reads any of them back. On disk a tokenizer is a
directory with `tokenizer.json` (`{"kind": ..., ...}`) plus whatever files its kind needs.

- `ByteTokenizer`: the 256 byte values of UTF-8; never fails on any text.
- `CharTokenizer`: one id per distinct character of a training corpus, sorted by code point;
  encoding a character it never saw raises `TokenError` naming it.
- `BPETokenizer` (`lmjax.tokenizers.bpe`): byte-level BPE in the GPT-2 scheme.
- `HFTokenizer` (`lmjax.tokenizers.hf_tokenizer`): a Hugging Face `tokenizer.json` (byte-level
  BPE: Llama 3, Qwen2/3, SmolLM), checked by lmjax and run by the `tokenizers` library, with its
  chat template; `load_hf_tokenizer(dir_or_file)`.
  Saved, it is HF's own files, and `load` recognises them (a tokenizer.json with a 'model').
"""

from __future__ import annotations

import os
from pathlib import Path

from lmjax.errors import ConfigError, FileFormatError
from lmjax.tokenizers._base import Tokenizer, read_manifest, write_manifest
from lmjax.tokenizers.bpe import BPETokenizer
from lmjax.tokenizers.bpe import load_directory as _load_bpe
from lmjax.tokenizers.hf_tokenizer import HFTokenizer, load_hf_tokenizer
from lmjax.tokenizers.hf_tokenizer import load_directory as _load_hf
from lmjax.tokenizers.simple import ByteTokenizer, CharTokenizer

# kind -> loader(directory, manifest). Kinds register here so `load` stays one function.
_LOADERS = {
    "byte": lambda directory, manifest: ByteTokenizer(),
    "char": lambda directory, manifest: CharTokenizer.from_manifest(
        manifest, where=directory / "tokenizer.json"
    ),
    "bpe": _load_bpe,
    "hf": _load_hf,
}


def register(kind: str, loader) -> None:
    """Make `load` understand `kind`: `loader(directory: Path, manifest: dict) -> Tokenizer`."""
    _LOADERS[kind] = loader


def load(directory: str | os.PathLike) -> Tokenizer:
    """Read the tokenizer that `tok.save(directory)` wrote (any kind)."""
    directory = Path(directory)
    manifest = read_manifest(directory)
    # Hugging Face's tokenizer.json has no lmjax 'kind'; its 'model' says what it is.
    kind = manifest.get("kind", "hf" if "model" in manifest else None)
    if not isinstance(kind, str) or kind not in _LOADERS:  # a list would not even hash
        raise FileFormatError.describe(
            f"{directory / 'tokenizer.json'}: kind",
            kind,
            f"one of {sorted(_LOADERS)}",
            "save the tokenizer again with this version of lmjax",
        )
    return _LOADERS[kind](directory, manifest)


def build(kind: str, texts=(), *, vocab_size: int | None = None) -> Tokenizer:
    """A tokenizer of `kind` built from the corpus `texts` (an iterable of strings).

    "bpe" needs `vocab_size` (>= 257: 256 byte tokens, `<|endoftext|>`, then learned merges).
    """
    if kind != "bpe" and vocab_size is not None:
        raise ConfigError.describe(
            "vocab_size", vocab_size, f"None for tokenizer {kind!r}", "drop it or use 'bpe'"
        )
    if kind == "byte":
        return ByteTokenizer()
    if kind == "char":
        return CharTokenizer.train(texts)
    if kind == "bpe":
        if vocab_size is None:
            raise ConfigError.describe(
                "vocab_size", None, "an int >= 257 for 'bpe'", "pass --vocab-size N"
            )
        return BPETokenizer.train(texts, vocab_size)
    raise ConfigError.describe("tokenizer", kind, "'byte', 'char' or 'bpe'", "pick one of those")


__all__ = [
    "BPETokenizer",
    "ByteTokenizer",
    "CharTokenizer",
    "HFTokenizer",
    "Tokenizer",
    "build",
    "load",
    "load_hf_tokenizer",
    "register",
    "read_manifest",
    "write_manifest",
]
