"""Text sampled during training: `RUN/samples.txt`, one block per evaluation.

    ===== step 200 =====
    PROMPT + continuation

PROMPT is `logging.sample_prompt`, or `logging.sample_chat` (a user message) through the
tokenizer's chat template, decoded with its special tokens. A fine-tune's chat sample stops at
the base's end-of-turn ids, as `lmjax chat` does (`Trainable.stop_ids`; the id stays in the
text, e.g. `<|im_end|>`).

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
from lmjax.checks import require
from lmjax.files import atomic_write_text


def sample_text(
    params,
    model,
    tokenizer,
    prompt: str | list[int],
    n_tokens: int,
    temperature: float,
    seed: int,
    stop_ids=(),
) -> str:
    """`prompt` (text, or its ids) continued by up to `n_tokens` sampled tokens (decoded, prompt
    included); the first of `stop_ids` sampled ends it (and is its last token)."""
    ids = tokenizer.encode(prompt) if isinstance(prompt, str) else list(prompt)
    out = generate.generate(
        params,
        [ids],
        model,
        max_new_tokens=n_tokens,
        temperature=temperature,
        seed=seed,
        stop_tokens=list(stop_ids),
    )
    return tokenizer.decode(list(ids) + list(out[0]))


def prompt_ids(tokenizer, logging) -> list[int]:
    """The ids a run's samples start from: `logging.sample_chat` as one user message through the
    tokenizer's chat template with the assistant header after it (what `apply_chat_template(...,
    add_generation_prompt=True)` gives), else `logging.sample_prompt` encoded. One error line
    for a chat prompt and a tokenizer without a chat template."""
    if logging.sample_chat is None:
        return list(tokenizer.encode(logging.sample_prompt))
    require(
        getattr(tokenizer, "chat_template", None) is not None,
        "logging.sample_chat",
        logging.sample_chat,
        f"a tokenizer with a chat template (this {tokenizer.kind} tokenizer has none)",
        "set logging.sample_chat=null and give logging.sample_prompt, or fine-tune a chat model",
    )
    chat = [{"role": "user", "content": logging.sample_chat}]
    return list(tokenizer.apply_chat_template(chat, add_generation_prompt=True))


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
    logging: Any  # the run's LoggingConfig: sample_prompt or _chat, _tokens, _temperature
    model_params: Any  # trained params -> the tree generate takes
    path: Path
    gather: bool = False
    stop_ids: tuple = ()  # a chat sample's end-of-turn ids (`Trainable.stop_ids`)

    def __call__(self, params, step: int) -> str | None:
        g = self.logging
        if g.sample_tokens == 0:
            return None
        params = self.model_params(params)
        if self.gather:  # sample from a host copy: decoding runs on one device
            # The model's tree, not the trained one: a fine-tune's frozen base is sharded too.
            params = multihost_utils.process_allgather(params, tiled=True)
        prompt, temperature = prompt_ids(self.tokenizer, g), g.sample_temperature
        text = sample_text(
            params, self.model, self.tokenizer, prompt, g.sample_tokens, temperature, step,
            self.stop_ids,
        )  # fmt: skip
        if parallel.is_main():
            with open(self.path, "a", encoding="utf-8") as handle:
                handle.write(f"===== step {step} =====\n{text}\n\n")
        return text


__all__ = ["Sampler", "prompt_ids", "sample_text", "truncate_samples"]
