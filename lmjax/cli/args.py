"""The argument groups several `lmjax` commands share, one function a group, so a flag that means
the same thing in two commands is parsed the same way (type, default, metavar) in both.

Each function takes the help words that differ between commands (what RUN must hold, what one
reply is); the rest is written once here. Only argparse is imported: `lmjax --help` stays fast.
"""

from __future__ import annotations

import argparse


def add_config_command(
    sub, name: str, help: str, description: str, config_help: str
) -> argparse.ArgumentParser:
    """The subcommand `lmjax NAME CONFIG [section.field=value ...]` (train, finetune, bench,
    compile): a YAML config and its overrides, before the command's own flags."""
    parser = sub.add_parser(name, help=help, description=description)
    parser.add_argument("config", help=config_help)
    parser.add_argument("overrides", nargs="*", help="section.field=value overrides")
    return parser


def add_run(parser: argparse.ArgumentParser, help: str) -> None:
    """The positional RUN (a run directory, or RUN/checkpoints/STEP) read by `common.load_run`,
    as `args.run_path` (eval, chat, export-hf)."""
    parser.add_argument("run_path", metavar="RUN", help=help)


def add_step(parser: argparse.ArgumentParser, help: str = "checkpoint step (default: newest)"):
    """`--step N`: the checkpoint of a run to load; unset is its newest (or the path's step)."""
    parser.add_argument("--step", type=int, default=None, help=help)


def add_sampling(parser: argparse.ArgumentParser, length: str, seed: str | None, stop: str) -> None:
    """How new tokens are drawn (generate, chat): --max-new-tokens, --temperature, --top-k,
    --top-p, --seed and --stop-token (repeatable), in that order. `length`, `seed` and `stop` are
    the help of the flags whose meaning depends on the command (a reply, or a continuation)."""
    parser.add_argument("--max-new-tokens", type=int, default=None, help=length)
    parser.add_argument("--temperature", type=float, default=0.8, help="0 = greedy (default 0.8)")
    parser.add_argument(
        "--top-k", type=int, default=None, help="keep the k most likely tokens (0: off, as unset)"
    )
    parser.add_argument("--top-p", type=float, default=1.0, help="nucleus mass in (0, 1]")
    parser.add_argument("--seed", type=int, default=0, help=seed)
    parser.add_argument("--stop-token", type=int, action="append", default=[], help=stop)


def add_quantize(parser: argparse.ArgumentParser, help: str) -> None:
    """`--quantize nf4|none` of a decoding command; unset follows the run (`runs.quantization`)."""
    parser.add_argument("--quantize", choices=("nf4", "none"), default=None, help=help)


def add_output(parser: argparse.ArgumentParser, what: str) -> None:
    """`--output FILE`: also write the command's `what` (result, report) as JSON there."""
    parser.add_argument("--output", default=None, help=f"also write the {what} as JSON here")


def add_skip_bad(parser: argparse.ArgumentParser) -> None:
    """`--skip-bad`: malformed corpus or SFT records are counted and skipped, not an error."""
    parser.add_argument(
        "--skip-bad", action="store_true", help="skip malformed records (counted, reported)"
    )


def add_mesh(parser: argparse.ArgumentParser, help: str) -> None:
    """`--mesh data=D,fsdp=F,model=M`: a device mesh's axis sizes (inspect, compile)."""
    parser.add_argument("--mesh", default=None, metavar="data=D,fsdp=F,model=M", help=help)
