"""Batched generation (docs/decoding.md): `stream` yields each step's tokens, `generate` collects.

    for step in stream(params, [[5, 3, 9], [7]], cfg, max_new_tokens=20, stop_tokens=[0]):
        step.tokens  # [B] int32, this step's token of every row (-1 where the row is done)
        step.active  # [B] bool, True where tokens[b] is a new token of row b

Policies:
- Padding: prompts of different lengths are right-padded into one `[B, T]` batch and each row
  decodes at its own positions (`kv_cache`), so row b's tokens and logits are those it gets
  alone (greedy: the same tokens; logits to float rounding, the padded shapes differ).
- Shapes: T is the longest prompt and S = prompt + max_new_tokens, each rounded up to a power
  of two (at least 8, at most C); with a sliding window W, S is at most W rounded up so (the
  cache is then a ring, `kv_cache.slots_of`: its memory follows W, not the sequence, and a
  paged row holds at most ceil(S / page_size) pages). The prefill compiles once per (B, T, S)
  bucket, the decode step once per (B, S); no step of a run compiles anything.
- Context: every row must fit, `len(prompt) + max_new_tokens <= C`, else `ConfigError` before
  any work (no silent truncation; a model's `sliding_window` bounds what each token sees and
  the cache, not the positions, which end at C).
- Stops: a row ends after `max_new_tokens` tokens or after emitting one of `stop_tokens` (the
  stop token is its last token); finished rows keep their batch slot but emit nothing, and a
  paged cache returns their pages to the pool at once. The run ends when every row has ended.
- Padded vocabulary (`cfg.tokenizer_size` n < V): only the first n logits are sampled from
  (greedy or not), so no id >= n is ever emitted; prompts and stop tokens must be below n.
- Randomness: step n samples with `fold_in(key(seed), n)`, so a seed reproduces a run exactly.
- Dtypes: the params are cast to `cfg.compute_dtype` once, before the first step, so each jitted
  step reads the compute-dtype weights (no per-token cast of float32 master weights).
- Non-finite logits (NaN or inf params, an overflow) raise `NonFiniteError` naming the row and
  step; they never turn silently into a token. Each step returns an `isfinite` flag per row,
  copied to the host with the tokens the loop copies anyway.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from lmjax.checks import check_token_ids, is_int, is_positive_int, require
from lmjax.errors import ConfigError, NonFiniteError, TokenError
from lmjax.generate.kv_cache import (
    LAYOUTS,
    check_layout,
    decode_logits,
    decoding_params,
    init_cache,
    prefill_hidden,
)
from lmjax.generate.paged import PageAllocator, init_paged_cache
from lmjax.generate.sampling import Sampling, sample
from lmjax.models import ModelConfig, head
from lmjax.models.transformer import cast

CACHES = ("contiguous", "paged")
MIN_BUCKET = 8
PAGE_SIZE = 16  # the paged cache's default page size


class Step(NamedTuple):
    """One decoding step: `tokens [B]` int32 (-1 where not active), `active [B]` bool, and
    the pages in use after it (paged cache; None for the contiguous one)."""

    tokens: np.ndarray
    active: np.ndarray
    pages_in_use: int | None


def token_logits(logits_BV, cfg: ModelConfig):
    """`[B, V] -> [B, n]`: the logits of the tokenizer's ids only (n = `cfg.vocab_ids`), so a
    padded embedding's extra rows are never sampled, whatever their values."""
    return logits_BV[:, : cfg.vocab_ids] if cfg.padded_vocab else logits_BV


def _prefill_sample(params, tokens_BT, lengths_B, cache, key, cfg, sampling):
    x_BTD, cache = prefill_hidden(params, tokens_BT, cfg, cache, lengths_B)
    # Only each row's last real position goes through the head.
    last_B1D = jnp.take_along_axis(x_BTD, (lengths_B - 1)[:, None, None], axis=1)
    logits_BV = head(cast(params, cfg.compute_dtype), last_B1D, cfg)[:, 0].astype(jnp.float32)
    logits_BV = token_logits(logits_BV, cfg)
    finite_B = jnp.isfinite(logits_BV).all(axis=-1)
    return sample(logits_BV, jax.random.fold_in(key, 0), sampling), finite_B, cache


def _decode_sample(params, token_B, cache, key, step, cfg, sampling):
    """`-> (token [B], finite [B], cache)`: the caller maps the pages (see `paged`)."""
    logits_BV, cache = decode_logits(params, token_B, cfg, cache)
    logits_BV = token_logits(logits_BV, cfg)
    finite_B = jnp.isfinite(logits_BV).all(axis=-1)
    return sample(logits_BV, jax.random.fold_in(key, step), sampling), finite_B, cache


prefill_sample = jax.jit(_prefill_sample, donate_argnames="cache")
decode_sample = jax.jit(_decode_sample, donate_argnames="cache")


def stream(
    params: dict,
    prompts: Sequence[Sequence[int]],
    cfg: ModelConfig,
    *,
    max_new_tokens: int,
    temperature: float = 0.0,
    top_k: int | None = None,
    top_p: float = 1.0,
    seed: int = 0,
    stop_tokens: Sequence[int] | None = (),
    cache: str = "contiguous",
    page_size: int | None = None,
    num_pages: int | None = None,
    layers: str = "auto",
) -> Iterator[Step]:
    """Decode a batch of prompts step by step; see the module docstring for the policies.

    prompts: a list of prompts, each a non-empty list (or 1-D array) of token ids. A padded
    `[B, T]` array is refused (`TokenError`): it carries no lengths, so its pad ids would be
    read as prompt tokens; pass `[list(row[:n]) for row, n in zip(tokens, lengths)]`.
    Sampling options as `Sampling`; `seed` an int in [-2**63, 2**63); `stop_tokens` a list of
    ids (None: none). `cache="paged"` uses a pool of `num_pages` pages of `page_size` slots
    (default 16); the default `num_pages` is the worst case, every row running to
    `max_new_tokens`: `sum_b ceil((len_b + max_new_tokens - 1) / page_size)` pages (with a
    sliding window each term at most a row's table, ceil(S / page_size)), about the
    contiguous cache's memory. Pages freed by finished rows are not used by other sequences of
    this call, so paging saves memory only with a smaller `num_pages` (see `paged`); if such a
    pool runs out mid-stream, `ConfigError` says the step reached (the tokens yielded so far
    stand) and the worst-case count to pass. `page_size` / `num_pages` with the contiguous cache
    raise `ConfigError`. `layers`: the blocks' layout (`kv_cache.decoding_params`). All else is
    validated before the first step: `TokenError` for an empty batch or prompt, non-integer or
    out-of-vocabulary ids (prompts and stop tokens) or a prompt longer than C; `ConfigError`
    for sampling options, the seed, `max_new_tokens < 1` or past the context, bad cache options
    or layout; `ShapeError` for params that do not match `cfg`. Non-finite logits of an active
    row raise `NonFiniteError` at that step.
    """
    rows = _check_prompts(prompts, cfg)
    sampling = Sampling(temperature, top_k, top_p)
    sampling.check_vocab(cfg.vocab_ids)
    _check_run(rows, cfg, max_new_tokens, seed, cache, page_size, num_pages, layers)
    stops = _check_stop_tokens(stop_tokens, cfg)
    check_layout(params, cfg)
    tokens_BT, lengths = _right_padded(rows, cfg)
    b, s = len(rows), cache_slots(cfg, int(lengths.max()) + max_new_tokens)
    pages, worst = None, 0
    if cache == "paged":
        page_size = PAGE_SIZE if page_size is None else page_size
        # The last token sampled is never written; a ring row needs no more than its table.
        slots_B = np.minimum(lengths + max_new_tokens - 1, -(-s // page_size) * page_size)
        worst = int(np.ceil(slots_B / page_size).sum())
        kv, pages = _paged_start(
            cfg, lengths, s, page_size, worst if num_pages is None else num_pages, worst
        )
    else:
        kv = init_cache(cfg, b, s)
    # Once, here: compute-dtype weights (the steps' own cast is a no-op), laid out for decoding.
    params = decoding_params(params, cfg, layers)
    key = jax.random.key(seed)
    token_B, finite_B, kv = prefill_sample(params, tokens_BT, lengths, kv, key, cfg, sampling)
    emitted = np.zeros(b, np.int32)
    done = np.zeros(b, bool)
    for step in range(1, max_new_tokens + 1):
        host_B, finite = jax.device_get((token_B, finite_B))
        active = ~done
        _check_finite(finite, active, step)
        emitted += active
        done = done | np.isin(host_B, stops) | (emitted >= max_new_tokens)
        if pages is not None:
            for i in np.flatnonzero(done & active):
                pages.release(int(i))
        yield Step(np.where(active, host_B, -1).astype(np.int32), active, _in_use(pages))
        if done.all():
            return
        if pages is not None:
            # The token just sampled is written at position len + emitted - 1 by the next step.
            for i in np.flatnonzero(~done):
                _ensure(pages, int(i), int(lengths[i] + emitted[i] - 1), worst, step)
            kv = kv._replace(page_table=jnp.asarray(pages.table))
        token_B, finite_B, kv = decode_sample(params, token_B, kv, key, step, cfg, sampling)


def _right_padded(rows: list[list[int]], cfg: ModelConfig) -> tuple[np.ndarray, np.ndarray]:
    """`(tokens [B, T], lengths [B])`: the prompts right-padded to a bucketed T; the pad id (0)
    is never attended to, as each row's length masks it."""
    lengths = np.array([len(r) for r in rows], np.int32)
    tokens_BT = np.zeros((len(rows), _bucket(lengths.max(), cfg)), np.int32)
    for i, row in enumerate(rows):
        tokens_BT[i, : len(row)] = row
    return tokens_BT, lengths


def _paged_start(cfg, lengths, s: int, page_size: int, num_pages: int, worst: int):
    """`(kv, pages)`: a paged cache of `num_pages` pages over `s` slots per row, with each
    prompt's pages allocated (the pool running out is `_ensure`'s error, at step 0)."""
    b = len(lengths)
    kv = init_paged_cache(cfg, b, num_pages, page_size, s)
    pages = PageAllocator(num_pages, page_size, b, kv.page_table.shape[1])
    for i in range(b):
        _ensure(pages, i, int(lengths[i]) - 1, worst, 0)
    return kv._replace(page_table=jnp.asarray(pages.table)), pages


def generate(params: dict, prompts, cfg: ModelConfig, **options) -> list[list[int]]:
    """The new tokens of each prompt (a stop token, if hit, is the last); options as `stream`.

    An error raised mid-run (a paged pool that runs out, non-finite logits) says how many steps
    had completed; their tokens are not returned (use `stream` to keep them).
    """
    out: list[list[int]] = []
    for step in stream(params, prompts, cfg, **options):  # validates before the first step
        out = out or [[] for _ in step.tokens]
        for i in np.flatnonzero(step.active):
            out[i].append(int(step.tokens[i]))
    return out


def _ensure(pages: PageAllocator, row: int, position: int, worst: int, completed: int) -> None:
    """Map the pages `row` needs to write `position` (and all before it: slots 0..position,
    or the whole table once a ring wraps), with an error that gives the run's progress and the
    worst-case pool."""
    n_slots = min(position + 1, pages.table.shape[1] * pages.page_size)
    missing = -(-n_slots // pages.page_size) - len(pages.owned[row])
    if missing > len(pages.free):
        raise ConfigError.describe(
            "num_pages",
            pages.num_pages,
            f"a free page for row {row}'s position {position} ({len(pages.free)} free) after "
            f"{completed} completed steps (tokens yielded so far stand; generate returns none)",
            f"pass num_pages >= {worst} (the worst case for this batch; None picks it), or "
            "decode fewer or shorter sequences at once",
        )
    pages.ensure(row, n_slots)


def _check_finite(finite_B: np.ndarray, active_B: np.ndarray, step: int) -> None:
    bad = np.flatnonzero(active_B & ~finite_B)
    if bad.size:
        raise NonFiniteError.describe(
            f"logits of row {int(bad[0])} at step {step} ({step - 1} steps completed)",
            "NaN or inf",
            "finite logits",
            "check the params for NaN/inf (a diverged or corrupt checkpoint), or compute in "
            "float32 if a lower-precision dtype overflowed",
        )


def _in_use(pages: PageAllocator | None) -> int | None:
    return None if pages is None else pages.in_use


def _bucket(n: int, cfg: ModelConfig) -> int:
    """The next power of two >= n, at least MIN_BUCKET, at most the context length."""
    return min(cfg.context_length, max(MIN_BUCKET, 1 << (int(n) - 1).bit_length()))


def cache_slots(cfg: ModelConfig, n_positions: int) -> int:
    """The cache capacity S `stream` gives each row for `n_positions` positions (longest
    prompt + max_new_tokens): `_bucket(n)`, and with a sliding window W at most `_bucket(W)`,
    a ring of >= W slots (or all C positions) that holds every key still in view."""
    s = _bucket(n_positions, cfg)
    return s if cfg.sliding_window is None else min(s, _bucket(cfg.sliding_window, cfg))


def _check_prompts(prompts, cfg: ModelConfig) -> list[np.ndarray]:
    fix_batch = "pass a list of prompts, each a non-empty list of token ids"
    if len(getattr(prompts, "shape", ())) >= 2:
        raise TokenError.describe(
            "prompts",
            f"a {len(prompts.shape)}-D array of shape {tuple(prompts.shape)}",
            "a list of prompts (a padded array has no lengths: its pad ids would be prompt tokens)",
            "pass [list(row[:n]) for row, n in zip(tokens, lengths)]",
        )
    if isinstance(prompts, (str, bytes)) or not hasattr(prompts, "__len__") or not len(prompts):
        raise TokenError.describe("prompts", prompts, "a non-empty batch of prompts", fix_batch)
    rows = []
    for i, prompt in enumerate(prompts):
        if is_int(prompt):
            raise TokenError.describe(
                f"prompts[{i}]", prompt, "a list of token ids", "wrap a single prompt in a list"
            )
        try:
            row = np.asarray(prompt)
        except (ValueError, TypeError):  # ragged nesting numpy can't make an array of
            row = np.empty((0, 0))
        if row.ndim != 1 or row.size == 0:
            raise TokenError.describe(
                f"prompts[{i}]", prompt, "a non-empty 1-D list of token ids", fix_batch
            )
        if row.dtype.kind not in "iu":
            raise TokenError.describe(
                f"prompts[{i}] dtype", str(row.dtype), "integer token ids", "tokenize the text"
            )
        if row.size > cfg.context_length:
            raise TokenError.describe(
                f"len(prompts[{i}])",
                row.size,
                f"<= context_length = {cfg.context_length}",
                "crop the prompt to its last tokens or use a model with a longer context",
            )
        check_token_ids(row, cfg.vocab_ids, f"prompts[{i}]")
        rows.append(row.astype(np.int32))
    return rows


def _check_run(rows, cfg, max_new_tokens, seed, cache, page_size, num_pages, layers) -> None:
    require(layers in LAYOUTS, "layers", layers, f"one of {LAYOUTS}", "pass one of them")
    longest = max(len(r) for r in rows)
    fix = "ask for at least one token"
    require(is_positive_int(max_new_tokens), "max_new_tokens", max_new_tokens, "an int >= 1", fix)
    if longest + max_new_tokens > cfg.context_length:
        raise ConfigError.describe(
            "longest prompt + max_new_tokens",
            f"{longest} + {max_new_tokens}",
            f"<= context_length = {cfg.context_length} (generation never passes the context)",
            f"set max_new_tokens <= {cfg.context_length - longest} or shorten the prompt",
        )
    if not is_int(seed) or not -(2**63) <= seed < 2**63:
        raise ConfigError.describe(
            "seed", seed, "an int in [-2**63, 2**63)", "pass a smaller integer seed"
        )
    if cache not in CACHES:
        raise ConfigError.describe("cache", cache, f"one of {CACHES}", "pick a listed cache")
    if cache == "contiguous":
        for what, value in (("page_size", page_size), ("num_pages", num_pages)):
            if value is not None:
                raise ConfigError.describe(
                    what,
                    value,
                    "None with cache='contiguous' (pages are a paged-cache option)",
                    f"pass cache='paged' to use {what}, or leave it unset",
                )
    ok = page_size is None or is_positive_int(page_size)
    expected = f"None (the default, {PAGE_SIZE}) or an int >= 1"
    require(ok, "page_size", page_size, expected, "use 16")
    ok = num_pages is None or is_positive_int(num_pages)
    require(ok, "num_pages", num_pages, "None (the worst case) or an int >= 1", "leave it unset")


def _check_stop_tokens(stop_tokens, cfg: ModelConfig) -> np.ndarray:
    stop_tokens = () if stop_tokens is None else stop_tokens
    try:
        if is_int(stop_tokens) or isinstance(stop_tokens, (str, bytes)):
            raise TypeError
        stop_tokens = list(stop_tokens)
    except TypeError:
        raise TokenError.describe(
            "stop_tokens",
            stop_tokens,
            "a list of int token ids (or None for none)",
            f"wrap a single id in a list: stop_tokens=[{stop_tokens!r}]"
            if is_int(stop_tokens)
            else "pass a list of ids",
        ) from None
    if not all(is_int(s) for s in stop_tokens):
        raise TokenError.describe(
            "stop_tokens", stop_tokens, "a list of int token ids", "pass ids, not strings"
        )
    for i, stop in enumerate(stop_tokens):  # before int64 conversion, which overflows
        if not 0 <= stop < cfg.vocab_ids:
            raise TokenError.describe(
                f"stop_tokens[{i}]",
                stop,
                f"an id in [0, {cfg.vocab_ids})",
                "pass ids of the model's vocabulary",
            )
    stops = np.asarray(stop_tokens, dtype=np.int64).reshape(-1)
    return stops


__all__ = ["CACHES", "Step", "cache_slots", "generate", "stream", "token_logits"]
