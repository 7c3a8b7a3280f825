"""lmjax: decoder-only transformer LMs as pure functions over parameter pytrees.

The public surface a notebook needs: `lmjax.ops` (primitives with hand-written VJPs),
`lmjax.models` (configs, presets, init and forward), `lmjax.params` (flatten/unflatten/count/mask
by name) and `lmjax.errors` (one exception family). `import lmjax.testing` brings the
gradient-check harness.

The four are attributes loaded on first use (PEP 562), not imported here: `pallas_kernels`
imports `lmjax.errors` and `lmjax.checks`, which runs this file first, and an eager
`import lmjax.models` here would come back round to the kernel half-imported
(`import pallas_kernels.flash_attention` as a program's first import failed that way).
"""

import importlib

__version__ = "0.1.0"

__all__ = ["errors", "models", "ops", "params", "__version__"]


def __getattr__(name: str):
    if name in __all__:
        return importlib.import_module(f"lmjax.{name}")
    raise AttributeError(f"module 'lmjax' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
