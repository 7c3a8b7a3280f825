"""lmjax.parallel.witness: a process that dies of a signal after its coordinator went still ends
with lmjax's line (issue 45, item 3: jax's agent aborts a survivor of a killed process 0).

A real process starts a witness, reports steps and calls `os.abort()` (SIGABRT raised in C, as
jax's `LOG(FATAL)` does); the coordinator is a loopback port that is closed (gone) or listening
(alive). The killed-coordinator runs of two real `lmjax train` processes, where jax itself
aborts the survivor, are benchmarks/multiprocess_faults.py's `coordinator_killed` case.
"""

from __future__ import annotations

import socket
import subprocess
import sys
import time

import pytest

from lmjax.parallel import multihost, witness

# The process under watch: loads witness.py alone (no jax), starts its witness, reports `steps`
# steps and ends as `end` says.
CHILD = r"""
import importlib.util, os, sys
spec = importlib.util.spec_from_file_location("witness", sys.argv[1])
w = importlib.util.module_from_spec(spec)
spec.loader.exec_module(w)
coordinator, rank, steps, end = sys.argv[2], int(sys.argv[3]), int(sys.argv[4]), sys.argv[5]
w.start(coordinator, rank, "LOST " + w.STEP_PLACE)
for step in range(1, steps + 1):
    w.at_step(step)
{"abort": os.abort, "exit": lambda: sys.exit(0), "lost": lambda: os._exit(75)}[end]()
"""


@pytest.fixture
def gone() -> str:
    """host:port of a coordinator that is gone (a port bound, then closed)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return f"127.0.0.1:{s.getsockname()[1]}"


@pytest.fixture
def alive():
    """host:port of a coordinator that still accepts connections."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        yield f"127.0.0.1:{s.getsockname()[1]}"


def _child(coordinator: str, rank: int, steps: int, end: str) -> subprocess.CompletedProcess:
    """Run CHILD; returns once its stderr is closed, so the witness (which holds it) has ended."""
    args = [sys.executable, "-c", CHILD, witness.__file__, coordinator, str(rank), str(steps), end]
    return subprocess.run(args, capture_output=True, text=True, timeout=60)


def test_an_aborted_process_ends_with_the_line_naming_its_last_step(gone):
    done = _child(gone, 1, 3, "abort")
    assert done.returncode == -6, done
    assert done.stderr.strip().splitlines()[-1] == "LOST in step 3", done.stderr
    assert "Fatal Python error" not in done.stderr  # the report is the witness's, not shown
    early = _child(gone, 1, 0, "abort")
    assert early.stderr.strip().splitlines()[-1] == "LOST before its first step", early.stderr


def test_with_the_coordinator_alive_or_on_process_0_the_report_is_shown_as_it_is(gone, alive):
    """A crash while the coordinator answers is not the coordinator's loss; process 0 hosts the
    coordinator, so its own crash is not either: faulthandler's report (the threads' stacks)."""
    for coordinator, rank in ((alive, 1), (gone, 0)):
        done = _child(coordinator, rank, 2, "abort")
        assert done.returncode == -6, done
        assert "Fatal Python error: Aborted" in done.stderr, done.stderr
        assert "LOST" not in done.stderr and "line 10 in <module>" in done.stderr


def test_a_normal_exit_or_lmjax_own_stop_leaves_the_witness_silent(gone):
    for end, code in (("exit", 0), ("lost", 75)):
        done = _child(gone, 1, 5, end)
        assert (done.returncode, done.stderr) == (code, ""), done


def test_the_witness_reads_steps_and_the_report_across_pieces(gone):
    """The pipe delivers what it holds: a step line or the report's first words may arrive cut
    in two; the last whole `step N` before the report is the one named."""
    line, place = "LOST " + witness.STEP_PLACE, witness.STEP_PLACE
    args = [sys.executable, "-I", "-S", "-c", witness.PROGRAM, gone, line, place, "1"]
    proc = subprocess.Popen(args, stdin=subprocess.PIPE, stderr=subprocess.PIPE)
    for piece in (b"step 9\nste", b"p 1", b"2\nstep 1", b"3\nFatal Py", b"thon error: Abo"):
        proc.stdin.write(piece)
        proc.stdin.flush()
        time.sleep(0.05)
    proc.stdin.write(b"rted\n\nstep 99\n")  # inside the report: not a step
    proc.stdin.close()
    assert proc.wait(30) == 0
    assert proc.stderr.read().decode().strip() == "LOST in step 13"


def test_the_aborted_line_names_the_coordinator_this_process_and_the_status():
    line = multihost.aborted_message(1, 2)
    assert line.startswith(
        "lmjax train: error: the coordinator (process 0 of 2) = unreachable, and jax aborted "
        f"this process (1 of 2) {witness.STEP_PLACE};"
    ), line
    assert "with status 134 (jax's abort)" in line and "--resume" in line
