"""A run's tokenizer as the harness sees it: text to ids the way `HFLM` makes them, the
end-of-text and prefix ids, decoding without special tokens, chat templates (`model`'s
docstring has the rules)."""

from __future__ import annotations

import dataclasses

from lmjax import chat
from lmjax.errors import FileFormatError, TokenError
from lmjax.tokenizers import BPETokenizer, HFTokenizer
from lmjax.tokenizers.bpe_scheme import ENDOFTEXT
from lmjax.tokenizers.chat import render

# Appended to an open last message before rendering, and cut there after (`_render_open`); its
# trailing space tells whether the template kept the content's trailing whitespace.
OPEN_END = "<|lmjax-open-end|> "


@dataclasses.dataclass(frozen=True)
class RunText:
    tokenizer: object
    eot_id: int
    prefix_id: int

    @classmethod
    def of(cls, run, prefix_token_id: int | None = None) -> RunText:
        """The text side of a loaded run (`lmjax.train.load_run`); one error line for a run
        without a tokenizer, or whose tokenizer has no end-of-text token to stand for an
        empty context."""
        tok = run.tokenizer
        if tok is None:
            raise FileFormatError.describe(
                "run", str(run.directory), "a tokenizer/ directory (saved by train or import-hf)",
                "copy the data's tokenizer/ into the run",
            )  # fmt: skip
        eot = _eot_id(tok, run)
        bos = tok.token_id(tok.bos_token) if isinstance(tok, HFTokenizer) else None
        prefix = prefix_token_id if prefix_token_id is not None else bos if bos is not None else eot
        if prefix is None:
            raise TokenError.describe(
                f"{run.directory} tokenizer ({tok.kind})", "no end-of-text or bos token",
                "a token an empty context can stand for",
                "pass prefix_token_id=N (e.g. the id of a newline)",
            )  # fmt: skip
        return cls(tok, prefix if eot is None else eot, prefix)

    def encode(self, text: str, add_special_tokens: bool | None = None) -> list[int]:
        """Ids of `text`: a Hugging Face tokenizer adds its post-processor's ids unless told
        not to or the text starts with the prefix token's text (as HFLM); special tokens'
        texts are encoded as those tokens."""
        tok = self.tokenizer
        if isinstance(tok, HFTokenizer):
            if add_special_tokens is None:
                add_special_tokens = not text.startswith(self.decode([self.prefix_id], False))
            return tok.encode(text, add_special_tokens=add_special_tokens)
        if isinstance(tok, BPETokenizer):
            return tok.encode(text, allowed_special="all")
        return tok.encode(text)

    def decode(self, ids, skip_special_tokens: bool = True) -> str:
        tok = self.tokenizer
        if isinstance(tok, HFTokenizer):
            return tok.decode(list(ids), skip_special_tokens=skip_special_tokens)
        specials = set(getattr(tok, "special_tokens", {}).values()) if skip_special_tokens else ()
        return tok.decode([i for i in ids if i not in specials])

    def generation_prompt(self, context: str, room: int) -> list[int]:
        """A context's ids for generation: the last `room` of them (the prefix token for an
        empty one). Whether post-processor ids are added follows the tokenizer's bos_token
        text, as HFLM's batch encoding does."""
        bos = getattr(self.tokenizer, "bos_token", None)
        special = False if bos and context.startswith(bos) else None
        ids = self.encode(context, special) if context else []
        return ids[-room:] if ids else [self.prefix_id]

    def stop_ids(self, run_stops: list[int]) -> list[int]:
        """The ids a generation ends at: the run's (generation_config.json, eos_token) and the
        end-of-text id."""
        return list(dict.fromkeys([*run_stops, self.eot_id]))

    def render_chat(self, messages, add_generation_prompt: bool) -> str:
        """`messages` through the run's chat template, as text, as `HFLM.apply_chat_template`
        renders it: without a generation prompt the last message is left open (transformers'
        continue_final_message, `_render_open`); a template that refuses the messages (its
        raise_exception, say on a system role) is tried again without the system messages."""
        tok = self.tokenizer
        chat.require_template(tok)
        try:
            return _render_open(tok, messages, add_generation_prompt)
        except TokenError:
            rest = [m for m in messages if m.get("role") != "system"]
            if len(rest) == len(messages):
                raise
            return _render_open(tok, rest, add_generation_prompt)


def _render_open(tok, messages, add_generation_prompt: bool) -> str:
    """The rendered text; without a generation prompt, cut where the last message's content
    ends: a marker appended to it is rendered with it and the text cut at the marker. Where
    the template kept the marker's trailing space it kept the content's own trailing spaces,
    so they stay; where it stripped the content, the text before the marker is stripped too."""
    open_end = not add_generation_prompt and bool(messages)
    if open_end:
        last = dict(messages[-1], content=messages[-1]["content"] + OPEN_END)
        messages = [*messages[:-1], last]
    text = render(tok.chat_template, messages, add_generation_prompt, tok.template_variables())
    if not open_end:
        return text
    at = text.rfind(OPEN_END.strip())
    if at < 0:
        raise TokenError.describe(
            "chat template rendering", "the last message's content missing from the text",
            "a template that writes every message's content",
            "use add_generation_prompt, or a template that keeps the content",
        )  # fmt: skip
    return text[:at] if text.startswith(OPEN_END, at) else text[:at].rstrip()


def _eot_id(tok, run) -> int | None:
    """The end-of-text id: a Hugging Face tokenizer's eos_token, BPE's <|endoftext|>, else the
    first of generation_config.json's eos ids; None when there is none."""
    if isinstance(tok, HFTokenizer) and tok.eos_token is not None:
        return tok.token_id(tok.eos_token)
    if isinstance(tok, BPETokenizer) and ENDOFTEXT in tok.special_tokens:
        return tok.special_tokens[ENDOFTEXT]
    stops = chat.run_stop_ids(run)
    return stops[0] if stops else None
