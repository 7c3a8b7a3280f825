"""A witness outside each process of a multi-process run: lmjax's line for a process that jax
aborts (issue 45, item 3).

When process 0 dies it takes jax's coordination service with it, and jax's agent in every other
process may then abort that process from one of its C++ threads (`LOG(FATAL)`, SIGABRT, status
134) before lmjax's own handling of the failed collective prints its line: a race, lost 2 times
in 10 under load and 7 in 8 on a quiet machine (benchmarks/multiprocess_faults.py). jaxlib gives
no hook before that abort: `missed_heartbeat_callback` throws `std::bad_cast` when called (jax
0.10.2 and 0.12). No Python can run in the aborting process, so the line comes from outside it:

    trainer ── faulthandler's report of a fatal signal ──┐ one pipe
            ── "step N" at each step (`at_step`) ─────────┤
                                                          └─> witness (a small Python, no jax)

`faulthandler` writes its report from its C signal handler (no GIL, no Python code) before
the signal kills the process. When the pipe closes, the trainer has ended: a normal exit, one
of lmjax's own lines, or a SIGKILL leave no report and the witness says nothing. A report,
with the coordinator no longer accepting a connection (and this process not process 0, which
hosts it), makes the witness print lmjax's line on the trainer's stderr, naming process 0 and
the step this process last started; the trainer's status stays the signal's. Any other report
(a crash of another kind) is copied to stderr as it is: the Python threads' stacks.
"""

from __future__ import annotations

import faulthandler
import os
import subprocess
import sys

STEP_PLACE = "<STEP>"  # where the witness puts the step into the line it was given

# The witness: argv = [coordinator host:port, the line, its STEP_PLACE, rank]; stdin = the pipe.
PROGRAM = r"""
import socket, sys
address, line, place, rank = sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4])
step, pending, report = None, b"", b""
for chunk in iter(lambda: sys.stdin.buffer.read1(65536), b""):
    if report:
        report += chunk
        continue
    pending += chunk
    at = pending.find(b"Fatal Python error")
    if at >= 0:
        pending, report = pending[:at] + b"\n", pending[at:]
    *lines, pending = pending.split(b"\n")
    for one in lines:
        if one.startswith(b"step ") and one[5:].isdigit():
            step = one[5:].decode()

def answers(address):
    host, _, port = address.rpartition(":")
    try:
        socket.create_connection((host.strip("[]"), int(port)), timeout=2).close()
        return True
    except (OSError, ValueError):
        return False

if report:
    if rank != 0 and not answers(address):
        where = "before its first step" if step is None else "in step " + step
        sys.stderr.write(line.replace(place, where) + "\n")
    else:
        sys.stderr.buffer.write(report)
    sys.stderr.flush()
"""

_PIPE: list[int] = []  # the write end, while a witness listens
_WITNESS: list[subprocess.Popen] = []  # held, so no collection warns that it still runs


def start(coordinator: str, rank: int, line: str) -> subprocess.Popen:
    """Start this process's witness; `line` (with `STEP_PLACE`) is what it prints if jax aborts
    this process once the coordinator is gone. faulthandler reports into its pipe from now on."""
    read, write = os.pipe()  # both ends not inherited (PEP 446): only stdin carries `read`
    witness = subprocess.Popen(
        [sys.executable, "-I", "-S", "-c", PROGRAM, coordinator, line, STEP_PLACE, str(rank)],
        stdin=read,
        stdout=subprocess.DEVNULL,
    )
    os.close(read)
    os.set_blocking(write, False)  # a stalled witness must never block a training step
    faulthandler.enable(file=write, all_threads=True)
    _PIPE[:], _WITNESS[:] = [write], [witness]
    return witness


def at_step(step: int) -> None:
    """Tell the witness (if any) that this process starts `step`."""
    if _PIPE:
        try:
            os.write(_PIPE[0], b"step %d\n" % step)
        except OSError:  # a full pipe or a gone witness: the line would only lack the step
            pass


__all__ = ["PROGRAM", "STEP_PLACE", "at_step", "start"]
