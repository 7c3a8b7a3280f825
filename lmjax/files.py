"""Atomic file writes: a reader sees the old file or the new one, never half of either.

The bytes go to a temporary file in the target's own directory (so the final `os.replace` is a
rename within one file system, which POSIX makes atomic), are flushed and fsynced, and only then
replace the target. If anything fails midway the temporary file is removed and the target is
untouched. The temporary file and directory are created as `open()` and `mkdir` create theirs
(modes 0o666 and 0o777 less the umask: 0644 and 0755 under umask 022), not as `tempfile` does
(0600 and 0700, private to their owner): what lmjax writes is readable by whoever the user's
umask lets read it (another user, a container, a serving process).

`atomic_dir` does the same for a whole directory, and is safe when several processes build the
same directory at once: the first rename wins and the others check and accept its result.

Both survive a power cut: the new file (every file and directory of the new tree) is fsynced
before the rename, and the parent directory after it, so once they return the new content is on
disk under its name (`fsync_tree`, `fsync_dir`); a cut before that leaves the old content or
none, and at worst a hidden temporary (`.NAME.<16 hex>.tmp`, `remove_stale`).
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import secrets
import shutil
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import IO, Any

from lmjax.errors import ConfigError


@contextlib.contextmanager
def atomic_open(path: str | os.PathLike, mode: str = "wb") -> Iterator[IO]:
    """`with atomic_open(p, "w") as f: f.write(...)` replaces `p` only if the block succeeds."""
    if mode not in ("w", "wb"):
        raise ValueError(f"atomic_open mode = {mode!r}; expected 'w' or 'wb'")
    path = Path(path)
    fd, tmp = _new_file(path)
    try:
        encoding = None if "b" in mode else "utf-8"
        with os.fdopen(fd, mode, encoding=encoding) as handle:
            yield handle
            handle.flush()
            os.fsync(handle.fileno())
        os.replace(tmp, path)
        fsync_dir(path.parent)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        raise


def _create_beside(path: Path, create: Callable[[Path], Any]) -> Any:
    """`create(tmp)` for a new hidden name `.NAME.<16 hex>.tmp` beside `path`, drawn again while
    the name is taken (`create` raises FileExistsError: another writer's temporary)."""
    while True:
        tmp = path.parent / f".{path.name}.{secrets.token_hex(8)}.tmp"
        with contextlib.suppress(FileExistsError):
            return create(tmp)


def _new_file(path: Path) -> tuple[int, Path]:
    """`(fd, tmp)`: a new, empty temporary file beside `path`, open for writing. Asking `os.open`
    for 0o666 lets the kernel apply the umask, as `open(tmp, "w")` does (mkstemp asks 0o600)."""
    flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_CLOEXEC", 0)
    return _create_beside(path, lambda tmp: (os.open(tmp, flags, 0o666), tmp))


def _new_dir(path: Path) -> Path:
    """A new, empty temporary directory beside `path`, 0o777 less the umask (as `mkdir`)."""
    return _create_beside(path, lambda tmp: (tmp.mkdir(0o777), tmp)[1])


def atomic_write_bytes(path: str | os.PathLike, data: bytes) -> None:
    with atomic_open(path, "wb") as handle:
        handle.write(data)


def atomic_write_text(path: str | os.PathLike, text: str) -> None:
    with atomic_open(path, "w") as handle:
        handle.write(text)


def copy_tree(source: str | os.PathLike, target: str | os.PathLike) -> None:
    """Copy the directory `source` to `target` (new, or empty: an `atomic_dir`): the bytes, not
    the modes (shutil.copytree copies those), so what is written follows the umask as any other
    write, whoever wrote the source (a cache an older lmjax made owner-only, another user's
    files)."""
    source, target = Path(source), Path(target)
    target.mkdir(parents=True, exist_ok=True)
    for path in source.iterdir():
        if path.is_dir():
            copy_tree(path, target / path.name)
        else:
            shutil.copyfile(path, target / path.name)


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
    tmp = _new_dir(path)
    try:
        yield tmp
        fsync_tree(tmp)
        published = _rename_if_absent(tmp, path)
        fsync_dir(path.parent)
    finally:  # after a successful rename `tmp` is gone and this removes nothing
        shutil.rmtree(tmp, ignore_errors=True)
    if not published:
        _accept_twin(path, twin)


def fsync_dir(path: str | os.PathLike) -> None:
    """fsync the directory `path`: the names created, renamed or removed in it are on disk."""
    _fsync(path, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0))


def _fsync(path: str | os.PathLike, flags: int = os.O_RDONLY) -> None:
    fd = os.open(path, flags)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def fsync_tree(path: str | os.PathLike) -> None:
    """fsync every file and directory under `path` (deepest first), `path` itself and its
    parent: the whole tree, its names included, is on disk when this returns."""
    path = Path(path)
    for root, _, files in os.walk(path, topdown=False):
        for name in files:
            _fsync(os.path.join(root, name))
        fsync_dir(root)
    fsync_dir(path.parent)


def replace_dir(new: str | os.PathLike, path: str | os.PathLike) -> None:
    """Put the complete directory `new` (beside `path`, e.g. an `atomic_dir`'s) in place of
    `path`, which may exist: the old one is renamed to a hidden temporary (`.NAME.<16 hex>.tmp`),
    `new` to `path`, the parent fsynced, the old removed. A kill leaves under `path` the old
    directory, the new one or none (the rest as temporaries), never one half written or half
    removed, as `shutil.rmtree(path)` then a rename could."""
    new, path = Path(new), Path(path)
    old = path.parent / f".{path.name}.{secrets.token_hex(8)}.tmp"
    if path.exists():
        os.rename(path, old)
    os.rename(new, path)
    fsync_dir(path.parent)
    shutil.rmtree(old, ignore_errors=True)


def temporary_of(name: str) -> str | None:
    """NAME when `name` is a temporary of ours for it (`.NAME.<16 hex>.tmp`), else None."""
    parts = name.rsplit(".", 2)
    ours = len(parts) == 3 and parts[0][:1] == "." and parts[2] == "tmp" and len(parts[1]) == 16
    return parts[0][1:] if ours else None


def remove_stale(directory: str | os.PathLike, names: tuple[str, ...]) -> list[str]:
    """Remove the temporaries `atomic_open` and `atomic_dir` left for `names` in `directory`
    when their process was killed; their names. Only for a directory one process writes (a
    run's own files): elsewhere another writer's temporary may be in use."""
    removed = []
    for path in sorted(Path(directory).iterdir()):
        if temporary_of(path.name) in names:
            if path.is_dir() and not path.is_symlink():
                shutil.rmtree(path, ignore_errors=True)
            else:
                path.unlink(missing_ok=True)
            removed.append(path.name)
    return removed


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
