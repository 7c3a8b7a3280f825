"""A deterministic byte mutator over a target's seeds: what the suite runs where atheris is not
(tests/test_fuzz.py), and a quick local check:

    python fuzz/mutate.py TARGET [N [SEED]]   N mutated inputs (default 2000), seeded by TARGET

Mutations: flip, set, insert or delete a byte or a run; copy a slice of another seed in; replace
a number with an extreme (0, -1, 2**31, 10**12, 1e309, NaN); cut. Each input runs through
`targets.run_one`; any exception escapes (a finding), with the input saved to fuzz/findings/.
"""

from __future__ import annotations

import os
import random
import resource
import signal
import sys
import zlib
from pathlib import Path

HERE = Path(__file__).parent
sys.path.insert(0, str(HERE))
from targets import RSS_LIMIT_MB, TIMEOUT_S, Finding, keep, run_one  # noqa: E402

FRESH_MB = 600  # a fresh fuzzing process's resident size (jax imported, no torch)

_EXTREMES = [b"0", b"-1", b"2147483648", b"1000000000000", b"1e309", b"NaN", b"null", b'""']


def seeds(target: str) -> list[bytes]:
    return [p.read_bytes() for p in sorted((HERE / "corpus" / target).iterdir())]


def mutate(rng: random.Random, data: bytes, pool: list[bytes]) -> bytes:
    out = bytearray(data)
    for _ in range(rng.choice((1, 1, 2, 4))):
        at = rng.randrange(len(out) + 1)
        kind = rng.randrange(7)
        if kind == 0 and out:
            out[min(at, len(out) - 1)] ^= 1 << rng.randrange(8)
        elif kind == 1 and out:
            out[min(at, len(out) - 1)] = rng.randrange(256)
        elif kind == 2:
            out[at:at] = bytes(rng.randrange(256) for _ in range(rng.randrange(1, 9)))
        elif kind == 3:
            del out[at : at + rng.randrange(1, 17)]
        elif kind == 4:
            other = rng.choice(pool)
            start = rng.randrange(len(other) + 1)
            out[at:at] = other[start : start + rng.randrange(1, 65)]
        elif kind == 5:
            digits = [i for i, b in enumerate(out) if 48 <= b <= 57]
            if digits:
                i = rng.choice(digits)
                j = i
                while j < len(out) and 48 <= out[j] <= 57:
                    j += 1
                out[i:j] = rng.choice(_EXTREMES)
        else:
            del out[at:]
    return bytes(out)


def _timed_out(*_):
    raise Finding(f"an input ran past {TIMEOUT_S} s")


def checked_run(target: str, data: bytes) -> None:
    """`run_one`, with a hang past TIMEOUT_S (SIGALRM) or memory past the bound made a
    `Finding`. The bound is on what the input added: the process's high-water mark after it,
    less the resident size before it, at most RSS_LIMIT_MB - FRESH_MB (a fresh fuzzing process
    holds about FRESH_MB, so there the peak stays under RSS_LIMIT_MB, as libFuzzer's
    -rss_limit_mb checks). Judged only when the input raised the high-water mark: in a test
    process that other tests took higher already, an input staying under that mark is unseen
    (a long-lived pytest worker holds gigabytes: its peak alone is no input's fault)."""
    before_mb, resident_mb = _peak_mb(), _resident_mb()
    previous = signal.signal(signal.SIGALRM, _timed_out)
    signal.setitimer(signal.ITIMER_REAL, TIMEOUT_S)
    try:
        run_one(target, data)
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)
    peak_mb = _peak_mb()
    added_mb = peak_mb - resident_mb
    if peak_mb > before_mb and added_mb > RSS_LIMIT_MB - FRESH_MB:
        raise Finding(
            f"resident size {peak_mb:.0f} MB, {added_mb:.0f} MB more than before the input "
            f"(bound {RSS_LIMIT_MB - FRESH_MB} MB: {RSS_LIMIT_MB} MB from a fresh process)"
        )


def _peak_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def _resident_mb() -> float:
    """The resident size now (Linux's /proc/self/statm; elsewhere the high-water mark)."""
    try:
        pages = int(Path("/proc/self/statm").read_text().split()[1])
    except (OSError, IndexError, ValueError):
        return _peak_mb()
    return pages * os.sysconf("SC_PAGE_SIZE") / 2**20


def run(target: str, n: int, seed: int = 0, findings: Path = HERE / "findings") -> int:
    """Run `n` mutated inputs of `target` (and its seeds); returns how many ran. A finding
    escapes, its input saved to `findings`/TARGET/ (fuzz/findings/: a regression test runs each
    file there; the suite passes its own temporary directory, so a failing test run leaves the
    repository as it was) and the path added to the exception's notes."""
    pool = seeds(target)
    rng = random.Random(zlib.crc32(target.encode()) + seed)
    for data in pool:
        checked_run(target, data)
    for _ in range(n):
        data = mutate(rng, rng.choice(pool), pool)
        try:
            checked_run(target, data)
        except BaseException as e:
            e.add_note(f"the input: {keep(data, findings, target, 'mutate')}")
            raise
    return n + len(pool)


if __name__ == "__main__":
    run(sys.argv[1], *map(int, sys.argv[2:] or [2000]))
