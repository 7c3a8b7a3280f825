"""`run.compile_cache`: the second `lmjax train` of a config reads its compiled programs from
JAX's persistent compilation cache instead of compiling them again (lmjax.train.compile_cache).

Each run is a fresh process, as a user's second command is: JAX decides at a process's first
compile whether it has a cache. JAX counts its reads as `/jax/compilation_cache/cache_hits`
events; the runs here report them. JAX writes only programs that took over
`jax_persistent_cache_min_compile_time_secs` (1 s) to compile, which a tiny model's train step
may not on a fast CPU: the runs set it to 0 through JAX's own environment variable.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).parent.parent
CONFIG = """
model: {{preset: gpt, vocab_size: null, context_length: 16, d_model: 32, n_heads: 2,
        n_layers: 1, d_ff: 64}}
data: {{corpus: {corpus}, tokenizer: char}}
train: {{steps: 2, batch_size: 4, seq_len: 16, eval_every: 2, eval_batches: 1}}
logging: {{every: 1, progress: false, sample_tokens: 0, plot: false, peak_flops: 1.0e+12}}
"""
# The CLI in a fresh process, printing how many compiled programs JAX read from its cache.
RUN = """
import sys, jax
hits = []
jax.monitoring.register_event_listener(
    lambda event, **_: hits.append(event) if event.endswith("/cache_hits") else None)
from lmjax.cli import main
code = main(sys.argv[1:])
print("cache hits:", len(hits))
sys.exit(code)
"""


def lmjax_train(root: Path, *args: str) -> subprocess.CompletedProcess:
    env = dict(
        os.environ,
        XDG_CACHE_HOME=str(root / "cache"),
        PYTHONPATH=str(ROOT),
        JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS="0",
    )
    env.pop("JAX_COMPILATION_CACHE_DIR", None)
    argv = [sys.executable, "-c", RUN, "train", str(root / "tiny.yaml"), *args]
    done = subprocess.run(argv, cwd=root, env=env, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr[-3000:]
    return done


def hits(done: subprocess.CompletedProcess) -> int:
    return int(done.stdout.rsplit("cache hits:", 1)[1].split()[0])


@pytest.fixture
def root(tmp_path):
    (tmp_path / "corpus.txt").write_text("to be or not to be, that is the question\n" * 40)
    (tmp_path / "tiny.yaml").write_text(CONFIG.format(corpus=tmp_path / "corpus.txt"))
    return tmp_path


def test_the_second_run_reads_what_the_first_compiled(root):
    cache = root / "cache" / "lmjax" / "jax-compile"
    first = lmjax_train(root, "run.dir=first")
    assert f"compilation cache: {cache} (run.compile_cache=false turns it off)" in first.stdout
    assert hits(first) == 0 and any(cache.iterdir())
    written = sorted(p.name for p in cache.iterdir())
    second = lmjax_train(root, "run.dir=second")
    # The train step, the eval step and whatever else compiled: all read, none written anew.
    assert hits(second) >= 2, second.stdout
    assert sorted(p.name for p in cache.iterdir()) == written


def test_compile_cache_false_leaves_jax_alone(root):
    done = lmjax_train(root, "run.dir=off", "run.compile_cache=false")
    assert "compilation cache" not in done.stdout + done.stderr and hits(done) == 0
    assert not (root / "cache" / "lmjax" / "jax-compile").exists()


def test_a_cache_the_user_set_is_kept(root):
    mine = root / "mine"
    env_run = f"import jax; jax.config.update('jax_compilation_cache_dir', {str(mine)!r})\n"
    argv = [sys.executable, "-c", env_run + RUN, "train", str(root / "tiny.yaml"), "run.dir=u"]
    env = dict(os.environ, XDG_CACHE_HOME=str(root / "cache"), PYTHONPATH=str(ROOT))
    done = subprocess.run(argv, cwd=root, env=env, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr[-3000:]
    assert f"compilation cache: {mine} (JAX's setting)" in done.stdout
    assert not (root / "cache" / "lmjax" / "jax-compile").exists()
