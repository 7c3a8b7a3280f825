"""What is on disk under a directory, to prove a failed command wrote nothing (issue 12).

    before = tree_snapshot(tmp_path)
    ...  # a command that must fail without touching the disk
    assert_unchanged(tmp_path, before)

A snapshot maps each path (relative, '/'-separated) to `(kind, size, sha256)`: directories and
symlinks are recorded too, so a created empty directory, a truncated file, a file rewritten with
other bytes of the same size, or a new dangling link all show as a difference.
"""

from __future__ import annotations

import hashlib
import os
from pathlib import Path


def tree_snapshot(root: str | os.PathLike) -> dict[str, tuple[str, int, str]]:
    """`{relative path: (kind, size, sha256)}` of everything under `root` (not following links)."""
    root = Path(root)
    out: dict[str, tuple[str, int, str]] = {}
    for path in sorted(root.rglob("*")):
        rel = path.relative_to(root).as_posix()
        if path.is_symlink():
            out[rel] = ("link", 0, os.readlink(path))
        elif path.is_dir():
            out[rel] = ("dir", 0, "")
        elif path.is_file():
            data = path.read_bytes()
            out[rel] = ("file", len(data), hashlib.sha256(data).hexdigest())
        else:
            out[rel] = ("other", 0, "")
    return out


def tree_diff(before: dict, after: dict) -> list[str]:
    """Readable differences: `created X`, `removed X`, `changed X (size a -> b)`."""
    lines = [f"created {p}" for p in sorted(set(after) - set(before))]
    lines += [f"removed {p}" for p in sorted(set(before) - set(after))]
    lines += [
        f"changed {p} (size {before[p][1]} -> {after[p][1]})"
        for p in sorted(set(before) & set(after))
        if before[p] != after[p]
    ]
    return lines


def assert_unchanged(root: str | os.PathLike, before: dict) -> None:
    """Fail, listing what changed, if anything under `root` differs from `before`."""
    diff = tree_diff(before, tree_snapshot(root))
    assert not diff, f"the disk under {root} changed: " + "; ".join(diff[:20])
