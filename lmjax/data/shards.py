"""A split's token files: shards of ids and the index of its document boundaries.

    SPLIT.bin                        the split's ids when it fits one shard (every split
                                     before format 2, and any under `shard_tokens` ids)
    SPLIT-00000.bin, -00001.bin ...  else: consecutive pieces of at most `shard_tokens` ids
    SPLIT.idx                        int64 [D + 1]: document d is ids offsets[d]:offsets[d+1]
                                     of the split (the shards concatenated); absent when the
                                     split is one document (a single text corpus, format 1)

meta.json lists each split's shards with their id counts (`shards`), and the document count.
A document may continue from one shard into the next: shards cut by size, documents by index.
Files are written as the ids arrive (nothing is held but the current document).
"""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np

from lmjax.errors import FileFormatError

SHARD_TOKENS = 1 << 30  # ids per shard: 2 GiB of uint16, 4 GiB of uint32
OFFSET_DTYPE = np.int64


class ShardWriter:
    """Appends documents' ids to `SPLIT-k.bin` shards and their boundaries to `SPLIT.idx`."""

    def __init__(self, directory: Path, split: str, dtype, shard_tokens: int = SHARD_TOKENS):
        self.directory, self.split, self.dtype = Path(directory), split, np.dtype(dtype)
        self.shard_tokens = shard_tokens
        self.tokens, self.documents = 0, 0
        self.shards: list[list] = []  # [name, ids] per shard
        self._handle = None
        self._index = open(self.directory / f"{split}.idx", "wb")
        self._index.write(np.zeros(1, OFFSET_DTYPE).tobytes())

    def add(self, ids) -> None:
        """One document's ids `[L]` (any int array), written in shard-sized pieces."""
        ids = np.asarray(ids, dtype=self.dtype)
        while ids.size:
            if self._handle is None or self.shards[-1][1] == self.shard_tokens:
                self._next_shard()
            room = self.shard_tokens - self.shards[-1][1]
            self._handle.write(ids[:room].tobytes())
            self.shards[-1][1] += min(room, ids.size)
            self.tokens += min(room, ids.size)
            ids = ids[room:]
        self.documents += 1
        self._index.write(np.asarray([self.tokens], OFFSET_DTYPE).tobytes())

    def _next_shard(self) -> None:
        if self._handle is not None:
            self._handle.close()
        name = f"{self.split}-{len(self.shards):05d}.bin"
        self._handle = open(self.directory / name, "wb")
        self.shards.append([name, 0])

    def close(self) -> dict:
        """Finish the files; returns meta.json's entry `{tokens, documents, shards}`. A split of
        one shard is renamed `SPLIT.bin` (the format-1 name)."""
        if self._handle is None:
            self._next_shard()  # an empty split still has its (empty) file
        self._handle.close()
        self._index.close()
        if len(self.shards) == 1:
            name = f"{self.split}.bin"
            os.replace(self.directory / self.shards[0][0], self.directory / name)
            self.shards[0][0] = name
        return {
            "tokens": self.tokens,
            "documents": self.documents,
            "shards": [{"file": n, "tokens": t} for n, t in self.shards],
        }


class ShardedTokens:
    """Several shards read as one `[N]` array: `len`, `x[i]`, `x[a:b]`, `np.asarray(x)`."""

    def __init__(self, parts: list[np.ndarray]):
        self.parts = parts
        self.ends = np.cumsum([len(p) for p in parts])
        self.dtype = parts[0].dtype
        self.filename = getattr(parts[0], "filename", None)  # named in TokenError messages

    def __len__(self) -> int:
        return int(self.ends[-1])

    @property
    def shape(self) -> tuple[int]:
        return (len(self),)

    def __getitem__(self, key):
        if isinstance(key, slice):
            start, stop, step = key.indices(len(self))
            if step != 1:
                return np.asarray(self)[key]
            return self._range(start, max(start, stop))
        i = int(key) + (len(self) if int(key) < 0 else 0)
        return self._range(i, i + 1)[0]

    def _range(self, start: int, stop: int) -> np.ndarray:
        pieces, begin = [], 0
        for part, end in zip(self.parts, self.ends, strict=True):
            if start < end and stop > begin:
                pieces.append(np.asarray(part[max(start - begin, 0) : stop - begin]))
            begin = end
        return np.concatenate(pieces) if pieces else np.zeros(0, self.dtype)

    def __array__(self, dtype=None, copy=None):
        whole = np.concatenate([np.asarray(p) for p in self.parts])
        return whole if dtype is None else whole.astype(dtype)


def split_shards(meta: dict, split: str) -> list[tuple[str, int]]:
    """(file name, ids) of each shard of `split`, from meta.json (format 1: one `SPLIT.bin`)."""
    entry = meta.get("splits", {}).get(split)
    if entry is None:
        return [(f"{split}.bin", meta[f"{split}_tokens"])]
    return [(s["file"], s["tokens"]) for s in entry["shards"]]


def open_shards(directory: Path, split: str, dtype, meta: dict):
    """The split's ids: a memmap (one shard), `ShardedTokens` (several), each file's size
    checked against meta.json (a truncated file is a `FileFormatError` naming it)."""
    shards = split_shards(meta, split)
    parts = [_open_shard(directory / n, t, dtype, meta["dtype"]) for n, t in shards]
    return parts[0] if len(parts) == 1 else ShardedTokens(parts)


def _open_shard(path: Path, expected: int, dtype, dtype_name: str) -> np.ndarray:
    size = path.stat().st_size if path.is_file() else None
    itemsize = np.dtype(dtype).itemsize
    if size is None or size != expected * itemsize:
        raise FileFormatError.describe(
            str(path),
            "missing" if size is None else f"{size} bytes",
            f"{expected} {dtype_name} tokens = {expected * itemsize} bytes (meta.json)",
            "prepare the data again (the file is truncated or from another corpus)",
        )
    if expected == 0:
        return np.zeros(0, dtype)
    return np.memmap(path, dtype=dtype, mode="r")


def open_index(directory: Path, split: str, meta: dict, n_tokens: int) -> np.ndarray:
    """The split's document offsets `[D + 1]` (int64, memmapped): `SPLIT.idx`, or `[0, N]` for
    a split without one (one document). Checked: D + 1 entries, from 0 to N."""
    entry = meta.get("splits", {}).get(split)
    if entry is None:
        return np.asarray([0, n_tokens], OFFSET_DTYPE)
    path = directory / f"{split}.idx"
    n = entry["documents"] + 1
    size = path.stat().st_size if path.is_file() else None
    offsets = np.memmap(path, OFFSET_DTYPE, "r") if size == n * 8 else None
    if offsets is None or offsets[0] != 0 or offsets[-1] != n_tokens:
        raise FileFormatError.describe(
            str(path),
            "missing" if size is None else f"{size} bytes",
            f"{n} int64 document offsets from 0 to {n_tokens} (meta.json)",
            "prepare the data again (the index is truncated or from another corpus)",
        )
    return offsets
