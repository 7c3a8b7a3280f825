"""Every module of lmjax/ and pallas_kernels/ imports as a program's first import of ours.

tests/test_architecture.py reads the import graph statically and, by design, does not count the
parent packages an import runs. This test runs them: the one cycle that hides there goes through
`lmjax/__init__.py`, which every `lmjax.errors` import executes first. `pallas_kernels` imports
`lmjax.errors`; had `lmjax/__init__.py` imported `lmjax.models` eagerly, `models` would have come
back round to a kernel still half-imported, and `import pallas_kernels.flash_attention` (or
`pallas_kernels._backend`) as a program's first line failed with "cannot import name ... from
partially initialized module". Within one subprocess every module is imported on its own, with
all of lmjax and pallas_kernels purged from `sys.modules` before each (jax and the other
third-party packages stay loaded, and each source is compiled once, so a round costs only running
our own modules: 141 rounds, ~5 s of CPU in all; 16 s when every round compiled them again).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("lmjax", "pallas_kernels")

SCRIPT = r"""
import importlib
import json
import sys
from importlib.machinery import SourceFileLoader

import jax  # noqa: F401  (kept loaded: only our modules are purged between rounds)

# Each source compiled once, its code object reused by the later rounds (with no bytecode cache,
# as under PYTHONDONTWRITEBYTECODE, each round compiled again all it imported). A module's code
# still runs afresh in every round: only the compile is shared.
compiled, get_code = {}, SourceFileLoader.get_code


def compile_once(loader, fullname):
    path = loader.get_filename(fullname)
    if path not in compiled:
        compiled[path] = get_code(loader, fullname)
    return compiled[path]


SourceFileLoader.get_code = compile_once
names, failed = json.loads(sys.argv[1]), {}
for name in names:
    for loaded in [m for m in sys.modules if m.split(".")[0] in ("lmjax", "pallas_kernels")]:
        del sys.modules[loaded]
    try:
        importlib.import_module(name)
    except Exception as error:
        failed[name] = f"{type(error).__name__}: {error}"
print(json.dumps(failed))
"""


def _module_names() -> list[str]:
    names = []
    for package in PACKAGES:
        for path in sorted((ROOT / package).rglob("*.py")):
            parts = list(path.relative_to(ROOT).with_suffix("").parts)
            if parts[-1] == "__main__":  # runs the CLI: not a module to import
                continue
            names.append(".".join(parts[:-1] if parts[-1] == "__init__" else parts))
    return names


def test_every_module_imports_first():
    names = _module_names()
    assert {"lmjax", "pallas_kernels._backend", "pallas_kernels.flash_attention"} <= set(names)
    env = {**os.environ, "JAX_PLATFORMS": "cpu"}
    done = subprocess.run(
        [sys.executable, "-c", SCRIPT, json.dumps(names)],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    failed = json.loads(done.stdout.strip().splitlines()[-1])
    assert not failed, failed


def test_lmjax_still_offers_its_submodules_as_attributes():
    """`import lmjax` then `lmjax.models.forward`: the four names load on first use."""
    code = (
        "import sys, lmjax\n"
        "assert 'lmjax.models' not in sys.modules\n"
        "assert lmjax.models.forward and lmjax.ops.linear and lmjax.params.flatten\n"
        "assert lmjax.errors.ConfigError\n"
        "assert {'errors', 'models', 'ops', 'params'} <= set(dir(lmjax))\n"
        "try:\n    lmjax.nothing\nexcept AttributeError as e:\n    print(e)\n"
    )
    env = {**os.environ, "JAX_PLATFORMS": "cpu"}
    done = subprocess.run(
        [sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert "module 'lmjax' has no attribute 'nothing'" in done.stdout
