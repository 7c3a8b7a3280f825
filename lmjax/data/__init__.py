"""The data pipeline (docs/training.md): everything from a corpus on disk to batches of ids.

    corpus, corpus_files   where a corpus is (the bundled Shakespeare, files, globs) and its
                           formats: .txt, .jsonl[.gz], .parquet
    encoding, text_stream  text to ids through a tokenizer, in bounded chunks
    prepare_docs, shards   a corpus of documents split by whole documents, written as token
                           shards with document offsets
    prepared               `prepare`: a prepared data directory (meta.json, tokenizer/, SPLIT.bin,
                           SPLIT.idx), opened again by `open_prepared`
    sft, sft_records,      supervised fine-tuning records (chat, Alpaca, prompt/completion) to a
    sft_rows               prepared directory plus a loss mask per split
    packing, batches       rows of a batch: random crops or packed whole documents, a pure
                           function of (seed, step)
    prefetch               the next batches built on a host thread while a step runs

It imports the layers below it (errors, checks, config, files, models' config, tokenizers) and
nothing of `lmjax.train`, `lmjax.finetune` or `lmjax.cli`, which read batches from it.

    data_dir = lmjax.data.prepare("input.txt", tokenizer="char")
    prepared = lmjax.data.open_prepared(data_dir)
    batch = lmjax.data.train_batch(prepared.train, seed, step, batch_size, seq_len, 1)
"""

from lmjax.data.prepared import (
    DTYPES,
    FORMAT,
    TOKENIZER_DIR,
    DocOptions,
    Prepared,
    cache_dir,
    check_vocab,
    corpus_digest,
    corpus_files,
    corpus_settings,
    crops,
    default_dir,
    default_workers,
    eval_batch,
    files_sha256,
    format_of,
    gpt2_tokenizer,
    known_vocab_size,
    open_index,
    open_prepared,
    open_shards,
    packed,
    packing_efficiency,
    prepare,
    prepare_section,
    shakespeare_path,
    train_batch,
)

__all__ = [
    "DTYPES",
    "FORMAT",
    "TOKENIZER_DIR",
    "DocOptions",
    "Prepared",
    "cache_dir",
    "check_vocab",
    "corpus_digest",
    "corpus_files",
    "corpus_settings",
    "crops",
    "default_dir",
    "default_workers",
    "eval_batch",
    "files_sha256",
    "format_of",
    "gpt2_tokenizer",
    "known_vocab_size",
    "open_index",
    "open_prepared",
    "open_shards",
    "packed",
    "packing_efficiency",
    "prepare",
    "prepare_section",
    "shakespeare_path",
    "train_batch",
]
