"""Byte-level BPE training: learn merges from a corpus (the merge rule of Sennrich et al.).

    count the corpus' pre-tokenized pieces (GPT-2 pattern), each a sequence of byte tokens
    repeat until the vocabulary has `vocab_size - len(special_tokens)` tokens:
        pick the adjacent pair (a, b) with the highest count over all pieces (times frequency);
        ties go to the smallest (id_a, id_b); record the merge a b -> ab and replace every
        non-overlapping occurrence, left to right, in every piece that holds it
    special tokens take the ids after the mergeable tokens (GPT-2: <|endoftext|> = 50256)

Byte tokens get ids 0..255 in GPT-2's order (`bpe_scheme.BYTE_ORDER`); merged tokens follow in the
order they are learned, so a token's id is its rank. A pair whose concatenation is already a
token (reached before by another split) is merged into that token and recorded in `merges`
without taking a new id. These rules (ordering, tie-break, duplicates) are those of Hugging Face
`tokenizers`' `BpeTrainer` with the `ByteLevel` pre-tokenizer, which the tests use as the
witness: on the same corpus both learn the same merges.

Cost: pair counts and the pieces holding each pair are updated incrementally after a merge
(only the pieces that contain it are touched), and the best pair comes from a heap whose stale
entries (counts that have since dropped) are re-pushed with their current count when popped.
"""

from __future__ import annotations

import heapq
from collections import Counter, defaultdict
from collections.abc import Iterable, Sequence

from lmjax.checks import is_int
from lmjax.errors import ConfigError
from lmjax.tokenizers._base import check_text, training_texts
from lmjax.tokenizers.bpe_scheme import BYTE_ORDER, PATTERN, special_regex

Pair = tuple[int, int]


def count_pieces(texts: Iterable[str] | str, special_tokens: Sequence[str]) -> Counter:
    """How often each pre-tokenized piece occurs; special-token strings are cut out first."""
    texts = training_texts(texts)
    splitter = special_regex(special_tokens) if special_tokens else None
    counts: Counter = Counter()
    for text in texts:
        if not isinstance(text, str):
            raise ConfigError.describe(
                "training text", type(text).__name__, "str", "pass an iterable of strings"
            )
        check_text(text)  # a lone surrogate has no UTF-8 bytes to learn from
        for segment in splitter.split(text) if splitter else (text,):
            counts.update(PATTERN.findall(segment))
    return counts


def _merge_word(
    word: list[int], a: int, b: int, new: int
) -> tuple[list[int], list[tuple[Pair, int]]]:
    """`word` with each (a, b) replaced by `new`, left to right, and the pair-count changes.

    One pass into a new list (linear in the word's length however many occurrences it holds).
    The left neighbour is the last token written, so it may itself be `new` (a a a a -> N N).
    """
    out: list[int] = []
    changes: list[tuple[Pair, int]] = []
    i, n = 0, len(word)
    while i < n:
        if word[i] == a and i + 1 < n and word[i + 1] == b:
            if out:
                changes += [((out[-1], a), -1), ((out[-1], new), 1)]
            if i + 2 < n:
                changes += [((b, word[i + 2]), -1), ((new, word[i + 2]), 1)]
            out.append(new)
            i += 2
        else:
            out.append(word[i])
            i += 1
    return out, changes


def train(
    texts: Iterable[str] | str, vocab_size: int, special_tokens: Sequence[str] = ()
) -> tuple[dict[bytes, int], list[tuple[bytes, bytes]], dict[str, int]]:
    """`(ranks, merges, special_tokens)` learned from `texts` (see the module docstring).

    The vocabulary reaches `vocab_size` unless the corpus runs out of pairs first; it is then
    smaller (every piece a single token), as with `tokenizers`' trainer.
    """
    special_tokens = list(dict.fromkeys(special_tokens))
    n_mergeable = _check_size(vocab_size, special_tokens)
    tokens = [bytes([b]) for b in BYTE_ORDER]
    token_id = {t: i for i, t in enumerate(tokens)}
    byte_id = {b: i for i, b in enumerate(BYTE_ORDER)}

    counts = count_pieces(texts, special_tokens)
    words = [[byte_id[b] for b in piece.encode("utf-8")] for piece in counts]
    freqs = list(counts.values())
    pair_counts: dict[Pair, int] = defaultdict(int)
    where: dict[Pair, set[int]] = defaultdict(set)
    for w, word in enumerate(words):
        for pair in zip(word, word[1:], strict=False):
            pair_counts[pair] += freqs[w]
            where[pair].add(w)
    heap = [(-c, pair) for pair, c in pair_counts.items()]
    heapq.heapify(heap)

    merges: list[tuple[bytes, bytes]] = []
    while heap and len(tokens) < n_mergeable:
        neg_count, pair = heapq.heappop(heap)
        count = pair_counts[pair]
        if count != -neg_count:  # stale: the count dropped since this entry was pushed
            if count > 0:
                heapq.heappush(heap, (-count, pair))
            continue
        a, b = pair
        joined = tokens[a] + tokens[b]
        new = token_id.get(joined)
        if new is None:
            new = token_id[joined] = len(tokens)
            tokens.append(joined)
        merges.append((tokens[a], tokens[b]))
        pair_counts[pair] = 0
        grown: set[Pair] = set()
        for w in sorted(where.pop(pair)):
            words[w], changes = _merge_word(words[w], a, b, new)
            for changed, delta in changes:
                pair_counts[changed] += delta * freqs[w]
                if delta > 0:
                    where[changed].add(w)
                    grown.add(changed)
        for changed in grown:
            if pair_counts[changed] > 0:
                heapq.heappush(heap, (-pair_counts[changed], changed))
    ranks = {t: i for i, t in enumerate(tokens)}
    special = {s: len(tokens) + k for k, s in enumerate(special_tokens)}
    return ranks, merges, special


def _check_size(vocab_size, special_tokens: list[str]) -> int:
    least = 256 + len(special_tokens)
    if not (is_int(vocab_size) and vocab_size >= least):
        raise ConfigError.describe(
            "vocab_size",
            vocab_size,
            f"an int >= {least} (256 byte tokens + {len(special_tokens)} special tokens)",
            "raise vocab_size",
        )
    for s in special_tokens:
        if not isinstance(s, str) or not s:
            raise ConfigError.describe(
                "special token", s, "a non-empty str", "e.g. special_tokens=('<|endoftext|>',)"
            )
    return vocab_size - len(special_tokens)
