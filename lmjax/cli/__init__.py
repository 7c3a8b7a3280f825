"""The `lmjax` command line: thin parsing around library calls, one-line errors.

Subcommands: `prepare` (corpus -> token files), `train` (a YAML run config), `eval` (a run's
validation loss), `generate` (sample from a run), `chat` (a conversation through a run's chat
template), `import-hf` / `export-hf` (Hugging Face checkpoints), `inspect` (parameter table,
counts, memory estimate), `gradcheck` (every primitive's hand-written VJP against `jax.grad` and
finite differences), `compile` (a config's sharded step compiled for a TPU topology by libtpu,
its memory against the HBM). Library errors (`lmjax.errors`) print one line on stderr and exit
2; Ctrl-C exits 130.

One module per command group, each adding its parsers and running its commands: `training`
(prepare, train, finetune), `runs` (eval, generate), `chat`, `hf` (import-hf, export-hf),
`inspection` (inspect), `measure` (gradcheck, bench, compile); `args` holds the flags they
share, `common` the steps they share. Their lmjax imports sit inside the functions, so
`lmjax --help` reads no more than the parser needs.
"""

from __future__ import annotations

import argparse
import difflib
import sys

from lmjax.cli import chat, hf, inspection, measure, runs, training
from lmjax.errors import LMJaxError

# The subcommands in `lmjax --help` order, each as the function adding its parser.
_COMMANDS = (
    measure.add_gradcheck,
    inspection.add_inspect,
    training.add_prepare,
    training.add_train,
    runs.add_eval,
    runs.add_generate,
    chat.add_chat,
    hf.add_import_hf,
    hf.add_export_hf,
    measure.add_bench,
    training.add_finetune,
    measure.add_compile,
)

# Commands that run many XLA steps on the host: they keep freed memory mapped (lmjax.hostmem).
_LONG_RUNNING = ("train", "finetune", "bench")


class _Parser(argparse.ArgumentParser):
    """argparse, but a usage error is one line (docs/guarantees.md) and exits 2, as library errors
    do; subcommand parsers are made with the same class."""

    def error(self, message: str):
        usage = " ".join(self.format_usage().split())
        self.exit(2, f"{self.prog}: error: {message}. Fix: see `{self.prog} --help` ({usage}).\n")


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(
        prog="lmjax",
        description="lmjax: decoder-only transformer LMs in JAX, from the command line.",
    )
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    for add_command in _COMMANDS:
        add_command(sub)
    parser.commands = sub.choices  # name -> its parser, whose errors name its own --help
    return parser


def _parse(argv: list[str] | None) -> argparse.Namespace:
    """Parse, letting `key=value` overrides sit anywhere, also after options. An argument the
    subcommand does not know is its parser's error (`see lmjax finetune --help`), with the
    nearest flag it has (`--qlroa`: did you mean --qlora?)."""
    parser = build_parser()
    args, extra = parser.parse_known_args(argv)
    overrides = [item for item in extra if "=" in item and not item.startswith("-")]
    unknown = [item for item in extra if item not in overrides]
    if unknown or (overrides and not hasattr(args, "overrides")):
        command = parser.commands[args.command]
        command.error(
            f"unrecognized arguments: {' '.join(unknown or overrides)}{_nearest(unknown, command)}"
        )
    if overrides:
        args.overrides = [*args.overrides, *overrides]
    return args


def _nearest(unknown: list[str], command: argparse.ArgumentParser) -> str:
    """` (did you mean --qlora?)` for the first unknown flag near one of `command`'s, else ""."""
    flags = [f for action in command._actions for f in action.option_strings]  # no public list
    for item in unknown:
        close = difflib.get_close_matches(item.partition("=")[0], flags, n=1)
        if item.startswith("-") and close:
            return f" (did you mean {close[0]}?)"
    return ""


def main(argv: list[str] | None = None) -> int:
    args = _parse(argv)
    if args.command in _LONG_RUNNING:
        from lmjax.hostmem import keep_freed_memory

        keep_freed_memory()
    try:
        return args.run(args)
    except LMJaxError as err:
        _close_progress_bars()
        print(f"lmjax {args.command}: error: {err}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        _close_progress_bars()
        print(f"lmjax {args.command}: interrupted", file=sys.stderr)
        return 130


def _close_progress_bars() -> None:
    """Close the progress bars an error left open, so their line ends before the error line
    (an open bar's text has no newline yet; it would be glued in front of the message)."""
    module = sys.modules.get("tqdm")  # not imported: no bar was ever shown
    for bar in list(getattr(module.tqdm, "_instances", ())) if module else ():
        bar.close()


__all__ = ["build_parser", "main"]
