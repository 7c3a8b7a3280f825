"""`lmjax import-hf` and `lmjax export-hf`: Hugging Face checkpoints (gpt2, llama, mistral,
qwen2, qwen3) in and out of lmjax run directories, with their tokenizers."""

from __future__ import annotations

import argparse
from pathlib import Path

from lmjax.cli.common import load_run
from lmjax.errors import CheckpointError, LMJaxError


def add_import_hf(sub) -> None:
    imp = sub.add_parser(
        "import-hf",
        help="import a Hugging Face checkpoint (gpt2, llama, mistral, qwen2, qwen3) as a run",
        description="Read a Hugging Face directory (config.json + model.safetensors, or "
        "sharded model-0000x-of-0000y.safetensors with model.safetensors.index.json) of "
        "model_type gpt2, llama (SmolLM too), mistral, qwen2 or qwen3, or one GPT-2 "
        ".safetensors file, and write OUT (config.yaml, model.safetensors, tokenizer/) for "
        "lmjax generate / eval / export-hf. tokenizer/ is the tokenizer.json (with "
        "tokenizer_config.json) or the vocab.json + merges.txt beside SOURCE; without them, "
        "GPT-2's own vocabulary for a 50,257-token GPT-2, else no tokenizer (the output says "
        "so: copy the original run's tokenizer/ into OUT).",
    )
    imp.add_argument("source", help="a Hugging Face checkpoint directory or a .safetensors file")
    imp.add_argument("--out", required=True, help="the new run directory")
    imp.add_argument("--dtype", default="float32", help="parameter dtype (default float32)")
    imp.set_defaults(run=run_import_hf)


def run_import_hf(args: argparse.Namespace) -> int:
    from lmjax import params as ptree
    from lmjax.io import hf, hf_gpt2
    from lmjax.tokenizers import gpt2
    from lmjax.train.runs import write_weights_run

    family = hf.model_type(args.source)
    params, model = hf.load(args.source, dtype=args.dtype)
    tokenizer, note = _hf_tokenizer(args.source), ""
    if tokenizer is not None:
        hf_gpt2.check_tokenizer(tokenizer, model, args.source)
    elif family == "gpt2" and model.vocab_size == gpt2.VOCAB_SIZE:
        from lmjax.train.data import gpt2_tokenizer

        tokenizer = gpt2_tokenizer()
        note = " (no vocab.json/merges.txt beside it: GPT-2's own vocabulary is used)"
    else:  # GPT-2's vocabulary would encode ids this model lacks: write none rather than guess
        note = (
            f", no tokenizer (no tokenizer.json or vocab.json/merges.txt beside it, and "
            f"{_not_gpt2(family, model.vocab_size)}: copy the tokenizer/ of "
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
    count = f"{ptree.count(params):,} parameters"
    print(f"imported {args.source} -> {args.out}: {family}, {count}{note}")
    return 0


def _not_gpt2(family: str, vocab_size: int) -> str:
    """Why GPT-2's own vocabulary is not the model's: the clause of import-hf's note."""
    from lmjax.tokenizers import gpt2

    if family != "gpt2":
        return f"GPT-2's vocabulary is not a {family} model's"
    return f"vocab_size {vocab_size} is not GPT-2's {gpt2.VOCAB_SIZE:,}"


def _hf_tokenizer(source: str):
    """The tokenizer files next to a Hugging Face checkpoint, if any: tokenizer.json (with its
    tokenizer_config.json), else either GPT-2 pair."""
    from lmjax.tokenizers import BPETokenizer, load_hf_tokenizer

    directory = Path(source) if Path(source).is_dir() else Path(source).parent
    if (directory / "tokenizer.json").is_file():
        return load_hf_tokenizer(directory)
    for vocab, merges in (("vocab.json", "merges.txt"), ("encoder.json", "vocab.bpe")):
        if (directory / vocab).is_file() and (directory / merges).is_file():
            return BPETokenizer.from_files(directory / vocab, directory / merges)
    return None


def add_export_hf(sub) -> None:
    exp = sub.add_parser(
        "export-hf",
        help="export a run as a Hugging Face directory (gpt2, llama, mistral, qwen2, qwen3)",
        description="Write OUT/config.json and OUT/model.safetensors (plus the tokenizer: "
        "tokenizer.json + tokenizer_config.json for an imported Hugging Face one, vocab.json "
        "and merges.txt for a BPE tokenizer) so transformers.AutoModelForCausalLM."
        "from_pretrained(OUT) loads the run's newest (or --step) weights. The family follows "
        "the config: gpt2 for LayerNorm and learned positions; else qk_norm -> qwen3, q/k/v "
        "biases -> qwen2, a sliding window -> mistral, otherwise llama.",
    )
    exp.add_argument("run_path", metavar="RUN", help="a run directory")
    exp.add_argument("--out", required=True, help="the new Hugging Face directory")
    exp.add_argument("--step", type=int, default=None, help="checkpoint step (default: newest)")
    exp.set_defaults(run=run_export_hf)


def run_export_hf(args: argparse.Namespace) -> int:
    from lmjax.checks import require
    from lmjax.files import atomic_dir
    from lmjax.io import hf
    from lmjax.train.rundir import run_label

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
        family = hf.save(run.params, run.model, tmp)
        if run.tokenizer is not None and run.tokenizer.kind == "hf":
            run.tokenizer.save(tmp)  # Hugging Face's own tokenizer.json + tokenizer_config.json
        elif run.tokenizer is not None and run.tokenizer.kind == "bpe":
            run.tokenizer.save(tmp)  # vocab.json + merges.txt, as transformers expects
            (tmp / "tokenizer.json").unlink()  # lmjax's manifest; transformers reads its own
    print(
        f"exported {run_label(run.directory, run.step)} -> {out}: {family}, config.json, "
        "model.safetensors"
    )
    return 0
