"""BPE vocabularies on disk: `vocab.json` + `merges.txt` (GPT-2's `encoder.json` + `vocab.bpe`).

    vocab.json   {"token": id, ...}; a token is its bytes through GPT-2's byte -> character
                 map (`bpe_scheme.BYTE_TO_CHAR`: space 'Ġ', newline 'Ċ'); special tokens as
                 plain text
    merges.txt   an optional "#version: ..." line, then one merge "left right" per line in rank
                 order (a token never contains a space: the space byte is 'Ġ')

The two GPT-2 releases are the same formats under other names. Mergeable tokens are the 256
byte tokens and every merge's result; any other vocab.json entry (e.g. `<|endoftext|>`) is a
special token. A merge's result takes a larger id than its two parts, and results appear in
merges.txt in id order (a line whose result an earlier line already made is a duplicate and
adds nothing): the id is the merge's priority when encoding, so a vocabulary whose ids disagree
with the merge order would tokenize differently from GPT-2 / Hugging Face and is refused. Both
files may start with a UTF-8 byte-order mark. `tokenizer.json` (the lmjax manifest) also records
the special tokens and the `encode` policy, so `lmjax.tokenizers.load(dir)` restores the same
tokenizer.
"""

from __future__ import annotations

import json
from collections import Counter
from collections.abc import Mapping, Sequence
from pathlib import Path

from lmjax.checks import is_nonnegative_int
from lmjax.errors import FileFormatError
from lmjax.files import atomic_write_text
from lmjax.tokenizers._base import check_regular, write_manifest, writing
from lmjax.tokenizers.bpe_scheme import BYTE_TO_CHAR, CHAR_TO_BYTE, GPT2_PATTERN, special_policy

VOCAB, MERGES = "vocab.json", "merges.txt"
_FIX = "use vocab.json/merges.txt (or encoder.json/vocab.bpe) written by lmjax, GPT-2 or HF"


def _bad(path: Path, what: str, value, expected: str) -> FileFormatError:
    return FileFormatError.describe(f"{path}: {what}", value, expected, _FIX)


def _read_text(path: Path) -> str:
    check_regular(path)
    try:
        return path.read_text(encoding="utf-8-sig")  # a leading BOM is not part of the text
    except FileNotFoundError:
        raise FileFormatError.describe(
            "BPE file", str(path), "an existing file", "check the path"
        ) from None
    except UnicodeDecodeError as err:
        raise _bad(path, "encoding", str(err), "UTF-8 text") from None
    except OSError as err:  # a directory, no permission...
        raise FileFormatError.describe(
            "BPE file", str(path), f"a readable file ({err.strerror or err})", "check the path"
        ) from None


def read_vocab(path: Path) -> dict[str, int]:
    text = _read_text(path)
    try:
        vocab = json.loads(text)
    # ValueError: bad JSON or an integer over 4,300 digits; RecursionError: `[[[[...`
    except (ValueError, RecursionError) as err:
        raise _bad(path, "JSON", str(err), "a JSON object {token: id}") from None
    if not isinstance(vocab, dict):
        raise _bad(path, "top level", type(vocab).__name__, "a JSON object {token: id}")
    for token, i in vocab.items():
        if not is_nonnegative_int(i):
            raise _bad(path, f"id of {token!r}", i, "a non-negative integer")
        if not token:  # as a special token it would match at every offset of every text
            raise _bad(path, "token", repr(token), "a non-empty string")
        try:
            token.encode("utf-8")
        except UnicodeEncodeError:  # a JSON escape like "\ud800": no UTF-8 bytes to decode to
            raise _bad(
                path, "token", token, "a string UTF-8 can encode (no lone surrogate)"
            ) from None
    return vocab


def read_merges(path: Path) -> list[tuple[str, str, int]]:
    """`(left, right, line number)` for each merge line, in rank order."""
    merges = []
    for number, line in enumerate(_read_text(path).split("\n"), start=1):
        line = line.rstrip("\r")
        if not line or (number == 1 and line.startswith("#version")):
            continue
        parts = line.split(" ")
        if len(parts) != 2 or not all(parts):
            raise _bad(path, f"line {number}", line, "two tokens separated by one space")
        merges.append((parts[0], parts[1], number))
    return merges


def _to_bytes(path: Path, token: str, where: str) -> bytes:
    try:
        return bytes(CHAR_TO_BYTE[c] for c in token)
    except KeyError as err:
        raise _bad(
            path, f"{where} token {token!r}", err.args[0], "characters of GPT-2's byte alphabet"
        ) from None


def _check_order(vocab_path, merges_path, vocab, left, right, number, last) -> None:
    """A new result's id exceeds its parts' ids and the previous new result's id."""
    result = left + right
    i = vocab[result]
    what = f"line {number} ({left} {right}) result id"
    if i <= max(vocab[left], vocab[right]):
        expected = f"> the ids of its parts ({vocab[left]}, {vocab[right]}) in {vocab_path.name}"
        raise _bad(merges_path, what, i, expected)
    if last is not None and i <= last[0]:
        expected = (
            f"> {last[0]}, the id made by line {last[1]}: {vocab_path.name}'s ids must follow "
            "the merge order (the id is the merge's priority)"
        )
        raise _bad(merges_path, what, i, expected)


def read_files(vocab_path: Path, merges_path: Path):
    """`(ranks, merges, special_tokens)` from a vocab file and a merges file."""
    vocab = read_vocab(vocab_path)
    lines = read_merges(merges_path)
    ranks: dict[bytes, int] = {}
    for b, c in BYTE_TO_CHAR.items():
        if c not in vocab:
            raise _bad(vocab_path, f"byte token for byte {b}", "missing", f"an entry {c!r}")
        ranks[bytes([b])] = vocab[c]
    merges, mergeable = [], set(BYTE_TO_CHAR.values())
    last = None  # (id, line number) of the last result made for the first time
    for left, right, number in lines:
        where = f"line {number} ({left} {right})"
        for part in (left, right, left + right):
            if part not in vocab:
                expected = f"every merge's parts and result in {vocab_path.name}"
                raise _bad(merges_path, where, f"{part!r} not in vocab", expected)
        result = left + right
        if result not in mergeable:
            _check_order(vocab_path, merges_path, vocab, left, right, number, last)
            last = (vocab[result], number)
        pair = (
            _to_bytes(merges_path, left, f"line {number} left"),
            _to_bytes(merges_path, right, f"line {number} right"),
        )
        merges.append(pair)
        ranks[pair[0] + pair[1]] = vocab[result]
        mergeable.add(result)
    for left, right, number in lines:  # e.g. the line making `left` was lost: it'd be "special"
        for part in (left, right):
            if part not in mergeable:
                where, found = f"line {number} ({left} {right})", f"{part!r} made by no merge line"
                expected = "parts that are byte tokens or results of merges (a line is missing)"
                raise _bad(merges_path, where, found, expected)
    special = {t: i for t, i in vocab.items() if t not in mergeable}
    ids = sorted(vocab.values())
    if ids != list(range(len(ids))):
        repeated = sorted(i for i, n in Counter(ids).items() if n > 1)[:4]
        found = f"repeated {repeated}" if repeated else f"max {ids[-1]}"
        raise _bad(vocab_path, "ids", found, f"each of 0..{len(ids) - 1} exactly once")
    return ranks, merges, special


def _policy_json(value):
    return value if value == "all" else sorted(value)


def write_directory(
    directory: Path,
    ranks: Mapping[bytes, int],
    merges: Sequence[tuple[bytes, bytes]],
    special_tokens: Mapping[str, int],
    *,
    kind: str,
    allowed_special: frozenset[str] | str,
    disallowed_special: frozenset[str] | str,
) -> None:
    """`vocab.json`, `merges.txt` (GPT-2 style, `#version: 0.2`) and the manifest, atomically."""

    def text(token: bytes) -> str:
        return "".join(BYTE_TO_CHAR[b] for b in token)

    by_id = sorted(
        [(i, text(t)) for t, i in ranks.items()] + [(i, s) for s, i in special_tokens.items()]
    )
    vocab = {token: i for i, token in by_id}
    lines = ["#version: 0.2"] + [f"{text(a)} {text(b)}" for a, b in merges]
    with writing(directory):
        directory.mkdir(parents=True, exist_ok=True)
        atomic_write_text(directory / VOCAB, json.dumps(vocab, ensure_ascii=False))
        atomic_write_text(directory / MERGES, "\n".join(lines) + "\n")
    write_manifest(
        directory,
        {
            "kind": kind,
            "vocab": VOCAB,
            "merges": MERGES,
            "pattern": GPT2_PATTERN,
            "special_tokens": dict(special_tokens),
            "allowed_special": _policy_json(allowed_special),
            "disallowed_special": _policy_json(disallowed_special),
        },
    )


def manifest_paths(directory: Path, manifest: dict) -> tuple[Path, Path]:
    """(vocab file, merges file) that the manifest `directory/tokenizer.json` names."""
    where = directory / "tokenizer.json"
    if manifest.get("pattern", GPT2_PATTERN) != GPT2_PATTERN:
        raise _bad(where, "pattern", manifest.get("pattern"), "the GPT-2 pattern")
    return (
        directory / str(manifest.get("vocab", VOCAB)),
        directory / str(manifest.get("merges", MERGES)),
    )


def manifest_policy(directory: Path, manifest: dict, special_tokens: Mapping[str, int]) -> dict:
    """The manifest's `encode` policy as `BPETokenizer` options, checked against the special
    tokens that vocab.json holds (the manifest must list the same ones)."""
    where = directory / "tokenizer.json"
    if "special_tokens" in manifest and manifest["special_tokens"] != special_tokens:
        raise _bad(
            where,
            "special_tokens",
            manifest["special_tokens"],
            f"{special_tokens} (vocab.json)",
        )
    options = {
        "allowed_special": manifest.get("allowed_special", ()),
        "disallowed_special": manifest.get("disallowed_special", "all"),
    }
    try:
        return {what: special_policy(v, special_tokens, what) for what, v in options.items()}
    except ValueError as err:
        raise _bad(where, "policy", str(err), "special tokens of this vocabulary") from None
