"""`generate_until` over token ids: batched decoding (`lmjax.generate.stream`) of prompts in a
fixed batch, each row cut at the first of its stop strings.

Prompts are sorted by length and decoded `batch_size` at a time; a short last batch is padded
with copies of its first prompt, so every batch has the same B and `stream` compiles one prefill
per prompt-length bucket and one decode step per cache size. A batch stops as soon as every
row has ended (an end-of-sequence id, or `max_new_tokens`) or its text holds a stop string;
greedy decoding makes the text before the first stop string independent of when that is.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import numpy as np

from lmjax.generate import stream
from lmjax.models import ModelConfig


def cut_at_stops(text: str, until: Sequence[str]) -> str:
    """`text` up to the first occurrence of any non-empty stop string (the harness's rule: each
    stop cuts in turn)."""
    for stop in until:
        if stop:
            text = text.split(stop)[0]
    return text


def generate_texts(
    params: dict,
    cfg: ModelConfig,
    prompts: Sequence[Sequence[int]],
    *,
    decode: Callable[[list[int]], str],
    until: Sequence[str],
    max_new_tokens: int,
    stop_tokens: Sequence[int],
    batch_size: int,
    sampling: dict | None = None,
    seed: int = 0,
    progress: Callable[[int], object] | None = None,
) -> list[str]:
    """The continuation text of each prompt (ids, each at most C - max_new_tokens long), in
    order: decoded without its end-of-sequence id, cut at the first of `until`. `sampling`:
    `temperature` (0: greedy, the default), `top_k`, `top_p` as `generate.stream` takes them;
    batch i samples with `seed + i`."""
    order = sorted(range(len(prompts)), key=lambda i: (-len(prompts[i]), i))
    out: list[str] = [""] * len(prompts)
    for n, start in enumerate(range(0, len(order), batch_size)):
        members = order[start : start + batch_size]
        batch = [list(prompts[i]) for i in members]
        batch += [batch[0]] * (batch_size - len(batch))
        texts = _decode_batch(
            params, cfg, batch, len(members), decode, until, max_new_tokens, stop_tokens,
            dict(sampling or {}), seed + n,
        )  # fmt: skip
        for i, text in zip(members, texts, strict=True):
            out[i] = cut_at_stops(text, until)
        if progress is not None:
            progress(len(members))
    return out


def _decode_batch(params, cfg, batch, real, decode, until, max_new, stops, sampling, seed):
    """The texts of the first `real` rows of `batch`, decoded until each has ended or holds a
    stop string."""
    ids: list[list[int]] = [[] for _ in range(real)]
    ended = np.zeros(real, bool)
    steps = stream(
        params, batch, cfg, max_new_tokens=max_new, stop_tokens=list(stops), seed=seed, **sampling
    )
    stop_set = set(stops)
    for step in steps:
        for i in np.flatnonzero(step.active[:real]):
            token = int(step.tokens[i])
            if token in stop_set:
                ended[i] = True
                continue
            ids[i].append(token)
            ended[i] = _holds_stop(decode(ids[i]), until)
        ended |= ~step.active[:real]
        if ended.all():
            break
    steps.close()
    return [decode(row) for row in ids]


def _holds_stop(text: str, until: Sequence[str]) -> bool:
    return any(s and s in text for s in until)
