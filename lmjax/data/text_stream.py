"""One large text file read as a stream of decoded blocks (a single-document corpus).

`prepare` splits such a corpus at a character position, so it reads the file twice without
holding it: `scan_text` counts the characters (and collects the alphabet a char tokenizer
needs), `char_range` yields the characters [start, stop) block by block. Memory is one block
(`BLOCK` bytes) plus the encoder's chunk, not the file.
"""

from __future__ import annotations

import codecs
from collections.abc import Iterator
from pathlib import Path

from lmjax.errors import FileFormatError

BLOCK = 1 << 20  # bytes read at a time


def decoded_blocks(path: Path) -> Iterator[str]:
    """The file's text, `BLOCK` bytes at a time; bytes that are not UTF-8 are a
    `FileFormatError` naming the byte offset and the line."""
    block = BLOCK
    decoder = codecs.getincrementaldecoder("utf-8")()
    consumed, lines = 0, 1
    with open(path, "rb") as handle:
        for raw in iter(lambda: handle.read(block), b""):
            pending = decoder.getstate()[0]
            try:
                text = decoder.decode(raw)
            except UnicodeDecodeError as err:
                at = consumed - len(pending) + err.start
                line = lines + (pending + raw)[: err.start].count(b"\n")
                raise _not_utf8(path, at, line) from None
            consumed, lines = consumed + len(raw), lines + raw.count(b"\n")
            yield text
    try:
        decoder.decode(b"", final=True)
    except UnicodeDecodeError:
        raise _not_utf8(path, consumed - len(decoder.getstate()[0]), lines) from None


def _not_utf8(path: Path, at: int, line: int) -> FileFormatError:
    return FileFormatError.describe(
        f"corpus {path}", f"not UTF-8 (byte {at}, line {line})", "UTF-8 text", "convert it to UTF-8"
    )


def scan_text(path: Path, want_alphabet: bool) -> tuple[int, str]:
    """(characters in the file, its sorted alphabet or "")."""
    n, chars = 0, set()
    for text in decoded_blocks(path):
        n += len(text)
        if want_alphabet:
            chars.update(text)
    if n == 0:
        raise FileFormatError.describe(
            f"corpus {path}", "an empty file", "some text", "point data.corpus at a non-empty file"
        )
    return n, "".join(sorted(chars))


def char_range(path: Path, start: int, stop: int) -> Iterator[str]:
    """The characters [start, stop) of the file's text, in blocks."""
    at = 0
    for text in decoded_blocks(path):
        lo, hi = max(start - at, 0), min(stop - at, len(text))
        if lo < hi:
            yield text[lo:hi]
        at += len(text)
        if at >= stop:
            return
