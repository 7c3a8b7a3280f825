"""A Hugging Face `tokenizer.json` (byte-level BPE) as an lmjax tokenizer (SPEC section 8).

    text --added tokens split out (hf_json's order)--> segments and added-token ids
    segment --NFC if the file asks--> --each split pattern in turn (matches and gaps)--> pieces
    piece --UTF-8--> bpe_merge(pair_ranks=merges, whole=ignore_merges)      (lmjax's BPE loop)
    add_special_tokens=True: the post-processor's ids around the result   (HF's default too)

so `encode(text)` equals `tokenizers.Tokenizer.from_file(path).encode(text).ids` and
`encode(text, add_special_tokens=False)` equals it with `add_special_tokens=False`. `decode`
joins each token's bytes (HF's ByteLevel decoder) and keeps special tokens, so
`decode(encode(text, add_special_tokens=False)) == text` for NFC-stable text.

On disk the tokenizer is HF's own files: `save(dir)` writes the `tokenizer.json` it was read
from and its `tokenizer_config.json` (chat template, bos/eos), so `transformers` loads the
directory and `lmjax.tokenizers.load(dir)` recognises it (a tokenizer.json with a 'model' and
no lmjax 'kind').
"""

from __future__ import annotations

import json
import os
import unicodedata
from collections.abc import Iterator
from pathlib import Path

from lmjax.errors import TokenError
from lmjax.files import atomic_write_text
from lmjax.tokenizers import chat
from lmjax.tokenizers._base import check_ids, check_text, writing
from lmjax.tokenizers.bpe import bpe_merge
from lmjax.tokenizers.bpe_scheme import special_regex
from lmjax.tokenizers.chat import config_template
from lmjax.tokenizers.hf_json import AddedToken, HFSpec, parse, read_json

_CACHE_PIECES = 200_000  # pieces -> ids kept between encode calls (~50 MB at most)
TOKENIZER_FILE, CONFIG_FILE, TEMPLATE_FILE = (
    "tokenizer.json",
    "tokenizer_config.json",
    "chat_template.jinja",
)


def _splitter(tokens: list[AddedToken]):
    """A function text -> [(ordinary text, AddedToken | None), ...] covering the text in order."""
    if not tokens:
        return lambda text: [(text, None)]
    by_content = {t.content: t for t in tokens}
    pattern = special_regex(by_content)  # leftmost match, the longest one there

    def split(text: str):
        out, start = [], 0
        for found in pattern.finditer(text):
            out.append((text[start : found.start()], by_content[found.group()]))
            start = found.end()
        out.append((text[start:], None))
        return out

    return split


def _pieces(text: str, splits) -> list[str]:
    """`text` cut by each pattern in turn; a split keeps its matches and the gaps between them
    (HF's `Isolated` behaviour); empty pieces are dropped."""
    pieces = [text] if text else []
    for pattern in splits:
        cut = []
        for piece in pieces:
            if not pattern.groups:  # findall gives whole matches: the fast path when no gaps
                found = pattern.findall(piece)
                if sum(map(len, found)) == len(piece):
                    cut += [p for p in found if p] if "" in found else found
                    continue
            start = 0
            for found in pattern.finditer(piece):
                cut += [p for p in (piece[start : found.start()], found.group()) if p]
                start = found.end()
            if start < len(piece):
                cut.append(piece[start:])
        pieces = cut
    return pieces


class HFTokenizer:
    """Byte-level BPE read from a Hugging Face tokenizer.json (see the module docstring).

    `special_tokens` are the added tokens marked special (content -> id); `bos_token` /
    `eos_token` (strings or None) come from tokenizer_config.json; `chat_template` is its Jinja
    template (or None).
    """

    kind = "hf"

    def __init__(
        self,
        data: dict,
        config: dict | None = None,
        *,
        template: str | None = None,
        where: Path | None = None,
    ):
        where = where or Path(TOKENIZER_FILE)
        self._data, self._config = data, dict(config or {})
        self.spec: HFSpec = parse(data, where)
        spec = self.spec
        self.special_tokens = {t.content: t.id for t in spec.added if t.special}
        self.bos_token = chat.token_text(self._config.get("bos_token"))
        self.eos_token = chat.token_text(self._config.get("eos_token"))
        self.chat_template = (
            template if template is not None else config_template(self._config, where)
        )
        self._raw_split = _splitter([t for t in spec.added if not t.normalized])
        self._normalized_split = _splitter([t for t in spec.added if t.normalized])
        self._max_token_bytes = max(map(len, spec.vocab))
        self._vocab_size = 1 + max(spec.token_bytes)
        self._cache: dict[str, tuple[tuple[int, int], ...]] = {}

    @property
    def vocab_size(self) -> int:
        """One more than the largest id (of the model's vocab and the added tokens)."""
        return self._vocab_size

    # ---- encode ---------------------------------------------------------------------------

    def _segments(self, text: str) -> Iterator[tuple[str, AddedToken | None]]:
        for raw, token in self._raw_split(text):
            if self.spec.nfc:
                raw = unicodedata.normalize("NFC", raw)
            yield from self._normalized_split(raw)
            if token is not None:
                yield "", token

    def _piece_parts(self, piece: str) -> tuple[tuple[int, int], ...]:
        got = self._cache.get(piece)
        if got is None:
            data = piece.encode("utf-8")
            ids = bpe_merge(
                data,
                self.spec.vocab,
                self._max_token_bytes,
                pair_ranks=self.spec.pair_ranks,
                whole=self.spec.ignore_merges,
            )
            got = tuple((i, len(self.spec.token_bytes[i])) for i in ids)
            if len(self._cache) > _CACHE_PIECES:  # bounded memory over a streamed corpus
                self._cache.clear()
            if len(piece) < 64:
                self._cache[piece] = got
        return got

    def encode_parts(self, text: str) -> list[tuple[int, int]]:
        """`(id, byte length)` per token of `text` (no post-processor): the lengths add up to the
        UTF-8 length of the normalized text, so they give each token's byte offsets."""
        check_text(text)
        parts: list[tuple[int, int]] = []
        for segment, token in self._segments(text):
            for piece in _pieces(segment, self.spec.splits):
                parts.extend(self._piece_parts(piece))
            if token is not None:
                parts.append((token.id, len(token.content.encode("utf-8"))))
        return parts

    def encode(self, text: str, *, add_special_tokens: bool = True) -> list[int]:
        """Token ids of `text`; `add_special_tokens` adds the post-processor's ids (e.g. Llama 3's
        `<|begin_of_text|>`), as `tokenizers.Tokenizer.encode` does by default."""
        ids = [i for i, _ in self.encode_parts(text)]
        if add_special_tokens:
            return [*self.spec.prefix_ids, *ids, *self.spec.suffix_ids]
        return ids

    def normalize(self, text: str) -> str:
        """`text` as the BPE model sees it: NFC outside non-normalized added tokens, if asked."""
        if not self.spec.nfc:
            return text
        return "".join(
            unicodedata.normalize("NFC", raw) + (t.content if t else "")
            for raw, t in self._raw_split(text)
        )

    # ---- decode ---------------------------------------------------------------------------

    def decode_bytes(self, ids) -> bytes:
        table = self.spec.token_bytes
        ids = check_ids(ids, self.vocab_size)
        gaps = [i for i in ids if i not in table]
        if gaps:
            raise TokenError.describe(
                "token id", gaps[0], "an id this tokenizer.json defines", "decode ids from encode()"
            )
        return b"".join(table[i] for i in ids)

    def decode(self, ids, *, skip_special_tokens: bool = False) -> str:
        """Text of `ids` (invalid UTF-8 -> U+FFFD, as HF); special tokens kept unless skipped."""
        if skip_special_tokens:
            special = set(self.special_tokens.values())
            ids = [i for i in check_ids(ids, self.vocab_size) if i not in special]
        return self.decode_bytes(ids).decode("utf-8", errors="replace")

    def token_id(self, text: str | None) -> int | None:
        """The id of the added token (or single vocab token) `text`, None for None."""
        if text is None:
            return None
        ids = self.encode(text, add_special_tokens=False)
        if len(ids) != 1:
            raise TokenError.describe(
                "token", text, "a single token of this vocabulary", "check tokenizer_config.json"
            )
        return ids[0]

    # ---- chat templates -------------------------------------------------------------------

    def template_variables(self) -> dict:
        """The special-token strings a chat template sees (bos_token, eos_token, ...)."""
        names = (
            "bos_token",
            "eos_token",
            "unk_token",
            "pad_token",
            "sep_token",
            "cls_token",
            "mask_token",
        )
        found = {n: chat.token_text(self._config.get(n)) for n in names}
        return {n: v for n, v in found.items() if v is not None}

    def apply_chat_template(
        self, messages, *, add_generation_prompt: bool = False, **variables
    ) -> list[int]:
        """Ids of `messages` rendered by the chat template; equal to transformers'
        `apply_chat_template(messages, tokenize=True)` (rendered, then encoded without the
        post-processor's special tokens: the template writes them)."""
        text = chat.render(
            self.chat_template,
            messages,
            add_generation_prompt,
            self.template_variables() | variables,
        )
        return self.encode(text, add_special_tokens=False)

    def render_with_mask(self, messages, **variables) -> tuple[list[int], list[int]]:
        """`(ids, assistant_mask)`: the ids of `apply_chat_template(messages)` and 1 on each token
        that overlaps an assistant message's span (see `lmjax.tokenizers.chat.assistant_spans`)."""
        return chat.render_with_mask(self, messages, variables)

    # ---- files ----------------------------------------------------------------------------

    def save(self, directory: str | os.PathLike) -> None:
        """Write tokenizer.json and tokenizer_config.json (with the chat template), atomically."""
        directory = Path(directory)
        config = dict(self._config)
        if config_template(config, directory / CONFIG_FILE) != self.chat_template:
            config["chat_template"] = self.chat_template  # it came from chat_template.jinja
        with writing(directory):
            directory.mkdir(parents=True, exist_ok=True)
            atomic_write_text(
                directory / TOKENIZER_FILE, json.dumps(self._data, ensure_ascii=False)
            )
            atomic_write_text(
                directory / CONFIG_FILE, json.dumps(config, ensure_ascii=False, indent=1)
            )

    def __repr__(self) -> str:
        return (
            f"HFTokenizer(vocab_size={self.vocab_size}, special_tokens={len(self.special_tokens)})"
        )


def _beside(directory: Path) -> tuple[dict, str | None]:
    """(tokenizer_config.json, chat_template.jinja's text) in `directory`, when present."""
    config = read_json(directory / CONFIG_FILE) if (directory / CONFIG_FILE).is_file() else {}
    template = None
    if (directory / TEMPLATE_FILE).is_file():  # transformers 5 saves the template here
        template = (directory / TEMPLATE_FILE).read_text(encoding="utf-8")
    return config, template


def load_hf_tokenizer(path: str | os.PathLike) -> HFTokenizer:
    """The tokenizer of a Hugging Face directory (its tokenizer.json, with tokenizer_config.json
    and chat_template.jinja when present), or of a tokenizer.json file (and those beside it)."""
    path = Path(path)
    directory, file = (path, path / TOKENIZER_FILE) if path.is_dir() else (path.parent, path)
    config, template = _beside(directory)
    return HFTokenizer(read_json(file), config, template=template, where=file)


def load_directory(directory: Path, manifest: dict) -> HFTokenizer:
    """The `lmjax.tokenizers.load` loader for a Hugging Face tokenizer.json (`manifest` is it,
    already read)."""
    config, template = _beside(directory)
    return HFTokenizer(manifest, config, template=template, where=directory / TOKENIZER_FILE)
