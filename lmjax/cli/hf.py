"""`lmjax import-hf` and `lmjax export-hf`: Hugging Face GPT-2 directories in and out of
lmjax run directories."""

from __future__ import annotations

import argparse
from pathlib import Path

from lmjax.cli.common import load_run
from lmjax.errors import CheckpointError, LMJaxError


def add_import_hf(sub) -> None:
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
    imp.set_defaults(run=run_import_hf)


def run_import_hf(args: argparse.Namespace) -> int:
    from lmjax import params as ptree
    from lmjax.io import hf_gpt2
    from lmjax.tokenizers import gpt2
    from lmjax.train.runs import write_weights_run

    params, model = hf_gpt2.load(args.source, dtype=args.dtype)
    tokenizer, note = _hf_tokenizer(args.source), ""
    if tokenizer is not None:
        hf_gpt2.check_tokenizer(tokenizer, model, args.source)
    elif model.vocab_size == gpt2.VOCAB_SIZE:
        from lmjax.train.data import gpt2_tokenizer

        tokenizer = gpt2_tokenizer()
        note = " (no vocab.json/merges.txt beside it: GPT-2's own vocabulary is used)"
    else:  # GPT-2's vocabulary would encode ids this model lacks: write none rather than guess
        note = (
            f", no tokenizer (no vocab.json/merges.txt beside it, and vocab_size "
            f"{model.vocab_size} is not GPT-2's {gpt2.VOCAB_SIZE:,}: copy the tokenizer/ of "
            f"the run it came from into {args.out}/tokenizer, or put the files beside it and "
            "import again)"
        )
    try:
        write_weights_run(args.out, params, model, tokenizer, "gpt2")
    except OSError as err:  # the output can't be made (a file in the path, no permission...)
        if isinstance(err, LMJaxError):
            raise
        expected = f"a new directory lmjax can write ({err.strerror or err})"
        fix = "pick a writable location (nothing was written)"
        raise CheckpointError.describe("--out", args.out, expected, fix) from err
    print(f"imported {args.source} -> {args.out}: gpt2, {ptree.count(params):,} parameters{note}")
    return 0


def _hf_tokenizer(source: str):
    """The tokenizer files next to a Hugging Face checkpoint, if any (either GPT-2 pair)."""
    from lmjax.tokenizers import BPETokenizer

    directory = Path(source) if Path(source).is_dir() else Path(source).parent
    for vocab, merges in (("vocab.json", "merges.txt"), ("encoder.json", "vocab.bpe")):
        if (directory / vocab).is_file() and (directory / merges).is_file():
            return BPETokenizer.from_files(directory / vocab, directory / merges)
    return None


def add_export_hf(sub) -> None:
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
    exp.set_defaults(run=run_export_hf)


def run_export_hf(args: argparse.Namespace) -> int:
    from lmjax.checks import require
    from lmjax.files import atomic_dir
    from lmjax.io import hf_gpt2

    run = load_run(args.run_path, args.step)
    out = Path(args.out)
    require(
        not out.exists(),
        "--out",
        str(out),
        "a path that does not exist yet",
        "pick a new directory (nothing was overwritten)",
    )
    with atomic_dir(out) as tmp:
        hf_gpt2.save(run.params, run.model, tmp)
        if run.tokenizer is not None and run.tokenizer.kind == "bpe":
            run.tokenizer.save(tmp)  # vocab.json + merges.txt, as transformers expects
            (tmp / "tokenizer.json").unlink()  # lmjax's manifest; transformers reads its own
    print(f"exported {run.directory} (step {run.step}) -> {out}: config.json, model.safetensors")
    return 0
