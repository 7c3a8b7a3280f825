"""A named pipe that cannot hang a test (for the bad-input suites of issue 12)."""

from __future__ import annotations

import os
import threading


def fifo(path) -> threading.Timer:
    """Make a named pipe at `path`. If a reader blocks on it, a writer opens and closes it after
    3 s, so a regression fails the test's time assertion instead of hanging the whole run.
    Cancel the returned timer when done."""
    os.mkfifo(path)

    def release():
        try:
            os.close(os.open(path, os.O_WRONLY | os.O_NONBLOCK))
        except OSError:  # no reader waiting: nothing to release
            pass

    timer = threading.Timer(3.0, release)
    timer.daemon = True
    timer.start()
    return timer
