"""Encode speed of a Hugging Face tokenizer.json in lmjax: now (`tokenizers`) and before.

    python benchmarks/hf_tokenizer.py [--mb 4] [--vocab 8192] [--repeats 2] [--quick]
                                      [--output FILE]

The tokenizer.json is built here, offline: a byte-level BPE in Llama 3's layout (its split
regex, then ByteLevel without a regex, ignore_merges, `<|begin_of_text|>` added by the
post-processor) trained by `tokenizers` to --vocab tokens on the first MB of the corpus (Python's
documentation, the standard library's sources and a multilingual block: the same text as
benchmarks/tokenizer.py). Then every document of two corpora is encoded, one call each, single
thread (RAYON_NUM_THREADS=1): "natural" (that text, whose words repeat, as real text's do) and
"unique words" (the same number of bytes of seeded random words, so that no cache of words
helps), by three engines in turn, in one process (so the machine's load is shared alike):

    lmjax HFTokenizer.encode (tokenizers)   lmjax now: the `tokenizers` library behind lmjax's
                                            checks
    tokenizers Tokenizer.encode             the library called directly
    lmjax before issue 34 (Python BPE)      lmjax's own pure-Python BPE loop (with its cache of
                                            words), loaded from git history at
                                            PYTHON_ENGINE_COMMIT; left out without that history

All must give the same ids. Reports MB/s of UTF-8 input, best of --repeats passes, each pass by
a fresh tokenizer (no words cached from an earlier pass). `--quick`: 0.2 MB, vocabulary 1,024
(the smoke test). Writes benchmarks/results/hf_tokenizer.json (or --output).
benchmarks/results/hf_tokenizer_python.json is an earlier run of this script's first version at
PYTHON_ENGINE_COMMIT (then lmjax's only engine was the Python one).
"""

from __future__ import annotations

import os

os.environ.setdefault("RAYON_NUM_THREADS", "1")  # before tokenizers starts its thread pool
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import random  # noqa: E402
import subprocess  # noqa: E402
import sys  # noqa: E402
import tempfile  # noqa: E402
import time  # noqa: E402
import types  # noqa: E402
from pathlib import Path  # noqa: E402

import tokenizers  # noqa: E402
from tokenizers import (  # noqa: E402
    Regex,
    Tokenizer,
    decoders,
    models,
    pre_tokenizers,
    processors,
    trainers,
)

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout, no install
from benchmarks._harness import add_output, load_average, machine, parser, write_result  # noqa: E402
from benchmarks._text import corpus, encode_speeds  # noqa: E402
from lmjax.tokenizers import load_hf_tokenizer  # noqa: E402

RESULTS = Path(__file__).parent / "results" / "hf_tokenizer.json"
PYTHON_ENGINE_COMMIT = "4af229c822f65d7de8a59d78b1a8b0e197e12c4e"  # the last with lmjax's own BPE
LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+"
)
SPECIALS = ["<|begin_of_text|>", "<|end_of_text|>", "<|eot_id|>"]


def unique_words(nbytes: int, seed: int = 0) -> list[str]:
    """Documents of random words (Latin, accented, CJK and digit characters), about `nbytes`."""
    rng = random.Random(seed)
    alphabet = "abcdefghijklmnopqrstuvwxyzéüß東京晴日本語0123456789"
    docs, size = [], 0
    while size < nbytes:
        words = ("".join(rng.choices(alphabet, k=rng.randint(2, 12))) for _ in range(5000))
        docs.append(" ".join(words))
        size += len(docs[-1].encode("utf-8"))
    return docs


def llama3_style(train_docs: list[str], vocab_size: int) -> Tokenizer:
    """A byte-level BPE laid out as Llama 3's tokenizer.json, trained on `train_docs`."""
    tok = Tokenizer(models.BPE(ignore_merges=True))
    split = pre_tokenizers.Split(Regex(LLAMA3_SPLIT), behavior="isolated", invert=False)
    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.pre_tokenizer = pre_tokenizers.Sequence([split, byte_level])
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        special_tokens=SPECIALS,
        show_progress=False,
    )
    tok.train_from_iterator(train_docs, trainer)
    bos = tok.token_to_id(SPECIALS[0])
    tok.post_processor = processors.TemplateProcessing(
        single=f"{SPECIALS[0]} $A", special_tokens=[(SPECIALS[0], bos)]
    )
    return tok


OLD_TOKEN_TEXT = """

def _old_token_text(value):
    if isinstance(value, dict):
        value = value.get("content")
    return value if isinstance(value, str) else None
"""


def python_engine(directory: str):
    """`load_hf_tokenizer(directory)` of lmjax before issue 34 (its pure-Python BPE), loaded
    from git history at PYTHON_ENGINE_COMMIT; None where that history is not at hand."""
    root = Path(__file__).resolve().parents[1]
    sources = {}
    for name in ("hf_json", "hf_tokenizer"):
        spec = f"{PYTHON_ENGINE_COMMIT}:lmjax/tokenizers/{name}.py"
        try:
            shown = subprocess.run(["git", "show", spec], cwd=root, capture_output=True, text=True)
        except OSError:
            return None
        if shown.returncode != 0:
            return None
        sources[name] = shown.stdout
    sources["hf_tokenizer"] = sources["hf_tokenizer"].replace(
        "from lmjax.tokenizers.hf_json import", "from bench_old_hf_json import"
    )
    # The old module's one call into lmjax.tokenizers.chat that chat no longer has (issue 45
    # made a special token that is neither text nor {"content": text} an error): the old reading.
    sources["hf_tokenizer"] = (
        sources["hf_tokenizer"].replace("chat.token_text(", "_old_token_text(") + OLD_TOKEN_TEXT
    )
    modules = {}
    for name in ("hf_json", "hf_tokenizer"):
        module = types.ModuleType(f"bench_old_{name}")
        sys.modules[module.__name__] = module  # dataclasses look their module up there
        exec(compile(sources[name], f"{spec} (old {name})", "exec"), module.__dict__)
        modules[name] = module
    return modules["hf_tokenizer"].load_hf_tokenizer(directory)


def bench(megabytes: float, vocab_size: int, repeats: int) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        file = f"{tmp}/tokenizer.json"
        llama3_style(corpus(min(1.0, megabytes)), vocab_size).save(file)
        start = time.perf_counter()
        ours = load_hf_tokenizer(tmp)
        load_s = time.perf_counter() - start
        engines = {
            "lmjax HFTokenizer.encode (tokenizers)": lambda: load_hf_tokenizer(tmp).encode,
            "tokenizers Tokenizer.encode": lambda: _ids(
                Tokenizer.from_file(f"{tmp}/tokenizer.json")
            ),
        }
        if python_engine(tmp) is not None:
            engines["lmjax before issue 34 (Python BPE)"] = lambda: python_engine(tmp).encode
        out = {"vocab_size": ours.vocab_size, "lmjax_load_seconds": round(load_s, 4)}
        natural, passes = corpus(megabytes), lambda _name: repeats
        print("natural text")
        out["natural"] = encode_speeds(natural, engines, passes)
        print("unique words")
        words = unique_words(out["natural"]["bytes"])
        out["unique_words"] = encode_speeds(words, engines, passes)
    return out


def _ids(tok: Tokenizer):
    return lambda text: tok.encode(text).ids


def _commit() -> str | None:
    try:
        here = Path(__file__).parent
        out = subprocess.run(["git", "rev-parse", "HEAD"], cwd=here, capture_output=True, text=True)
        return out.stdout.strip() or None
    except OSError:
        return None


def main(argv=None) -> dict:
    ap = parser(__doc__)
    ap.add_argument("--mb", type=float, default=4.0, help="encode corpus size (MB)")
    ap.add_argument("--vocab", type=int, default=8192, help="vocabulary size to train")
    ap.add_argument("--repeats", type=int, default=2, help="passes per engine (best)")
    ap.add_argument("--quick", action="store_true", help="0.2 MB, vocabulary 1,024")
    add_output(ap, RESULTS, "the JSON file to write")
    args = ap.parse_args(argv)
    mb, vocab = (0.2, 1024) if args.quick else (args.mb, args.vocab)
    result = {
        "command": "python benchmarks/hf_tokenizer.py" + (" --quick" if args.quick else ""),
        "machine": machine(
            load_average_before=load_average(),
            threads="single (RAYON_NUM_THREADS=1)",
            tokenizers=tokenizers.__version__,
            commit=_commit(),
        ),
        "encode": bench(mb, vocab, args.repeats),
    }
    write_result(args.output, result, indent=1)
    print(f"wrote {args.output}")
    return result | {"path": str(args.output)}


if __name__ == "__main__":
    main()
