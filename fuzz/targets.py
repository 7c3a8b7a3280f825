"""Fuzz targets: what lmjax reads from a user or a downloaded checkpoint (issue 45, item 4).

Each target takes bytes, writes them where lmjax reads them (a fresh temporary directory) and
calls the reader the commands call. It must return or raise an `lmjax.errors` exception; any
other exception is a finding (`run_one` re-raises it). fuzz/run.py drives a target with atheris
(coverage-guided; a hang past 5 s or a resident size past `RSS_LIMIT_MB` is a finding too);
tests/test_fuzz.py runs each for a few thousand deterministic mutations of its seeds.

    safetensors_header   model.safetensors      lmjax.io.safetensors.load
    config_json          config.json            lmjax.io.hf.load (beside a tiny gpt2 or llama
                                                model.safetensors: the seeds are each family's)
    tokenizer_json       tokenizer.json         load_hf_tokenizer, then encode / decode
    bpe_files            vocab.json \\0 merges.txt  BPETokenizer.from_files, then encode / decode
    tokenizer_config     tokenizer_config.json  load_hf_tokenizer (a fixed tokenizer.json),
                                                its chat template rendered, chat's stop ids
    generation_config    generation_config.json read_generation_config, stop_ids
    run_config           YAML \\0 overrides      load_run_config(path, overrides)
    corpus_txt / corpus_jsonl / corpus_jsonl_gz / corpus_parquet
                         a corpus file          lmjax.data.corpus_files.documents

A chat template renders in a sandbox: `tokenizer_config` also fails if the rendered text holds
`CANARY`, which sits in an environment variable and a file beside the template, so a template
that reads either (or Python internals through them) is a finding.
"""

from __future__ import annotations

import functools
import gzip
import io
import os
import tempfile
import zlib
from pathlib import Path

from lmjax.errors import LMJaxError

RSS_LIMIT_MB = 4096  # jax, torch-free: the process starts near 600 MB; leaks show far above
TIMEOUT_S = 5
CANARY = "lmjax-fuzz-canary-7d1f"
FIXTURES = Path(__file__).parent / "fixtures"
_FAMILIES = ("llama", "mistral", "qwen2", "qwen3", "gpt2")
_TEXT = "The quick fox, 1234 émigrés \u00a0 naïve 🦊.\n"


class Finding(Exception):
    """A target broke its contract (other than by raising a non-lmjax exception)."""


def _split(data: bytes, parts: int) -> list[bytes]:
    """`data` cut at its first `parts - 1` NUL bytes (missing parts are empty)."""
    pieces = data.split(b"\0", parts - 1)
    return pieces + [b""] * (parts - len(pieces))


def safetensors_header(data: bytes, root: Path) -> None:
    from lmjax.io import safetensors as st

    (root / "model.safetensors").write_bytes(data)
    st.load(root / "model.safetensors")


def config_json(data: bytes, root: Path) -> None:
    from lmjax.io import hf

    # the weights of the seed's family, so a config close to a seed gets past the shape checks
    family = next((f for f in _FAMILIES if f'"{f}"'.encode() in data), "gpt2")
    os.symlink(FIXTURES / f"{family}.safetensors", root / "model.safetensors")
    (root / "config.json").write_bytes(data)
    hf.load(root)


def _round_trip(tok) -> None:
    ids = tok.encode(_TEXT)
    tok.decode(ids)


def tokenizer_json(data: bytes, root: Path) -> None:
    from lmjax.tokenizers import load_hf_tokenizer

    (root / "tokenizer.json").write_bytes(data)
    _round_trip(load_hf_tokenizer(root))


def bpe_files(data: bytes, root: Path) -> None:
    from lmjax.tokenizers import BPETokenizer

    vocab, merges = _split(data, 2)
    (root / "vocab.json").write_bytes(vocab)
    (root / "merges.txt").write_bytes(merges)
    _round_trip(BPETokenizer.from_files(root / "vocab.json", root / "merges.txt"))


def tokenizer_config(data: bytes, root: Path) -> None:
    from lmjax import chat
    from lmjax.tokenizers import load_hf_tokenizer

    os.symlink(FIXTURES / "tokenizer.json", root / "tokenizer.json")
    (root / "tokenizer_config.json").write_bytes(data)
    (root / "secret.txt").write_text(CANARY)
    tok = load_hf_tokenizer(root)
    chat.stop_ids(tok, {}, tok.vocab_size)
    if tok.chat_template is None:
        return
    from lmjax.tokenizers.chat import render

    messages = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yes"}]
    text = render(tok.chat_template, messages, True, tok.template_variables())
    if CANARY in text:
        raise Finding(f"the chat template read the canary: {text[:200]!r}")
    tok.apply_chat_template(messages, add_generation_prompt=True)


@functools.cache
def _fixture_tokenizer():
    from lmjax.tokenizers import load_hf_tokenizer

    return load_hf_tokenizer(FIXTURES)


def generation_config(data: bytes, root: Path) -> None:
    from lmjax import chat

    (root / "generation_config.json").write_bytes(data)
    chat.stop_ids(_fixture_tokenizer(), chat.read_generation_config(root), 300)


def run_config(data: bytes, root: Path) -> None:
    from lmjax.config import load_run_config

    text, overrides = _split(data, 2)
    (root / "run.yaml").write_bytes(text)
    items = overrides.decode("utf-8", "surrogateescape").split("\n") if overrides else []
    load_run_config(root / "run.yaml", [i for i in items if i])


def _corpus(name: str):
    def read(data: bytes, root: Path) -> None:
        from lmjax.data.corpus_files import BadRecords, documents

        (root / name).write_bytes(data)
        for skip in (False, True):
            for document in documents([root / name], "text", BadRecords(skip=skip)):
                assert isinstance(document.text, str) and document.text
                assert document.nbytes >= 0

    read.__name__ = read.__qualname__ = "corpus_" + name.split(".", 1)[1].replace(".", "_")
    return read


TARGETS = {
    f.__name__: f
    for f in (
        safetensors_header,
        config_json,
        tokenizer_json,
        bpe_files,
        tokenizer_config,
        generation_config,
        run_config,
        _corpus("corpus.txt"),
        _corpus("corpus.jsonl"),
        _corpus("corpus.jsonl.gz"),
        _corpus("corpus.parquet"),
    )
}


@functools.cache
def scratch() -> str | None:
    """Where each input's directory goes: /dev/shm (a tmpfs) where there is one.

    The targets test parsing, not the disk; on a disk-backed /tmp the directory's create, write
    and delete were most of an execution (corpus_txt: 4,100 executions/s on /tmp, 14,700 on
    /dev/shm, this host, atheris, 20 s each). $TMPDIR, where set, still decides.
    """
    shm = Path("/dev/shm")
    if "TMPDIR" in os.environ or not (shm.is_dir() and os.access(shm, os.W_OK)):
        return None
    return str(shm)


def run_one(name: str, data: bytes) -> None:
    """Run target `name` on `data` in a fresh directory; an `lmjax.errors` exception is fine."""
    os.environ["LMJAX_FUZZ_CANARY"] = CANARY  # what a template must not reach
    with tempfile.TemporaryDirectory(prefix="lmjax-fuzz-", dir=scratch()) as tmp:
        try:
            TARGETS[name](data, Path(tmp))
        except LMJaxError:
            pass


def keep(data: bytes, findings: Path, target: str, engine: str) -> Path:
    """Save a finding's input as `findings`/TARGET/ENGINE-<crc32>; its path."""
    found = findings / target / f"{engine}-{zlib.crc32(data):08x}"
    found.parent.mkdir(parents=True, exist_ok=True)
    found.write_bytes(data)
    return found


def gzipped(data: bytes) -> bytes:
    out = io.BytesIO()
    with gzip.GzipFile(fileobj=out, mode="wb", mtime=0) as f:
        f.write(data)
    return out.getvalue()


__all__ = [
    "CANARY",
    "RSS_LIMIT_MB",
    "TARGETS",
    "TIMEOUT_S",
    "Finding",
    "gzipped",
    "keep",
    "run_one",
    "scratch",
]
