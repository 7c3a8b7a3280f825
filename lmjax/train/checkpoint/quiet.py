"""Silence what orbax and tensorstore print around a failed read or write of a checkpoint."""

from __future__ import annotations

import contextlib
import gc
import logging
import sys


@contextlib.contextmanager
def quiet():
    """Silence what orbax and tensorstore print while reading a damaged step.

    A read that fails midway leaves orbax's other reads pending: their tasks and coroutines are
    reported by the asyncio logger and `sys.unraisablehook` (hundreds of lines, some after the
    error is raised), and absl logs each missing metadata file. The error lmjax raises says
    it all in one line.
    """
    loggers = [logging.getLogger(name) for name in ("asyncio", "absl")]
    disabled, hook = [g.disabled for g in loggers], sys.unraisablehook
    for g in loggers:
        g.disabled = True
    sys.unraisablehook = lambda unraisable: None
    try:
        yield
    except BaseException:
        gc.collect()  # the failed read's leftovers are reported now, while silenced
        # ... or later, when the pending reads end: keep dropping those reports.
        if not any(isinstance(f, _OrbaxLeftovers) for f in loggers[0].filters):
            loggers[0].addFilter(_OrbaxLeftovers())
        if not isinstance(hook, _ClosedLoopHook):
            hook = _ClosedLoopHook(hook)
        raise
    finally:
        sys.unraisablehook = hook
        for g, was in zip(loggers, disabled, strict=True):
            g.disabled = was


class _ClosedLoopHook:
    """`sys.unraisablehook` after a failed orbax call: tensorstore threads finishing the
    abandoned reads call back into orbax's event loop, closed by then, and each report lands
    here as "Event loop is closed" (measured: up to hundreds of tracebacks, printed after the
    one-line error). Those are dropped; every other report goes to the previous hook."""

    def __init__(self, previous):
        self.previous = previous

    def __call__(self, unraisable) -> None:
        err = unraisable.exc_value
        if isinstance(err, RuntimeError) and str(err) == "Event loop is closed":
            return
        self.previous(unraisable)


class _OrbaxLeftovers(logging.Filter):
    """Drops asyncio's "exception was never retrieved" reports of orbax's abandoned reads and
    writes (their error was already raised as a `CheckpointError`); keeps everything else."""

    def filter(self, record: logging.LogRecord) -> bool:
        if "never retrieved" not in str(record.msg):
            return True
        text = record.getMessage() + str(record.exc_info[1] if record.exc_info else "")
        return not any(word in text for word in ("orbax", "OCDBT", "tensorstore"))
