r"""Hugging Face `tokenizer.json` (the fast-tokenizer file) checked and read into an `HFSpec`.

The `tokenizers` library (the format's own implementation) encodes and decodes
(`lmjax.tokenizers.hf_tokenizer`); this module decides, before it runs, which files lmjax
accepts, and keeps what lmjax needs beside the library. It stays for three reasons:

- lmjax relies on byte-level BPE: each token stands for a known run of bytes (`token_bytes`,
  HF's ByteLevel decoder table), which is what gives the chat template's assistant mask its token
  offsets (`chat.render_with_mask`) and what the tests compare with `transformers`. So only the
  layout Llama 3, Qwen2/3, SmolLM and GPT-2 ship is accepted:

    added_tokens     single_word / lstrip / rstrip false (each -> its id wherever it appears)
    normalizer       null or NFC (a Sequence of those)
    pre_tokenizer    Split(Regex|String, Isolated, invert=false) or Digits ... then ByteLevel
                     (add_prefix_space=false), or a plain ByteLevel
    model            BPE over all 256 byte tokens: vocab + merges ("a b" strings or [a, b]
                     lists) whose parts are in the vocab; no dropout, prefix/suffix, byte_fallback
    post_processor   null, ByteLevel, TemplateProcessing, or a Sequence of those
    decoder          ByteLevel

- Anything else (WordPiece, Unigram, Metaspace, byte_fallback, a Split behaviour other than
  Isolated, ...) is one `FileFormatError` line naming the field; the library's own errors name
  only a line and column of the JSON.
- `added` (which added tokens are special, which are matched before the normalizer) gives
  `HFTokenizer.special_tokens` and `normalize`.

The pre-tokenizer's regexes are left to the library to compile (its regex engine, not Python's,
decides what they mean). The BPE merge loop that used to live here is gone: the library runs it.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from lmjax.checks import is_int, is_nonnegative_int
from lmjax.errors import FileFormatError
from lmjax.tokenizers._base import check_regular
from lmjax.tokenizers.bpe_scheme import CHAR_TO_BYTE

_FIX = (
    "lmjax reads byte-level BPE tokenizer.json files (Llama 3, Qwen2/3, SmolLM, GPT-2 style); "
    "use transformers for this tokenizer"
)


@dataclass(frozen=True)
class AddedToken:
    """One `added_tokens` entry: `content` encodes to `id` wherever it appears in the text."""

    content: str
    id: int
    special: bool
    normalized: bool


@dataclass(frozen=True)
class HFSpec:
    """What lmjax keeps of a checked tokenizer.json beside the `tokenizers` library.

    `nfc`: whether the normalizer is NFC; `added`: the added tokens; `token_bytes`: id -> the
    bytes HF's ByteLevel decoder gives that token (model vocab and added tokens).
    """

    nfc: bool
    added: tuple[AddedToken, ...]
    token_bytes: dict[int, bytes]


def bad(where: str, value: Any, expected: str, fix: str = _FIX) -> FileFormatError:
    return FileFormatError.describe(where, value, expected, fix)


def read_json(path: Path) -> dict:
    """The JSON object in `path`; a missing, unreadable or non-object file is one error line."""
    check_regular(path)
    try:
        data = json.loads(path.read_text(encoding="utf-8-sig"))
    except FileNotFoundError:
        raise bad("file", str(path), "an existing file", "check the path") from None
    except (ValueError, RecursionError) as err:
        raise bad(str(path), f"invalid JSON ({err})", "a JSON object", "check the file") from None
    except OSError as err:
        raise bad(
            "file", str(path), f"a readable file ({err.strerror or err})", "check it"
        ) from None
    if not isinstance(data, dict):
        raise bad(str(path), type(data).__name__, "a JSON object", "check the file")
    return data


def _type(node: Any, where: str) -> str:
    if not isinstance(node, dict) or not isinstance(node.get("type"), str):
        raise bad(f"{where}", node, "an object with a 'type'")
    return node["type"]


def _flag(node: dict, key: str, where: str, allowed: bool) -> None:
    """Refuse `node[key]` unless it is absent, null or `allowed` (the only value lmjax runs)."""
    value = node.get(key)
    if value is not None and value != allowed:
        raise bad(f"{where}.{key}", value, f"{allowed} (lmjax implements only that)")


def token_bytes(text: str) -> bytes:
    """HF ByteLevel's bytes for a token string: its characters through GPT-2's byte alphabet,
    or, when one is outside it (an added token such as '東京'), the string's own UTF-8."""
    try:
        return bytes(CHAR_TO_BYTE[c] for c in text)
    except KeyError:
        return text.encode("utf-8")


def _merge_pair(merge: Any, where: str) -> tuple[str, str]:
    if isinstance(merge, str):
        parts = merge.split(" ")
    elif isinstance(merge, list):
        parts = merge
    else:
        parts = []
    if len(parts) != 2 or not all(isinstance(p, str) and p for p in parts):
        raise bad(where, merge, "'left right' or [left, right]", "check the merges list")
    return parts[0], parts[1]


def _bpe_vocab(model: dict, where: str) -> dict[str, int]:
    vocab = model.get("vocab")
    ok = isinstance(vocab, dict) and all(is_nonnegative_int(i) for i in vocab.values())
    if not ok:
        raise bad(f"{where}.vocab", type(vocab).__name__, "an object {token: id >= 0}")
    missing = [b for c, b in CHAR_TO_BYTE.items() if c not in vocab]
    if missing:
        raise bad(f"{where}.vocab: byte tokens missing", missing[:8], "all 256 byte tokens")
    return vocab


def parse_model(model: Any, where: str = "model") -> dict[int, str]:
    """id -> token string of a checked byte-level BPE model."""
    kind = _type(model, where)
    if kind != "BPE":
        raise bad(f"{where}.type", kind, "'BPE' (byte-level)")
    for key in ("dropout", "continuing_subword_prefix", "end_of_word_suffix"):
        if model.get(key) not in (None, "", 0, 0.0):
            raise bad(f"{where}.{key}", model[key], "null (lmjax implements only that)")
    _flag(model, "byte_fallback", where, False)
    vocab = _bpe_vocab(model, where)
    merges = model.get("merges")
    if not isinstance(merges, list):
        raise bad(f"{where}.merges", type(merges).__name__, "a list of merges")
    for rank, merge in enumerate(merges):
        left, right = _merge_pair(merge, f"{where}.merges[{rank}]")
        for part in (left, right, left + right):
            if part not in vocab:
                raise bad(
                    f"{where}.merges[{rank}]",
                    merge,
                    f"parts and result in the vocab ({part!r} is not)",
                )
    return {i: t for t, i in vocab.items()}


def parse_normalizer(node: Any, where: str = "normalizer") -> bool:
    """True for NFC, False for none; any other normalizer is refused by name."""
    if node is None:
        return False
    kind = _type(node, where)
    if kind == "NFC":
        return True
    if kind == "Sequence" and isinstance(node.get("normalizers"), list):
        parts = [parse_normalizer(n, f"{where}.normalizers") for n in node["normalizers"]]
        return any(parts)
    raise bad(f"{where}.type", kind, "null or 'NFC'")


def _check_split(node: dict, where: str) -> None:
    pattern = node.get("pattern")
    kinds = ("Regex", "String")
    ok = isinstance(pattern, dict) and any(isinstance(pattern.get(k), str) for k in kinds)
    if not ok:
        raise bad(f"{where}.pattern", pattern, "{'Regex': ...} or {'String': ...}")
    if node.get("behavior") != "Isolated":
        raise bad(f"{where}.behavior", node.get("behavior"), "'Isolated'")
    _flag(node, "invert", where, False)


def parse_pre_tokenizer(node: Any, where: str = "pre_tokenizer") -> None:
    """Check the steps: Split/Digits ... ByteLevel (ByteLevel last, once)."""
    kind = _type(node, where)
    steps = node.get("pretokenizers") if kind == "Sequence" else [node]
    if not isinstance(steps, list) or not steps:
        raise bad(f"{where}.pretokenizers", steps, "a non-empty list")
    for k, step in enumerate(steps):
        here = f"{where}.pretokenizers[{k}]" if kind == "Sequence" else where
        step_kind = _type(step, here)
        last = k == len(steps) - 1
        if step_kind == "Split" and not last:
            _check_split(step, here)
        elif step_kind == "ByteLevel" and last:
            _flag(step, "add_prefix_space", here, False)
        elif step_kind != "Digits" or last:
            expected = "Split/Digits steps, then ByteLevel" if kind == "Sequence" else "ByteLevel"
            raise bad(f"{here}.type", step_kind, expected)


def parse_added(entries: Any, where: str = "added_tokens") -> tuple[AddedToken, ...]:
    if entries is None:
        return ()
    if not isinstance(entries, list):
        raise bad(where, type(entries).__name__, "a list")
    added = []
    for k, entry in enumerate(entries):
        here = f"{where}[{k}]"
        content, i = (
            (entry.get("content"), entry.get("id")) if isinstance(entry, dict) else (None, None)
        )
        if not isinstance(content, str) or not content or not is_nonnegative_int(i):
            raise bad(here, entry, "{'id': int >= 0, 'content': non-empty str, ...}")
        for key in ("single_word", "lstrip", "rstrip"):
            _flag(entry, key, f"{here} ({content!r})", False)
        special = bool(entry.get("special", False))
        added.append(AddedToken(content, i, special, bool(entry.get("normalized", not special))))
    return tuple(added)


def _template_ids(node: dict, where: str) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """(ids before $A, ids after $A) of a TemplateProcessing's `single` template."""
    single, specials = node.get("single"), node.get("special_tokens") or {}
    if not isinstance(single, list) or not isinstance(specials, dict):
        raise bad(f"{where}.single", single, "a list of SpecialToken / Sequence items")
    before, after, seen = [], [], 0
    for k, item in enumerate(single):
        if isinstance(item, dict) and "Sequence" in item and item["Sequence"].get("id") == "A":
            seen += 1
            continue
        name = item.get("SpecialToken", {}).get("id") if isinstance(item, dict) else None
        ids = specials.get(name, {}).get("ids") if isinstance(specials.get(name), dict) else None
        if not isinstance(ids, list) or not all(is_int(i) for i in ids):
            raise bad(
                f"{where}.single[{k}]", item, "a SpecialToken listed in special_tokens, or $A"
            )
        (after if seen else before).extend(ids)
    if seen != 1:
        raise bad(f"{where}.single", single, "exactly one $A (Sequence A)")
    return tuple(before), tuple(after)


def parse_post_processor(node: Any, where: str = "post_processor"):
    """(prefix ids, suffix ids) a single sequence gets with add_special_tokens=True."""
    if node is None:
        return (), ()
    kind = _type(node, where)
    if kind == "ByteLevel":  # it only trims offsets; ids are unchanged
        return (), ()
    if kind == "TemplateProcessing":
        return _template_ids(node, where)
    if kind == "Sequence" and isinstance(node.get("processors"), list):
        parts = [parse_post_processor(p, f"{where}.processors") for p in node["processors"]]
        nonempty = [p for p in parts if p != ((), ())]
        if len(nonempty) > 1:
            raise bad(f"{where}.processors", kind, "at most one TemplateProcessing")
        return nonempty[0] if nonempty else ((), ())
    raise bad(
        f"{where}.type", kind, "null, 'ByteLevel', 'TemplateProcessing' or a Sequence of those"
    )


def parse(data: dict, path: Path) -> HFSpec:
    """Check every part of a tokenizer.json object and gather an `HFSpec` (errors name `path`)."""
    if "model" not in data:
        raise bad(f"{path}", sorted(data)[:8], "a Hugging Face tokenizer.json (with 'model')")
    at = f"{path}: "
    names = parse_model(data["model"], at + "model")
    nfc = parse_normalizer(data.get("normalizer"), at + "normalizer")
    parse_pre_tokenizer(data.get("pre_tokenizer"), at + "pre_tokenizer")
    decoder = data.get("decoder")
    if _type(decoder, at + "decoder") != "ByteLevel":
        raise bad(at + "decoder.type", decoder.get("type"), "'ByteLevel'")
    added = parse_added(data.get("added_tokens"), at + "added_tokens")
    for token in added:  # HF looks an id up among the added tokens first, then in the model
        names[token.id] = token.content
    prefix, suffix = parse_post_processor(data.get("post_processor"), at + "post_processor")
    for i in (*prefix, *suffix):
        if i not in names:
            raise bad(at + "post_processor id", i, "an id of the vocabulary or added_tokens")
    return HFSpec(nfc, added, {i: token_bytes(t) for i, t in names.items()})
