"""The GPT-2 byte-level BPE scheme: what the tokenizer, its trainer and its files all share.

- `GPT2_PATTERN` / `PATTERN`: the pre-tokenization regex that cuts text into pieces.
- `BYTE_TO_CHAR` / `CHAR_TO_BYTE`: GPT-2's reversible byte <-> printable character map, the
  alphabet of vocab.json and merges.txt; `BYTE_ORDER` is GPT-2's order of the 256 byte tokens.
- `special_regex`: a regex finding special-token strings, the longest first.
- `special_policy`: an `allowed_special` / `disallowed_special` value checked and normalised.

It imports nothing of lmjax.tokenizers, so `bpe` (the tokenizer), `bpe_train` and `bpe_files`
import it and each other in one direction only: bpe -> bpe_files, bpe_train -> bpe_scheme.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping

import regex

from lmjax.errors import ConfigError

# The GPT-2 pre-tokenization pattern in tiktoken's equivalent, faster spelling (possessive
# quantifiers). Original: 's|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+
GPT2_PATTERN = (
    r"""'(?:[sdmt]|ll|ve|re)| ?\p{L}++| ?\p{N}++| ?[^\s\p{L}\p{N}]++|\s++$|\s+(?!\S)|\s"""
)
PATTERN = regex.compile(GPT2_PATTERN)
ENDOFTEXT = "<|endoftext|>"


def bytes_to_unicode() -> dict[int, str]:
    """GPT-2's reversible byte -> printable character map, in GPT-2's byte-token order.

    Printable Latin-1 bytes map to themselves; the other 68 bytes (controls, space, NBSP, soft
    hyphen) map to chr(256 + k) in increasing byte order, so every token is a readable string
    in vocab.json / merges.txt (a space becomes 'Ġ', a newline 'Ċ'). The dict's insertion order
    is the order of the 256 byte tokens in GPT-2's vocabulary (ids 0..255).
    """
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1)]
    printable += range(ord("®"), ord("ÿ") + 1)
    others = [b for b in range(256) if b not in set(printable)]
    return {
        **{b: chr(b) for b in printable},
        **{b: chr(256 + k) for k, b in enumerate(others)},
    }


BYTE_TO_CHAR = bytes_to_unicode()
CHAR_TO_BYTE = {c: b for b, c in BYTE_TO_CHAR.items()}
BYTE_ORDER = tuple(BYTE_TO_CHAR)  # byte value of token id i in a freshly trained vocabulary


def special_regex(tokens: Iterable[str]) -> regex.Pattern:
    """A regex matching any of `tokens` (non-empty), trying the longest first."""
    # Longest first, so a special token that is a prefix of another never wins over it.
    return regex.compile("|".join(regex.escape(t) for t in sorted(tokens, key=lambda t: -len(t))))


def special_policy(value, special: Mapping[str, int], what: str) -> frozenset[str] | str:
    """`value` ("all" or a collection of keys of `special`) as "all" or a frozenset."""
    if value == "all":
        return "all"
    expected = "'all' or a collection of special-token strings"
    if isinstance(value, str) or not isinstance(value, Iterable):
        raise ConfigError.describe(what, value, expected, "pass e.g. {'<|x|>'}")
    try:
        value = frozenset(value)
    except TypeError:  # unhashable members, e.g. [[1]] from a hand-edited tokenizer.json
        raise ConfigError.describe(what, value, expected, "pass e.g. {'<|x|>'}") from None
    unknown = sorted(value - special.keys())
    if unknown:
        raise ConfigError.describe(
            what, unknown, f"special tokens of this tokenizer ({sorted(special)})", "drop them"
        )
    return value
