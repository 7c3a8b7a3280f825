"""`lmjax eval` and `lmjax generate`: a trained, fine-tuned or imported run's validation loss,
and text sampled from it."""

from __future__ import annotations

import argparse
import dataclasses
import itertools
import math

from lmjax.cli import harness
from lmjax.cli.args import add_quantize, add_run, add_sampling, add_step
from lmjax.cli.common import load_run
from lmjax.errors import ConfigError, FileFormatError, TokenError

# ---- lmjax eval ----------------------------------------------------------------------------------


def add_eval(sub) -> None:
    ev = sub.add_parser(
        "eval",
        help="print a run's validation loss, or its scores on lm-evaluation-harness tasks",
        description="Load RUN's newest (or --step) checkpoint and print the mean validation "
        "loss over the run's fixed evaluation batches; with --tasks, score it on "
        "lm-evaluation-harness tasks instead and print the harness's table "
        "(docs/evaluation.md).",
    )
    add_run(ev, "a run directory (or RUN/checkpoints/STEP)")
    add_step(ev)
    ev.add_argument(
        "--batches", type=int, default=None, help="evaluation batches (default: config)"
    )
    ev.add_argument("--batch-size", type=int, default=None, help="sequences per batch (--tasks: 8)")
    ev.add_argument("--seq-len", type=int, default=None, help="tokens per sequence")
    harness.add_task_flags(ev)
    ev.set_defaults(run=run_eval)


def run_eval(args: argparse.Namespace) -> int:
    from lmjax import train
    from lmjax.checks import require
    from lmjax.train.rundir import RunDir, run_label
    from lmjax.train.runs import eval_tokenizer_dir

    harness.check_flags(args)
    # The run path first (a check of its files): a typo there is named before anything loads.
    named_step = RunDir.parse(args.run_path)[1]
    if args.step is not None:  # a checkpoint path already names its step
        require(
            named_step in (None, args.step),
            "--step",
            args.step,
            f"the step of the checkpoint path {args.run_path}",
            "pass a run directory with --step, or a checkpoint path alone",
        )
    if args.tasks is not None:
        return harness.run_tasks(args)
    run = load_run(args.run_path, args.step)
    cfg = _eval_config(args, run)
    tokenizer_dir = eval_tokenizer_dir(run, cfg)
    prepared = train.prepare_data(cfg, progress=False, tokenizer_dir=tokenizer_dir)
    train.loop.resolve(cfg, prepared)
    eval_step = train.make_eval_step(run.model)
    loss = train.evaluate(
        eval_step,
        run.params,
        prepared.val,
        cfg.train,
        cfg.seq_len,
        vocab_size=run.model.vocab_ids,
        documents=prepared.val_documents if cfg.data.packing else None,
    )
    t = cfg.train
    print(
        f"{run_label(run.directory, run.step)}: validation loss {loss:.4f} nats/token "
        f"(perplexity {math.exp(min(loss, 700)):.3f}) over {t.eval_batches} batches of "
        f"{t.batch_size} x {cfg.seq_len} tokens drawn from {_held_out(prepared.meta, cfg)} "
        f"({_tokenizer_words(cfg.data.tokenizer, tokenizer_dir, prepared.tokenizer)})"
    )
    return 0


def _held_out(meta: dict, cfg) -> str:
    """What the evaluation batches are cut from: the held-out records (SFT) or documents and
    their tokens, or the held-out tail's tokens; and when the batches hold more tokens than
    that, that they read the same ones again (two held-out records fill no 10 batches)."""
    tokens, documents = int(meta["val_tokens"]), meta.get("val_documents")
    unit = ("record" if "sft" in meta else "document") + ("s" if documents != 1 else "")
    split = f"{documents:,} held-out {unit} ({tokens:,} tokens)" if documents else None
    what = f"{split or f'the {tokens:,} held-out tokens'} of {cfg.data.corpus}"
    t = cfg.train
    if t.eval_batches * t.batch_size * cfg.seq_len > tokens:
        what += ", which the batches repeat"
    return what


def _tokenizer_words(kind: str, own_dir, tok) -> str:
    """What encoded eval's corpus: the data section's kind, or the run's own tokenizer/."""
    if own_dir is None:
        return f"{kind} tokenizer"
    what = "Hugging Face tokenizer.json" if tok.kind == "hf" else f"{tok.kind} tokenizer"
    return f"the run's own {what} in {own_dir}, {tok.vocab_size:,} tokens"


def _eval_config(args: argparse.Namespace, run):
    """The run's config with eval's flags over its evaluation batches (one micro-batch each)."""
    from lmjax.checks import require

    t = run.cfg.train
    changes = {
        "eval_batches": _positive("--batches", args.batches, t.eval_batches),
        "batch_size": _positive("--batch-size", args.batch_size, t.batch_size // t.grad_accum),
        "grad_accum": 1,
        "seq_len": _positive("--seq-len", args.seq_len, run.cfg.seq_len),
    }
    context = run.model.context_length
    seq_len = changes["seq_len"]
    require(seq_len <= context, "--seq-len", seq_len, f"<= context_length = {context}", "lower it")
    return run.cfg.replace(train=dataclasses.replace(t, **changes))


def _positive(flag: str, value, default: int) -> int:
    if value is None:
        return default
    if value < 1:
        raise ConfigError.describe(flag, value, "an int >= 1", f"pass e.g. {flag} {default}")
    return value


# ---- lmjax generate ------------------------------------------------------------------------------


def add_generate(sub) -> None:
    gen = sub.add_parser(
        "generate",
        help="sample text from a trained or imported run, streaming tokens",
        description="Encode --prompt with the run's tokenizer and sample a continuation with "
        "a KV cache (temperature 0 = greedy). One prompt streams as it is generated; several "
        "--prompt flags are generated as one batch. --chat renders each prompt as a user "
        "message with the run's chat template; --show-ids prints the token ids too.",
    )
    source = gen.add_mutually_exclusive_group(required=True)
    source.add_argument("--run", dest="run_dir", help="a run directory (its newest checkpoint)")
    source.add_argument("--checkpoint", help="RUN/checkpoints/STEP, or a weights-only run")
    add_step(gen, "checkpoint step of --run")
    gen.add_argument("--prompt", action="append", required=True, help="text (repeatable)")
    add_sampling(
        gen,
        length="tokens to generate (default: 200, or what fits in the context)",
        seed=None,
        stop="token id that ends a sequence",
    )
    gen.add_argument("--cache", choices=("contiguous", "paged"), default="contiguous")
    gen.add_argument(
        "--chat",
        action="store_true",
        help="each --prompt is a user message: render it with the run's chat template (with "
        "the assistant header) and stop at the model's end-of-sequence ids "
        "(generation_config.json, tokenizer_config.json); see lmjax chat for a conversation",
    )
    gen.add_argument(
        "--show-ids", action="store_true", help="also print the prompt's and the new token ids"
    )
    add_quantize(
        gen,
        "nf4: decode with the block projections in NF4 (the NF4 kernel on GPU/TPU, the "
        "tiled path on CPU); none: float weights. Default: nf4 for a QLoRA run (its NF4 base "
        "with the adapters attached, not merged), none otherwise",
    )
    gen.set_defaults(run=run_generate)


def run_generate(args: argparse.Namespace) -> int:
    from lmjax import generate
    from lmjax.checks import require

    # The sampling flags first: a typo fails before the weights are read.
    generate.Sampling(args.temperature, args.top_k, args.top_p)
    path = args.run_dir or args.checkpoint
    run = load_run(path, args.step, quantization(args.quantize, path))
    require(
        run.tokenizer is not None,
        "run",
        str(run.directory),
        "a tokenizer/ directory (saved by train or import-hf)",
        "copy the data's tokenizer/ into the run",
        error=FileFormatError,
    )
    prompts, stops, hidden = [run.tokenizer.encode(text) for text in args.prompt], [], ()
    if args.chat:
        prompts, stops = chat_prompts(run, args.prompt)
        hidden = stops  # an end-of-turn token ends the reply; it is not part of its text
    n = _check_generate_lengths(args, prompts, run.model.context_length)
    options = dict(
        max_new_tokens=n,
        temperature=args.temperature,
        top_k=args.top_k,
        top_p=args.top_p,
        seed=args.seed,
        stop_tokens=[*args.stop_token, *stops],
        cache=args.cache,
    )
    shown = args.prompt if not args.chat else ["" for _ in args.prompt]
    if len(prompts) > 1:  # a batch: print each continuation when all are done
        outs = generate.generate(run.params, prompts, run.model, **options)
        for text, head, prompt, out in zip(args.prompt, shown, prompts, outs, strict=True):
            body = run.tokenizer.decode([i for i in out if i not in hidden])
            print(f"--- {text!r}\n{head}{body}")
            if args.show_ids:
                print_ids(prompt, out)
        return 0
    steps = generate.stream(run.params, prompts, run.model, **options)
    first = next(steps)  # every option is validated before the first token: print nothing before
    print(shown[0], end="", flush=True)
    ids = stream_text(run.tokenizer, itertools.chain([first], steps), hidden)
    if args.show_ids:
        print_ids(prompts[0], ids)
    return 0


def chat_prompts(run, messages: list[str]) -> tuple[list[list[int]], list[int]]:
    """(prompt ids of each message as a one-turn chat, the stop ids) for `generate --chat`."""
    from lmjax import chat
    from lmjax.train.rundir import RunDir

    stops = chat.run_stop_ids(run)
    chat.require_template(run.tokenizer, RunDir(run.directory).tokenizer_dir)
    return [chat.Conversation(run.tokenizer).prompt_ids(m) for m in messages], stops


def stream_text(tokenizer, steps, hidden=()) -> list[int]:
    """Print row 0's text as `generate.stream` yields it; its new ids. Ids in `hidden` (an
    end-of-turn token) are generated but not printed."""
    shown, ids, text = "", [], ""
    for step in steps:
        if step.active[0]:
            ids.append(int(step.tokens[0]))
        text = tokenizer.decode([i for i in ids if i not in hidden])
        # A multi-byte character split across tokens decodes to U+FFFD until it is complete.
        stable = text.rstrip("\ufffd")
        print(stable[len(shown) :], end="", flush=True)
        shown = stable
    print(text[len(shown) :])
    return ids


def print_ids(prompt: list[int], new: list[int]) -> None:
    """`--show-ids`: the prompt's ids and the generated ones, each a JSON list on its line."""
    print(f"prompt ids: {list(map(int, prompt))}")
    print(f"new ids: {list(map(int, new))}")


def quantization(flag: str | None, path) -> str | None:
    """`--quantize` as `train.load_run`'s `quantize`: unset follows the run (a QLoRA run decodes
    its NF4 base, as it trained), "none" is float weights."""
    from lmjax.train.runs import is_qlora

    if flag is None:
        return "nf4" if is_qlora(path) else None
    return None if flag == "none" else flag


def _check_generate_lengths(args, prompts: list[list[int]], context: int) -> int:
    """The number of new tokens, with the CLI's own names in every error."""
    from lmjax.checks import require

    for text, ids in zip(args.prompt, prompts, strict=True):
        expected = "text that encodes to at least one token"
        require(bool(ids), "--prompt", text, expected, "give a prompt", error=TokenError)
        length, fewer = f"{len(ids)} tokens", f"fewer than context_length = {context}"
        require(len(ids) < context, "--prompt", length, fewer, "shorten the prompt", TokenError)
    room = context - max(len(p) for p in prompts)
    if args.max_new_tokens is None:
        return min(200, room)
    require(
        1 <= args.max_new_tokens <= room,
        "--max-new-tokens",
        args.max_new_tokens,
        f"an int in [1, {room}] (context_length {context} minus the longest prompt)",
        f"pass --max-new-tokens {room} or less",
    )
    return args.max_new_tokens
