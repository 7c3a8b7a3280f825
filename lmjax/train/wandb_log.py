"""Optional Weights & Biases logging (`train.wandb: true`), one W&B run per lmjax run.

Every `metrics.jsonl` record is logged at its step under TensorBoard's tags (`train/loss`,
`val/loss`, ... : `lmjax.train.tensorboard.TAGS`). The W&B run id lives in `RUN/wandb_id`;
`--resume` reads it back and calls `wandb.init(id=..., resume="allow")`, so the resumed
session continues the same W&B run. W&B writes its own files under `RUN/wandb/`.

Limit: W&B history cannot be truncated (`truncate_after` drops nothing). Offline, each session
writes its own file, and the resumed one logs again the steps after the last checkpoint (what
tests/test_wandb.py checks); once synced, W&B may keep the crashed session's values for those
steps, as a step below the run's last is refused online (not checked: the tests never sync).

`wandb` is imported only here and only when the first record is logged (it costs seconds of
import; tests/test_architecture.py's LAZY_THIRD_PARTY), so `import lmjax.train` stays fast.
"""

from __future__ import annotations

import importlib.util
import secrets
import sys
from pathlib import Path

from lmjax.errors import ConfigError
from lmjax.train.tensorboard import TAGS, is_number

ID_FILE = "wandb_id"


def require_installed(enabled: bool) -> None:
    """ConfigError when `train.wandb` is on but the package is missing (checked before a run
    writes anything; `find_spec` looks the package up without importing it)."""
    if enabled and importlib.util.find_spec("wandb") is None:
        raise ConfigError(
            "train.wandb = true needs the wandb package, which is not installed: "
            "pip install wandb (or set train.wandb: false)"
        )


def run_id(run_dir: Path, resume: bool) -> str:
    """The run's W&B id: the stored one when resuming, else a new one written to RUN/wandb_id."""
    path = Path(run_dir) / ID_FILE
    if resume and path.exists():
        return path.read_text(encoding="utf-8").strip()
    new = secrets.token_hex(4)  # W&B ids: short, [a-z0-9]
    path.write_text(new + "\n", encoding="utf-8")
    return new


class WandbLog:
    """`append(record)` logs a metrics record's scalars at its step; `close()` finishes the
    W&B run (exit code 1 while an exception propagates, so a failed run is marked failed and
    nothing waits). The W&B run starts on first use: only process 0 logs, and a run that logs
    nothing starts none."""

    def __init__(self, run_dir: Path, config: dict, resume: bool, project: str = "lmjax"):
        self.run_dir, self.config, self.resume = Path(run_dir), config, resume
        self.project = project
        self._run = None

    def _wandb_run(self):
        if self._run is None:
            import wandb  # lazy: see the module docstring

            self._run = wandb.init(
                project=self.project,
                dir=str(self.run_dir),
                id=run_id(self.run_dir, self.resume),
                resume="allow",
                config=self.config,
                # lmjax prints its own progress: W&B must not wrap the process's stdout.
                settings=wandb.Settings(console="off"),
            )
        return self._run

    def truncate_after(self, step: int) -> None:
        """Nothing to drop (see the module docstring); starts the run, as a resume does."""
        self._wandb_run()

    def append(self, record: dict) -> None:
        values = {TAGS[k]: float(v) for k, v in record.items() if k in TAGS and is_number(v)}
        if values:
            self._wandb_run().log(values, step=record["step"])

    def close(self) -> None:
        if self._run is not None:
            failed = sys.exc_info()[0] is not None  # close() runs in the trainer's `finally`
            self._run.finish(exit_code=1 if failed else 0)
            self._run = None


__all__ = ["ID_FILE", "WandbLog", "require_installed", "run_id"]
