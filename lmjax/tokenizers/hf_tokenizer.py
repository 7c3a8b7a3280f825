"""A Hugging Face `tokenizer.json` (byte-level BPE) as an lmjax tokenizer (docs/interop.md).

Encoding and decoding run in the `tokenizers` library, the format's own (Rust) implementation:

    tokenizer.json --hf_json.parse: checked, one error line naming what lmjax refuses-->
    --tokenizers.Tokenizer.from_str--> encode(text, add_special_tokens) / decode(ids)

so `encode(text)` is `tokenizers.Tokenizer.from_file(path).encode(text).ids` by construction
(with `add_special_tokens=True` the post-processor's ids, e.g. Llama 3's `<|begin_of_text|>`, as
the library's default), and `decode` is its `decode` (special tokens kept unless skipped).
lmjax adds the checks the library leaves out: a str without lone surrogates, and ids in range
and defined. `encode_parts` pairs each id with the number of bytes it stands for (HF's ByteLevel
decoder table, `hf_json`), which the chat template's assistant mask needs.

On disk the tokenizer is HF's own files: `save(dir)` writes the `tokenizer.json` it was read
from and its `tokenizer_config.json` (chat template, bos/eos), so `transformers` loads the
directory and `lmjax.tokenizers.load(dir)` recognises it (a tokenizer.json with a 'model' and
no lmjax 'kind').
"""

from __future__ import annotations

import json
import os
import unicodedata
from pathlib import Path

import tokenizers as hf_tokenizers

from lmjax.errors import TokenError
from lmjax.files import atomic_write_text
from lmjax.tokenizers import chat
from lmjax.tokenizers._base import check_ids, check_text, writing
from lmjax.tokenizers.bpe_scheme import special_regex
from lmjax.tokenizers.chat import config_template
from lmjax.tokenizers.hf_json import AddedToken, HFSpec, bad, parse, read_json

TOKENIZER_FILE, CONFIG_FILE, TEMPLATE_FILE = (
    "tokenizer.json",
    "tokenizer_config.json",
    "chat_template.jinja",
)


def _splitter(tokens: list[AddedToken]):
    """A function text -> [(ordinary text, AddedToken | None), ...] covering the text in order
    (`normalize` needs it: NFC applies outside the added tokens matched in the raw text)."""
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


_MAX_ID = 2**31 - 1


def _engine(data: dict, where: Path) -> hf_tokenizers.Tokenizer:
    """The `tokenizers` library's tokenizer for the (already checked) JSON object `data`."""
    try:
        return hf_tokenizers.Tokenizer.from_str(json.dumps(data))
    except Exception as err:  # the binding raises a bare Exception for a file it cannot build
        reason = " ".join(str(err).split()) or type(err).__name__
        expected = f"a tokenizer.json the tokenizers library {hf_tokenizers.__version__} reads"
        fix = "repair the file: tokenizers.Tokenizer.from_file (and transformers) must load it"
        raise bad(str(where), reason, expected, fix) from None


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
        top = max(self.spec.token_bytes)
        if top > _MAX_ID:  # lmjax's ids are int32 (and a huge id made decode's set of holes huge)
            expected = f"token ids <= {_MAX_ID} (int32, as lmjax's token arrays)"
            raise bad(f"{where}: largest token id", top, expected, "fix the tokenizer.json")
        self._engine = _engine(data, where)
        spec = self.spec
        self.special_tokens = {t.content: t.id for t in spec.added if t.special}
        self._specials = chat.special_tokens(self._config, where.parent / CONFIG_FILE)
        self.bos_token = self._specials.get("bos_token")
        self.eos_token = self._specials.get("eos_token")
        self.chat_template = (
            template if template is not None else config_template(self._config, where)
        )
        self._raw_split = _splitter([t for t in spec.added if not t.normalized])
        self._vocab_size = 1 + top
        # are there ids below vocab_size that neither the vocab nor added_tokens define (rare)?
        # decode refuses them, where the library would drop them silently
        self._holes = len(spec.token_bytes) < self._vocab_size

    @property
    def vocab_size(self) -> int:
        """One more than the largest id (of the model's vocab and the added tokens)."""
        return self._vocab_size

    # ---- encode ---------------------------------------------------------------------------

    def encode(self, text: str, *, add_special_tokens: bool = True) -> list[int]:
        """Token ids of `text`; `add_special_tokens` adds the post-processor's ids (e.g. Llama 3's
        `<|begin_of_text|>`), as `tokenizers.Tokenizer.encode` does by default."""
        check_text(text)
        return self._engine.encode(text, add_special_tokens=add_special_tokens).ids

    def specials_around(self) -> tuple[list[int], list[int]]:
        """The post-processor's ids before and after any text (`encode(t)` is `before +
        encode(t, add_special_tokens=False) + after`): what a text encoded in pieces gets once,
        not once a piece."""
        inner = self._engine.encode("a", add_special_tokens=False).ids
        whole = self._engine.encode("a").ids
        start = next(i for i in range(len(whole)) if whole[i : i + len(inner)] == inner)
        return whole[:start], whole[start + len(inner) :]

    def encode_parts(self, text: str) -> list[tuple[int, int]]:
        """`(id, byte length)` per token of `text` (no post-processor): the lengths add up to the
        UTF-8 length of the normalized text, so they give each token's byte offsets."""
        table = self.spec.token_bytes
        return [(i, len(table[i])) for i in self.encode(text, add_special_tokens=False)]

    def normalize(self, text: str) -> str:
        """`text` as the BPE model sees it: NFC outside non-normalized added tokens, if asked."""
        if not self.spec.nfc:
            return text
        return "".join(
            unicodedata.normalize("NFC", raw) + (t.content if t else "")
            for raw, t in self._raw_split(text)
        )

    # ---- decode ---------------------------------------------------------------------------

    def decode(self, ids, *, skip_special_tokens: bool = False) -> str:
        """Text of `ids` (invalid UTF-8 -> U+FFFD, as HF); special tokens kept unless skipped."""
        ids = check_ids(ids, self.vocab_size)
        gaps = [i for i in ids if i not in self.spec.token_bytes] if self._holes else []
        if gaps:
            raise TokenError.describe(
                "token id", gaps[0], "an id this tokenizer.json defines", "decode ids from encode()"
            )
        return self._engine.decode(ids, skip_special_tokens=skip_special_tokens)

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
        return dict(self._specials)

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
