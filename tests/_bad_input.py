"""Shared pieces of the bad-input suites (issue 12): a tiny weights-only run made without
compiling anything, and `lmjax` run in-process with its one-line error checked."""

from __future__ import annotations

from pathlib import Path

import jax
import numpy as np

from lmjax import cli, models
from lmjax.tokenizers.simple import CharTokenizer
from lmjax.train.runs import write_weights_run

CHARS = "abcdefgh \n"  # the tiny run's vocabulary: 10 characters
TINY = dict(context_length=16, d_model=32, n_heads=4, n_layers=1, d_ff=64)


def tiny_weights_run(out: Path, chars: str = CHARS, preset: str = "gpt", **fields) -> Path:
    """A weights-only char run (as `lmjax import-hf` writes) of random N(0, 0.02) weights.

    The weights come from numpy over `models.abstract_params`, not `models.init`, which
    compiles for seconds; bad-input tests never look at their values.
    """
    tokenizer = CharTokenizer.train(chars)
    model = models.preset(preset, vocab_size=tokenizer.vocab_size, **{**TINY, **fields})
    rng = np.random.default_rng(0)
    params = jax.tree.map(
        lambda a: (0.02 * rng.standard_normal(a.shape)).astype(a.dtype),
        models.abstract_params(model),
    )
    return write_weights_run(out, params, model, tokenizer, "char")


def run_main(ws: Path, argv: list[str], capsys, monkeypatch) -> tuple[int, str, str]:
    """`lmjax ARGV` in-process with `ws` as working and cache directory: (status, out, err);
    argparse's usage errors (SystemExit) give their exit code."""
    monkeypatch.chdir(ws)
    monkeypatch.setenv("XDG_CACHE_HOME", str(ws / "cache"))
    capsys.readouterr()
    try:
        code = cli.main(argv)
    except SystemExit as done:
        code = done.code
    out, err = capsys.readouterr()
    return code, out, err


def assert_one_line_error(code: int, out: str, err: str, named: str) -> None:
    """Exit 2, nothing on stdout, one stderr line `lmjax ...: error: ...NAMED... Fix: ...`."""
    assert code == 2, (code, err)
    assert out == "", out
    lines = err.splitlines()
    assert len(lines) == 1 and err.endswith("\n"), err
    assert lines[0].startswith("lmjax") and ": error: " in lines[0], lines[0]
    assert named in lines[0], (named, lines[0])
    assert "Fix:" in lines[0] and "Traceback" not in err, lines[0]
