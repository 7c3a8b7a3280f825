"""Throughput, model FLOPs utilisation, `metrics.jsonl` and the loss-curve plot.

Model FLOPs per trained token (forward + backward, the usual 6N + attention count):

    F = 6 * N_matmul + 12 * L * T * D

N_matmul counts the weights of every matrix multiply (the linear layers and the LM head; the
token table counts once as the head when tied, and never as the embedding gather). MFU is
`F * tokens_per_second / peak`, with peak the measured throughput of one large matmul on the
device in the compute dtype (or `logging.peak_flops`).
"""

from __future__ import annotations

import functools
import io
import json
import math
import os
import time
from pathlib import Path

import jax
import jax.numpy as jnp

from lmjax.files import atomic_open
from lmjax.models import ModelConfig, declare


def flops_per_token(cfg: ModelConfig, seq_len: int) -> float:
    """F above for one token of a length-`seq_len` sequence."""
    matmul = sum(
        math.prod(spec.shape)
        for name, spec in declare(cfg).items()
        if len(spec.shape) == 2 and "embedding" not in name
    )
    if cfg.tie_embeddings:
        matmul += cfg.vocab_size * cfg.d_model
    return 6.0 * matmul + 12.0 * cfg.n_layers * seq_len * cfg.d_model


@functools.cache
def measured_peak_flops(dtype: str = "float32", n: int = 2048, repeats: int = 5) -> float:
    """FLOP/s of the best of `repeats` n x n x n matmuls on the default device (compiled once)."""
    a = jnp.ones((n, n), dtype)
    matmul = jax.jit(lambda x, y: x @ y)
    matmul(a, a).block_until_ready()
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        matmul(a, a).block_until_ready()
        best = min(best, time.perf_counter() - start)
    return 2.0 * n**3 / best


class MetricsLog:
    """Append-only `metrics.jsonl`: one JSON object per line, each with a `step`."""

    def __init__(self, path: str | os.PathLike):
        self.path = Path(path)

    def truncate_after(self, step: int) -> None:
        """Drop records of steps after `step` (a resumed run redoes them), atomically."""
        kept = [r for r in self.read() if r.get("step", 0) <= step]
        with atomic_open(self.path, "w") as handle:
            handle.writelines(json.dumps(r) + "\n" for r in kept)

    def append(self, record: dict) -> None:
        with open(self.path, "a", encoding="utf-8") as handle:
            handle.write(json.dumps(record) + "\n")
            handle.flush()

    def read(self) -> list[dict]:
        if not self.path.exists():
            return []
        records = []
        for line in self.path.read_text(encoding="utf-8").splitlines():
            try:
                records.append(json.loads(line))
            except json.JSONDecodeError:
                continue  # a line cut short by a crash: the next run rewrites the file
        return records


def plot_losses(records: list[dict], path: str | os.PathLike, title: str = "") -> None:
    """Train and validation loss against step, written atomically as a PNG."""
    import matplotlib

    matplotlib.use("Agg")
    from matplotlib.figure import Figure

    train = [(r["step"], r["loss"]) for r in records if "loss" in r]
    val = [(r["step"], r["val_loss"]) for r in records if "val_loss" in r]
    fig = Figure(figsize=(7, 4.5))
    ax = fig.add_subplot()
    if train:
        ax.plot(*zip(*train, strict=True), label="train loss", linewidth=1)
    if val:
        ax.plot(*zip(*val, strict=True), "o-", label="validation loss", markersize=3)
    ax.set_xlabel("step")
    ax.set_ylabel("cross-entropy (nats/token)")
    ax.set_title(title)
    ax.grid(alpha=0.3)
    ax.legend()
    buffer = io.BytesIO()
    fig.savefig(buffer, format="png", dpi=110, bbox_inches="tight")
    with atomic_open(path, "wb") as handle:
        handle.write(buffer.getvalue())
