"""Batches built ahead on a background thread while the train step runs.

    producer:  make(s0), make(s0 + 1), ...      (in order, at most `depth` finished ahead)
    consumer:  batch, wait_s = next(prefetch)    (wait_s: the step's data time)

A batch is a pure function of its step, so building it on another thread changes nothing but
when it is built: the loop sees exactly the batches it would have built itself. An exception in
`make(s)` (a corrupt token file, a Ctrl-C simulated there) is raised by the consumer, as is,
when it asks for step s, after every earlier batch; the producer stops there. `close()` (or the
`with` block's end) stops the producer and lets it go, however early the loop ends.
"""

from __future__ import annotations

import queue
import threading
import time
from collections.abc import Callable, Iterable
from typing import Any

from lmjax.checks import is_positive_int, require
from lmjax.errors import ConfigError

_POLL_S = 0.05  # how often a producer blocked on a full queue checks for close()


class Prefetch:
    """`make(step)` for each step of `steps`, built on one daemon thread, `depth` ahead."""

    def __init__(self, make: Callable[[int], Any], steps: Iterable[int], depth: int = 2):
        fix = "build 1 or 2 batches ahead"
        require(is_positive_int(depth), "prefetch depth", depth, "a positive int", fix, ConfigError)
        self._make, self._steps = make, iter(steps)
        self._ready: queue.Queue = queue.Queue(maxsize=depth)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._produce, name="lmjax-prefetch", daemon=True)
        self._thread.start()

    def _produce(self) -> None:
        for step in self._steps:
            try:
                item = (step, self._make(step), None)
            except BaseException as err:  # noqa: BLE001 (handed to the consumer, not swallowed)
                item = (step, None, err)
            if not self._put(item) or item[2] is not None:
                return

    def _put(self, item) -> bool:
        """Wait for room; False once closed (the consumer is gone: nobody will take it)."""
        while not self._stop.is_set():
            try:
                self._ready.put(item, timeout=_POLL_S)
                return True
            except queue.Full:
                continue
        return False

    def next(self) -> tuple[int, Any, float]:
        """(step, its batch, seconds waited for it); raises what `make(step)` raised."""
        start = time.perf_counter()
        step, batch, err = self._ready.get()
        waited = time.perf_counter() - start
        if err is not None:
            raise err
        return step, batch, waited

    def close(self) -> None:
        """Stop the producer and drop what it built ahead; returns once the thread has ended
        (after the batch it is building, if any)."""
        self._stop.set()
        while self._thread.is_alive():
            try:
                self._ready.get_nowait()
            except queue.Empty:
                self._thread.join(_POLL_S)

    def __enter__(self) -> Prefetch:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


__all__ = ["Prefetch"]
