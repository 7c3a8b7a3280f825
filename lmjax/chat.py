"""Chatting with a run: its chat template, its end-of-turn ids, a conversation kept across turns.

    conversation = Conversation(tokenizer, system="Be brief.")
    prompt = conversation.prompt_ids("Hello")     # the template's rendering + assistant header
    reply = <ids decoded from prompt until one of stop_ids(...) or a length>
    conversation.add_reply(tokenizer.decode(reply_without_the_stop_id, skip_special_tokens=True))

The prompt of every turn is the whole conversation rendered again by the template with
`add_generation_prompt=True`, so its ids are what transformers' `apply_chat_template` gives for
the same messages (the template decides how earlier turns look, e.g. a reasoning model's may
drop them). The stop ids are the model's end-of-sequence ids as Hugging Face records them:

    generation_config.json  eos_token_id: an int or a list of ints (Llama 3 lists end-of-turn
                            <|eot_id|> beside <|end_of_text|>)
    tokenizer_config.json   eos_token: a token string (ChatML's <|im_end|>), its id

`lmjax import-hf` keeps generation_config.json in RUN/tokenizer/ beside the tokenizer's files;
a fine-tuned run finds it through its base (`finetune.yaml`'s base_path).
"""

from __future__ import annotations

import json
from pathlib import Path

from lmjax.checks import is_int
from lmjax.errors import FileFormatError
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
        ids.append(tokenizer.token_id(eos))
    return [i for i in dict.fromkeys(ids) if i < vocab_size]


def run_stop_ids(run) -> list[int]:
    """`stop_ids` of a loaded run (`lmjax.train.load_run`): its generation config (or its
    base's) and its tokenizer's eos_token, below the ids its model emits (`vocab_ids`)."""
    where = generation_config_dir(run.directory)
    config = read_generation_config(where) if where is not None else {}
    return stop_ids(run.tokenizer, config, run.model.vocab_ids)


class Conversation:
    """The messages of a chat so far, rendered by `tokenizer`'s chat template (an `HFTokenizer`
    or any tokenizer with `apply_chat_template` and `chat_template`)."""

    def __init__(self, tokenizer, system: str | None = None):
        if getattr(tokenizer, "chat_template", None) is None:
            kind = getattr(tokenizer, "kind", type(tokenizer).__name__)
            raise FileFormatError.describe(
                "run tokenizer",
                f"{kind} tokenizer without a chat template",
                "a Hugging Face tokenizer whose tokenizer_config.json has a chat_template",
                "chat with a run imported (lmjax import-hf) from a chat model, or use "
                "lmjax generate for plain text",
            )
        self.tokenizer = tokenizer
        self.messages: list[dict] = []
        if system is not None:
            self.messages.append({"role": "system", "content": system})

    def prompt_ids(self, user: str) -> list[int]:
        """Add the user's turn; the ids of the conversation with the assistant's header after."""
        self.messages.append({"role": "user", "content": user})
        return self.tokenizer.apply_chat_template(self.messages, add_generation_prompt=True)

    def add_reply(self, text: str) -> None:
        """Add the assistant's turn (its text, without the end-of-turn token)."""
        self.messages.append({"role": "assistant", "content": text})


__all__ = [
    "GENERATION_CONFIG",
    "Conversation",
    "eos_ids",
    "generation_config_dir",
    "read_generation_config",
    "run_stop_ids",
    "stop_ids",
]
