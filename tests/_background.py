"""A long test subprocess started at collection, so it runs beside the rest of the suite.

The suite's own process keeps about one of CI's two cores busy. A module with a long
subprocess defines `start_in_background()` (calling `Worker.start`); tests/conftest.py calls it
once collection has selected a test of that module, and the module's fixture waits for the
result. Output goes to files, not pipes, so the child never blocks on a full pipe; the child is
killed and its directory removed at exit, also when the session is interrupted.
"""

from __future__ import annotations

import atexit
import os
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from _xla_flags import host_devices

ROOT = Path(__file__).resolve().parents[1]


@dataclass
class Done:
    returncode: int
    stdout: str
    stderr: str
    workdir: Path


class Worker:
    """`command(workdir)` gives (argv, env); run once per session in a fresh directory."""

    def __init__(self, name: str, command: Callable[[Path], tuple[list[str], dict]]):
        self.name, self.command = name, command
        self.proc: subprocess.Popen | None = None

    def start(self) -> None:
        if self.proc is not None:
            return
        self.workdir = Path(tempfile.mkdtemp(prefix=f"lmjax-{self.name}-"))
        argv, env = self.command(self.workdir)
        self.out, self.err = (open(self.workdir / n, "w+") for n in (".stdout", ".stderr"))
        self.proc = subprocess.Popen(argv, env=env, stdout=self.out, stderr=self.err, text=True)
        atexit.register(self._stop)

    def result(self) -> Done:
        """Start if not started (e.g. in a pytest-xdist worker), wait, and return the outcome."""
        self.start()
        returncode = self.proc.wait()
        for f in (self.out, self.err):
            f.seek(0)
        return Done(returncode, self.out.read(), self.err.read(), self.workdir)

    def _stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()
        self.out.close()
        self.err.close()
        shutil.rmtree(self.workdir, ignore_errors=True)


def on_host_devices(script: str, n: int = 8) -> Callable[[Path], tuple[list[str], dict]]:
    """A `Worker` command running `python script WORKDIR` on `n` simulated CPU devices (the
    caller's XLA_FLAGS kept), with this checkout on the path and a cache of its own."""

    def command(workdir: Path) -> tuple[list[str], dict]:
        env = dict(
            os.environ,
            XLA_FLAGS=host_devices(n),
            PYTHONPATH=str(ROOT),
            XDG_CACHE_HOME=str(workdir / "cache"),
            JAX_PLATFORMS="cpu",
        )
        return [sys.executable, script, str(workdir)], env

    return command
