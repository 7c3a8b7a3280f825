"""Chatting with a run: its chat template, its end-of-turn ids, a conversation kept across turns.

    conversation = Conversation(tokenizer, system="Be brief.")
    prompt, dropped = conversation.fit_turn("Hello", context_length, room=200)
    reply = <ids decoded from prompt until one of stop_ids(...) or a length>
    conversation.add_reply(tokenizer.decode(content, skip_special_tokens=True), content)

`content` is the reply without its stop id. The prompt of every turn is the whole conversation
rendered again by the template with `add_generation_prompt=True`, so its ids are what
transformers' `apply_chat_template` gives for the same messages (the template decides how
earlier turns look, e.g. a reasoning model's may drop them), except that each earlier reply is
the ids the model generated, not its decoded text encoded again: a reply that stopped inside a
multi-byte character, or any ids that do not survive decode and encode, stay what the model
said. When the context is full, `fit_turn` forgets the oldest exchanges (never the system
message), and refuses only a turn that does not fit by itself. The stop ids are the model's
end-of-sequence ids as Hugging Face records them:

    generation_config.json  eos_token_id: an int or a list of ints (Llama 3 lists end-of-turn
                            <|eot_id|> beside <|end_of_text|>)
    tokenizer_config.json   eos_token: a token string (ChatML's <|im_end|>), its id

`lmjax import-hf` keeps generation_config.json in RUN/tokenizer/ beside the tokenizer's files;
a fine-tuned run finds it through its base (`finetune.yaml`'s base_path).
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path

from lmjax.checks import is_int
from lmjax.errors import FileFormatError, TokenError
from lmjax.tokenizers.chat import render
from lmjax.train.finetuned import read_spec
from lmjax.train.rundir import MERGED_DIR, RunDir

GENERATION_CONFIG = "generation_config.json"
_MAX_BASES = 8  # fine-tunes of fine-tunes followed before giving up (a cycle cannot loop)


def read_generation_config(directory: Path) -> dict:
    """`directory/generation_config.json` as a dict ({} when absent); one error line when it is
    not a JSON object."""
    path = Path(directory) / GENERATION_CONFIG
    if not path.is_file():
        return {}
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (ValueError, OSError) as err:
        data = err
    if not isinstance(data, dict):
        raise FileFormatError.describe(
            str(path), str(data)[:80], "a JSON object", "restore the model's generation_config.json"
        )
    return data


def generation_config_dir(run_dir: Path) -> Path | None:
    """The directory holding the generation_config.json of a run: its tokenizer/, or for a
    fine-tuned run without one, its base's (followed through finetune.yaml; a fine-tune's
    merged/ run follows the fine-tune); None if none."""
    run = RunDir(Path(run_dir))
    for _ in range(_MAX_BASES):
        if (run.tokenizer_dir / GENERATION_CONFIG).is_file():
            return run.tokenizer_dir
        parent = RunDir(run.path.parent)
        if run.path.name == MERGED_DIR and parent.is_finetune():
            run = parent
        elif run.is_finetune():
            run = RunDir(Path(read_spec(run).base_path))
        else:
            return None
    return None


def eos_ids(generation_config: dict, where: str = GENERATION_CONFIG) -> list[int]:
    """The `eos_token_id` of a generation config as a list (an int, a list of ints, or absent)."""
    value = generation_config.get("eos_token_id")
    values = [] if value is None else value if isinstance(value, list) else [value]
    if not all(is_int(v) and v >= 0 for v in values):
        raise FileFormatError.describe(
            f"{where}: eos_token_id",
            value,
            "an int >= 0 or a list of them",
            "fix the model's generation_config.json",
        )
    return values


def stop_ids(tokenizer, generation_config: dict, vocab_size: int) -> list[int]:
    """End-of-sequence ids a reply stops at: generation_config's `eos_token_id` and the
    tokenizer's `eos_token`, in that order, without repeats. Ids past the model's `vocab_size`
    are dropped: the model can never emit them."""
    ids = eos_ids(generation_config)
    eos = getattr(tokenizer, "eos_token", None)
    if eos is not None:
        try:
            ids.append(tokenizer.token_id(eos))
        except TokenError:
            raise FileFormatError.describe(
                "tokenizer_config.json: eos_token",
                eos,
                "one token of the tokenizer's vocabulary",
                "fix the model's tokenizer_config.json",
            ) from None
    return [i for i in dict.fromkeys(ids) if i < vocab_size]


def run_stop_ids(run) -> list[int]:
    """`stop_ids` of a loaded run (`lmjax.train.load_run`): its generation config (or its
    base's) and its tokenizer's eos_token, below the ids its model emits (`vocab_ids`)."""
    where = generation_config_dir(run.directory)
    config = read_generation_config(where) if where is not None else {}
    return stop_ids(run.tokenizer, config, run.model.vocab_ids)


class Conversation:
    """The messages of a chat so far, rendered by `tokenizer`'s chat template (an `HFTokenizer`
    or any tokenizer with `apply_chat_template` and `chat_template`), with the ids of each reply
    as the model generated them (`add_reply(text, ids)`).

    `where` (a directory) names where the template goes in the error for a tokenizer without
    one. Messages are plain `{"role", "content"}` dicts; the system message, if any, is first.
    """

    def __init__(self, tokenizer, system: str | None = None, where: Path | None = None):
        require_template(tokenizer, where)
        self.tokenizer = tokenizer
        self.messages: list[dict] = []
        self._reply_ids: list[list[int] | None] = []  # beside messages: a reply's kept ids
        self.system = system

    @property
    def system(self) -> str | None:
        """The system message (None: none; the template may add its own default)."""
        has = self.messages and self.messages[0]["role"] == "system"
        return self.messages[0]["content"] if has else None

    @system.setter
    def system(self, text: str | None) -> None:
        if self.system is not None:
            del self.messages[0], self._reply_ids[0]
        if text is not None:
            self.messages.insert(0, {"role": "system", "content": text})
            self._reply_ids.insert(0, None)

    def add_user(self, text: str) -> None:
        """Add a user turn."""
        self._add("user", text, None)

    def prompt_ids(self, user: str) -> list[int]:
        """Add the user's turn; the ids of the conversation with the assistant's header after."""
        self.add_user(user)
        return self.ids()

    def add_reply(self, text: str, ids: Sequence[int] | None = None) -> None:
        """Add the assistant's turn: its text without the end-of-turn token and, when given, the
        ids it was generated as (also without it), which later prompts then carry unchanged."""
        self._add("assistant", text, None if ids is None else [int(i) for i in ids])

    def reset(self) -> None:
        """Forget every turn; the system message stays."""
        system = self.system
        self.messages, self._reply_ids = [], []
        self.system = system

    def drop_oldest(self) -> int:
        """Forget the oldest exchange (a user turn and the replies up to the next user turn),
        never the last user turn nor the system message; the number of messages dropped."""
        first = 1 if self.system is not None else 0
        users = [i for i, m in enumerate(self.messages) if m["role"] == "user" and i > first]
        if not users:
            return 0
        del self.messages[first : users[0]], self._reply_ids[first : users[0]]
        return users[0] - first

    def ids(self) -> list[int]:
        """The conversation's ids with the assistant's header after (`add_generation_prompt`).

        The template renders the whole conversation again, as transformers' apply_chat_template;
        each kept reply's ids then stand where its text is rendered, verbatim, right after the
        rendering of the messages before it with the assistant header. A reply the template
        renders otherwise (e.g. a reasoning model dropping earlier thinking) is its text
        re-encoded, as transformers would have it. The text between replies is encoded in
        pieces; a piece starts after a reply's content, where the template's end of turn starts
        (a special token in the templates seen), so the pieces are what the whole would be."""
        text_of = self._renderer()
        if text_of is None:  # a tokenizer that renders no text: the template's ids as they are
            return list(
                self.tokenizer.apply_chat_template(self.messages, add_generation_prompt=True)
            )
        whole, ids, done = text_of(self.messages), [], 0
        for k, reply in enumerate(self._reply_ids):
            if reply is None:
                continue
            before, content = text_of(self.messages[:k]), self.messages[k]["content"]
            start = len(before)
            if start < done or not whole.startswith(before + content):
                continue
            ids += self._encode(whole[done:start]) + reply
            done = start + len(content)
        return ids + self._encode(whole[done:])

    def fit_turn(self, user: str, context_length: int, room: int) -> tuple[list[int], int]:
        """Add the user's turn, forgetting the oldest exchanges (the system message stays) until
        its prompt leaves `room` of `context_length` positions for the reply, or until it is the
        only turn; `(prompt ids, messages dropped)`. A turn whose prompt alone (with the system
        message) fills the context is refused (`TokenError`), the conversation left as it was."""
        self.add_user(user)
        ids, dropped = self.ids(), 0
        if len(ids) + room <= context_length:
            return ids, 0
        alone = Conversation(self.tokenizer, self.system).prompt_ids(user)
        if len(alone) >= context_length:
            del self.messages[-1], self._reply_ids[-1]
            raise TokenError.describe(
                "turn",
                f"{len(alone)} tokens" + (" with the system message" if self.system else ""),
                f"fewer than context_length = {context_length}",
                "shorten it, or send it in parts",
            )
        while len(ids) + room > context_length and (n := self.drop_oldest()):
            dropped += n
            ids = self.ids()
        return ids, dropped

    def _add(self, role: str, text: str, ids: list[int] | None) -> None:
        self.messages.append({"role": role, "content": text})
        self._reply_ids.append(ids)

    def _renderer(self):
        """messages -> their text with the assistant header, or None for a tokenizer that has
        no text rendering of its template (then replies are re-encoded)."""
        variables = getattr(self.tokenizer, "template_variables", None)
        if variables is None:
            return None
        template, values = self.tokenizer.chat_template, variables()
        return lambda messages: render(template, messages, True, values)

    def _encode(self, text: str) -> list[int]:
        return self.tokenizer.encode(text, add_special_tokens=False) if text else []


def require_template(tokenizer, where: Path | None = None) -> None:
    """One error line for a tokenizer without a chat template, saying where one goes: a
    Hugging Face tokenizer reads `chat_template.jinja` or tokenizer_config.json's
    `chat_template` in its directory (`where`, e.g. RUN/tokenizer/)."""
    if getattr(tokenizer, "chat_template", None) is not None:
        return
    kind = getattr(tokenizer, "kind", type(tokenizer).__name__)
    if kind != "hf":  # only a tokenizer.json tokenizer reads a template
        fix = "chat with a run imported (lmjax import-hf) from a chat model, or use lmjax generate"
    else:
        folder = "the tokenizer's directory" if where is None else str(where)
        fix = (
            f"copy the chat model's chat_template.jinja into {folder} (or set "
            f'"chat_template" in its tokenizer_config.json), or use lmjax generate for plain text'
        )
    raise FileFormatError.describe(
        "run tokenizer", f"{kind} tokenizer without a chat template", "a chat template", fix
    )


__all__ = [
    "GENERATION_CONFIG",
    "Conversation",
    "eos_ids",
    "generation_config_dir",
    "read_generation_config",
    "require_template",
    "run_stop_ids",
    "stop_ids",
]
