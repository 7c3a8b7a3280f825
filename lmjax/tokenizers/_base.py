"""What every tokenizer shares: the protocol and the `tokenizer.json` manifest."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any, Protocol, runtime_checkable

from lmjax.errors import FileFormatError
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


def write_manifest(directory: str | os.PathLike, manifest: dict[str, Any]) -> None:
    """Write `directory/tokenizer.json` atomically (creating the directory)."""
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    atomic_write_text(directory / MANIFEST, json.dumps(manifest, ensure_ascii=False, indent=1))


def read_manifest(directory: str | os.PathLike) -> dict[str, Any]:
    path = Path(directory) / MANIFEST
    try:
        manifest = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise FileFormatError.describe(
            "tokenizer file", str(path), "an existing tokenizer.json", "run `lmjax prepare` first"
        ) from None
    except (json.JSONDecodeError, UnicodeDecodeError) as err:
        raise FileFormatError.describe(
            str(path), f"invalid JSON ({err})", "a tokenizer.json written by lmjax", "prepare again"
        ) from None
    if not isinstance(manifest, dict):
        raise FileFormatError.describe(
            str(path), type(manifest).__name__, "a JSON object", "prepare again"
        )
    return manifest
