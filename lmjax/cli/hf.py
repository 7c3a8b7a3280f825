"""`lmjax import-hf` and `lmjax export-hf`: Hugging Face checkpoints (gpt2, llama, mistral,
qwen2, qwen3) in and out of lmjax run directories, with their tokenizers."""

from __future__ import annotations

import argparse
import json
import shutil
from pathlib import Path

from lmjax.cli.args import add_run, add_step
from lmjax.cli.common import load_run
from lmjax.errors import CheckpointError, LMJaxError

GENERATION_CONFIG = "generation_config.json"  # lmjax.chat's name, without importing it here


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
        "so: copy the original run's tokenizer/ into OUT). generation_config.json (the "
        "model's end-of-sequence ids, for lmjax chat) is kept in OUT/tokenizer/. SOURCE may "
        "be a model id ORG/NAME: its snapshot in the Hugging Face cache (HF_HUB_CACHE, "
        "HF_HOME) is read; nothing is downloaded without --download (and HF_HUB_OFFLINE=1 "
        "forbids that too).",
    )
    imp.add_argument(
        "source",
        help="a Hugging Face checkpoint directory, a .safetensors file, or a model id ORG/NAME "
        "(from the Hugging Face cache)",
    )
    imp.add_argument("--out", required=True, help="the new run directory")
    imp.add_argument("--dtype", default="float32", help="parameter dtype (default float32)")
    imp.add_argument(
        "--download",
        action="store_true",
        help="ORG/NAME: download what is missing from the Hugging Face Hub (default: the "
        "local cache only)",
    )
    imp.add_argument(
        "--revision", default=None, help="ORG/NAME: a branch, tag or commit (default: main)"
    )
    imp.set_defaults(run=run_import_hf)


def run_import_hf(args: argparse.Namespace) -> int:
    from lmjax import params as ptree
    from lmjax.io import hf, hf_gpt2
    from lmjax.io.hf_hub import resolve
    from lmjax.tokenizers import gpt2
    from lmjax.train.runs import write_weights_run

    source = resolve(args.source, download=args.download, revision=args.revision)
    family = hf.model_type(source)
    params, model = hf.load(source, dtype=args.dtype)
    # "hf": the files beside SOURCE (the model's own), or none; "gpt2": GPT-2's fetched vocabulary
    tokenizer, note, kind = _hf_tokenizer(source), "", "hf"
    if tokenizer is not None:
        hf_gpt2.check_tokenizer(tokenizer, model, source)
    elif family == "gpt2" and model.vocab_size == gpt2.VOCAB_SIZE:
        from lmjax.data.prepared import gpt2_tokenizer

        tokenizer, kind = gpt2_tokenizer(), "gpt2"
        note = " (no vocab.json/merges.txt beside it: GPT-2's own vocabulary is used)"
    else:  # GPT-2's vocabulary would encode ids this model lacks: write none rather than guess
        note = (
            f", no tokenizer (no tokenizer.json or vocab.json/merges.txt beside it, and "
            f"{_not_gpt2(family, model.vocab_size)}: copy the tokenizer/ of "
            f"the run it came from into {args.out}/tokenizer, or put the files beside it and "
            "import again)"
        )
    generation_config = _generation_config(source) if tokenizer is not None else None
    if tokenizer is not None:  # chat's stop ids: a bad eos_token or eos_token_id fails here
        from lmjax.chat import stop_ids

        stop_ids(tokenizer, json.loads(generation_config or "{}"), model.vocab_size)
    if generation_config is not None:  # beside the tokenizer: chat's end-of-turn ids
        tokenizer = _WithFile(tokenizer, GENERATION_CONFIG, generation_config)
    try:
        write_weights_run(args.out, params, model, tokenizer, kind)
    except OSError as err:  # the output can't be made (a file in the path, no permission...)
        if isinstance(err, LMJaxError):
            raise
        expected = f"a new directory lmjax can write ({err.strerror or err})"
        fix = "pick a writable location (nothing was written)"
        raise CheckpointError.describe("--out", args.out, expected, fix) from err
    count = f"{ptree.count(params):,} parameters"
    cached = f" ({source})" if str(source) != str(args.source) else ""
    print(f"imported {args.source}{cached} -> {args.out}: {family}, {count}{note}")
    return 0


def _not_gpt2(family: str, vocab_size: int) -> str:
    """Why GPT-2's own vocabulary is not the model's: the clause of import-hf's note."""
    from lmjax.tokenizers import gpt2

    if family != "gpt2":
        return f"GPT-2's vocabulary is not a {family} model's"
    return f"vocab_size {vocab_size} is not GPT-2's {gpt2.VOCAB_SIZE:,}"


class _WithFile:
    """A tokenizer that saves one more file beside its own (inside the run's atomic write)."""

    def __init__(self, tokenizer, name: str, text: str):
        self._tokenizer, self._name, self._text = tokenizer, name, text

    def __getattr__(self, attr):
        return getattr(self._tokenizer, attr)

    def save(self, directory) -> None:
        from lmjax.files import atomic_write_text

        self._tokenizer.save(directory)
        atomic_write_text(Path(directory) / self._name, self._text)


def _generation_config(source: Path) -> str | None:
    """The text of the generation_config.json beside a checkpoint, checked (None if absent)."""
    from lmjax.chat import eos_ids, read_generation_config

    directory = source if source.is_dir() else source.parent
    path = directory / GENERATION_CONFIG
    if not path.is_file():
        return None
    eos_ids(read_generation_config(directory), str(path))  # a bad file fails the import
    return path.read_text(encoding="utf-8")


def _hf_tokenizer(source: Path):
    """The tokenizer files next to a Hugging Face checkpoint, if any: tokenizer.json (with its
    tokenizer_config.json), else either GPT-2 pair."""
    from lmjax.tokenizers import BPETokenizer, load_hf_tokenizer

    directory = source if source.is_dir() else source.parent
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
        "and merges.txt for a BPE tokenizer; the generation_config.json import-hf kept) so "
        "transformers.AutoModelForCausalLM."
        "from_pretrained(OUT) loads the run's newest (or --step) weights. The family follows "
        "the config: gpt2 for LayerNorm and learned positions; else qk_norm -> qwen3, q/k/v "
        "biases -> qwen2, a sliding window -> mistral, otherwise llama.",
    )
    add_run(exp, "a run directory")
    exp.add_argument("--out", required=True, help="the new Hugging Face directory")
    add_step(exp)
    exp.set_defaults(run=run_export_hf)


def run_export_hf(args: argparse.Namespace) -> int:
    from lmjax.chat import generation_config_dir
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
        if run.tokenizer is not None and (found := generation_config_dir(run.directory)):
            shutil.copyfile(found / GENERATION_CONFIG, tmp / GENERATION_CONFIG)  # stop ids
    print(
        f"exported {run_label(run.directory, run.step)} -> {out}: {family}, config.json, "
        "model.safetensors"
    )
    return 0
