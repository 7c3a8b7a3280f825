"""`prepare` for a corpus of many documents (several files, `.jsonl`, `.parquet`).

    scan     read every document once: count them, check every record (a malformed one is an
             error naming FILE:LINE, or counted with skip_bad), collect a char alphabet
    split    a seeded set of whole documents is the validation split:
                 n_val = max(1, round(val_fraction * n)), at most n - 1,
                 chosen by numpy.random.default_rng(split_seed).choice(n, n_val, replace=False)
    encode   read again; batches of documents go to worker processes (`encoding`), their ids
             (+ the end-of-text id, when there is one) are appended in document order to the
             train or val shards (`shards.ShardWriter`) with the index of document boundaries

Memory is the scan's alphabet / counters plus the workers' in-flight batches, not the corpus
(bpe training is the exception: it reads the training documents). The files written do not
depend on the worker count.
"""

from __future__ import annotations

import dataclasses
import sys
from pathlib import Path

import numpy as np
from tqdm import tqdm

from lmjax.checks import require
from lmjax.data import encoding
from lmjax.data.corpus_files import BadRecords, Document, documents
from lmjax.data.shards import SHARD_TOKENS, ShardWriter
from lmjax.errors import ConfigError, FileFormatError

ENDOFTEXT = "<|endoftext|>"
TOKENIZER_DIR = "tokenizer"  # the saved tokenizer, in a data directory and in a run directory
_BATCH_CHARS = 1 << 20  # characters per worker batch (about): bounds the in-flight buffer
_BATCH_DOCS = 512


@dataclasses.dataclass(frozen=True)
class DocOptions:
    """How documents are read and split (`field`, `eot`, `skip_bad` are in the cache key)."""

    field: str = "text"
    eot: str = "auto"  # "auto" | "none" | the text of one of the tokenizer's special tokens
    skip_bad: bool = False
    workers: int = 1
    val_fraction: float = 0.1
    split_seed: int = 0
    shard_tokens: int = SHARD_TOKENS
    progress: bool = True


@dataclasses.dataclass(frozen=True)
class Scan:
    n_documents: int
    alphabet: str  # every character of the corpus, sorted (the char tokenizer's)
    bad: BadRecords


def scan(files: list[Path], opts: DocOptions, want_alphabet: bool) -> Scan:
    """Count and check every document (the first pass)."""
    bad, chars, n = BadRecords(opts.skip_bad), set(), 0
    bar = _bar(files, "checking", opts.progress)
    for doc in documents(files, opts.field, bad):
        n += 1
        if want_alphabet:
            chars.update(doc.text)
        bar.update(doc.nbytes)
    bar.close()
    if n < 2:
        raise FileFormatError.describe(
            f"corpus {files[0]}" + (f" and {len(files) - 1} more files" if len(files) > 1 else ""),
            f"{n} documents" + (f" ({bad.report()})" if bad.count else ""),
            "at least 2 documents (the validation split is a set of whole documents)",
            "add documents, or give one .txt file (its text's tail is then the validation split)",
        )
    return Scan(n, "".join(sorted(chars)), bad)


def validation_documents(n: int, val_fraction: float, seed: int) -> np.ndarray:
    """`[n]` bool: True for the documents of the validation split (at least 1, at most n-1)."""
    n_val = min(max(1, round(val_fraction * n)), n - 1)
    chosen = np.random.default_rng(seed).choice(n, size=n_val, replace=False)
    is_val = np.zeros(n, bool)
    is_val[chosen] = True
    return is_val


def train_texts(files: list[Path], opts: DocOptions, is_val: np.ndarray):
    """The training documents' texts, in order (what a bpe vocabulary is learned from)."""
    docs = documents(files, opts.field, BadRecords(skip=True))
    return (d.text for i, d in enumerate(docs) if not is_val[i])


def eot_id(tok, eot: str) -> int | None:
    """The id appended to every document: `eot` "auto" is the tokenizer's `<|endoftext|>`
    when it has one (gpt2, bpe), else none (byte and char have no spare id); "none" is none;
    anything else must be one of the tokenizer's special tokens."""
    special = getattr(tok, "special_tokens", {}) or {}
    if eot == "auto":
        return special.get(ENDOFTEXT)
    if eot == "none":
        return None
    if eot not in special:
        raise ConfigError.describe(
            "data.eot",
            eot,
            f"'auto', 'none' or a special token of the {tok.kind} tokenizer "
            f"({sorted(special) or 'it has none'})",
            "use data.eot=auto (lmjax prepare: --eot auto)",
        )
    return special[eot]


def _batches(files, opts: DocOptions, bar):
    """(document index range, texts) batches of about `_BATCH_CHARS` characters."""
    texts, where, size = [], [], 0
    docs = documents(files, opts.field, BadRecords(skip=True))  # checked by the scan already
    for doc in docs:
        texts.append(doc.text)
        where.append(doc)
        size += len(doc.text)
        if size >= _BATCH_CHARS or len(texts) >= _BATCH_DOCS:
            yield _tagged(where, bar), texts
            texts, where, size = [], [], 0
    if texts:
        yield _tagged(where, bar), texts


def _tagged(docs: list[Document], bar) -> list[str]:
    bar.update(sum(d.nbytes for d in docs))
    return [d.where for d in docs]


def write_splits(out: Path, files, opts: DocOptions, tok, dtype: str, eot, is_val, bad) -> dict:
    """Encode every document into `out`'s train and val shards; meta.json's split entries.
    `tok` is also saved in `out`/tokenizer (what the worker processes load). A text the
    tokenizer refuses (a special token's text inside it) is a bad record (`bad`)."""
    writers = {s: ShardWriter(out, s, dtype, opts.shard_tokens) for s in ("train", "val")}
    bar = _bar(files, "tokenizing", opts.progress)
    index = 0
    batches = _batches(files, opts, bar)
    encoded = encoding.encode_batches(batches, tok, out / TOKENIZER_DIR, dtype, opts.workers)
    for wheres, results in encoded:
        for where, ids in zip(wheres, results, strict=True):
            split, index = "val" if is_val[index] else "train", index + 1
            if isinstance(ids, str):
                bad(where, f"the tokenizer refused it: {ids.split('; expected')[0]}")
                continue
            if eot is not None:
                ids = np.append(ids, np.asarray([eot], ids.dtype))
            writers[split].add(ids)
        bar.set_postfix(documents=index, refresh=False)
    bar.close()
    entries = {s: w.close() for s, w in writers.items()}
    empty = [s for s, e in entries.items() if e["documents"] == 0]
    require(not empty, "documents in split", empty, "at least one in each", "add documents",
            FileFormatError)  # fmt: skip
    return entries


def report_skipped(bad: BadRecords) -> None:
    """Skipped records are never silent: one line on stderr."""
    line = bad.report()
    if line:
        print(line, file=sys.stderr)


def _bar(files, desc: str, enabled: bool):
    total = sum(p.stat().st_size for p in files)
    return tqdm(
        total=total, desc=desc, unit="B", unit_scale=True, unit_divisor=1024, disable=not enabled
    )
