"""TensorBoard event files in the run directory: `tensorboard --logdir runs/` shows each run.

Every `metrics.jsonl` record becomes scalars at its step, under `train/` (loss, lr, grad_norm,
tokens_per_s, mfu, data_time_s, real_token_fraction, first_step_s) or `val/` (loss,
perplexity). The writer is TensorBoard's own `EventFileWriter` (the one
`torch.utils.tensorboard` uses; numpy and protobuf only, no TensorFlow or torch import).

A resumed run appends a new event file to the same directory and begins it with a
`SessionLog.START` at its first step s: TensorBoard's readers then drop every event at a step
>= s from the files before it (what the crashed run logged after its last checkpoint), so no
step shows twice, as `metrics.jsonl` is truncated to the checkpoint.
"""

from __future__ import annotations

import os
import time
from pathlib import Path

from tensorboard.compat.proto import event_pb2, summary_pb2
from tensorboard.summary.writer.event_file_writer import EventFileWriter

# metrics.jsonl key -> TensorBoard tag (keys not listed are not scalars: "step", strings).
TAGS = {
    "loss": "train/loss",
    "lr": "train/lr",
    "grad_norm": "train/grad_norm",
    "tokens_per_s": "train/tokens_per_s",
    "mfu": "train/mfu",
    "data_time_s": "train/data_time_s",
    "real_token_fraction": "train/real_token_fraction",
    "first_step_s": "train/first_step_s",
    "val_loss": "val/loss",
    "val_perplexity": "val/perplexity",
}


class TensorBoardLog:
    """`append(record)` writes a metrics record's scalars; `truncate_after(step)` starts a
    session at step + 1 (the readers drop later steps of earlier files). The file is opened
    on first use, so a run that never writes a record leaves none."""

    def __init__(self, directory: str | os.PathLike):
        self.directory = Path(directory)
        self._writer: EventFileWriter | None = None

    def _events(self) -> EventFileWriter:
        if self._writer is None:
            self.directory.mkdir(parents=True, exist_ok=True)
            self._writer = EventFileWriter(str(self.directory))
        return self._writer

    def truncate_after(self, step: int) -> None:
        start = event_pb2.SessionLog(status=event_pb2.SessionLog.START)
        self._write(event_pb2.Event(wall_time=time.time(), step=step + 1, session_log=start))

    def append(self, record: dict) -> None:
        values = [
            summary_pb2.Summary.Value(tag=TAGS[key], simple_value=float(value))
            for key, value in record.items()
            if key in TAGS and is_number(value)
        ]
        if values:
            summary = summary_pb2.Summary(value=values)
            self._write(
                event_pb2.Event(wall_time=time.time(), step=record["step"], summary=summary)
            )

    def _write(self, event) -> None:
        writer = self._events()
        writer.add_event(event)
        writer.flush()  # one record per logging window: cheap, and nothing is lost on a crash

    def close(self) -> None:
        if self._writer is not None:
            self._writer.close()
            self._writer = None


def is_number(value) -> bool:
    """A real scalar (not None, e.g. tokens_per_s of a window that only compiled)."""
    return isinstance(value, int | float) and not isinstance(value, bool)


__all__ = ["TAGS", "TensorBoardLog", "is_number"]
