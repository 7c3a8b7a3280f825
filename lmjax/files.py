"""Atomic file writes: a reader sees the old file or the new one, never half of either.

The bytes go to a temporary file in the target's own directory (so the final `os.replace` is a
rename within one file system, which POSIX makes atomic), are flushed and fsynced, and only then
replace the target. If anything fails midway the temporary file is removed and the target is
untouched.

`atomic_dir` does the same for a whole directory, and is safe when several processes build the
same directory at once: the first rename wins and the others check and accept its result.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import shutil
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import IO

from lmjax.errors import ConfigError


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
def atomic_dir(
    path: str | os.PathLike, twin: Callable[[Path], None] | None = None
) -> Iterator[Path]:
    """`with atomic_dir(p) as tmp:` fill `tmp`; it becomes `p` (a rename) only on success.

    `p` must not exist when the block starts (the caller refuses existing outputs); on any
    failure `tmp` is removed, so nothing half-written is ever left at `p` or beside it.

    Several writers may build the same `p` at once (two hosts of one run preparing the same
    token cache, two users' shells): the first rename wins, and a later writer finds `p` already
    there. With `twin`, that writer calls `twin(p)`, which returns only if `p` is a complete
    twin of what it built (and raises an lmjax error otherwise); its own copy is then dropped
    and `p` is used as is. Without `twin` the other copy is refused with a `ConfigError`; either
    way `p` is never overwritten.
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent))
    try:
        yield tmp
        published = _rename_if_absent(tmp, path)
    finally:  # after a successful rename `tmp` is gone and this removes nothing
        shutil.rmtree(tmp, ignore_errors=True)
    if not published:
        _accept_twin(path, twin)


def _rename_if_absent(tmp: Path, path: Path) -> bool:
    """Rename `tmp` to `path`: True, or False when `path` was created meanwhile by another
    writer (the rename of a directory onto a non-empty one fails: ENOTEMPTY or EEXIST, or
    ENOTDIR / EISDIR when a file stands there). Any other failure propagates."""
    try:
        os.rename(tmp, path)
    except OSError:
        if not os.path.lexists(path):
            raise
        return False
    return True


def _accept_twin(path: Path, twin: Callable[[Path], None] | None) -> None:
    if twin is None:
        raise ConfigError.describe(
            "output directory",
            str(path),
            "a path that does not exist yet (another process wrote it meanwhile)",
            "pick another output path (nothing was overwritten)",
        )
    twin(path)
