"""Comparing training runs: the same state bit for bit, and the losses a run logged."""

from __future__ import annotations

from pathlib import Path

import jax
import numpy as np

from lmjax import train


def assert_same_state(a, b):
    """Every leaf of two train states equal bit for bit (resume must reproduce a straight run)."""
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True):
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


def losses(run_dir: Path) -> list[tuple]:
    """(step, loss, val_loss) of every record in RUN/metrics.jsonl, in file order."""
    records = train.metrics.MetricsLog(run_dir / "metrics.jsonl").read()
    return [(r["step"], r.get("loss"), r.get("val_loss")) for r in records]
