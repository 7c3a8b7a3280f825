"""JAX's persistent compilation cache, turned on for a run (`run.compile_cache`).

Compiling a run's train step takes seconds on a CPU and over a minute for GPT-2 124M on a GPU.
JAX can keep each compiled program on disk, keyed by the program, its compile options, the
devices and the jax/jaxlib versions, so the second `lmjax train` of the same config (a resume,
a rerun, another seed) reads the program instead of compiling it. A key that does not match
(another shape, another jax) is an ordinary compile: the cache cannot change what runs.
"""

from __future__ import annotations

from pathlib import Path

import jax

from lmjax.data.corpus import cache_dir


def default_dir() -> Path:
    """`$XDG_CACHE_HOME/lmjax/jax-compile` (default `~/.cache/lmjax/jax-compile`)."""
    return cache_dir() / "jax-compile"


def enable(wanted: bool) -> str | None:
    """Turn the cache on for this process unless `wanted` is false; the one line to print.

    A directory the user gave JAX (`JAX_COMPILATION_CACHE_DIR`, `jax.config`) is kept. JAX's
    own threshold stays: programs that compiled in under
    `jax_persistent_cache_min_compile_time_secs` (1 s) are not worth a file. JAX looks at the
    setting once, at its first compile, so a process that has compiled before keeps what it had.
    """
    if not wanted:
        return None
    current = jax.config.jax_compilation_cache_dir
    if current:
        return f"compilation cache: {current} (JAX's setting)"
    path = default_dir()
    path.mkdir(parents=True, exist_ok=True)
    jax.config.update("jax_compilation_cache_dir", str(path))
    return f"compilation cache: {path} (run.compile_cache=false turns it off)"
