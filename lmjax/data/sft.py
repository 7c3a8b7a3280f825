"""Supervised fine-tuning data (`lmjax finetune CONFIG --data FILE.jsonl`): records in, a
prepared data directory out, whose batches put the loss on completion tokens only.

    scan     read every record once: check its schema (`sft_records`; a malformed one is an
             error naming FILE:LINE, or counted with data.skip_bad) and count them
    split    a seeded set of whole records is the validation split (`prepare_docs`' rule:
             max(1, round(val_fraction * n)) records, at most n - 1)
    encode   each record by the base run's tokenizer into ids and a mask (1: predicted);
             a record longer than seq_len + 1 ids is truncated to its first seq_len + 1
             (counted and reported), and one left with no predicted token after its first is
             dropped (counted and reported): it would teach nothing

The directory is a prepared data directory (`lmjax.data.prepared`) plus a mask per split:

    meta.json            the usual fields, `prepare`'s settings for this corpus with the
                         tokenizer's sha256 (so `lmjax train` and `lmjax eval` reuse it as it
                         is), and "sft": {format, seq_len, eot_id, records, truncated, dropped}
    tokenizer/           the base's tokenizer
    SPLIT.bin, SPLIT.idx the records' ids end to end, one document per record
    SPLIT.mask           uint8, one per id

`open_prepared` then gives `sft_rows.SFTSplit` splits, and every batch is cut by
`sft_rows.rows` (one record per row, or packed with data.packing). The directory is keyed by
the file's content, the tokenizer's files and these settings: the same inputs reuse it.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import sys
from pathlib import Path

import numpy as np

from lmjax import tokenizers
from lmjax.data import prepared as D
from lmjax.data import sft_records as R
from lmjax.data.corpus import cache_dir
from lmjax.data.corpus_files import BadRecords
from lmjax.data.prepare_docs import TOKENIZER_DIR, DocOptions, validation_documents
from lmjax.data.sft_rows import MASK_SUFFIX
from lmjax.data.shards import ShardWriter
from lmjax.errors import ConfigError, FileFormatError
from lmjax.files import atomic_dir, atomic_write_text

SFT_FORMAT = 1


@dataclasses.dataclass
class Counts:
    """What preparing the records did to them (reported, and kept in meta.json)."""

    records: int = 0  # well-formed records read
    truncated: int = 0  # kept, but longer than seq_len + 1 ids: cut to their first seq_len + 1
    dropped: int = 0  # no predicted token (after the first) within seq_len + 1: not written

    def report(self, path, seq_len: int, bad: BadRecords | None, splits: dict) -> str:
        """One line: the records of each split and what was cut, dropped or skipped."""
        kept = f"{splits['train']['documents']:,} train + {splits['val']['documents']:,} val"
        line = f"sft data {path}: {self.records:,} records ({kept})"
        if self.truncated:
            line += f", {self.truncated:,} truncated to seq_len + 1 = {seq_len + 1} tokens"
        if self.dropped:
            line += f", {self.dropped:,} dropped (no completion token within them)"
        skipped = bad.report() if bad is not None else None
        return line + (f"; {skipped}" if skipped else "")


def settings_of(d, path: Path, seq_len: int, tok_dir: Path, eot: int | None) -> dict:
    """meta.json's settings: `prepare`'s for this corpus (`data.corpus_settings`) and the SFT
    ones (`sft`) that decide the ids and rows: seq_len, the tokenizer's files, the eot id."""
    opts = DocOptions(field=d.field, eot=d.eot, skip_bad=d.skip_bad)
    settings = D.corpus_settings([path], d.tokenizer, d.vocab_size, d.val_fraction, opts)
    # As `prepare` records a given tokenizer: `lmjax eval` of the run compares its copy's.
    settings["tokenizer_sha256"] = D.files_sha256(tok_dir)
    return {**settings, "sft": {"format": SFT_FORMAT, "seq_len": seq_len, "eot_id": eot}}


def prepare(d, path, seq_len: int, tok_dir, out=None) -> Path:
    """The SFT data directory of the records in `path` (a `.jsonl`), encoded by the saved
    tokenizer in `tok_dir`, for rows of `seq_len`; built, or reused when it exists with the same
    settings. `d`: the run's data section (dir, val_fraction, eot, skip_bad, tokenizer).
    Prints one line on `out` (default stderr): records per split, truncated, dropped, skipped."""
    path, tok_dir = Path(path), Path(tok_dir)
    _check_file(path)
    tok = tokenizers.load(tok_dir)
    eot = R.end_of_text(tok, d.eot)
    settings = settings_of(d, path, seq_len, tok_dir, eot)
    key = hashlib.sha256(json.dumps(settings, sort_keys=True).encode()).hexdigest()
    target = Path(d.dir) if d.dir else cache_dir() / "data" / f"sft-{key[:16]}"
    if not target.exists():
        _build(target, path, tok, settings, d, out)
    meta = _reusable(target, settings)
    counts = Counts(**{k: meta["sft"][k] for k in ("records", "truncated", "dropped")})
    bad = BadRecords(skip=True, count=meta["skipped_records"], first=meta["first_skipped"])
    print(counts.report(path, seq_len, bad, meta["splits"]), file=out or sys.stderr)
    return target


def with_sft_data(cfg, path, tok_dir, out=None):
    """`cfg` (a `RunConfig`) with data.corpus the records' file and data.dir its prepared SFT
    directory (`prepare`, rows of `cfg.seq_len`), which `lmjax train`'s loop then opens."""
    target = prepare(cfg.data, path, cfg.seq_len, tok_dir, out)
    return cfg.replace(data=dataclasses.replace(cfg.data, corpus=str(path), dir=str(target)))


def is_sft_dir(directory) -> bool:
    """Whether `directory` (a run's data.dir, may be None or gone) holds prepared SFT records."""
    try:
        meta = json.loads((Path(directory) / "meta.json").read_text(encoding="utf-8"))
    except (TypeError, OSError, ValueError):
        return False
    return isinstance(meta, dict) and isinstance(meta.get("sft"), dict)


def _check_file(path: Path) -> None:
    if not path.is_file():
        raise ConfigError.describe(
            "lmjax finetune --data",
            str(path),
            "an existing .jsonl file of {prompt, completion} or {messages} records",
            "check the path",
        )


def scan(path: Path, tok, bad: BadRecords) -> int:
    """Count the well-formed records (malformed ones go to `bad`); a messages record with a
    tokenizer that has no chat template fails here, before any encoding."""
    n = 0
    for record, where in R.read_records(path, bad):
        if "messages" in record:
            R.check_chat_tokenizer(tok, where)
        n += 1
    if n < 2:
        raise FileFormatError.describe(
            f"sft data {path}",
            f"{n} records" + (f" ({bad.report()})" if bad.count else ""),
            "at least 2 records (the validation split is a set of whole records)",
            "add records",
        )
    return n


def _build(target: Path, path: Path, tok, settings: dict, d, out) -> None:
    bad = BadRecords(d.skip_bad)
    n = scan(path, tok, bad)
    is_val = validation_documents(n, d.val_fraction, 0)
    seq_len, counts = settings["sft"]["seq_len"], Counts(records=n)
    with atomic_dir(target) as tmp:
        tok.save(tmp / TOKENIZER_DIR)
        dtype = "uint16" if tok.vocab_size <= 1 << 16 else "uint32"
        writers = {s: _SplitWriter(tmp, s, dtype) for s in ("train", "val")}
        for index, item in enumerate(R.encoded_records(path, tok, settings["sft"]["eot_id"], bad)):
            kept = _truncated(item, seq_len, counts)
            if kept is not None:
                writers["val" if is_val[index] else "train"].add(*kept)
        splits = {s: w.close() for s, w in writers.items()}
        _check_splits(path, splits, counts)
        counts_meta = dataclasses.asdict(counts)
        meta = {
            "format": D.FORMAT,
            "vocab_size": tok.vocab_size,
            "dtype": dtype,
            **{f"{s}_tokens": splits[s]["tokens"] for s in splits},
            **{f"{s}_documents": splits[s]["documents"] for s in splits},
            "skipped_records": bad.count,
            "first_skipped": bad.first,
            "corpus": str(path),
            **settings,
            "sft": {**settings["sft"], **counts_meta},
            "splits": splits,
        }
        atomic_write_text(tmp / "meta.json", json.dumps(meta, indent=1))


def _truncated(item, seq_len: int, counts: Counts):
    """`(ids, mask)` cut to seq_len + 1 ids (counted), or None when nothing is left to
    predict (counted: the first id is never a target)."""
    if item is None:  # refused by the tokenizer: already counted as a bad record
        return None
    ids, mask = item.ids[: seq_len + 1], item.mask[: seq_len + 1]
    if not mask[1:].any():
        counts.dropped += 1
        return None
    counts.truncated += len(item.ids) > seq_len + 1
    return ids, mask


class _SplitWriter:
    """A split's token shards and index (`ShardWriter`) and its SPLIT.mask beside them."""

    def __init__(self, directory: Path, split: str, dtype: str):
        self.tokens = ShardWriter(directory, split, dtype)
        self.mask = open(directory / f"{split}{MASK_SUFFIX}", "wb")

    def add(self, ids, mask) -> None:
        self.tokens.add(ids)
        self.mask.write(np.asarray(mask, np.uint8).tobytes())

    def close(self) -> dict:
        self.mask.close()
        return self.tokens.close()


def _check_splits(path: Path, splits: dict, counts: Counts) -> None:
    for name, entry in splits.items():
        if entry["documents"] == 0:
            raise FileFormatError.describe(
                f"sft data {path}",
                f"no {name} records left ({counts.dropped} dropped with no completion token "
                f"within seq_len + 1 ids, {counts.truncated} truncated)",
                "records with completion tokens in both splits",
                "add records, shorten the prompts, or raise train.seq_len",
            )


def _reusable(target: Path, settings: dict) -> dict:
    """`target`'s meta.json when it was prepared with `settings`, else one error line."""
    try:
        meta = json.loads((target / "meta.json").read_text(encoding="utf-8"))
    except (OSError, ValueError):
        meta = None
    same = isinstance(meta, dict) and isinstance(meta.get("sft"), dict)
    old = {**meta, "sft": {k: meta["sft"].get(k) for k in settings["sft"]}} if same else {}
    differs = [k for k in settings if old.get(k) != settings[k]]
    if differs:
        raise ConfigError.describe(
            f"sft data directory {target}",
            f"prepared with other settings ({differs[0]})" if same else "not an SFT directory",
            "a new directory, or one prepared from the same file, tokenizer and seq_len",
            "remove data.dir (a cache directory is keyed by the inputs) or pick another one",
        )
    return meta


__all__ = [
    "SFT_FORMAT",
    "Counts",
    "is_sft_dir",
    "prepare",
    "scan",
    "settings_of",
    "with_sft_data",
]
