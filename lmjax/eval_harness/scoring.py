"""Scoring token requests in fixed shapes: the log-likelihood of each continuation given its
context, and whether greedy decoding would have produced it (lm-evaluation-harness's
`loglikelihood`, over token ids; `lmjax.eval_harness` does the text).

A request is `(context ids, continuation ids)`. Its input row is `(context + continuation)`
without the last token, left-truncated to the model's C positions as the harness's Hugging Face
backend does; its continuation is read at the row's last `len(continuation)` positions.

Rows, not requests, are what the model runs:
- Sharing. A request whose input is a prefix of another's is read from the longer row (the
  logits at a position depend only on the tokens before it): a multiple-choice task whose
  answers are one token each scores all its answers in one row, and answers that extend each
  other share too. A row answers queries `(position, token)`, at most T of them (its length
  bucket); more spill into a copy of the row.
- Shapes. Rows are sorted by length, right-padded to a bucket T (powers of two from
  `MIN_BUCKET`, at most C, and C itself) and batched `batch_size` at a time (a short last
  batch padded with empty rows), so a task compiles one program per bucket it uses: at most
  `len(buckets(C))`, 7 for C = 1024 (`compiled_programs` counts them).
- Devices. With several devices the batch axis is split over all of them (`batch_size` rounded
  up to a multiple of the device count); the weights are replicated.
"""

from __future__ import annotations

import bisect
import dataclasses
from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from lmjax.checks import is_positive_int, require
from lmjax.errors import TokenError
from lmjax.generate.loop import token_logits
from lmjax.models import ModelConfig, forward
from lmjax.models.transformer import cast

MIN_BUCKET = 16


def buckets(context: int) -> list[int]:
    """The row lengths T a model of C positions compiles for: 16, 32, ... below C, then C."""
    sizes, t = [], MIN_BUCKET
    while t < context:
        sizes.append(t)
        t *= 2
    return [*sizes, context]


def input_row(context: Sequence[int], continuation: Sequence[int], c: int) -> list[int]:
    """The tokens the model reads for one request (module docstring): at most C, left-truncated."""
    return [*context, *continuation][-(c + 1) :][:-1]


@dataclasses.dataclass
class _Row:
    tokens: list[int]
    queries: dict[tuple[int, int], int]  # (position, token) -> its slot in the row's answers


@dataclasses.dataclass(frozen=True)
class Plan:
    """Rows to run and, per request, the `(row, slot)` of each continuation token."""

    rows: list[_Row]
    slots: list[list[tuple[int, int]]]


def plan(requests: Sequence[tuple[Sequence[int], Sequence[int]]], c: int) -> Plan:
    """Rows for `requests` (each a non-empty continuation), shared where one input is a
    prefix of another's, each with at most `bucket(len)` queries."""
    for i, (_, cont) in enumerate(requests):
        ok = 1 <= len(cont) <= c
        require(ok, f"continuation {i} length", len(cont), f"1 to {c} tokens (the model's C)",
                "shorten the continuation", TokenError)  # fmt: skip
    inputs = [tuple(input_row(ctx, cont, c)) for ctx, cont in requests]
    ordered = sorted(set(inputs))
    # In lexicographic order a prefix of any input is a prefix of the input right after it.
    owner = list(range(len(ordered)))
    for i in range(len(ordered) - 2, -1, -1):
        nxt = ordered[i + 1]
        if nxt[: len(ordered[i])] == ordered[i]:
            owner[i] = owner[i + 1]
    index = {row: owner[i] for i, row in enumerate(ordered)}
    rows: list[_Row] = []
    open_rows: dict[int, int] = {}  # owner -> index of its newest copy in `rows`
    slots = []
    sizes = buckets(c)
    for (_, cont), inp in zip(requests, inputs, strict=True):
        key = index[inp]
        tokens = list(ordered[key])
        capacity = sizes[bisect.bisect_left(sizes, len(tokens))]
        start = len(inp) - len(cont)
        mine = []
        for k, token in enumerate(cont):
            query = (start + k, int(token))
            r = open_rows.get(key)
            if r is None or (query not in rows[r].queries and len(rows[r].queries) >= capacity):
                rows.append(_Row(tokens, {}))
                r = open_rows[key] = len(rows) - 1
            mine.append((r, rows[r].queries.setdefault(query, len(rows[r].queries))))
        slots.append(mine)
    return Plan(rows, slots)


@jax.jit
def _score(params, tokens_BT, position_BK, token_BK, cfg: ModelConfig):
    """`(log p(token_BK at position_BK), whether it is the argmax there)`, each `[B, K]`."""
    logits_BTV = token_logits_3d(forward(params, tokens_BT, cfg), cfg)
    logz_BT = jax.nn.logsumexp(logits_BTV, axis=-1)
    best_BT = jnp.argmax(logits_BTV, axis=-1)
    rows_B1 = jnp.arange(tokens_BT.shape[0])[:, None]
    picked_BK = logits_BTV[rows_B1, position_BK, token_BK]
    logp_BK = picked_BK - jnp.take_along_axis(logz_BT, position_BK, axis=1)
    greedy_BK = jnp.take_along_axis(best_BT, position_BK, axis=1) == token_BK
    return logp_BK, greedy_BK


def token_logits_3d(logits_BTV, cfg: ModelConfig):
    """`token_logits` over `[B, T, V]`: the tokenizer's ids only (a padded embedding's rows
    are never scored nor greedy)."""
    b, t, v = logits_BTV.shape
    return token_logits(logits_BTV.reshape(b * t, v), cfg).reshape(b, t, -1)


def compiled_programs() -> int:
    """How many programs the scorer has compiled in this process (one per shape bucket and
    batch size, per model config)."""
    return _score._cache_size()


def scoring_params(params: dict, cfg: ModelConfig, mesh: Mesh | None = None) -> dict:
    """The weights cast to the compute dtype once (not per batch), replicated over `mesh`."""
    params = cast(params, cfg.compute_dtype)
    if mesh is not None:
        params = jax.device_put(params, NamedSharding(mesh, P()))
    return params


def data_mesh() -> Mesh | None:
    """A one-axis mesh over every device for the batch, or None on one device."""
    devices = jax.devices()
    return Mesh(np.array(devices), ("data",)) if len(devices) > 1 else None


def batch_rows(batch_size: int, mesh: Mesh | None) -> int:
    """`batch_size` rounded up to a multiple of the mesh's devices."""
    require(is_positive_int(batch_size), "batch_size", batch_size, "an int >= 1", "pass e.g. 8")
    n = 1 if mesh is None else mesh.size
    return -(-batch_size // n) * n


def run(
    params: dict,
    cfg: ModelConfig,
    requests: Sequence[tuple[Sequence[int], Sequence[int]]],
    *,
    batch_size: int = 8,
    mesh: Mesh | None = None,
    progress=None,
) -> list[tuple[float, bool]]:
    """`(sum of the continuation's log-probabilities, whether each token is the argmax)` per
    request, in order. `params` as `scoring_params` returns them; `progress(n)` is called with
    the number of requests each batch completed (a tqdm bar's `update`)."""
    the_plan = plan(requests, cfg.context_length)
    b = batch_rows(batch_size, mesh)
    logp, greedy = _run_rows(params, cfg, the_plan, b, mesh, progress)
    out = []
    for mine in the_plan.slots:
        out.append(
            (float(sum(logp[r][k] for r, k in mine)), bool(all(greedy[r][k] for r, k in mine)))
        )
    return out


def _run_rows(params, cfg, the_plan: Plan, b: int, mesh, progress) -> tuple[dict, dict]:
    """Each row's answers, `(logp, greedy)` dicts row -> `[K]` arrays."""
    sizes = buckets(cfg.context_length)
    order = sorted(range(len(the_plan.rows)), key=lambda r: -len(the_plan.rows[r].tokens))
    rank = {r: i for i, r in enumerate(order)}
    per_row = [0] * len(the_plan.rows)  # requests whose last row is this one (for the bar)
    for mine in the_plan.slots:
        per_row[max((r for r, _ in mine), key=rank.__getitem__)] += 1
    groups: dict[int, list[int]] = {}
    for r in order:
        t = sizes[bisect.bisect_left(sizes, len(the_plan.rows[r].tokens))]
        groups.setdefault(t, []).append(r)
    logp, greedy = {}, {}
    sharding = None if mesh is None else NamedSharding(mesh, P("data"))
    for t, members in groups.items():
        for i in range(0, len(members), b):
            batch = members[i : i + b]
            arrays = _batch_arrays([the_plan.rows[r] for r in batch], b, t)
            if sharding is not None:
                arrays = jax.device_put(arrays, sharding)
            out_logp, out_greedy = jax.device_get(_score(params, *arrays, cfg))
            for j, r in enumerate(batch):
                logp[r], greedy[r] = out_logp[j], out_greedy[j]
            if progress is not None:
                progress(sum(per_row[r] for r in batch))
    return logp, greedy


def _batch_arrays(rows: list[_Row], b: int, t: int) -> tuple[np.ndarray, ...]:
    """`(tokens [b, t], positions [b, t], tokens to score [b, t])`, right-padded with zeros."""
    tokens = np.zeros((b, t), np.int32)
    positions = np.zeros((b, t), np.int32)
    targets = np.zeros((b, t), np.int32)
    for i, row in enumerate(rows):
        tokens[i, : len(row.tokens)] = row.tokens
        for (position, token), k in row.queries.items():
            positions[i, k], targets[i, k] = position, token
    return tokens, positions, targets
