"""lmjax: decoder-only transformer LMs as pure functions over parameter pytrees.

The public surface a notebook needs: `lmjax.ops` (primitives with hand-written VJPs),
`lmjax.models` (configs, presets, init and forward), `lmjax.params` (flatten/unflatten/count/mask
by name) and `lmjax.errors` (one exception family). `import lmjax.testing` brings the
gradient-check harness.
"""

from lmjax import errors, models, ops, params

__version__ = "0.1.0"

__all__ = ["errors", "models", "ops", "params", "__version__"]
