"""`lmjax chat`: a conversation with an imported (or fine-tuned) chat model, turn by turn.

Each turn renders the whole conversation with the run's chat template (`lmjax.chat`), decodes
until one of the model's end-of-sequence ids (or --max-new-tokens), prints the reply as it is
generated and keeps its ids for the next turn. User turns come from --message flags, else from
stdin, one per line until EOF (typed at a terminal: with line editing, when Python has
readline).

The session outlives what a person does at a terminal: a full context forgets the oldest
exchanges (one line says so), a turn too long by itself is refused (one line) and the chat goes
on, Ctrl-C during a reply stops it (what was said is kept), and Ctrl-C at an empty prompt or
Ctrl-D ends the chat (exit 0). A line starting with "/" is a command (`COMMANDS`), never sent to
the model; "//" sends a line starting with "/".
"""

from __future__ import annotations

import argparse
import signal
import sys

from lmjax.cli.args import add_quantize, add_run, add_sampling, add_step
from lmjax.cli.common import load_run
from lmjax.cli.prompt import Prompt
from lmjax.errors import FileFormatError, TokenError

DEFAULT_REPLY = 200  # tokens a reply may take by default (at most half the context)
COMMANDS = {
    "/help": "this list",
    "/reset": "a new conversation (the system message stays)",
    "/system TEXT": "the system message from now on (/system alone shows it)",
    "/exit": "leave the chat (also /quit, Ctrl-D, or Ctrl-C at an empty prompt)",
    "//TEXT": 'send a message that starts with "/" (/TEXT)',
}
_EXIT = ("exit", "quit")


def add_chat(sub) -> None:
    parser = sub.add_parser(
        "chat",
        help="chat with a run through its chat template, stopping at its end-of-turn ids",
        description="Talk to RUN (an import-hf of a chat model, or a fine-tune of one): each "
        "user turn (--message, repeatable, else one per line of stdin until EOF) is added to "
        "the conversation, rendered with the model's chat template (tokenizer_config.json) "
        "and answered until an end-of-sequence id of generation_config.json / "
        "tokenizer_config.json or --max-new-tokens; the reply is kept for the next turn. "
        "When the context is full the oldest turns are forgotten (the system message stays). "
        "Lines starting with / are commands (/help); Ctrl-C stops a reply; Ctrl-D, /exit or "
        "Ctrl-C at an empty prompt leaves.",
    )
    add_run(parser, "a run directory with a chat tokenizer")
    add_step(parser)
    parser.add_argument("--system", default=None, help="a system message opening the chat")
    parser.add_argument(
        "--message", action="append", default=[], help="a user turn (repeatable; default: stdin)"
    )
    add_sampling(
        parser,
        length="tokens kept free for each reply: older turns are forgotten to leave them "
        f"(default: {DEFAULT_REPLY}, at most half the context)",
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
    from lmjax.cli.runs import quantization
    from lmjax.train.rundir import RunDir

    for message in args.message:  # before loading: a script's mistake costs nothing
        require(
            bool(message.strip()),
            "--message",
            message,
            "text to send (a blank turn is never sent)",
            "give the --message some text, or drop it",
        )
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
    where = RunDir(run.directory).tokenizer_dir
    session = _Session(args, run, chat.Conversation(run.tokenizer, args.system, where))
    typed = not args.message and sys.stdin.isatty()
    if typed:
        _hear_ctrl_c()
    for line in args.message or (_typed_lines() if typed else _piped_lines()):
        if args.message:  # a script's transcript: say which turn each reply answers
            print(f"> {line}")
        if not session.take(line):
            break
    return 2 if session.refused and not typed else 0


def _hear_ctrl_c() -> None:
    """At a terminal Ctrl-C is how a reply is stopped, so it must raise: a process started with
    SIGINT ignored (by a non-interactive shell's `cmd &`, which passes that on to what it
    runs) would otherwise let every reply run to its end and never leave on Ctrl-C."""
    if signal.getsignal(signal.SIGINT) == signal.SIG_IGN:
        signal.signal(signal.SIGINT, signal.default_int_handler)


def parse_line(line: str) -> tuple[str | None, str]:
    """`(command, argument)` of a line starting with "/" ("/system Be brief." -> ("system",
    "Be brief.")), else `(None, the message)`; "//..." is the message "/...". A command word is
    lower-cased; leading blanks before "/" are ignored."""
    head = line.lstrip()
    if head.startswith("//"):
        return None, head[1:]
    if not head.startswith("/"):
        return None, line
    word, _, argument = head[1:].partition(" ")
    return word.lower(), argument.strip()


def reply_room(wanted: int | None, context_length: int) -> int:
    """Tokens each reply may take, kept free by forgetting old turns: --max-new-tokens, else
    `DEFAULT_REPLY` or half the context if less; one error line for a value the context cannot
    hold beside a one-token prompt."""
    from lmjax.checks import require

    if wanted is None:
        return max(1, min(DEFAULT_REPLY, context_length // 2))
    require(
        1 <= wanted < context_length,
        "--max-new-tokens",
        wanted,
        f"an int in [1, {context_length - 1}] (context_length {context_length} minus a prompt)",
        f"pass --max-new-tokens {min(DEFAULT_REPLY, context_length - 1)} or less",
    )
    return wanted


def _say(text: str) -> None:
    """A line about the session (not the model's words): on stderr, after what stdout has."""
    sys.stdout.flush()
    print(f"lmjax chat: {text}", file=sys.stderr, flush=True)


class _Session:
    """The conversation and what the command line asked for; `take` handles one line."""

    def __init__(self, args: argparse.Namespace, run, conversation):
        from lmjax import generate
        from lmjax.chat import run_stop_ids

        self.args, self.run, self.conversation = args, run, conversation
        # Laid out for decoding once for the session, not again at every turn's stream.
        self.params = generate.decoding_params(run.params, run.model)
        self.stops = [*args.stop_token, *run_stop_ids(run)]
        self.room = reply_room(args.max_new_tokens, run.model.context_length)
        self.refused = 0  # turns not sent and unknown commands (a script's exit status)

    def take(self, line: str) -> bool:
        """Run a command or answer a message; False once the chat should end."""
        command, text = parse_line(line)
        if command is None:
            self.turn(text)
        elif command in _EXIT:
            return False
        elif command == "help":
            width = max(map(len, COMMANDS))
            print("\n".join(f"{k.ljust(width)}  {v}" for k, v in COMMANDS.items()))
            print("Ctrl-C during a reply stops it; the reply so far is kept.")
        elif command == "reset":
            self.conversation.reset()
            _say("a new conversation (the system message stays)")
        elif command == "system":
            self._system(text)
        else:
            self.refused += 1
            _say(f'/{command} is not a command (/help lists them); "//" sends a line with "/"')
        return True

    def turn(self, text: str) -> None:
        """Answer a user turn, forgetting old turns as the context needs (or refusing it)."""
        context = self.run.model.context_length
        try:
            prompt, dropped = self.conversation.fit_turn(text, context, self.room)
        except TokenError as err:
            self.refused += 1
            _say(f"not sent: {err}")
            return
        if dropped:
            _say(
                f"the context ({context} tokens) is full: forgot the oldest {dropped} messages "
                f"to leave {self.room} for the reply"
            )
        reply, stopped = self._reply(prompt, min(self.room, context - len(prompt)))
        if stopped:
            _say("reply stopped (Ctrl-C); what it said so far is kept")
        if self.args.show_ids:
            from lmjax.cli.runs import print_ids

            print_ids(prompt, reply)
        content = reply[:-1] if reply and reply[-1] in self.stops else reply
        text = self.run.tokenizer.decode(content, skip_special_tokens=True)
        self.conversation.add_reply(text, content)

    def _reply(self, prompt: list[int], length: int) -> tuple[list[int], bool]:
        """(the reply's ids, whether Ctrl-C stopped it), printed as they come."""
        from lmjax import generate
        from lmjax.cli.runs import stream_text

        args, ids = self.args, []  # ids: what the reply said, also when Ctrl-C stops it

        def recorded(steps):
            for step in steps:
                if step.active[0]:
                    ids.append(int(step.tokens[0]))
                yield step

        sampling = {k: getattr(args, k) for k in ("temperature", "top_k", "top_p", "seed")}
        try:
            steps = generate.stream(
                self.params,
                [prompt],
                self.run.model,
                max_new_tokens=length,
                stop_tokens=self.stops,
                **sampling,
            )
            stream_text(self.run.tokenizer, recorded(steps), hidden=self.stops)
        except KeyboardInterrupt:
            print(flush=True)  # end the reply's line
            return ids, True
        return ids, False

    def _system(self, text: str) -> None:
        if not text:
            current = self.conversation.system
            _say("no system message" if current is None else f"the system message is {current!r}")
            return
        self.conversation.system = text
        _say("the system message is set (the conversation so far is kept)")


def _piped_lines():
    """stdin's non-blank lines (a file or a pipe)."""
    for line in sys.stdin:
        if line.strip():
            yield line.rstrip("\n")


def _typed_lines():
    """Lines typed after a "> " prompt until Ctrl-D, or Ctrl-C at an empty prompt; Ctrl-C on a
    line with text clears it, as a shell does (with readline; without it, Ctrl-C leaves). A
    Ctrl-C right after one that cleared a line leaves too: that prompt was empty.

    Whether the line held text is read when Ctrl-C arrives (`Prompt.had_text`, in the handler,
    before readline clears its line), not after: on Python 3.13 readline's buffer after the
    interrupt was seen both cleared and still holding the old line."""
    try:
        import readline  # noqa: F401  (input() then edits lines and keeps a history)
    except ImportError:
        readline = None
    cleared = False  # the last prompt ended in a Ctrl-C that cleared its line
    with Prompt(readline) as prompt:
        while True:
            try:
                line = prompt.input("> ")
            except EOFError:
                print()  # Ctrl-D after the prompt sign: end its line
                return
            except KeyboardInterrupt:
                print()
                if prompt.had_text and not cleared:
                    cleared = True
                    continue
                return
            cleared = False
            if line.strip():
                yield line
