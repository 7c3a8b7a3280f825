"""A terminal prompt that hears every Ctrl-C, in a process with many threads.

Python's `input()` with readline waits for a key in `select()` and runs Python's signal
handlers only when that wait is interrupted. A SIGINT can miss it in two ways:

- The kernel hands a process's signal to any thread that does not block it, and a JAX
  process has dozens (XLA's thread pools). Only the thread it lands on is interrupted: the
  main thread sleeps on in `select()`.
- One that lands on the main thread just before it enters `select()` (while readline is
  still echoing the last key) interrupts nothing.

Either way the Ctrl-C does nothing until the next key is pressed. `Prompt` closes both gaps:
Python's handler writes the number of each signal it catches to a pipe
(`signal.set_wakeup_fd`, from whichever thread caught it), and a watcher thread, while
`input()` waits, interrupts the main thread itself (SIGUSR1, whose handler does nothing)
every `NUDGE_S` until the SIGINT handler has run there.
"""

from __future__ import annotations

import os
import signal
import threading

NUDGE_S = 0.02  # how often the main thread is interrupted until it has heard a Ctrl-C


class Prompt:
    """`with Prompt(readline) as p: p.input("> ")`: `input` raising KeyboardInterrupt on
    Ctrl-C; `p.had_text` says whether readline's line held text when Ctrl-C came (read in the
    handler, before readline clears its line). The SIGINT handler is the prompt's from
    `__enter__` to `__exit__`, so a Ctrl-C between prompts (during a reply) raises
    KeyboardInterrupt too, wherever the main thread is."""

    def __init__(self, readline=None):
        self.readline = readline
        self.had_text = False
        self._waiting = False  # the main thread is inside input(); guarded by _lock
        self._lock = threading.Lock()
        self._heard = threading.Event()  # the SIGINT handler ran since input() began

    def __enter__(self) -> Prompt:
        read_end, self._write_end = os.pipe()
        os.set_blocking(self._write_end, False)  # set_wakeup_fd's requirement
        self._previous = (
            signal.signal(signal.SIGINT, self._on_ctrl_c),
            signal.signal(signal.SIGUSR1, _interrupted),
            signal.set_wakeup_fd(self._write_end, warn_on_full_buffer=False),
        )
        watcher = threading.Thread(target=self._watch, args=(read_end,), daemon=True)
        watcher.start()
        return self

    def __exit__(self, *exc) -> None:
        with self._lock:  # no nudge is sent once SIGUSR1's handler is gone
            self._waiting = False
            sigint, sigusr1, wakeup = self._previous
            signal.set_wakeup_fd(wakeup)
            signal.signal(signal.SIGUSR1, sigusr1)
            signal.signal(signal.SIGINT, sigint)
        os.close(self._write_end)  # the watcher reads end-of-file and stops

    def input(self, prompt: str) -> str:
        """`input(prompt)`; KeyboardInterrupt on Ctrl-C, EOFError on Ctrl-D."""
        self.had_text = False
        self._heard.clear()
        with self._lock:
            self._waiting = True
        try:
            return input(prompt)
        finally:
            with self._lock:
                self._waiting = False

    def _on_ctrl_c(self, signum, frame) -> None:
        """SIGINT, in the main thread: note whether the line holds text, then stop what runs
        (a reply or `input`) as Python's own handler does."""
        self.had_text = self.readline is not None and bool(self.readline.get_line_buffer())
        self._heard.set()
        raise KeyboardInterrupt

    def _watch(self, read_end: int) -> None:
        """For each SIGINT caught anywhere: interrupt the main thread while it waits in
        `input()` and has not run the handler yet."""
        main = threading.main_thread().ident
        with os.fdopen(read_end, "rb", buffering=0) as caught:
            while numbers := caught.read(64):
                if signal.SIGINT not in numbers:
                    continue
                while not self._heard.wait(NUDGE_S):
                    with self._lock:
                        if not self._waiting:
                            break
                        signal.pthread_kill(main, signal.SIGUSR1)


def _interrupted(signum, frame) -> None:
    """SIGUSR1: nothing to do; arriving was the point (it ends the main thread's wait)."""
