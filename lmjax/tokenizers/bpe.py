"""Byte-level BPE in the GPT-2 scheme: pre-tokenize, then merge bytes by rank (docs/interop.md).

    text --(special tokens split out per the policy)--> segments
    segment --PATTERN.findall--> pieces          (the GPT-2 pre-tokenization regex)
    piece --UTF-8--> bytes b_0 .. b_{n-1}        (one part per byte)
    repeat: among adjacent parts (p, q) whose concatenation pq is a token, merge the pair with
            the lowest rank(pq); ties go to the leftmost pair. Stop when no pair is a token.
    ids = rank of each final part                (a token's rank is its id)

A piece that is itself a token is emitted whole, before any merging. This is exactly tiktoken's
algorithm, so a vocabulary loaded here gives tiktoken's ids. `bpe_merge` is the pure-Python
reference: parts form a linked list over byte offsets and candidate pairs sit in a heap, so a
piece of n bytes costs O(n log n) (at most n - 1 merges, each pushing at most two new pairs),
never the O(n^2) of rescanning every pair after every merge.

`BPETokenizer.encode` runs tiktoken's Rust engine over lmjax's own ranks (`engine="tiktoken"`,
the default) or the reference (`engine="python"`); tests check both give identical ids.
Training, the file formats and the reference behaviour are lmjax's (`bpe_train`, `bpe_files`);
the pattern, the byte alphabet and the special-token rules they share are in `bpe_scheme`.

Special tokens (e.g. `<|endoftext|>`) follow tiktoken's policy: a special token's text inside
`encode`'s input raises `TokenError` if it is disallowed (default: all), becomes its id if it is
allowed, and is encoded as plain text if it is neither.
"""

from __future__ import annotations

import heapq
import os
from collections.abc import Collection, Iterable, Mapping, Sequence
from pathlib import Path

from lmjax.checks import require
from lmjax.errors import ConfigError, TokenError
from lmjax.tokenizers._base import check_ids, check_text
from lmjax.tokenizers.bpe_files import (
    manifest_paths,
    manifest_policy,
    read_files,
    write_directory,
)
from lmjax.tokenizers.bpe_scheme import (
    BYTE_ORDER,
    BYTE_TO_CHAR,
    CHAR_TO_BYTE,
    ENDOFTEXT,
    GPT2_PATTERN,
    PATTERN,
    bytes_to_unicode,
    special_policy,
    special_regex,
)
from lmjax.tokenizers.bpe_train import train as train_merges

try:  # a dependency of lmjax; without it the reference engine ("python") still runs
    import tiktoken
except ImportError:
    tiktoken = None

ENGINES = ("tiktoken", "python")


def bpe_merge(
    piece: bytes,
    ranks: Mapping[bytes, int],
    max_token_bytes: int,
    stats: dict | None = None,
    *,
    pair_ranks: Mapping[tuple[bytes, bytes], int] | None = None,
    whole: bool = True,
) -> list[int]:
    """Token ids of one pre-tokenized piece: the merge loop of the module docstring.

    `max_token_bytes` is the longest token's length (longer candidates are never looked up).
    Hugging Face's rule (`lmjax.tokenizers.hf_json`) is the same loop with two changes: with
    `pair_ranks` a pair (p, q) merges only if it is listed, by its rank there (not by the id of
    pq), and `whole=False` drops the shortcut for a piece that is itself a token (HF's
    `ignore_merges: false`). `ranks` still gives the final parts' ids.
    The parts are a linked list over byte offsets: `nxt[s]` is where the part starting at `s`
    ends. A heap entry `(rank, s, m, e)` proposes merging parts [s, m) and [m, e); it is stale
    (skipped) when either part has changed since it was pushed. `stats["lookups"]` (if given) is
    incremented by the number of rank lookups, which is O(n) for an n-byte piece.
    """
    n = len(piece)
    found = ranks.get(piece) if whole else None
    if found is not None:
        return [found]

    def rank_of(s: int, m: int, e: int) -> int | None:
        if pair_ranks is None:
            return ranks.get(piece[s:e])
        return pair_ranks.get((piece[s:m], piece[m:e]))

    nxt = list(range(1, n + 1))
    prv = list(range(-1, n - 1))
    alive = [True] * n
    heap = []
    for s in range(n - 1):
        rank = rank_of(s, s + 1, s + 2)
        if rank is not None:
            heap.append((rank, s, s + 1, s + 2))
    heapq.heapify(heap)
    lookups = n - 1

    def push(s: int) -> None:
        nonlocal lookups
        m = nxt[s]
        if m >= n:
            return
        e = nxt[m]
        if e - s <= max_token_bytes:
            lookups += 1
            rank = rank_of(s, m, e)
            if rank is not None:
                heapq.heappush(heap, (rank, s, m, e))

    while heap:
        _, s, m, e = heapq.heappop(heap)
        if not alive[s] or nxt[s] != m or nxt[m] != e:
            continue  # stale: one of the two parts merged with something else meanwhile
        alive[m] = False
        nxt[s] = e
        if e < n:
            prv[e] = s
        if prv[s] >= 0:
            push(prv[s])
        push(s)
    if stats is not None:
        stats["lookups"] = stats.get("lookups", 0) + lookups
    ids, s = [], 0
    while s < n:
        ids.append(ranks[piece[s : nxt[s]]])
        s = nxt[s]
    return ids


_utf8 = check_text


def _encodable(text: str) -> bool:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


class BPETokenizer:
    """Byte-level BPE: `ranks` (token bytes -> id) for mergeable tokens, plus special tokens.

    Ids are dense: the mergeable tokens and the special tokens together use exactly
    0..vocab_size-1 (GPT-2: 50,256 mergeable tokens, then `<|endoftext|>` = 50256). `merges`
    are the (left, right) byte pairs in rank order, kept for `merges.txt`; every one must join
    two tokens into a token. Build one with `train`, `from_files` or `lmjax.tokenizers.load`.
    """

    kind = "bpe"

    def __init__(
        self,
        ranks: Mapping[bytes, int],
        merges: Sequence[tuple[bytes, bytes]],
        special_tokens: Mapping[str, int] | None = None,
        *,
        allowed_special: Collection[str] | str = (),
        disallowed_special: Collection[str] | str = "all",
        engine: str = "tiktoken",
    ):
        self.ranks = dict(ranks)
        self.merges = tuple((bytes(a), bytes(b)) for a, b in merges)
        self.special_tokens = dict(special_tokens or {})
        self.allowed_special = special_policy(
            allowed_special, self.special_tokens, "allowed_special"
        )
        self.disallowed_special = special_policy(
            disallowed_special, self.special_tokens, "disallowed_special"
        )
        if engine not in ENGINES:
            raise ConfigError.describe("BPE engine", engine, f"one of {ENGINES}", "pick one")
        self.engine = engine
        self._check()
        self._decoder = [b""] * self.vocab_size
        for token, i in self.ranks.items():
            self._decoder[i] = token
        for text, i in self.special_tokens.items():
            self._decoder[i] = text.encode("utf-8")
        self._max_token_bytes = max(map(len, self.ranks))
        self._tiktoken = None  # built on first use: ~0.1 s for a 50k vocabulary

    def _check(self) -> None:
        fix = "build the vocabulary with BPETokenizer.train or from GPT-2-style files"
        missing = [b for b in range(256) if bytes([b]) not in self.ranks]
        if missing:
            raise ConfigError.describe(
                "single-byte tokens missing", missing[:8], "all 256 byte values", fix
            )
        for text in self.special_tokens:
            # "" would match at every offset of every text; a lone surrogate has no UTF-8 bytes.
            if not isinstance(text, str) or not text or not _encodable(text):
                raise ConfigError.describe(
                    "special token", text, "a non-empty str that UTF-8 can encode", fix
                )
        ids = sorted([*self.ranks.values(), *self.special_tokens.values()])
        if ids != list(range(len(ids))):
            raise ConfigError.describe(
                "token ids", "not exactly 0..V-1 (gaps or repeats)", "dense distinct ids", fix
            )
        for a, b in self.merges:
            if a not in self.ranks or b not in self.ranks or a + b not in self.ranks:
                raise ConfigError.describe("merge", (a, b), "two tokens joining into a token", fix)

    # ---- properties and variants ----------------------------------------------------------

    @property
    def vocab_size(self) -> int:
        return len(self.ranks) + len(self.special_tokens)

    def with_options(self, **changes) -> BPETokenizer:
        """A copy with `engine`, `allowed_special` or `disallowed_special` changed."""
        unknown = sorted(changes.keys() - {"engine", "allowed_special", "disallowed_special"})
        if unknown:
            known = "engine / allowed_special / disallowed_special"
            raise ConfigError.describe("BPETokenizer option", unknown[0], known, "fix the spelling")
        options = dict(
            engine=self.engine,
            allowed_special=self.allowed_special,
            disallowed_special=self.disallowed_special,
        )
        return BPETokenizer(self.ranks, self.merges, self.special_tokens, **(options | changes))

    # ---- encode / decode --------------------------------------------------------------------

    def encode(
        self,
        text: str,
        *,
        allowed_special: Collection[str] | str | None = None,
        disallowed_special: Collection[str] | str | None = None,
    ) -> list[int]:
        """Token ids of `text`; the special-token policy defaults to the tokenizer's own."""
        _utf8(text)
        allowed = self._resolve(allowed_special, self.allowed_special, "allowed_special")
        disallowed = self._resolve(
            disallowed_special, self.disallowed_special, "disallowed_special"
        )
        if allowed == "all":
            allowed = frozenset(self.special_tokens)
        if disallowed == "all":
            disallowed = frozenset(self.special_tokens) - allowed
        if disallowed:
            found = special_regex(disallowed).search(text)
            if found:
                raise TokenError.describe(
                    f"special token in text at offset {found.start()}",
                    found.group(),
                    "no disallowed special token inside ordinary text",
                    f"pass allowed_special={{{found.group()!r}}} to encode it as one token, or "
                    "disallowed_special=() to encode it as plain text",
                )
        if self.engine == "tiktoken":
            return self._engine().encode(text, allowed_special=allowed, disallowed_special=())
        ids: list[int] = []
        for segment, special in _split_special(text, allowed):
            ids.extend(self.encode_ordinary_reference(segment))
            if special is not None:
                ids.append(self.special_tokens[special])
        return ids

    def encode_ordinary(self, text: str) -> list[int]:
        """Ids of `text` with special-token strings treated as plain text."""
        return self.encode(text, allowed_special=(), disallowed_special=())

    def encode_ordinary_reference(self, text: str, stats: dict | None = None) -> list[int]:
        """The pure-Python reference: `PATTERN` pieces, each through `bpe_merge`."""
        _utf8(text)
        ids: list[int] = []
        cache: dict[str, list[int]] = {}
        for piece in PATTERN.findall(text):
            got = cache.get(piece)
            if got is None:
                got = bpe_merge(piece.encode("utf-8"), self.ranks, self._max_token_bytes, stats)
                if len(piece) < 64:
                    cache[piece] = got
            ids.extend(got)
        return ids

    def decode_bytes(self, ids) -> bytes:
        decoder = self._decoder
        return b"".join([decoder[i] for i in check_ids(ids, self.vocab_size)])

    def decode(self, ids) -> str:
        """Text of `ids`; byte sequences that are not valid UTF-8 become U+FFFD (as tiktoken)."""
        return self.decode_bytes(ids).decode("utf-8", errors="replace")

    def _resolve(self, value, default, what):
        return default if value is None else special_policy(value, self.special_tokens, what)

    def _engine(self):
        if self._tiktoken is None:
            fix = "pip install tiktoken, or use tok.with_options(engine='python')"
            missing = "tiktoken (not installed)"
            require(tiktoken is not None, "BPE engine", missing, "an importable engine", fix)
            self._tiktoken = tiktoken.Encoding(
                name="lmjax_bpe",
                pat_str=GPT2_PATTERN,
                mergeable_ranks=self.ranks,
                special_tokens=self.special_tokens,
            )
        return self._tiktoken

    # ---- training and files ------------------------------------------------------------------

    @classmethod
    def train(
        cls,
        texts: Iterable[str] | str,
        vocab_size: int,
        special_tokens: Sequence[str] = (ENDOFTEXT,),
        **options,
    ) -> BPETokenizer:
        """Learn merges on `texts` until `vocab_size` tokens (see `lmjax.tokenizers.bpe_train`)."""
        ranks, merges, special = train_merges(texts, vocab_size, special_tokens)
        return cls(ranks, merges, special, **options)

    @classmethod
    def from_files(
        cls, vocab_path: str | os.PathLike, merges_path: str | os.PathLike, **options
    ) -> BPETokenizer:
        """Load `vocab.json` + `merges.txt` (or GPT-2's `encoder.json` + `vocab.bpe`)."""
        ranks, merges, special = read_files(Path(vocab_path), Path(merges_path))
        return cls(ranks, merges, special, **options)

    def save(self, directory: str | os.PathLike) -> None:
        """Write `vocab.json`, `merges.txt` and `tokenizer.json` (kind, specials, policy)."""
        write_directory(
            Path(directory),
            self.ranks,
            self.merges,
            self.special_tokens,
            kind=self.kind,
            allowed_special=self.allowed_special,
            disallowed_special=self.disallowed_special,
        )

    def __repr__(self) -> str:
        return (
            f"BPETokenizer(vocab_size={self.vocab_size}, special_tokens={self.special_tokens}, "
            f"engine={self.engine!r})"
        )


def _split_special(text: str, allowed: frozenset[str]):
    """Yield (ordinary text, special token or None) pairs covering `text` in order."""
    if not allowed:
        yield text, None
        return
    start = 0
    for found in special_regex(allowed).finditer(text):
        yield text[start : found.start()], found.group()
        start = found.end()
    yield text[start:], None


def load_directory(directory: Path, manifest: dict) -> BPETokenizer:
    """The `lmjax.tokenizers.load` loader for kind "bpe": the files `manifest` names, then its
    special tokens (which must be vocab.json's) and `encode` policy."""
    tok = BPETokenizer.from_files(*manifest_paths(directory, manifest))
    return tok.with_options(**manifest_policy(directory, manifest, tok.special_tokens))


__all__ = [
    "BYTE_ORDER",
    "BYTE_TO_CHAR",
    "CHAR_TO_BYTE",
    "ENDOFTEXT",
    "ENGINES",
    "GPT2_PATTERN",
    "PATTERN",
    "BPETokenizer",
    "bpe_merge",
    "bytes_to_unicode",
    "load_directory",
]
