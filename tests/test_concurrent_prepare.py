"""Several writers of one output: `lmjax.files.atomic_dir`'s race, and `prepare` run by several
processes at once (two hosts of one run preparing the same token cache, issue 20 item 5)."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from lmjax.errors import ConfigError
from lmjax.files import atomic_dir

ROOT = Path(__file__).parent.parent


def _write_twin(path: Path) -> None:
    """What another writer's finished rename leaves: a complete directory at `path`."""
    path.mkdir()
    (path / "meta.json").write_text("theirs")


def _leftovers(parent: Path) -> list[str]:
    return sorted(p.name for p in parent.iterdir() if p.name.endswith(".tmp"))


def test_a_twin_that_appears_before_the_rename_is_handed_to_the_check(tmp_path):
    out, seen = tmp_path / "data", []
    with atomic_dir(out, twin=seen.append) as tmp:
        (tmp / "meta.json").write_text("ours")
        _write_twin(out)  # another process renames its copy into place first
    assert seen == [out]
    assert (out / "meta.json").read_text() == "theirs"  # the first writer's, untouched
    assert _leftovers(tmp_path) == []  # our copy is dropped


def test_a_twin_the_check_refuses_raises_its_error_and_leaves_nothing(tmp_path):
    out = tmp_path / "data"

    def refuse(path: Path) -> None:
        raise ConfigError(f"{path} has other settings")

    with pytest.raises(ConfigError, match="other settings"):
        with atomic_dir(out, twin=refuse) as tmp:
            (tmp / "meta.json").write_text("ours")
            _write_twin(out)
    assert (out / "meta.json").read_text() == "theirs" and _leftovers(tmp_path) == []


def test_without_a_check_a_race_is_one_config_error_not_an_oserror(tmp_path):
    out = tmp_path / "data"
    with pytest.raises(ConfigError, match="another process wrote it meanwhile"):
        with atomic_dir(out) as tmp:
            (tmp / "x").write_text("ours")
            _write_twin(out)
    assert (out / "meta.json").read_text() == "theirs" and _leftovers(tmp_path) == []


def test_a_failing_body_leaves_no_temporary(tmp_path):
    with pytest.raises(RuntimeError):
        with atomic_dir(tmp_path / "data") as tmp:
            (tmp / "x").write_text("half")
            raise RuntimeError("midway")
    assert list(tmp_path.iterdir()) == []


# Each process says it is ready (JAX imported), waits for the same start signal, then prepares
# with a slowed encoder, so every one of them has found the output absent before any has
# renamed its copy into place.
WORKER = textwrap.dedent(
    """
    import os, sys, time
    from pathlib import Path
    from lmjax.data import prepared as data

    corpus, out, go = sys.argv[1:4]
    encode = data._encode_to_file

    def slow_encode(*args, **kwargs):
        time.sleep(1.0)
        return encode(*args, **kwargs)

    data._encode_to_file = slow_encode
    Path(go + f".ready-{os.getpid()}").touch()
    while not Path(go).exists():
        time.sleep(0.01)
    print(data.prepare(corpus, out, tokenizer="char", progress=False))
    """
)


def _tree(directory: Path) -> dict[str, bytes]:
    return {
        str(p.relative_to(directory)): p.read_bytes()
        for p in sorted(directory.rglob("*"))
        if p.is_file()
    }


def test_processes_preparing_one_cache_at_once_all_succeed_with_one_result(tmp_path):
    corpus = tmp_path / "corpus.txt"
    corpus.write_text("".join(f"line {i}: to be, or not to be\n" for i in range(400)))
    out, go = tmp_path / "cache" / "prepared", tmp_path / "go"
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    argv = [sys.executable, "-c", WORKER, str(corpus), str(out), str(go)]
    pipes = {"stdout": subprocess.PIPE, "stderr": subprocess.PIPE, "text": True}
    procs = [subprocess.Popen(argv, env=env, **pipes) for _ in range(3)]
    try:
        for _ in range(6000):  # at most 60 s for the three to start
            if len(list(tmp_path.glob("go.ready-*"))) == len(procs):
                break
            time.sleep(0.01)
        go.touch()
        results = [proc.communicate(timeout=120) for proc in procs]
    finally:
        for proc in procs:
            proc.kill()
    for proc, (stdout, stderr) in zip(procs, results, strict=True):
        assert proc.returncode == 0, stderr[-2000:]
        assert stdout.strip() == str(out)
    assert _leftovers(out.parent) == []
    # The winner's directory is what one process alone prepares.
    from lmjax.data import prepared as data

    alone = data.prepare(str(corpus), tmp_path / "alone", tokenizer="char", progress=False)
    assert _tree(out) == _tree(alone)
