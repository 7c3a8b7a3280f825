"""Atomic file writes: a reader sees the old file or the new one, never half of either.

The bytes go to a temporary file in the target's own directory (so the final `os.replace` is a
rename within one file system, which POSIX makes atomic), are flushed and fsynced, and only then
replace the target. If anything fails midway the temporary file is removed and the target is
untouched.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import IO


@contextlib.contextmanager
def atomic_open(path: str | os.PathLike, mode: str = "wb") -> Iterator[IO]:
    """`with atomic_open(p, "w") as f: f.write(...)` replaces `p` only if the block succeeds."""
    if mode not in ("w", "wb"):
        raise ValueError(f"atomic_open mode = {mode!r}; expected 'w' or 'wb'")
    path = Path(path)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        encoding = None if "b" in mode else "utf-8"
        with os.fdopen(fd, mode, encoding=encoding) as handle:
            yield handle
            handle.flush()
            os.fsync(handle.fileno())
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        raise


def atomic_write_bytes(path: str | os.PathLike, data: bytes) -> None:
    with atomic_open(path, "wb") as handle:
        handle.write(data)


def atomic_write_text(path: str | os.PathLike, text: str) -> None:
    with atomic_open(path, "w") as handle:
        handle.write(text)


def sha256(path: str | os.PathLike) -> str:
    """Hex SHA-256 of a file's bytes, read in 1 MiB blocks (never the whole file at once)."""
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        for block in iter(lambda: handle.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


@contextlib.contextmanager
def atomic_dir(path: str | os.PathLike) -> Iterator[Path]:
    """`with atomic_dir(p) as tmp:` fill `tmp`; it becomes `p` (a rename) only on success.

    `p` must not exist (the caller refuses existing outputs); on any failure `tmp` is removed.
    """
    import shutil

    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent))
    try:
        yield tmp
        os.rename(tmp, path)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
