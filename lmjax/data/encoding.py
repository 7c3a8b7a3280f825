"""Text to ids for `prepare`: safe chunk cuts, and batches of documents encoded by workers.

`chunks` cuts a long text only where no tokenizer here merges across the cut, so the ids of
the pieces concatenated are the ids of the whole (bounding the Python list one encode call
builds). `encode_batches` hands batches of documents to `workers` processes and returns their
ids in submission order, with at most `2 * workers` batches in flight: memory is bounded by
that buffer, and the output is the same whatever the worker count.
"""

from __future__ import annotations

import collections
import multiprocessing
import re
from collections.abc import Iterator

import numpy as np

from lmjax import tokenizers
from lmjax.errors import LMJaxError

CHUNK = 1 << 20  # characters per encode call

# A cut between "word\n" and the next word: no tokenizer here (GPT-2's pre-tokenizer included)
# merges across a lone newline between two non-space characters, so the ids of the chunks
# concatenated equal the ids of the whole text.
_CUT = re.compile(r"(?<=\S\n)(?=\S)")


def chunks(text: str, size: int = CHUNK) -> Iterator[str]:
    """Pieces of about `size` characters, cut only where tokenization cannot straddle."""
    start = 0
    while len(text) - start > size:
        window = text[start + size // 2 : start + size]
        cuts = [m.start() for m in _CUT.finditer(window)]
        if not cuts:  # no safe cut nearby: keep the rest whole rather than risk a split
            break
        end = start + size // 2 + cuts[-1]
        yield text[start:end]
        start = end
    yield text[start:]


def encode_text(tok, text: str, dtype, size: int = CHUNK) -> np.ndarray:
    """`tok.encode(text)` as a `[L]` array of `dtype`, encoded chunk by chunk (`size`
    characters). A Hugging Face tokenizer's post-processor ids (Llama 3's
    `<|begin_of_text|>`) go around the whole text once, not around every chunk."""
    pieces = list(chunks(text, size))
    if len(pieces) == 1:
        return np.asarray(tok.encode(text), dtype=dtype)
    before, after = tok.specials_around() if hasattr(tok, "specials_around") else ([], [])
    if before or after:
        parts = [np.asarray(tok.encode(p, add_special_tokens=False), dtype) for p in pieces]
    else:
        parts = [np.asarray(tok.encode(p), dtype) for p in pieces]
    return np.concatenate([np.asarray(before, dtype), *parts, np.asarray(after, dtype)])


_WORKER: dict = {}  # this process's tokenizer and dtype (set by encode_batches / _start_worker)


def _start_worker(tokenizer_dir: str, dtype: str) -> None:
    _WORKER["tok"], _WORKER["dtype"] = tokenizers.load(tokenizer_dir), np.dtype(dtype)


def _encode_batch(texts: list[str]) -> list:
    """Each text's ids `[L]`, or the message of the error its encoding raised (the caller
    names the record)."""
    out = []
    for text in texts:
        try:
            out.append(encode_text(_WORKER["tok"], text, _WORKER["dtype"]))
        except LMJaxError as err:
            out.append(str(err))
    return out


def encode_batches(batches, tok, tokenizer_dir, dtype: str, workers: int) -> Iterator[tuple]:
    """`(tag, ids per text)` for each `(tag, texts)` of `batches`, in order, encoded by `tok`.

    `workers` 1 encodes in this process; more start a pool whose workers each load the
    tokenizer saved at `tokenizer_dir`. They are never forked from this process: it has JAX
    loaded, whose threads may hold locks at the fork that the child then waits on forever
    (Python 3.12 warns of it). A fork server (one fresh interpreter that imports this module
    once, ~3 s, and forks the workers) where the platform has one, else spawned interpreters."""
    _WORKER["tok"], _WORKER["dtype"] = tok, np.dtype(dtype)
    if workers == 1:
        for tag, texts in batches:
            yield tag, _encode_batch(texts)
        return
    server = "forkserver" in multiprocessing.get_all_start_methods()
    context = multiprocessing.get_context("forkserver" if server else "spawn")
    if server:
        context.set_forkserver_preload([__name__])
    start = (_start_worker, (str(tokenizer_dir), dtype))
    with context.Pool(workers, *start) as pool:
        pending = collections.deque()
        for tag, texts in batches:
            pending.append((tag, pool.apply_async(_encode_batch, (texts,))))
            if len(pending) >= 2 * workers:  # the bound: wait for the oldest batch
                yield _done(pending)
        while pending:
            yield _done(pending)


def _done(pending: collections.deque) -> tuple:
    tag, result = pending.popleft()
    return tag, result.get()
