"""Training rows of supervised fine-tuning records, with the loss only on completion tokens.

A prepared SFT split (`lmjax.data.sft`) is the records' ids end to end, their document offsets
and a per-token mask `m` (1: the token is a completion / assistant token, to be predicted). Row r
of batch `index` of `stream` (0 train, 1 evaluation) is a pure function of (seed, stream, index,
r), as every batch is (`lmjax.data.batches`):

    unpacked   one record per row, drawn uniformly, its ids then padding (id 0) to T + 1 slots
    packed     (data.packing) `packing.packed_rows`: whole records end to end while they fit,
               segment ids 1, 2, ... per record, 0 on padding

Records are at most T + 1 ids (`sft` truncates longer ones), so no record is ever split. With
`src[t]` the split position of slot t (-1 on padding):

    loss_mask[t] = same_record(t, t + 1) * m[src[t + 1]]

1 exactly where target t is a completion token of the record input t belongs to: prompts,
padding and the step across a record boundary count nothing.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import numpy as np

from lmjax.data import packing
from lmjax.errors import FileFormatError

MASK_SUFFIX = ".mask"  # SPLIT.mask: uint8 [N], 1 on the tokens the loss predicts


@dataclasses.dataclass(frozen=True)
class SFTSplit:
    """A prepared SFT split: `tokens [N]`, `mask [N]` uint8 and `offsets [D + 1]` int64.

    It stands where a split's token array does (`Prepared.train` / `.val`): `len` and slicing are
    the tokens', and `lmjax.data.batches` cuts its rows with `rows`.
    """

    tokens: np.ndarray
    mask: np.ndarray
    offsets: np.ndarray

    def __len__(self) -> int:
        return len(self.tokens)

    def __getitem__(self, key):
        return self.tokens[key]

    @property
    def dtype(self):
        return self.tokens.dtype

    @property
    def filename(self):
        return getattr(self.tokens, "filename", None)

    @property
    def n_records(self) -> int:
        return len(self.offsets) - 1


def open_split(directory: Path, split: str, tokens, offsets) -> SFTSplit:
    """The split's `SFTSplit`: its tokens and offsets (opened and checked by `lmjax.data.prepared`)
    with `SPLIT.mask`, whose size must be one byte per token."""
    path = Path(directory) / f"{split}{MASK_SUFFIX}"
    size = path.stat().st_size if path.is_file() else None
    if size != len(tokens):
        raise FileFormatError.describe(
            str(path),
            "missing" if size is None else f"{size} bytes",
            f"one uint8 per token of the split ({len(tokens)} bytes)",
            "prepare the fine-tuning data again (delete the directory; lmjax finetune --data "
            "rebuilds it)",
        )
    mask = np.memmap(path, np.uint8, "r") if size else np.zeros(0, np.uint8)
    return SFTSplit(tokens, mask, np.asarray(offsets))


def _one_per_row(split: SFTSplit, draws, seq_len: int):
    """Rows of one record each: (arrays of `[n, T]`, source positions `[n, T + 1]`)."""
    ids = np.zeros((len(draws), seq_len + 1), np.int64)
    positions = np.full((len(draws), seq_len + 1), -1, np.int64)
    for row, d in enumerate(draws):
        start = int(split.offsets[d])
        stop = min(int(split.offsets[d + 1]), start + seq_len + 1)
        ids[row, : stop - start] = np.asarray(split.tokens[start:stop])
        positions[row, : stop - start] = np.arange(start, stop)
    real_target = positions[:, 1:] >= 0  # input t is then real too: padding only trails
    arrays = {
        "inputs": ids[:, :-1].astype(np.int32),
        "targets": ids[:, 1:].astype(np.int32),
        "loss_mask": real_target.astype(np.float32),
    }
    return arrays, positions


def rows(split: SFTSplit, seed, stream, index, n, seq_len, packed: bool, pick=None):
    """`n` rows (`pick`: only those) of batch `index`: (dict of `[n, T]` inputs, targets,
    loss_mask (+ segment_ids when `packed`), source positions `[n, T + 1]`)."""
    if packed:
        draws = packing.row_positions(len(split), seed, stream, index, n, pick)
        arrays, positions = packing.packed_rows(split.tokens, split.offsets, draws, seq_len)
    else:
        rng = np.random.default_rng((seed, stream, index))
        draws = rng.integers(0, split.n_records, size=n)
        draws = draws if pick is None else draws[np.asarray(pick, dtype=np.int64)]
        arrays, positions = _one_per_row(split, draws, seq_len)
    source = positions[:, 1:]
    predicted = np.where(source >= 0, np.asarray(split.mask)[np.maximum(source, 0)], 0)
    arrays["loss_mask"] = (arrays["loss_mask"] * predicted).astype(np.float32)
    return arrays, positions


__all__ = ["MASK_SUFFIX", "SFTSplit", "open_split", "rows"]
