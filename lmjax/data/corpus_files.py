"""Corpus files in, documents out: what `lmjax prepare --corpus` reads.

    corpus   a file, a directory (every corpus file below it, recursively) or a glob
    files    sorted by path (a directory: by path relative to it), so the order is the same on
             every machine and every run
    format   by name: `.jsonl` / `.jsonl.gz` (one JSON object per line, the document is its
             `field`, default "text"), `.parquet` (the column `field`, read one row group batch
             at a time), anything else is UTF-8 text (the whole file is one document)

Documents are streamed: a `.jsonl` or `.parquet` file is never held whole, only the record being
read. A malformed record (invalid JSON, not an object, a missing / non-string / empty field,
bytes that are not UTF-8, a null parquet value) is a `FileFormatError` naming `FILE:LINE`
(parquet: `FILE:row N`), or, with `skip_bad`, counted by `BadRecords` and reported at the end.
A file that cannot be read at all (a broken gzip stream, a parquet file without the column) is
always an error.
"""

from __future__ import annotations

import dataclasses
import glob
import gzip
import hashlib
import json
import zlib
from collections.abc import Iterator
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq

from lmjax.errors import ConfigError, FileFormatError
from lmjax.files import sha256

JSONL = (".jsonl", ".jsonl.gz")
PARQUET = ".parquet"
CORPUS_SUFFIXES = (".txt", *JSONL, PARQUET)  # what a directory or glob contributes
_PARQUET_BATCH = 1024  # rows per read: bounds memory for a parquet file of any size


def format_of(path: Path) -> str:
    """ "jsonl", "parquet" or "text", from the file name."""
    name = path.name.lower()
    if name.endswith(JSONL):
        return "jsonl"
    return "parquet" if name.endswith(PARQUET) else "text"


def corpus_files(corpus: str) -> list[Path]:
    """The files of `corpus` (a file, a directory or a glob) in their reading order.

    A file named directly is read whatever its name (text unless `.jsonl[.gz]` / `.parquet`); a
    directory or a glob contributes only files named `*.txt`, `*.jsonl[.gz]`, `*.parquet`.
    """
    path = Path(corpus).expanduser()
    if path.is_file():
        return [path]
    if path.is_dir():
        found = (p for p in path.rglob("*") if p.is_file() and _is_corpus_file(p))
        files = sorted(found, key=lambda p: p.relative_to(path).as_posix())
    else:
        matches = glob.glob(str(path), recursive=True)
        files = sorted(Path(p) for p in matches if Path(p).is_file() and _is_corpus_file(p))
    if not files:
        raise ConfigError.describe(
            "data.corpus",
            corpus,
            "'shakespeare', an existing text / .jsonl / .jsonl.gz / .parquet file, or a "
            f"directory or glob holding some (*{', *'.join(CORPUS_SUFFIXES)})",
            "check the path",
        )
    return files


def _is_corpus_file(path) -> bool:
    name = Path(path).name
    return not name.startswith(".") and name.lower().endswith(CORPUS_SUFFIXES)


def corpus_digest(files: list[Path]) -> str:
    """The corpus's content key: one file's sha256 (as a single-file corpus always had), else
    the sha256 of the files' sha256s in reading order (each file streamed, never read whole)."""
    hashes = [sha256(p) for p in files]
    if len(hashes) == 1:
        return hashes[0]
    return hashlib.sha256("\n".join(hashes).encode()).hexdigest()


@dataclasses.dataclass
class BadRecords:
    """Malformed records: an error at the first (`skip` False) or counted (`skip` True)."""

    skip: bool = False
    count: int = 0
    first: str | None = None

    def __call__(self, where: str, reason: str) -> None:
        if not self.skip:
            raise FileFormatError.describe(
                f"record {where}",
                reason,
                "a well-formed document record",
                "fix or remove the record, or skip malformed records: data.skip_bad=true "
                "(lmjax prepare and finetune: --skip-bad)",
            )
        self.count += 1
        self.first = self.first or f"{where}: {reason}"

    def report(self) -> str | None:
        """ "skipped N bad records (first: FILE:LINE: reason)", or None when none were."""
        if not self.count:
            return None
        plural = "s" if self.count != 1 else ""
        return f"skipped {self.count} bad record{plural} (first: {self.first})"


@dataclasses.dataclass(frozen=True)
class Document:
    """One document: its text, where it came from (`FILE:LINE`) and the bytes it advances."""

    text: str
    where: str
    nbytes: int


def documents(files: list[Path], field: str, bad: BadRecords) -> Iterator[Document]:
    """Every well-formed document of `files` in order (malformed ones go to `bad`)."""
    readers = {"jsonl": _jsonl_documents, "parquet": _parquet_documents}
    for path in files:
        yield from readers.get(format_of(path), _text_documents)(path, field, bad)


def _text_documents(path: Path, field: str, bad: BadRecords) -> Iterator[Document]:
    raw = path.read_bytes()
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as err:
        line = raw[: err.start].count(b"\n") + 1
        bad(f"{path}:{line}", f"not UTF-8 (byte {err.start} of the file)")
        return
    if not text:
        bad(f"{path}:1", "an empty file")
        return
    yield Document(text, f"{path}:1", len(raw))


def _jsonl_documents(path: Path, field: str, bad: BadRecords) -> Iterator[Document]:
    gz = path.name.lower().endswith(".gz")
    try:
        with open(path, "rb") as raw:
            done = 0  # bytes of the file consumed (compressed for .gz): the progress bar's
            for number, line in enumerate(gzip.GzipFile(fileobj=raw) if gz else raw, 1):
                nbytes = raw.tell() - done if gz else len(line)
                done += nbytes
                if line.strip():
                    text = _record_text(line, field, f"{path}:{number}", bad)
                    if text is not None:
                        yield Document(text, f"{path}:{number}", nbytes)
    except (OSError, EOFError, zlib.error) as err:  # gzip.BadGzipFile is an OSError
        raise FileFormatError.describe(
            f"corpus file {path}", f"unreadable ({err})", "a complete file", "re-create it"
        ) from None


def _record_text(line: bytes, field: str, where: str, bad: BadRecords) -> str | None:
    """The `field` string of one JSON-lines record, or None after reporting it to `bad`."""
    try:
        record = json.loads(line.decode("utf-8"))
    except UnicodeDecodeError as err:
        return bad(where, f"not UTF-8 (byte {err.start} of the line)")
    except json.JSONDecodeError as err:
        return bad(where, json_problem(err))
    if not isinstance(record, dict):
        return bad(where, f"a JSON {type(record).__name__}, not an object")
    if field not in record:
        return bad(where, f"no field {field!r} (fields: {', '.join(sorted(record))[:80]})")
    text = record[field]
    if not isinstance(text, str):
        return bad(where, f"field {field!r} is {type(text).__name__}, not a string")
    if not text:
        return bad(where, f"field {field!r} is an empty string")
    return text


def json_problem(err: json.JSONDecodeError) -> str:
    """What is wrong with one JSON-lines record, for its `FILE:LINE` error: `invalid JSON
    (Expecting value at column 1)`. A line that ends inside a string (a record cut short) is
    said to be that: json's own message points at the newline, as an invalid control character."""
    rest = err.doc[err.pos :]
    if err.msg.startswith("Invalid control character") and not rest.strip():
        try:
            json.loads(err.doc.rstrip())
        except json.JSONDecodeError as cut:
            err = cut  # "Unterminated string starting at": the column where the string opens
    if err.msg.startswith("Unterminated string"):
        where = f"opened at column {err.colno}"
        return f"invalid JSON (unterminated string {where}: the line ends inside it)"
    return f"invalid JSON ({err.msg.removesuffix(' at')} at column {err.colno})"


def _parquet_documents(path: Path, field: str, bad: BadRecords) -> Iterator[Document]:
    try:
        yield from _parquet_rows(path, field, bad)
    except (pa.ArrowException, OSError, UnicodeDecodeError) as err:  # not parquet, corrupt...
        raise FileFormatError.describe(
            f"parquet file {path}",
            " ".join(str(err).split())[:160],
            "a readable parquet file",
            "rewrite it (pyarrow.parquet.write_table) or check the download",
        ) from None


def _parquet_rows(path: Path, field: str, bad: BadRecords) -> Iterator[Document]:
    table = pq.ParquetFile(path)
    schema = table.schema_arrow
    kind = schema.field(field).type if field in schema.names else None
    if kind is None or not (pa.types.is_string(kind) or pa.types.is_large_string(kind)):
        found = "no such column" if kind is None else f"a {kind} column"
        raise FileFormatError.describe(
            f"parquet file {path} column {field!r}",
            found,
            f"a string column (columns: {', '.join(schema.names)[:80]})",
            "pass --field NAME (data.field) naming the text column",
        )
    rows, size = max(table.metadata.num_rows, 1), path.stat().st_size
    row = 0
    for batch in table.iter_batches(batch_size=_PARQUET_BATCH, columns=[field]):
        for value in batch.column(0).to_pylist():
            row += 1
            if value is None or not value:
                bad(f"{path}:row {row}", "null" if value is None else "an empty string")
                continue
            nbytes = size * row // rows - size * (row - 1) // rows  # the file's size, spread
            yield Document(value, f"{path}:row {row}", nbytes)
