"""`LMJaxLM`: an lmjax run as an lm-evaluation-harness model (`lm_eval.api.model.TemplateLM`).

Text becomes ids as the harness's Hugging Face backend (`HFLM`) makes them, so both score the
same tokens: a context's trailing spaces move to the continuation and the continuation's ids
are those of the whole text past the context's (`TemplateLM`); an empty context is the prefix
token (the tokenizer's bos_token, else its end-of-text token); a Hugging Face tokenizer adds
its post-processor's ids (a BOS) unless the text already starts with the prefix token's text.
Inputs longer than the model are cut from the left (`scoring`); `loglikelihood_rolling` scores
the harness's own windows (`get_rolling_token_windows`, each C tokens); `generate_until` keeps
the last `C - max_gen_toks` tokens of a context, decodes until an end-of-sequence id (the
run's generation_config.json and tokenizer) or `max_gen_toks`, drops special tokens and cuts
at the first stop string (`until`, plus the end-of-text token's text).
"""

from __future__ import annotations

import json

from lm_eval.api.model import TemplateLM
from lm_eval.models.utils import handle_stop_sequences, normalize_gen_kwargs
from lm_eval.utils import get_rolling_token_windows, make_disjoint_window
from tqdm import tqdm

from lmjax import chat
from lmjax.checks import require
from lmjax.errors import ConfigError
from lmjax.eval_harness import generation, scoring
from lmjax.eval_harness.texts import RunText
from lmjax.models import param_count
from lmjax.train.runs import is_qlora, load_run

DEFAULT_BATCH = 8
MAX_GEN_TOKS = 256  # the harness's default for generate_until, as HFLM's
# generate_until's options besides `until` and the length: how tokens are drawn.
SAMPLING_KEYS = ("do_sample", "temperature", "top_k", "top_p")


class LMJaxLM(TemplateLM):
    """An lmjax run (trained, imported, fine-tuned; a QLoRA run decodes from its NF4 base) as
    an lm_eval model. `run`: a run directory or RUN/checkpoints/STEP; `step`: a checkpoint
    step; `quantize`: "nf4" or "none" (default: nf4 for a QLoRA run, as `lmjax generate`);
    `batch_size`: rows per forward pass (fixed, `scoring`); `prefix_token_id`: the id an empty
    context stands for (default: bos, else end of text); `seed`: sampled generation's seed.
    `max_batch_size` and `device` are the harness's own arguments, taken and not used (JAX
    places the work on its default devices)."""

    def __init__(
        self,
        run: str | None = None,
        step: int | None = None,
        quantize: str | None = None,
        batch_size: int | str | None = DEFAULT_BATCH,
        prefix_token_id: int | None = None,
        seed: int = 0,
        max_batch_size: int | None = None,
        device: str | None = None,
    ) -> None:
        super().__init__()
        require(run is not None, "model_args run", run, "a run directory", "pass run=RUN")
        require(quantize in (None, "nf4", "none"), "quantize", quantize, "nf4 or none", "drop it")
        if quantize is None:
            quantize = "nf4" if is_qlora(run) else None
        loaded = load_run(run, step, quantize=None if quantize == "none" else quantize)
        self.run = loaded
        self.text = RunText.of(loaded, prefix_token_id)
        self.tokenizer = self.text.tokenizer
        self._batch = _batch_size(batch_size)
        self._mesh = scoring.data_mesh()
        self._params = scoring.scoring_params(loaded.params, loaded.model, self._mesh)
        self._decode_params = loaded.params
        self._seed = seed

    # ---- what the harness reads --------------------------------------------------------------

    @property
    def eot_token_id(self) -> int:
        return self.text.eot_id

    @property
    def prefix_token_id(self) -> int:
        return self.text.prefix_id

    @property
    def max_length(self) -> int:
        return self.run.model.context_length

    @property
    def max_gen_toks(self) -> int:
        return MAX_GEN_TOKS

    @property
    def batch_size(self) -> int:
        return self._batch

    @property
    def tokenizer_name(self) -> str:
        return str(self.run.directory).replace("/", "__")

    def tok_encode(self, string: str, add_special_tokens: bool | None = None, **kwargs):
        return self.text.encode(string, add_special_tokens)

    def tok_decode(self, tokens, skip_special_tokens: bool = True) -> str:
        return self.text.decode(tokens, skip_special_tokens)

    def chat_template(self, chat_template: bool | str = False) -> str | None:
        return getattr(self.tokenizer, "chat_template", None) if chat_template else None

    def apply_chat_template(self, chat_history, add_generation_prompt: bool = True) -> str:
        return self.text.render_chat(chat_history, add_generation_prompt)

    def get_model_info(self) -> dict:
        return {
            "model_num_parameters": param_count(self.run.model),
            "model_dtype": str(self.run.model.dtype),
            "model_revision": "" if self.run.step is None else str(self.run.step),
            "model_sha": "",
        }

    # ---- requests --------------------------------------------------------------------------

    def _loglikelihood_tokens(self, requests, disable_tqdm: bool = False, **kwargs):
        pairs = [(ctx, cont) for _, ctx, cont in requests]
        with tqdm(total=len(pairs), desc="lmjax loglikelihood", disable=disable_tqdm) as bar:
            out = self._score(pairs, bar.update)
        for (text, _, _), answer in zip(requests, out, strict=True):
            if text is not None:
                self.cache_hook.add_partial("loglikelihood", text, answer)
        return out

    def _score(self, pairs, progress) -> list[tuple[float, bool]]:
        return scoring.run(
            self._params, self.run.model, pairs, batch_size=self._batch, mesh=self._mesh,
            progress=progress,
        )  # fmt: skip

    def loglikelihood_rolling(self, requests, disable_tqdm: bool = False) -> list[float]:
        windows, owners = [], []
        for i, (string,) in enumerate(req.args for req in requests):
            ids = self.tok_encode(string)
            for pair in get_rolling_token_windows(ids, self.prefix_token_id, self.max_length, 1):
                windows.append(make_disjoint_window(pair))
                owners.append(i)
        totals = [0.0] * len(requests)
        bar = tqdm(total=len(windows), desc="lmjax loglikelihood_rolling", disable=disable_tqdm)
        with bar:
            for i, (logp, _) in zip(owners, self._score(windows, bar.update), strict=True):
                totals[i] += logp
        for req, total in zip(requests, totals, strict=True):
            self.cache_hook.add_partial("loglikelihood_rolling", req.args, total)
        return totals

    def generate_until(self, requests, disable_tqdm: bool = False) -> list[str]:
        groups: dict[str, list[int]] = {}
        for i, req in enumerate(requests):
            groups.setdefault(json.dumps(req.args[1], sort_keys=True, default=str), []).append(i)
        out = [""] * len(requests)
        with tqdm(total=len(requests), desc="lmjax generate_until", disable=disable_tqdm) as bar:
            for members in groups.values():
                contexts = [requests[i].args[0] for i in members]
                texts = self._generate(contexts, requests[members[0]].args[1], bar.update)
                for i, text in zip(members, texts, strict=True):
                    out[i] = text
                    self.cache_hook.add_partial("generate_until", requests[i].args, text)
        return out

    def _generate(self, contexts: list[str], gen_kwargs: dict, progress) -> list[str]:
        kwargs = normalize_gen_kwargs(dict(gen_kwargs), self.max_gen_toks)
        eot_text = self.text.decode([self.eot_token_id], skip_special_tokens=False)
        until = handle_stop_sequences(kwargs.pop("until", None), eos=eot_text)
        max_new = kwargs.pop("max_gen_toks")
        room = self.max_length - max_new
        require(0 < room, "max_gen_toks", max_new, f"< the model's {self.max_length} positions",
                "ask for fewer new tokens", ConfigError)  # fmt: skip
        prompts = [self.text.generation_prompt(c, room) for c in contexts]
        return generation.generate_texts(
            self._decode_params, self.run.model, prompts,
            decode=self.text.decode, until=until, max_new_tokens=max_new,
            stop_tokens=self.text.stop_ids(chat.run_stop_ids(self.run)), batch_size=self._batch,
            sampling=_sampling(kwargs), seed=self._seed, progress=progress,
        )  # fmt: skip


def _sampling(kwargs: dict) -> dict:
    """`generate.stream`'s sampling options from normalized gen_kwargs; others refused."""
    unknown = sorted(set(kwargs) - set(SAMPLING_KEYS))
    require(not unknown, "generation kwargs", unknown, f"only {SAMPLING_KEYS}",
            "drop them from the task's generation_kwargs", ConfigError)  # fmt: skip
    if not kwargs.get("do_sample"):
        return {"temperature": 0.0}
    options = {"temperature": float(kwargs.get("temperature", 1.0))}
    if kwargs.get("top_k"):
        options["top_k"] = int(kwargs["top_k"])
    if kwargs.get("top_p") is not None:
        options["top_p"] = float(kwargs["top_p"])
    return options


def _batch_size(value) -> int:
    """The harness's batch_size (an int, its text, "auto" or "auto:N") as rows per pass:
    "auto" is `DEFAULT_BATCH` (shapes are fixed, so no search is run)."""
    if value is None or (isinstance(value, str) and value.startswith("auto")):
        return DEFAULT_BATCH
    text = str(value)
    if not text.isdigit() or int(text) < 1:
        raise ConfigError.describe("batch_size", value, "an int >= 1 or auto", "pass e.g. 8")
    return int(text)


__all__ = ["DEFAULT_BATCH", "LMJaxLM"]
