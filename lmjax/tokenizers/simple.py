"""Byte-level and character-level tokenizers."""

from __future__ import annotations

import os
from collections.abc import Iterable
from dataclasses import dataclass

from lmjax.errors import ConfigError, FileFormatError, LMJaxError, TokenError
from lmjax.tokenizers._base import check_ids, check_text, training_texts, write_manifest


class ByteTokenizer:
    """id = UTF-8 byte value (vocab 256). Decoding replaces invalid UTF-8 with U+FFFD."""

    kind = "byte"
    vocab_size = 256

    def encode(self, text: str) -> list[int]:
        return list(check_text(text))

    def decode(self, ids) -> str:
        return bytes(check_ids(ids, 256)).decode("utf-8", errors="replace")

    def save(self, directory: str | os.PathLike) -> None:
        write_manifest(directory, {"kind": self.kind})


@dataclass(frozen=True)
class CharTokenizer:
    """One id per character of `chars` (distinct, sorted by code point)."""

    chars: str
    kind = "char"

    def __post_init__(self):
        if not self.chars:
            raise TokenError.describe(
                "character vocabulary", "''", "at least one character", "train on non-empty text"
            )
        if not isinstance(self.chars, str):
            raise TokenError.describe(
                "character vocabulary", self.chars, "a str", "build it with CharTokenizer.train"
            )
        check_text(self.chars)  # a lone surrogate could never be saved (UTF-8) or encoded
        if len(set(self.chars)) != len(self.chars):
            raise FileFormatError.describe(
                "character vocabulary", "repeated characters", "distinct characters", "retrain"
            )

    @classmethod
    def train(cls, texts: Iterable[str] | str) -> CharTokenizer:
        texts = training_texts(texts)
        seen: set[str] = set()
        for text in texts:
            if not isinstance(text, str):
                raise ConfigError.describe(
                    "training text", type(text).__name__, "str", "pass an iterable of strings"
                )
            check_text(text)  # names a lone surrogate by its index in this text
            seen.update(text)
        return cls("".join(sorted(seen)))

    @classmethod
    def from_manifest(cls, manifest: dict, where="tokenizer.json") -> CharTokenizer:
        """The tokenizer of a manifest read from `where` (named in every error)."""
        chars = manifest.get("chars")
        if not isinstance(chars, str):
            raise FileFormatError.describe(
                f"{where}: chars", chars, "a string of characters", "prepare the data again"
            )
        try:
            return cls(chars)
        except LMJaxError as err:  # empty, repeated or unencodable characters
            raise FileFormatError(f"{where}: {err}") from None

    @property
    def vocab_size(self) -> int:
        return len(self.chars)

    @property
    def _index(self) -> dict[str, int]:
        # Built on demand: the dataclass is frozen and cheap to hash without a cached dict.
        return {c: i for i, c in enumerate(self.chars)}

    def encode(self, text: str) -> list[int]:
        check_text(text)
        index = self._index
        try:
            return [index[c] for c in text]
        except KeyError as err:
            raise TokenError.describe(
                "character",
                err.args[0],
                f"one of the {len(self.chars)} characters seen in training",
                "use a byte tokenizer or retrain on text containing it",
            ) from None

    def decode(self, ids) -> str:
        return "".join(self.chars[i] for i in check_ids(ids, len(self.chars)))

    def save(self, directory: str | os.PathLike) -> None:
        write_manifest(directory, {"kind": self.kind, "chars": self.chars})
