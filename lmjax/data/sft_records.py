"""Supervised fine-tuning records: one JSON object per line of a `.jsonl` file, encoded into
token ids and a per-token loss mask by the base run's own tokenizer.

    {"prompt": str, "completion": str}
        ids  = encode(prompt) + encode(completion) + [eot]      (each part encoded on its own,
                                                                 so the boundary is exact)
        mask = 0 on the prompt's tokens, 1 on the completion's and on the eot

    {"messages": [{"role": "system" | "user" | "assistant" | "tool", "content": str}, ...]}
        ids, mask = tokenizer.render_with_mask(messages)        (the tokenizer's own Jinja chat
                                                                 template: ids equal transformers'
                                                                 apply_chat_template; mask 1 on
                                                                 the assistant turns' tokens)

    {"instruction": str, "input": str (optional, may be empty), "output": str}   (Alpaca)
        user = instruction + "\n\n" + input   (just instruction when input is empty or absent)
        with a chat template: the messages [user, assistant = output], as above
        without one:          prompt = user + "\n\n", completion = output, as above

`mask[i] = 1` means token i is predicted (its target position enters the loss). `eot`: the
tokenizer's eos token (a Hugging Face tokenizer's `eos_token`) or `<|endoftext|>`, by
`data.eot` (auto); none for byte/char tokenizers (nothing is appended). The prompt gets the
post-processor's special tokens (e.g. a BOS) when the tokenizer has them, the completion none.

A malformed record (invalid JSON, not an object, none of the schemas, a non-string field, an
empty completion, output or instruction, an unknown role, no assistant turn, text the tokenizer
or template refuses) is a `FileFormatError` naming `FILE:LINE`, or counted with `skip_bad`
(`corpus_files.BadRecords`, as `lmjax prepare`). An empty prompt (or input) is allowed.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Iterator
from pathlib import Path

import numpy as np

from lmjax.data.corpus_files import BadRecords, json_problem
from lmjax.data.prepare_docs import eot_id
from lmjax.errors import FileFormatError, LMJaxError

ROLES = ("system", "user", "assistant", "tool")


@dataclasses.dataclass(frozen=True)
class Encoded:
    """One record's `ids [L]` and `mask [L]` (1: predicted), and where it came from."""

    ids: np.ndarray
    mask: np.ndarray
    where: str


def end_of_text(tok, eot: str) -> int | None:
    """The id ending a completion: `eot` "auto" is a Hugging Face tokenizer's eos_token when it
    has one (what generation stops on), else `prepare_docs.eot_id`'s rule (`<|endoftext|>`,
    none for byte/char); any other value is `prepare_docs.eot_id`'s (a special token, "none")."""
    eos = getattr(tok, "eos_token", None)
    if eot == "auto" and eos is not None:
        return tok.token_id(eos)
    return eot_id(tok, eot)


def read_records(path: Path, bad: BadRecords) -> Iterator[tuple[dict, str]]:
    """`(record, "FILE:LINE")` of every well-formed line (blank lines skipped)."""
    with open(path, "rb") as handle:
        for number, line in enumerate(handle, 1):
            if not line.strip():
                continue
            where = f"{path}:{number}"
            reason, record = _parse(line)
            if reason is None:
                reason = schema_error(record)
            if reason is not None:
                bad(where, reason)
                continue
            yield record, where


def _parse(line: bytes) -> tuple[str | None, object]:
    try:
        return None, json.loads(line.decode("utf-8"))
    except UnicodeDecodeError as err:
        return f"not UTF-8 (byte {err.start} of the line)", None
    except json.JSONDecodeError as err:
        return json_problem(err), None


def schema_error(record) -> str | None:
    """Why `record` is neither SFT schema (None: it is one)."""
    if not isinstance(record, dict):
        return f"a JSON {type(record).__name__}, not an object"
    keys = set(record)
    if keys == {"prompt", "completion"}:
        return _prompt_error(record)
    if keys == {"messages"}:
        return _messages_error(record["messages"])
    if keys in ({"instruction", "output"}, {"instruction", "input", "output"}):
        return _alpaca_error(record)
    return (
        f"fields {sorted(keys)}: expected exactly {{prompt, completion}} (two strings), "
        "{messages} (a list of {role, content}) or {instruction, input, output} (Alpaca; "
        "input optional)"
    )


def _alpaca_error(record: dict) -> str | None:
    for key in ("instruction", "input", "output"):
        if not isinstance(record.get(key, ""), str):
            return f"field {key!r} is {type(record[key]).__name__}, not a string"
    for key in ("instruction", "output"):
        if not record[key]:
            return f"field {key!r} is an empty string"
    return None


def alpaca_messages(record: dict) -> list[dict]:
    """An Alpaca record as a conversation: user = instruction (+ "\n\n" + input when
    non-empty), assistant = output."""
    extra = record.get("input", "")
    user = record["instruction"] + (f"\n\n{extra}" if extra else "")
    return [{"role": "user", "content": user}, {"role": "assistant", "content": record["output"]}]


def _prompt_error(record: dict) -> str | None:
    for key in ("prompt", "completion"):
        if not isinstance(record[key], str):
            return f"field {key!r} is {type(record[key]).__name__}, not a string"
    return None if record["completion"] else "field 'completion' is an empty string"


def _messages_error(messages) -> str | None:
    if not isinstance(messages, list) or not messages:
        return "'messages' is not a non-empty list"
    for k, message in enumerate(messages):
        if not isinstance(message, dict) or not {"role", "content"} <= set(message):
            return f"messages[{k}] is not an object with 'role' and 'content'"
        role, content = message["role"], message["content"]
        if role not in ROLES:
            return f"messages[{k}] has an unknown role {role!r} (expected one of {ROLES})"
        if not isinstance(content, str):
            return f"messages[{k}].content is {type(content).__name__}, not a string"
    if not any(m["role"] == "assistant" for m in messages):
        return "no assistant message (nothing to learn)"
    return None


def encode_record(tok, record: dict, eot: int | None) -> tuple[list[int], list[int]]:
    """`(ids, mask)` of a well-formed record (see the module docstring)."""
    if "messages" in record:
        return tok.render_with_mask(record["messages"])
    if "instruction" in record:
        user, assistant = alpaca_messages(record)
        if getattr(tok, "chat_template", None) is not None:
            return tok.render_with_mask([user, assistant])
        record = {"prompt": user["content"] + "\n\n", "completion": assistant["content"]}
    prompt = _encode(tok, record["prompt"], True) if record["prompt"] else []
    completion = _encode(tok, record["completion"], False) + ([] if eot is None else [eot])
    return prompt + completion, [0] * len(prompt) + [1] * len(completion)


def _encode(tok, text: str, special: bool) -> list[int]:
    """HF tokenizers take `add_special_tokens` (the prompt's BOS, none mid-sequence)."""
    if getattr(tok, "kind", None) == "hf":
        return tok.encode(text, add_special_tokens=special)
    return tok.encode(text)


def check_chat_tokenizer(tok, where: str) -> None:
    """A messages record needs a tokenizer with a chat template: one error line otherwise."""
    if getattr(tok, "chat_template", None) is None:
        raise FileFormatError.describe(
            f"record {where}",
            f"a messages record, but the base's {tok.kind} tokenizer has no chat template",
            "a base whose tokenizer_config.json has a chat_template (a Hugging Face chat "
            "model imported with lmjax import-hf)",
            "use {prompt, completion} records, or fine-tune a chat model's base",
        )


def encoded_records(path: Path, tok, eot: int | None, bad: BadRecords):
    """Each well-formed record of `path` encoded (`Encoded`), in order, or None for one the
    tokenizer or template refuses (reported to `bad`, naming FILE:LINE). Runs after a scan that
    reported the malformed ones to `bad` (they are passed over silently here), so the items line
    up with the scan's count."""
    for record, where in read_records(path, BadRecords(skip=True)):
        try:
            ids, mask = encode_record(tok, record, eot)
        except LMJaxError as err:
            bad(where, f"refused by the tokenizer ({err})")
            yield None
            continue
        yield Encoded(np.asarray(ids, np.int64), np.asarray(mask, np.uint8), where)


__all__ = [
    "ROLES",
    "Encoded",
    "alpaca_messages",
    "check_chat_tokenizer",
    "encode_record",
    "encoded_records",
    "end_of_text",
    "read_records",
    "schema_error",
]
