"""lmjax as an lm-evaluation-harness model (docs/evaluation.md): `lm_eval` scores any run.

    import lmjax.eval_harness                  # registers the model "lmjax" with lm_eval
    import lm_eval
    results = lm_eval.simple_evaluate(model="lmjax", model_args="run=runs/gpt2",
                                      tasks=["lambada_openai"], batch_size=16)

`LMJaxLM` (`model`) is the harness's `TemplateLM`; `scoring` runs log-likelihood requests in
fixed shapes (shared rows, length buckets, a fixed batch, data-parallel over the devices);
`generation` is `generate_until` over ids; `texts` turns text into ids as the harness's
Hugging Face backend does. `lm_eval`'s own command line finds the model only once this module
is imported: `python -m lmjax.eval_harness run --model lmjax --model_args run=RUN --tasks ...`
is that command line with it imported, and `lmjax eval RUN --tasks ...` is lmjax's.

lm_eval is an optional dependency: `pip install 'lmjax[eval]'`.
"""

from __future__ import annotations

try:
    import lm_eval.models  # noqa: F401  (its lazy table first: lm_eval reads it only when empty)
    from lm_eval.api.registry import model_registry, register_model
except ImportError as err:  # pragma: no cover - exercised by the CLI test with a stub
    raise ImportError(
        f"lmjax.eval_harness needs lm-evaluation-harness ({err}); pip install 'lmjax[eval]'"
    ) from err

from lmjax.eval_harness.model import DEFAULT_BATCH, LMJaxLM


def _registered_before(existing) -> bool:
    """Whether the registry's "lmjax" is LMJaxLM from an earlier import of this package (a
    `importlib.reload`, or a run that purged lmjax from `sys.modules`): a class of the same
    module and name. lm_eval refuses a second class under one alias; that one still works."""
    return isinstance(existing, type) and (existing.__module__, existing.__qualname__) == (
        LMJaxLM.__module__,
        LMJaxLM.__qualname__,
    )


if not _registered_before(model_registry.get("lmjax", None)):
    register_model("lmjax")(LMJaxLM)  # a different "lmjax" is lm_eval's one-line conflict

__all__ = ["DEFAULT_BATCH", "LMJaxLM"]
