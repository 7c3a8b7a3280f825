"""Packed rows: whole documents laid end to end in a row, with segment ids and a loss mask.

A row is `T + 1` token slots (inputs are slots 0..T-1, targets slots 1..T). Row r of batch
`index` of `stream` (0 train, 1 evaluation) is a pure function of (seed, stream, index, r):

    p      = a token position drawn uniformly from the split (the same draw as a random crop)
    first  = the document holding p; if it is longer than a row, the piece of it holding p,
             pieces starting every T tokens (each piece's last token is the next one's first,
             so every token of the document is predicted exactly once over its pieces)
    then   the documents after it, whole and in order, while the next one fits the slots left
    tail   padding (id 0, segment 0) when the next document does not fit

Trade-off: the tail is padding rather than the start of a document cut at the row's end, so
no row starts a document mid-way except the pieces of a document longer than a row, at the
price of padded slots (`packing_efficiency` = the fraction of real targets, reported per
batch). Documents are drawn in proportion to their length, as crops draw text.

Each row carries (api.md "Batches"):

    segment_ids [T]  int32: 1, 2, ... per document (restarting each row), 0 on padding
    loss_mask   [T]  float32: 1 where target t is the next token of input t's document
                     (same segment, not padding); 0 across a boundary and on padding
"""

from __future__ import annotations

import numpy as np


def _first_piece(offsets, d: int, p: int, seq_len: int) -> tuple[int, int]:
    """(start, stop) of the piece of document d holding token p: at most T + 1 ids."""
    start, stop = int(offsets[d]), int(offsets[d + 1])
    n_pieces = max(1, -(-(stop - start - 1) // seq_len))  # each piece predicts >= 1 token
    k = min((p - start) // seq_len, n_pieces - 1)
    return start + k * seq_len, min(start + k * seq_len + seq_len + 1, stop)


def _row_spans(offsets, p: int, seq_len: int) -> list[tuple[int, int]]:
    """The (start, stop) spans of the split that row `p` packs, in order, T + 1 ids at most."""
    d = int(np.searchsorted(offsets, p, side="right")) - 1
    start, stop = _first_piece(offsets, d, p, seq_len)
    spans, room = [(start, stop)], seq_len + 1 - (stop - start)
    if stop != int(offsets[d + 1]) or room == 0:
        return spans  # a piece of a longer document fills the row alone
    # Every document has >= 1 id, so at most `room` of the next ones can fit.
    ends = np.asarray(offsets[d + 1 : d + 2 + room], dtype=np.int64)
    fits = int(np.searchsorted(ends[1:] - stop, room, side="right"))
    return spans + [(int(a), int(b)) for a, b in zip(ends[:fits], ends[1 : fits + 1], strict=True)]


def packed_row(tokens, offsets, p: int, seq_len: int):
    """(ids [T + 1], segment [T + 1], source position [T + 1]; -1 = padding) of row `p`."""
    ids = np.zeros(seq_len + 1, np.int64)
    segment = np.zeros(seq_len + 1, np.int32)
    position = np.full(seq_len + 1, -1, np.int64)
    at = 0
    for number, (start, stop) in enumerate(_row_spans(offsets, p, seq_len), 1):
        ids[at : at + stop - start] = np.asarray(tokens[start:stop])
        segment[at : at + stop - start] = number
        position[at : at + stop - start] = np.arange(start, stop)
        at += stop - start
    return ids, segment, position


def row_positions(n_tokens: int, seed: int, stream: int, index: int, n: int, pick=None):
    """The `n` draws `p` of batch `index` (`pick`: only those rows), as `crops` draws starts."""
    rng = np.random.default_rng((seed, stream, index))
    draws = rng.integers(0, n_tokens, size=n)
    return draws if pick is None else draws[np.asarray(pick, dtype=np.int64)]


def packed_rows(tokens, offsets, draws, seq_len: int):
    """The packed rows of `draws`: (arrays dict of `[n, T]`, source positions `[n, T + 1]`)."""
    rows = [packed_row(tokens, offsets, int(p), seq_len) for p in draws]
    ids = np.stack([r[0] for r in rows])
    segment = np.stack([r[1] for r in rows])
    positions = np.stack([r[2] for r in rows])
    same = (segment[:, :-1] == segment[:, 1:]) & (segment[:, :-1] > 0)
    arrays = {
        "inputs": ids[:, :-1].astype(np.int32),
        "targets": ids[:, 1:].astype(np.int32),
        "segment_ids": segment[:, :-1],
        "loss_mask": same.astype(np.float32),
    }
    return arrays, positions


def packing_efficiency(batch: dict) -> float:
    """The fraction of a batch's target slots that are real next tokens: mean(loss_mask)
    (1.0 for an unpacked batch, which has no mask)."""
    mask = batch.get("loss_mask")
    return 1.0 if mask is None else float(np.mean(mask))
