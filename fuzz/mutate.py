"""A deterministic byte mutator over a target's seeds: what the suite runs where atheris is not
(tests/test_fuzz.py), and a quick local check:

    python fuzz/mutate.py TARGET [N [SEED]]   N mutated inputs (default 2000), seeded by TARGET

Mutations: flip, set, insert or delete a byte or a run; copy a slice of another seed in; replace
a number with an extreme (0, -1, 2**31, 10**12, 1e309, NaN); cut. Each input runs through
`targets.run_one`; any exception escapes (a finding), with the input saved to fuzz/findings/.
"""

from __future__ import annotations

import random
import resource
import signal
import sys
import zlib
from pathlib import Path

HERE = Path(__file__).parent
sys.path.insert(0, str(HERE))
from targets import RSS_LIMIT_MB, TIMEOUT_S, Finding, run_one  # noqa: E402

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
    """`run_one`, with a hang past TIMEOUT_S (SIGALRM) or a peak RSS past RSS_LIMIT_MB made
    a `Finding`. The peak is the process's high-water mark, read after the input: an input that
    raised it past the bound is the finding (in a test process that other tests took past it
    already, only an input going higher still is seen)."""
    before_mb = _peak_mb()
    previous = signal.signal(signal.SIGALRM, _timed_out)
    signal.setitimer(signal.ITIMER_REAL, TIMEOUT_S)
    try:
        run_one(target, data)
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)
    peak_mb = _peak_mb()
    if peak_mb > RSS_LIMIT_MB and peak_mb > before_mb:
        raise Finding(f"resident size {peak_mb:.0f} MB past {RSS_LIMIT_MB} MB")


def _peak_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def run(target: str, n: int, seed: int = 0) -> int:
    """Run `n` mutated inputs of `target` (and its seeds); returns how many ran. A finding
    escapes, its input saved to fuzz/findings/TARGET/ (a regression test runs each file)."""
    pool = seeds(target)
    rng = random.Random(zlib.crc32(target.encode()) + seed)
    for data in pool:
        checked_run(target, data)
    for _ in range(n):
        data = mutate(rng, rng.choice(pool), pool)
        try:
            checked_run(target, data)
        except BaseException:
            found = HERE / "findings" / target
            found.mkdir(parents=True, exist_ok=True)
            (found / f"mutate-{zlib.crc32(data):08x}").write_bytes(data)
            raise
    return n + len(pool)


if __name__ == "__main__":
    run(sys.argv[1], *map(int, sys.argv[2:] or [2000]))
