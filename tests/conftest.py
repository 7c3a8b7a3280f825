"""Suite-wide JAX settings.

Implicit rank promotion is an error, so no broadcast in lmjax is silent; float32 matmuls run at
full precision, so the same tolerances hold on GPUs (which default to TF32) as on CPUs.
"""

import jax

jax.config.update("jax_numpy_rank_promotion", "raise")
jax.config.update("jax_default_matmul_precision", "highest")


def pytest_collection_finish(session):
    """Start the long subprocess of each module that has one as soon as collection is done, so
    it runs beside the suite instead of in series with it (tests/_background.py). A module
    with a `start_in_background(names)` gets the names of its selected tests (after -k/-m)
    and starts only what they need. Not for --collect-only, and not in pytest-xdist workers
    (each would start its own copy; the fixtures start it on first use there)."""
    if session.config.option.collectonly or hasattr(session.config, "workerinput"):
        return
    selected: dict = {}
    for item in session.items:
        module = getattr(item, "module", None)
        if module is not None and hasattr(module, "start_in_background"):
            selected.setdefault(module, set()).add(item.originalname)
    for module, names in selected.items():
        module.start_in_background(names)
