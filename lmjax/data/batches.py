"""Training and evaluation batches from a split's ids: a pure function of (seed, step).

Row draws come from `numpy.random.default_rng((seed, stream, index))`, stream 0 for training
and 1 for evaluation, so a resumed run sees exactly the batches an uninterrupted run would have
seen. Unpacked (the default): random crops of T + 1 ids across documents. Packed (`documents`
given, data.packing): rows of whole documents with segment_ids and loss_mask (`packing`).
"""

from __future__ import annotations

import numpy as np

from lmjax.data import packing, sft_rows
from lmjax.data.sft_rows import SFTSplit
from lmjax.errors import ConfigError, TokenError

packing_efficiency = packing.packing_efficiency


def crops(tokens, seed, stream, index, n, seq_len, pick=None, vocab_size=None):
    """`n` random windows of `seq_len + 1` tokens: (inputs, targets), each int32 `[n, seq_len]`.

    `tokens`: `[N]` ids (an array or memmap); the rest are ints (`pick` a sequence of them).
    The starts are a pure function of (seed, stream, index); `pick` (row indices) reads only
    those of the `n` windows (a host's share of a sharded batch, `lmjax.parallel`).
    `vocab_size`: every id must be below it, else `TokenError` naming the id and its position
    (a corrupt token file: the embedding gather would silently clamp the id).
    """
    _check_length(tokens, seq_len)
    rng = np.random.default_rng((seed, stream, index))
    starts = rng.integers(0, len(tokens) - seq_len, size=n)
    starts = starts if pick is None else starts[np.asarray(pick, dtype=np.int64)]
    windows = np.stack([np.asarray(tokens[s : s + seq_len + 1]) for s in starts])
    positions = starts[:, None] + np.arange(seq_len + 1)
    _check_ids(windows, positions, tokens, stream, index, vocab_size)
    windows = windows.astype(np.int32)
    return windows[:, :-1], windows[:, 1:]


def _check_length(tokens, seq_len: int) -> None:
    if len(tokens) < seq_len + 1:
        raise ConfigError.describe(
            "token split length",
            len(tokens),
            f"at least seq_len + 1 = {seq_len + 1} tokens",
            "lower train.seq_len or use a longer corpus / smaller data.val_fraction",
        )


def _check_ids(ids_NT, positions_NT, tokens, stream: int, index: int, vocab_size) -> None:
    """Every id of `ids_NT` (read from `positions_NT` of `tokens`; -1 = padding) is below
    `vocab_size` (None: unchecked), else `TokenError` naming the first bad id's position."""
    if vocab_size is None or not ids_NT.size or int(ids_NT.max()) < vocab_size:
        return
    row, col = (int(i[0]) for i in np.nonzero(ids_NT >= vocab_size))
    where = getattr(tokens, "filename", None) or "the token array"
    # Training names the step as the loop and metrics.jsonl do (1-based).
    batch = f"train step {index + 1}" if stream == 0 else f"validation batch {index}"
    raise TokenError.describe(
        f"token id at position {int(positions_NT[row, col])} of {where} ({batch})",
        int(ids_NT[row, col]),
        f"an id below the vocabulary size {vocab_size}",
        "prepare the data again (the token file is corrupt or from another tokenizer)",
    )


def packed(tokens, documents, seed, stream, index, n, seq_len, pick=None, vocab_size=None):
    """`n` packed rows (`packing`): a dict of `[n, seq_len]` inputs, targets, segment_ids and
    loss_mask. `documents`: the split's `[D + 1]` offsets; the rest as in `crops`."""
    _check_length(tokens, seq_len)
    draws = packing.row_positions(len(tokens), seed, stream, index, n, pick)
    arrays, positions = packing.packed_rows(tokens, documents, draws, seq_len)
    return _checked(arrays, positions, tokens, stream, index, vocab_size)


def _checked(arrays: dict, positions_NT, tokens, stream: int, index: int, vocab_size) -> dict:
    """`arrays` (inputs, targets `[n, T]` read from `positions_NT [n, T + 1]`), ids checked."""
    ids = np.concatenate([arrays["inputs"], arrays["targets"][:, -1:]], axis=1)
    _check_ids(ids, positions_NT, tokens, stream, index, vocab_size)
    return arrays


def sft(split: SFTSplit, seed, stream, index, n, seq_len, pick, vocab_size, packed_rows: bool):
    """`n` rows of supervised fine-tuning records (`sft_rows`): loss only on completions."""
    arrays, positions = sft_rows.rows(split, seed, stream, index, n, seq_len, packed_rows, pick)
    return _checked(arrays, positions, split, stream, index, vocab_size)


def train_batch(
    tokens,
    seed: int,
    step: int,
    batch_size: int,
    seq_len: int,
    accum: int,
    rows=None,
    vocab_size: int | None = None,
    documents=None,
) -> dict:
    """The batch of optimizer step `step`: inputs/targets `[accum, batch_size/accum, T]`.

    `rows`: only these rows of every micro-batch, `[accum, len(rows), T]` (one host's share).
    `vocab_size`: check every id against it (`crops`). `documents`: the split's document
    offsets (`Prepared.train_documents`): rows packed with whole documents, the batch then
    also holding segment_ids and loss_mask (api.md "Batches"); None: random crops.
    `tokens` an `SFTSplit` (supervised fine-tuning): its records' rows (`sft`), packed when
    `documents` is given (the trainer passes it under data.packing).
    """
    micro = batch_size // accum
    pick = None if rows is None else [a * micro + r for a in range(accum) for r in rows]
    shape = (accum, micro if rows is None else len(rows), seq_len)
    if isinstance(tokens, SFTSplit):
        packs = documents is not None
        arrays = sft(tokens, seed, 0, step, batch_size, seq_len, pick, vocab_size, packs)
        return {k: v.reshape(shape) for k, v in arrays.items()}
    if documents is not None:
        arrays = packed(tokens, documents, seed, 0, step, batch_size, seq_len, pick, vocab_size)
        return {k: v.reshape(shape) for k, v in arrays.items()}
    inputs, targets = crops(tokens, seed, 0, step, batch_size, seq_len, pick, vocab_size)
    return {"inputs": inputs.reshape(shape), "targets": targets.reshape(shape)}


def eval_batch(
    tokens,
    seed: int,
    index: int,
    batch_size: int,
    seq_len: int,
    vocab_size: int | None = None,
    documents=None,
) -> dict:
    """Evaluation batch `index` (the same every time it is asked for): a dict of `[B, T]`
    inputs and targets (+ segment_ids and loss_mask with `documents`, as `train_batch`)."""
    if isinstance(tokens, SFTSplit):
        packs = documents is not None
        return sft(tokens, seed, 1, index, batch_size, seq_len, None, vocab_size, packs)
    if documents is not None:
        return packed(tokens, documents, seed, 1, index, batch_size, seq_len, None, vocab_size)
    inputs, targets = crops(tokens, seed, 1, index, batch_size, seq_len, vocab_size=vocab_size)
    return {"inputs": inputs, "targets": targets}
