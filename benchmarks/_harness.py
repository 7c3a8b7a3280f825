"""What the CPU benchmarks share: their command line's common flags, the machine a figure came
from, alternating timed rounds and their medians, and the results file.

No jax, torch or tokenizers import here: the tokenizer and prepare benchmarks use it without the
JAX runtime, and a torch worker process without jax. Each benchmark keeps its own JSON keys;
these functions fill some of them.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import socket
import statistics
import time
from pathlib import Path


def parser(doc: str) -> argparse.ArgumentParser:
    """A benchmark's argument parser, described by its module docstring's first line."""
    return argparse.ArgumentParser(description=doc.splitlines()[0])


def add_output(ap: argparse.ArgumentParser, default: Path | None, help: str) -> None:
    """`--output FILE`: where the JSON result goes (None: the benchmark picks, e.g. by --quick)."""
    ap.add_argument("--output", type=Path, default=default, help=help)


def machine(**extra) -> dict:
    """The host a CPU figure was measured on: OS and kernel, Python, logical CPUs; `extra`
    (JSON-able) beside them."""
    return {
        "platform": platform.platform(),
        "python": platform.python_version(),
        "cpu_count": os.cpu_count(),
        **extra,
    }


def load_average() -> list[float]:
    """The 1, 5 and 15-minute load averages to two places: how shared the CPU was (recorded
    before and after, since a figure from a busy machine is slower than the code)."""
    return [round(x, 2) for x in os.getloadavg()]


def free_port() -> int:
    """A TCP port on 127.0.0.1 free now (the kernel's pick), for a coordinator to listen on."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def timed(fn) -> tuple[float, object]:
    """`(wall seconds, result)` of one call of `fn()`."""
    start = time.perf_counter()
    out = fn()
    return time.perf_counter() - start, out


def alternate(sides: dict, rounds: int, check=None) -> dict[str, list[float]]:
    """Seconds of each `sides[name]()` over `rounds` rounds, the sides taking turns within a
    round, so a burst of other work on a shared machine slows both rather than one.
    `check(name, out)`, if given, sees each call's result (e.g. that the tokens did not change)."""
    times = {name: [] for name in sides}
    for _ in range(rounds):
        for name, fn in sides.items():
            seconds, out = timed(fn)
            if check is not None:
                check(name, out)
            times[name].append(seconds)
    return times


def rates(times: dict[str, list[float]], work: float) -> dict:
    """Each side's median seconds, and `work` (tokens, bytes) per second at the median and at
    the best round: the median is the headline, the best the least disturbed round."""
    medians = {name: statistics.median(t) for name, t in times.items()}
    return {
        "median_seconds": medians,
        "per_second": {name: work / m for name, m in medians.items()},
        "best_per_second": {name: work / min(t) for name, t in times.items()},
    }


def write_result(path: Path, result: dict, indent: int = 2) -> None:
    """`result` as JSON at `path`, its folder made; written beside and renamed, so a benchmark
    killed mid-write never leaves half a file where the last good one was."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".json.tmp")
    tmp.write_text(json.dumps(result, indent=indent) + "\n")
    tmp.replace(path)
