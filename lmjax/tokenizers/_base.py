"""What every tokenizer shares: the protocol and the `tokenizer.json` manifest."""

from __future__ import annotations

import contextlib
import json
import os
import stat
from collections.abc import Iterable
from pathlib import Path
from typing import Any, Protocol, runtime_checkable

import numpy as np

from lmjax.checks import is_int, require
from lmjax.errors import CheckpointError, FileFormatError, TokenError
from lmjax.files import atomic_write_text

MANIFEST = "tokenizer.json"


@runtime_checkable
class Tokenizer(Protocol):
    kind: str

    @property
    def vocab_size(self) -> int: ...

    def encode(self, text: str) -> list[int]: ...

    def decode(self, ids) -> str: ...

    def save(self, directory: str | os.PathLike) -> None: ...


@contextlib.contextmanager
def writing(directory: Path):
    """Turn an OSError while writing a tokenizer into a `CheckpointError` naming `directory`
    (still an OSError); each file is written atomically, so none is left half-written."""
    try:
        yield
    except OSError as err:
        what, reason = f"writing a tokenizer to {directory}", err.strerror or str(err)
        expected = "a writable directory with free space"
        fix = "check the path, its permissions and the free disk space"
        raise CheckpointError.describe(what, reason, expected, fix) from err


def training_texts(texts: Iterable[str] | str) -> Iterable[str]:
    """The training corpus as an iterable of texts (a str is one text); ConfigError if it is
    neither a str nor iterable. The texts themselves are checked as they are read."""
    texts = [texts] if isinstance(texts, str) else texts
    ok, kind = isinstance(texts, Iterable), type(texts).__name__
    require(ok, "training texts", kind, "a str or an iterable of str", "pass the corpus text")
    return texts


def write_manifest(directory: str | os.PathLike, manifest: dict[str, Any]) -> None:
    """Write `directory/tokenizer.json` atomically (creating the directory)."""
    directory = Path(directory)
    with writing(directory):
        directory.mkdir(parents=True, exist_ok=True)
        text = json.dumps(manifest, ensure_ascii=False, indent=1)
        atomic_write_text(directory / MANIFEST, text)


def check_regular(path: Path) -> None:
    """Refuse a pipe, socket or device before reading it: the read could block forever.

    A missing path or a directory is left to the read that follows, which names it.
    """
    try:
        mode = path.stat().st_mode
    except OSError:
        return
    if not (stat.S_ISREG(mode) or stat.S_ISDIR(mode)):
        raise FileFormatError.describe(
            str(path), "a pipe, socket or device", "a regular file", "point at the file itself"
        )


def read_manifest(directory: str | os.PathLike) -> dict[str, Any]:
    path = Path(directory) / MANIFEST
    check_regular(path)
    try:
        manifest = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise FileFormatError.describe(
            "tokenizer file", str(path), "an existing tokenizer.json", "run `lmjax prepare` first"
        ) from None
    # ValueError: bad JSON, bad UTF-8, an integer over 4,300 digits; RecursionError: `[[[[...`
    except (ValueError, RecursionError) as err:
        raise FileFormatError.describe(
            str(path), f"invalid JSON ({err})", "a tokenizer.json written by lmjax", "prepare again"
        ) from None
    except OSError as err:  # a directory, no permission...
        raise FileFormatError.describe(
            "tokenizer file", str(path), f"a readable file ({err.strerror or err})", "prepare again"
        ) from None
    if not isinstance(manifest, dict):
        raise FileFormatError.describe(
            str(path), type(manifest).__name__, "a JSON object", "prepare again"
        )
    return manifest


def check_text(text) -> bytes:
    """The UTF-8 bytes of `text`; a non-str or a lone surrogate raises `TokenError` naming it."""
    if not isinstance(text, str):
        raise TokenError.describe("text", type(text).__name__, "a str", "pass a Python string")
    try:
        return text.encode("utf-8")
    except UnicodeEncodeError as err:
        raise TokenError.describe(
            f"text[{err.start}]",
            text[err.start],
            "a character UTF-8 can encode (a lone surrogate cannot)",
            "repair the text, e.g. s.encode('utf-16', 'surrogatepass').decode('utf-16', 'replace')",
        ) from None


def check_ids(ids, vocab_size: int) -> list[int]:
    """`ids` (a list, tuple or 1-d array of integers) as a list of ints in `[0, vocab_size)`.

    Anything else raises `TokenError` naming it: a nested or ragged sequence (by its shape), a
    non-integer dtype, or the first id outside the vocabulary (even one too large for int64).
    """
    try:
        array = np.asarray(ids)
    except (ValueError, TypeError):  # ragged: [[1, 2], [3]]
        raise TokenError.describe(
            "token ids", ids, "a flat sequence of ints (not nested)", "decode one row at a time"
        ) from None
    if array.ndim > 1:
        raise TokenError.describe(
            "token ids shape", array.shape, "a 1-d sequence", "decode one row at a time"
        )
    values = array.reshape(-1).tolist()
    if array.dtype == object:  # python ints past int64 (or mixed types) land here
        integral = all(is_int(i) for i in values)
        bad = [i for i in values if integral and not 0 <= i < vocab_size]
    else:
        integral = np.issubdtype(array.dtype, np.integer) or array.size == 0
        bad = array[(array < 0) | (array >= vocab_size)].tolist() if integral else []
    if not integral:
        raise TokenError.describe(
            "token ids dtype", array.dtype, "integers", "pass ids from encode()"
        )
    if bad:
        raise TokenError.describe(
            "token id",
            bad[0],
            f"an id in [0, {vocab_size})",
            "decode ids produced by this tokenizer",
        )
    return [int(i) for i in values]
