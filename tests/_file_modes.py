"""Walking what lmjax wrote for the modes its files and directories got (tests/test_file_modes.py,
tests/test_finetune_ux.py): a umask set for a block, and the check that every file is 0o666 and
every directory 0o777 less it."""

from __future__ import annotations

import contextlib
import os
import stat
from pathlib import Path


@contextlib.contextmanager
def umask(mask: int):
    """The process's umask set to `mask` for the block, the old one restored after."""
    old = os.umask(mask)
    try:
        yield
    finally:
        os.umask(old)


def modes(root: Path) -> dict[str, int]:
    """`{path relative to root: permission bits}` of everything under `root`."""
    return {str(p.relative_to(root)): stat.S_IMODE(p.lstat().st_mode) for p in root.rglob("*")}


def assert_modes(root: Path, mask: int, expected: tuple[str, ...]) -> None:
    """Every file under `root` is 0o666 & ~mask and every directory 0o777 & ~mask; the walk saw
    each of `expected` (paths relative to root), so it walked what the commands wrote."""
    found = modes(root)
    missing = [name for name in expected if name not in found]
    assert not missing, f"not written: {missing}"
    wrong = {
        name: oct(mode)
        for name, mode in found.items()
        if mode != (0o777 if (root / name).is_dir() else 0o666) & ~mask
    }
    assert not wrong, f"under umask {mask:03o}: {wrong}"
