"""Text sampled during training: `RUN/samples.txt`, one block per evaluation.

    ===== step 200 =====
    PROMPT + continuation

A mesh run samples from a host copy of its parameters (`process_allgather`: every process
takes part, so it runs on all of them), decoding on one device; only the main process writes.
"""

from __future__ import annotations

import dataclasses
import re
from pathlib import Path
from typing import Any

from jax.experimental import multihost_utils

from lmjax import generate, parallel
from lmjax.files import atomic_write_text


def sample_text(
    params, model, tokenizer, prompt: str, n_tokens: int, temperature: float, seed: int
) -> str:
    """`prompt` continued by `n_tokens` sampled tokens (decoded, prompt included)."""
    ids = tokenizer.encode(prompt)
    out = generate.generate(
        params, [ids], model, max_new_tokens=n_tokens, temperature=temperature, seed=seed
    )
    return tokenizer.decode(list(ids) + list(out[0]))


def truncate_samples(path: Path, step: int) -> None:
    """Keep the samples of steps <= `step` (a resumed run writes the later ones again)."""
    if not path.exists():
        return
    blocks = re.split(r"(?m)^(?====== step \d+ =====$)", path.read_text(encoding="utf-8"))
    kept = [b for b in blocks if b and int(b.split()[2]) <= step]
    atomic_write_text(path, "".join(kept))


@dataclasses.dataclass(frozen=True)
class Sampler:
    """`sampler(trained params, step) -> text | None`: a run's sample at `step`, appended to
    `path` (None when `logging.sample_tokens` is 0). `gather`: the parameters are sharded
    over a mesh (collect a host copy first)."""

    model: Any  # ModelConfig
    tokenizer: Any
    logging: Any  # the run's LoggingConfig: sample_prompt, sample_tokens, sample_temperature
    model_params: Any  # trained params -> the tree generate takes
    path: Path
    gather: bool = False

    def __call__(self, params, step: int) -> str | None:
        g = self.logging
        if g.sample_tokens == 0:
            return None
        params = self.model_params(params)
        if self.gather:  # sample from a host copy: decoding runs on one device
            # The model's tree, not the trained one: a fine-tune's frozen base is sharded too.
            params = multihost_utils.process_allgather(params, tiled=True)
        prompt, n, temperature = g.sample_prompt, g.sample_tokens, g.sample_temperature
        text = sample_text(params, self.model, self.tokenizer, prompt, n, temperature, seed=step)
        if parallel.is_main():
            with open(self.path, "a", encoding="utf-8") as handle:
                handle.write(f"===== step {step} =====\n{text}\n\n")
        return text


__all__ = ["Sampler", "sample_text", "truncate_samples"]
