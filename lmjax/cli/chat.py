"""`lmjax chat`: a conversation with an imported (or fine-tuned) chat model, turn by turn.

Each turn renders the whole conversation with the run's chat template (`lmjax.chat`), decodes
until one of the model's end-of-sequence ids (or --max-new-tokens), prints the reply as it is
generated and keeps it for the next turn. User turns come from --message flags, else from
stdin, one per line until EOF.
"""

from __future__ import annotations

import argparse
import sys

from lmjax.cli.args import add_quantize, add_run, add_sampling, add_step
from lmjax.cli.common import load_run
from lmjax.errors import FileFormatError


def add_chat(sub) -> None:
    parser = sub.add_parser(
        "chat",
        help="chat with a run through its chat template, stopping at its end-of-turn ids",
        description="Talk to RUN (an import-hf of a chat model, or a fine-tune of one): each "
        "user turn (--message, repeatable, else one per line of stdin until EOF) is added to "
        "the conversation, rendered with the model's chat template (tokenizer_config.json) "
        "and answered until an end-of-sequence id of generation_config.json / "
        "tokenizer_config.json or --max-new-tokens; the reply is kept for the next turn.",
    )
    add_run(parser, "a run directory with a chat tokenizer")
    add_step(parser)
    parser.add_argument("--system", default=None, help="a system message opening the chat")
    parser.add_argument(
        "--message", action="append", default=[], help="a user turn (repeatable; default: stdin)"
    )
    add_sampling(
        parser,
        length="tokens per reply at most (default: 200, or what is left of the context)",
        seed="the seed of every turn's sampling",
        stop="another id ending a reply",
    )
    add_quantize(
        parser, "as lmjax generate --quantize (default: nf4 for a QLoRA run, none otherwise)"
    )
    parser.add_argument(
        "--show-ids", action="store_true", help="print each turn's prompt ids and reply ids"
    )
    parser.set_defaults(run=run_chat)


def run_chat(args: argparse.Namespace) -> int:
    from lmjax import chat, generate
    from lmjax.checks import require
    from lmjax.cli.runs import print_ids, quantization, stream_text

    generate.Sampling(args.temperature, args.top_k, args.top_p)  # a typo fails before loading
    run = load_run(args.run_path, args.step, quantization(args.quantize, args.run_path))
    require(
        run.tokenizer is not None,
        "run",
        str(run.directory),
        "a tokenizer/ directory (saved by import-hf)",
        "chat with a run imported from a chat model (lmjax import-hf)",
        error=FileFormatError,
    )
    conversation = chat.Conversation(run.tokenizer, system=args.system)
    stops = [*args.stop_token, *chat.run_stop_ids(run)]
    for message in _user_turns(args.message):
        prompt = conversation.prompt_ids(message)
        options = dict(
            max_new_tokens=_reply_length(args.max_new_tokens, len(prompt), run.model),
            temperature=args.temperature,
            top_k=args.top_k,
            top_p=args.top_p,
            seed=args.seed,
            stop_tokens=stops,
        )
        steps = generate.stream(run.params, [prompt], run.model, **options)
        if args.message:  # a script's transcript: say which turn each reply answers
            print(f"> {message}")
        reply = stream_text(run.tokenizer, steps, hidden=stops)
        if args.show_ids:
            print_ids(prompt, reply)
        text = [i for i in reply if i not in stops]
        conversation.add_reply(run.tokenizer.decode(text, skip_special_tokens=True))
    return 0


def _user_turns(messages: list[str]):
    """--message's turns, else stdin's lines (a "> " prompt when a person types them)."""
    if messages:
        yield from messages
        return
    typed = sys.stdin.isatty()
    while True:
        if typed:
            print("> ", end="", flush=True)
        line = sys.stdin.readline()
        if not line:
            if typed:  # Ctrl-D after the prompt sign: end its line
                print()
            return
        if line.strip():
            yield line.rstrip("\n")


def _reply_length(wanted: int | None, prompt: int, model) -> int:
    """New tokens of a turn: --max-new-tokens, or up to 200; one error line when the
    conversation leaves no room in the context."""
    from lmjax.checks import require
    from lmjax.errors import TokenError

    room = model.context_length - prompt
    require(
        room >= 1,
        "conversation",
        f"{prompt} tokens",
        f"fewer than context_length = {model.context_length}",
        "start a new chat (shorter turns, or a shorter --system)",
        error=TokenError,
    )
    if wanted is None:
        return min(200, room)
    require(
        1 <= wanted <= room,
        "--max-new-tokens",
        wanted,
        f"an int in [1, {room}] (context_length {model.context_length} minus the conversation)",
        f"pass --max-new-tokens {room} or less, or start a new chat",
    )
    return wanted
