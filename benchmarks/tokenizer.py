"""Tokenizer speed: lmjax BPE encode vs tiktoken and Hugging Face `tokenizers`, and training.

    python benchmarks/tokenizer.py [--mb 4] [--train-mb 2] [--vocab 8192] [--output FILE]

Encode: the GPT-2 vocabulary (fetched with pip, hash-checked, see lmjax.tokenizers.gpt2) on the
same few MB of varied text (Python's documentation, then the standard library's sources and a
multilingual block), one document per call, single thread (RAYON_NUM_THREADS=1 for the Rust
libraries). Reports MB/s of UTF-8 input, best of 3, for lmjax's fast path (tiktoken's engine over
lmjax's ranks), lmjax's pure-Python reference, tiktoken's gpt2 encoding and `tokenizers`' BPE;
all four must produce identical ids. Training: lmjax's `BPETokenizer.train` vs `tokenizers`'
`BpeTrainer` (ByteLevel, single thread) at the same vocabulary size on the same corpus, and
whether both learned the same merges. Writes benchmarks/results/tokenizer.json (or --output).
"""

from __future__ import annotations

import os

os.environ.setdefault("RAYON_NUM_THREADS", "1")  # before tokenizers/tiktoken start their pools
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import json  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402
from pathlib import Path  # noqa: E402

import tiktoken  # noqa: E402
from tiktoken.load import data_gym_to_mergeable_bpe_ranks  # noqa: E402
from tiktoken_ext import openai_public  # noqa: E402
from tokenizers import Tokenizer, models, pre_tokenizers, trainers  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout, no install
from benchmarks._harness import add_output, machine, parser, write_result  # noqa: E402
from benchmarks._text import corpus, encode_speeds  # noqa: E402
from lmjax.tokenizers import BPETokenizer  # noqa: E402
from lmjax.tokenizers.bpe import BYTE_TO_CHAR  # noqa: E402
from lmjax.tokenizers.gpt2 import fetch_gpt2_files, load_gpt2  # noqa: E402

CACHE = Path(os.environ.get("LMJAX_TEST_ASSETS", Path.home() / ".cache/lmjax/test-assets"))
RESULTS = Path(__file__).parent / "results" / "tokenizer.json"


def bench_encode(megabytes: float) -> dict:
    encoder, vocab_bpe = fetch_gpt2_files(CACHE / "gpt2")
    ours = load_gpt2(encoder, vocab_bpe)
    ranks = data_gym_to_mergeable_bpe_ranks(str(vocab_bpe), str(encoder))
    tik = tiktoken.Encoding(
        "gpt2", pat_str=openai_public.r50k_pat_str, mergeable_ranks=ranks,
        special_tokens={"<|endoftext|>": 50256},
    )  # fmt: skip
    hf = Tokenizer(models.BPE.from_file(str(encoder), str(vocab_bpe)))
    hf.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    docs = corpus(megabytes)
    ours.encode(docs[0])  # build the engine outside the timing
    runs = {
        "lmjax (tiktoken engine over lmjax ranks)": ours.encode_ordinary,
        "lmjax pure-Python reference": ours.with_options(engine="python").encode_ordinary,
        "tiktoken gpt2": tik.encode_ordinary,
        "tokenizers (HF) BPE": lambda d: hf.encode(d).ids,
    }
    engines = {name: (lambda fn=fn: fn) for name, fn in runs.items()}  # the same fn each pass
    passes = lambda name: 1 if "reference" in name else 3  # noqa: E731 (the reference is slow)
    return encode_speeds(docs, engines, passes, rate="MB_per_s", digits=2)


def bench_train(megabytes: float, vocab_size: int) -> dict:
    docs = corpus(megabytes)
    start = time.perf_counter()
    ours = BPETokenizer.train(docs, vocab_size, special_tokens=())
    ours_s = time.perf_counter() - start
    hf = Tokenizer(models.BPE())
    hf.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        special_tokens=[], show_progress=False,
    )  # fmt: skip
    start = time.perf_counter()
    hf.train_from_iterator(docs, trainer)
    hf_s = time.perf_counter() - start
    theirs = json.loads(hf.to_str())["model"]["merges"]
    theirs = [tuple(m) if isinstance(m, list) else tuple(m.split(" ")) for m in theirs]
    text = lambda t: "".join(BYTE_TO_CHAR[b] for b in t)  # noqa: E731
    same = [(text(a), text(b)) for a, b in ours.merges] == theirs
    print(f"train {vocab_size}: lmjax {ours_s:.2f} s, tokenizers {hf_s:.2f} s, same merges {same}")
    return {
        "bytes": sum(len(d.encode("utf-8")) for d in docs),
        "vocab_size": vocab_size,
        "lmjax_seconds": round(ours_s, 3),
        "tokenizers_seconds": round(hf_s, 3),
        "same_merges": same,
    }


def main() -> None:
    ap = parser(__doc__)
    ap.add_argument("--mb", type=float, default=4.0, help="encode corpus size (MB)")
    ap.add_argument("--train-mb", type=float, default=2.0, help="training corpus size (MB)")
    ap.add_argument("--vocab", type=int, default=8192, help="training vocabulary size")
    add_output(ap, RESULTS, "the JSON file to write")
    args = ap.parse_args()
    result = {
        "machine": machine(threads="single (RAYON_NUM_THREADS=1)", tiktoken=tiktoken.__version__),
        "encode": bench_encode(args.mb),
        "train": bench_train(args.train_mb, args.vocab),
    }
    write_result(args.output, result, indent=1)
    print(f"wrote {args.output}")


if __name__ == "__main__":
    main()
