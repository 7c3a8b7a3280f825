"""`python -m lmjax.eval_harness ARGS`: lm_eval's own command line (`lm_eval ARGS`) with the
model "lmjax" registered, e.g. `python -m lmjax.eval_harness run --model lmjax --model_args
run=RUN --tasks lambada_openai`."""

from lm_eval.__main__ import cli_evaluate

import lmjax.eval_harness  # noqa: F401  (registers "lmjax")

if __name__ == "__main__":
    cli_evaluate()
