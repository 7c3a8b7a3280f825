"""Silence what orbax and tensorstore print around a failed read or write of a checkpoint."""

from __future__ import annotations

import contextlib
import gc
import logging
import sys
import time
from collections.abc import Callable

# After a failed read or write, how long the work orbax abandoned must show no sign of life
# before lmjax goes on, and the most it waits.
SETTLE_S, SETTLE_LIMIT_S = 0.2, 5.0
_reports = [0]  # "Event loop is closed" reports dropped so far


@contextlib.contextmanager
def quiet():
    """Silence what orbax and tensorstore print while reading a damaged step.

    A read that fails midway leaves orbax's other reads pending: their tasks and coroutines are
    reported by the asyncio logger and `sys.unraisablehook` (hundreds of lines, some after the
    error is raised), and absl logs each missing metadata file. The error lmjax raises says
    it all in one line.

    Those pending reads run on in tensorstore's threads and call back into orbax's event loop,
    closed by then; a process crashed once in a background thread while they did (Python
    3.12.1, jax 0.12.0.1, issue 43). So after a failure this waits until they are over: until
    no report has come for `SETTLE_S` (at most `SETTLE_LIMIT_S`), and only then raises.
    """
    loggers = [logging.getLogger(name) for name in ("asyncio", "absl")]
    disabled, hook = [g.disabled for g in loggers], sys.unraisablehook
    for g in loggers:
        g.disabled = True
    sys.unraisablehook = _dropped
    try:
        yield
    except BaseException:
        gc.collect()  # the failed read's leftovers are reported now, while silenced
        settle(_reported_since())
        # Reads still pending at the first collect hold their suspended coroutines until their
        # tensorstore futures end; garbage now, they are finalized (and report) here, silenced,
        # not at some later collection in the middle of the next command's output.
        gc.collect()
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


def _closed_loop(unraisable) -> bool:
    err = unraisable.exc_value
    return isinstance(err, RuntimeError) and str(err) == "Event loop is closed"


def _dropped(unraisable) -> None:
    """The hook while silenced: drops every report, counting an abandoned read's."""
    if _closed_loop(unraisable):
        _reports[0] += 1


def _reported_since() -> Callable[[], bool]:
    """A poll for `settle`: whether an abandoned read has reported since the previous call."""
    seen = _reports[0]

    def reported() -> bool:
        nonlocal seen
        new, seen = _reports[0] != seen, _reports[0]
        return new

    return reported


def settle(active: Callable[[], bool], settle_s=SETTLE_S, limit_s=SETTLE_LIMIT_S) -> None:
    """Poll `active()` (True: the abandoned work did something since the last poll) until it
    has been False for `settle_s`, at most `limit_s` in all: after a failed read (`quiet`) and
    a failed save (`Checkpoints._remove_failed_save`)."""
    start = quiet_since = time.monotonic()
    while time.monotonic() - start < limit_s:
        if active():
            quiet_since = time.monotonic()
        elif time.monotonic() - quiet_since >= settle_s:
            return
        time.sleep(0.02)


class _ClosedLoopHook:
    """`sys.unraisablehook` after a failed orbax call: tensorstore threads finishing the
    abandoned reads call back into orbax's event loop, closed by then, and each report lands
    here as "Event loop is closed" (measured: up to hundreds of tracebacks, printed after the
    one-line error). Those are dropped; every other report goes to the previous hook."""

    def __init__(self, previous):
        self.previous = previous

    def __call__(self, unraisable) -> None:
        if _closed_loop(unraisable):
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
