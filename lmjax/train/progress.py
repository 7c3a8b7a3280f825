"""The training loop's metrics: one record per window of steps, the progress bar, the health check.

A window is the steps since the last record. `MetricsWindow.flush` waits for them, refuses a
non-finite one (`NonFiniteError` naming the step) and appends to `metrics.jsonl`

    {"step", "loss" (mean over the window), "lr", "grad_norm", "tokens_per_s", "mfu",
     "data_time_s", and with a loss mask "real_token_fraction" (mean over the window)}
    tokens_per_s = tokens_per_step * timed steps / window seconds
    mfu          = flops_per_step / tokens_per_step * tokens_per_s / peak FLOP/s
    data_time_s  = mean over the window's steps of the time the loop waited for the batch

The process's first step compiles: it is timed apart (`first_step_s`, once per process) and not
counted into the throughput. Only the main process writes; every process checks health.
"""

from __future__ import annotations

import time
from collections.abc import Callable

import jax
import numpy as np
from tqdm import tqdm

from lmjax import parallel
from lmjax.errors import NonFiniteError
from lmjax.train.metrics import MetricsLog


def progress_bar(start: int, total: int, enabled: bool, out) -> tqdm:
    """The `train` bar, steps `start` .. `total`, on `out` (disabled: no output)."""
    return tqdm(
        total=total,
        initial=start,
        desc="train",
        unit="step",
        disable=not enabled,
        file=out,
        dynamic_ncols=True,
    )


class MetricsWindow:
    """The pending steps `[(step, device metrics)]`, their timer, and where records go.

    `latest_step()` names the newest checkpoint for the message of a non-finite step.
    """

    def __init__(
        self,
        log: MetricsLog,
        bar: tqdm,
        tokens_per_step: int,
        flops_per_step: float,
        peak_flops: float,
        latest_step: Callable[[], int | None],
    ):
        self.log, self.bar = log, bar
        self.tokens_per_step, self.flops_per_step = tokens_per_step, flops_per_step
        self.peak = peak_flops
        self.latest_step = latest_step
        self.pending: list[tuple[int, dict]] = []
        self.data_s: list[float] = []  # per pending step: time waiting for its batch
        self.compile_s: float | None = None
        self.started = time.perf_counter()

    def restart(self) -> None:
        """Start timing anew (after a checkpoint or an evaluation: they are not training)."""
        self.started = time.perf_counter()

    def add(self, step: int, metrics: dict, first: bool, data_s: float = 0.0) -> None:
        """Step `step` is dispatched; `first`: the process's first (it compiles: time it);
        `data_s`: the seconds the loop waited for its batch."""
        self.pending.append((step, metrics))
        self.data_s.append(data_s)
        if first:
            jax.block_until_ready(metrics)
            self.compile_s = time.perf_counter() - self.started
            self.restart()

    def flush(self, state_step: int) -> None:
        """Record the pending steps (the state is at `state_step`) and start a new window."""
        if self.pending:
            self._record(state_step)
        self.pending.clear()
        self.data_s.clear()
        self.restart()

    def _record(self, state_step: int) -> None:
        pending = self.pending
        host = jax.device_get([m for _, m in pending])  # waits for the steps to finish
        elapsed = time.perf_counter() - self.started
        for (step, _), m in zip(pending, host, strict=True):
            if not m["finite"] or step > state_step:
                raise self._non_finite(step, m)
        timed = len(pending) - (self.compile_s is not None)
        tokens_per_s = self.tokens_per_step * timed / elapsed if timed else None
        step, m = pending[-1][0], host[-1]
        per_token = self.flops_per_step / self.tokens_per_step
        record = {
            "step": step,
            "loss": float(np.mean([x["loss"] for x in host])),
            "lr": float(m["lr"]),
            "grad_norm": float(m["grad_norm"]),
            "tokens_per_s": tokens_per_s,
            "mfu": None if timed == 0 else per_token * tokens_per_s / self.peak,
            "data_time_s": float(np.mean(self.data_s)),
        }
        if "real_token_fraction" in m:  # a masked or packed batch: the share of real targets
            record["real_token_fraction"] = float(np.mean([x["real_token_fraction"] for x in host]))
        if self.compile_s is not None:  # once per process: the first step's compile + run time
            record["first_step_s"], self.compile_s = self.compile_s, None
        if parallel.is_main():
            self.log.append(record)
        speed = f"{tokens_per_s:,.0f}" if tokens_per_s else "compiling"
        data = f"{record['data_time_s'] * 1e3:.0f}ms"
        self.bar.set_postfix(loss=f"{record['loss']:.4f}", tok_s=speed, data=data, refresh=False)
        self.bar.update(step - self.bar.n)

    def _non_finite(self, step: int, m) -> NonFiniteError:
        latest = self.latest_step()
        return NonFiniteError.describe(
            f"train step {step}: loss",
            _Raw(f"{float(m['loss'])} (grad norm {float(m['grad_norm'])})"),
            "a finite loss, gradient and update",
            "lower optimizer.lr, set optimizer.clip_norm, or check the data; the run stopped "
            + (
                f"and its newest checkpoint (step {latest}) is the last good one"
                if latest is not None
                else "before saving any checkpoint"
            ),
        )


class _Raw(str):
    """A value shown as is in an error message (not as a quoted repr)."""

    def __repr__(self) -> str:
        return str(self)


__all__ = ["MetricsWindow", "progress_bar"]
