"""Fuzz one target, coverage-guided, with atheris (libFuzzer for Python; `pip install
'lmjax[fuzz]'`), or with fuzz/mutate.py's seeded byte mutator where atheris is not installed:

    python fuzz/run.py --list                          the targets (fuzz/targets.py)
    python fuzz/run.py TARGET -max_total_time=60       one target for 60 s (more libFuzzer flags
                                                       may follow: -runs=N, -jobs=N, ...)

The corpus is fuzz/corpus/TARGET (the committed seeds, only read) after a working directory,
$FUZZ_WORK/TARGET (default /tmp/lmjax-fuzz/TARGET), where libFuzzer keeps each input that
reached new code, so a second run goes on from the first. A finding (an exception that is not
an `lmjax.errors` one, an input running past TIMEOUT_S or a resident size past RSS_LIMIT_MB)
stops the run with exit status 1 and its input in fuzz/findings/TARGET/: fix it, then
tests/test_fuzz.py runs that file as a regression test. lmjax, jinja2 and yaml are instrumented
(the code the inputs reach); jax, numpy and pyarrow are not.
"""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path

HERE = Path(__file__).parent
sys.path.insert(0, str(HERE))
os.environ.setdefault("JAX_PLATFORMS", "cpu")

# what the targets import, instrumented for coverage when atheris is there
_READERS = (
    "lmjax.io.hf",
    "lmjax.io.safetensors",
    "lmjax.tokenizers",
    "lmjax.tokenizers.chat",
    "lmjax.chat",
    "lmjax.config",
    "lmjax.data.corpus_files",
)


def _import_readers() -> None:
    import importlib

    for name in _READERS:
        importlib.import_module(name)


def _atheris(target: str, flags: list[str]) -> None:
    import atheris

    with atheris.instrument_imports(include=["lmjax", "jinja2", "yaml"]):
        _import_readers()
    import targets

    work = Path(os.environ.get("FUZZ_WORK", "/tmp/lmjax-fuzz")) / target
    work.mkdir(parents=True, exist_ok=True)
    findings = HERE / "findings" / target
    findings.mkdir(parents=True, exist_ok=True)
    argv = [sys.argv[0], f"-timeout={targets.TIMEOUT_S}", f"-rss_limit_mb={targets.RSS_LIMIT_MB}"]
    argv += [f"-artifact_prefix={findings}/", *flags, str(work), str(HERE / "corpus" / target)]
    atheris.Setup(argv, lambda data: _kept_if_it_fails(targets, target, data, findings))
    atheris.Fuzz()


def _kept_if_it_fails(targets, target: str, data: bytes, findings: Path) -> None:
    """`run_one`, saving the input of an escaping exception before atheris reports it: its own
    crash file can be lost (seen: a run_config TypeError whose process then died of libFuzzer's
    SIGALRM, status 142, before the file was written)."""
    try:
        targets.run_one(target, data)
    except BaseException as e:
        e.add_note(f"the input: {targets.keep(data, findings.parent, target, 'atheris')}")
        raise


def _mutator(target: str, flags: list[str]) -> None:
    """Without atheris: mutate.py's inputs in rounds of 500 until -max_total_time (or -runs)."""
    import mutate

    options = dict(f.lstrip("-").split("=", 1) for f in flags if "=" in f)
    seconds = float(options.get("max_total_time", 60))
    runs = int(options.get("runs", 1 << 62))
    start, done, round_ = time.monotonic(), 0, 0
    while time.monotonic() - start < seconds and done < runs:
        done += mutate.run(target, min(500, runs - done), seed=round_)
        round_ += 1
    rate = done / (time.monotonic() - start)
    print(f"#{done} DONE (mutate.py, no coverage) exec/s: {rate:.0f}", file=sys.stderr)
    print(f"stat::number_of_executed_units: {done}", file=sys.stderr)


def main(argv: list[str]) -> None:
    import targets

    if argv[:1] == ["--list"] or not argv:
        print("\n".join(targets.TARGETS))
        return
    target, flags = argv[0], argv[1:]
    if target not in targets.TARGETS:
        sys.exit(f"fuzz/run.py: unknown target {target!r}; one of {', '.join(targets.TARGETS)}")
    try:
        import atheris  # noqa: F401
    except ImportError:
        _mutator(target, flags)
    else:
        _atheris(target, flags)


if __name__ == "__main__":
    main(sys.argv[1:])
