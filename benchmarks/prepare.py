"""Preparing a .jsonl corpus: `lmjax prepare` vs Hugging Face `datasets` map + `tokenizers`.

    python benchmarks/prepare.py [--mb 50] [--workers N] [--output FILE] [--quick]

The corpus: a synthetic `.jsonl` of about `--mb` MB, built deterministically from the bundled
Shakespeare text (its paragraphs grouped into documents of 1-8 KB, cycled, each numbered).
Both sides tokenize it with GPT-2's vocabulary (lmjax's `gpt2` tokenizer; `tokenizers`'
ByteLevel BPE from the same encoder.json / vocab.bpe files) and end every document with
`<|endoftext|>` (50256):

    lmjax     lmjax.data.prepare(corpus, tokenizer="gpt2", workers=N): token shards +
              document index on disk
    datasets  Dataset.from_json(corpus).map(encode_batch, batched=True, num_proc=N): the arrow
              cache on disk (the ids column)

Each runs in a fresh subprocess (its peak RSS is its own: ru_maxrss of the process and of its
largest worker), single-threaded per process (RAYON_NUM_THREADS=1), N processes each. The
witness: both produce the same number of tokens. Reports MB/s of corpus file bytes and peak
memory, with the load average before and after (the machine may be shared). Writes
benchmarks/results/prepare.json (or --output).
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

RESULTS = Path(__file__).parent / "results" / "prepare.json"
ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # run from a checkout, no install

from benchmarks._harness import add_output, load_average, machine, parser, write_result  # noqa: E402

EOT = 50256


def write_corpus(path: Path, megabytes: float) -> dict:
    """The synthetic corpus at `path`: documents of the bundled text's paragraphs, cycled."""
    from lmjax.data.corpus import shakespeare_path

    paragraphs = [p for p in shakespeare_path().read_text().split("\n\n") if p.strip()]
    target, size, n, i = int(megabytes * 1e6), 0, 0, 0
    with open(path, "w", encoding="utf-8") as handle:
        while size < target:
            want, parts = 1000 + (n * 7919) % 7000, []  # 1-8 KB, a fixed sequence
            while sum(map(len, parts)) < want:
                parts.append(paragraphs[i % len(paragraphs)])
                i += 1
            line = json.dumps({"id": n, "text": f"Document {n}.\n" + "\n\n".join(parts)}) + "\n"
            handle.write(line)
            size += len(line.encode("utf-8"))
            n += 1
    return {"bytes": path.stat().st_size, "documents": n}


def run_lmjax(corpus: Path, out: Path, workers: int) -> dict:
    from lmjax import data

    start = time.perf_counter()
    directory = data.prepare(str(corpus), out, tokenizer="gpt2", progress=False, workers=workers)
    seconds = time.perf_counter() - start
    meta = data.open_prepared(directory).meta
    return {"seconds": seconds, "tokens": meta["train_tokens"] + meta["val_tokens"]}


def run_datasets(corpus: Path, out: Path, workers: int) -> dict:
    from datasets import Dataset, disable_progress_bars
    from tokenizers import Tokenizer, models, pre_tokenizers

    from lmjax.data.corpus import cache_dir
    from lmjax.tokenizers.gpt2 import fetch_gpt2_files

    disable_progress_bars()
    encoder, vocab_bpe = fetch_gpt2_files(cache_dir() / "gpt2")
    tok = Tokenizer(models.BPE.from_file(str(encoder), str(vocab_bpe)))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)

    def encode(batch):
        return {"ids": [e.ids + [EOT] for e in tok.encode_batch(batch["text"])]}

    start = time.perf_counter()
    ds = Dataset.from_json(str(corpus), cache_dir=str(out))
    ds = ds.map(encode, batched=True, num_proc=workers, remove_columns=ds.column_names)
    seconds = time.perf_counter() - start
    tokens = sum(len(ids) for batch in ds.iter(batch_size=4096) for ids in batch["ids"])
    return {"seconds": seconds, "tokens": tokens}


def child(args) -> None:
    """One measured run (in its own process): prints its JSON result."""
    run = {"lmjax": run_lmjax, "datasets": run_datasets}[args.child]
    result = run(Path(args.corpus), Path(args.out), args.workers)
    kib = 1024  # ru_maxrss is in KiB on Linux
    result["peak_rss_mb"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * kib / 1e6
    result["peak_worker_rss_mb"] = (
        resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss * kib / 1e6
    )
    print(json.dumps(result))


def measure(tool: str, corpus: Path, work: Path, workers: int, in_process: bool) -> dict:
    if in_process:  # the smoke test: no fresh interpreter, so no peak memory either
        run = {"lmjax": run_lmjax, "datasets": run_datasets}[tool]
        result = run(corpus, work / f"{tool}-out", workers)
        return {**result, "mb_per_s": corpus.stat().st_size / 1e6 / result["seconds"]}
    env = dict(os.environ, RAYON_NUM_THREADS="1", TOKENIZERS_PARALLELISM="false")
    env.update(HF_DATASETS_OFFLINE="1", HF_HUB_OFFLINE="1", JAX_PLATFORMS="cpu")
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")])
    env["HF_DATASETS_CACHE"] = str(work / f"{tool}-hf-cache")
    out = work / f"{tool}-out"
    argv = [sys.executable, __file__, "--child", tool, "--corpus", str(corpus)]
    argv += ["--out", str(out), "--workers", str(workers)]
    done = subprocess.run(argv, env=env, capture_output=True, text=True)
    if done.returncode != 0:
        raise RuntimeError(f"{tool} run failed:\n{done.stderr[-3000:]}")
    result = json.loads(done.stdout.strip().splitlines()[-1])
    result["mb_per_s"] = corpus.stat().st_size / 1e6 / result["seconds"]
    return result


def main(argv=None) -> dict:
    ap = parser(__doc__)
    ap.add_argument("--mb", type=float, default=50.0, help="corpus size (MB)")
    ap.add_argument("--workers", type=int, default=min(os.cpu_count() or 1, 4))
    add_output(ap, RESULTS, "the JSON file to write")
    ap.add_argument("--quick", action="store_true", help="0.2 MB, one worker (smoke test)")
    ap.add_argument(
        "--in-process", action="store_true", help="no subprocesses (no peak memory): tests"
    )
    ap.add_argument("--child", choices=("lmjax", "datasets"), help=argparse.SUPPRESS)
    ap.add_argument("--corpus", help=argparse.SUPPRESS)
    ap.add_argument("--out", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.child:
        child(args)
        return {}
    megabytes, workers = (0.2, 1) if args.quick else (args.mb, args.workers)
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        corpus = work / "corpus.jsonl"
        made = write_corpus(corpus, megabytes)
        load_before = load_average()
        tools = ("lmjax", "datasets")
        runs = {tool: measure(tool, corpus, work, workers, args.in_process) for tool in tools}
        load_after = load_average()
    result = {
        "machine": machine(load_average_before=load_before, load_average_after=load_after),
        "corpus": {**made, "megabytes": megabytes, "format": "jsonl"},
        "workers": workers,
        "tokenizer": "GPT-2 (50,257), <|endoftext|> after each document",
        "runs": runs,
        "same_token_count": runs["lmjax"]["tokens"] == runs["datasets"]["tokens"],
        "speed_ratio_lmjax_over_datasets": runs["lmjax"]["mb_per_s"] / runs["datasets"]["mb_per_s"],
    }
    write_result(args.output, result, indent=1)
    print(json.dumps(result, indent=1))
    return {**result, "path": str(args.output)}


if __name__ == "__main__":
    main()
