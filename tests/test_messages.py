"""Messages a user of an imported model met (issue 34 item 7), each reproduced:

- a weights-only run (import-hf) printed as "(step None)";
- a progress bar's text glued in front of an error line;
- `lmjax inspect RUN_DIR` read as a preset name;
- `init_state(key, adapters, tx)` failing with an AttributeError deep inside;
- a chat sample prompt (`logging.sample_chat`): transformers' `apply_chat_template` ids, and one
  line for a tokenizer without a template.

(An SFT run resumed without --data, and "resumed from step N", are in tests/test_recipes.py and
tests/test_train_run.py.) Cost: a few seconds (an import-hf of a tiny Llama, no compiles).
"""

from __future__ import annotations

import json

import jax
import optax
import pytest
from _llama_run import hf_checkpoint, imported_run
from transformers import PreTrainedTokenizerFast

from lmjax import cli, lora
from lmjax.config import LoggingConfig
from lmjax.errors import ConfigError
from lmjax.tokenizers import ByteTokenizer, load_hf_tokenizer
from lmjax.train import init_state, load_run
from lmjax.train.rundir import run_label
from lmjax.train.sampling import prompt_ids


@pytest.fixture(scope="module")
def base(tmp_path_factory):
    """`lmjax import-hf` of the tiny Llama (tests/_llama_run.py): a weights-only run."""
    root = tmp_path_factory.mktemp("messages")
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("XDG_CACHE_HOME", str(root / "cache"))
        yield imported_run(root)


def _one_error_line(capfd, command: str) -> str:
    err = capfd.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith(f"lmjax {command}: error: "), err
    return err[0]


def test_a_weights_only_run_is_named_without_step_none(base, tmp_path, capfd):
    assert run_label("runs/x", None) == "runs/x (weights only)"
    assert run_label("runs/x", 12) == "runs/x step 12"
    assert cli.main(["export-hf", str(base), "--out", str(tmp_path / "hf")]) == 0
    out = capfd.readouterr().out
    assert f"exported {base} (weights only) -> " in out and "None" not in out


def test_an_error_line_starts_on_its_own_line_after_a_progress_bar(tmp_path, capfd):
    corpus = tmp_path / "c.jsonl"
    good = "".join(json.dumps({"text": f"hello world {i}"}) + "\n" for i in range(50))
    corpus.write_text(good + "{bad\n")
    argv = ["prepare", "--corpus", str(corpus), "--tokenizer", "byte"]
    assert cli.main([*argv, "--out", str(tmp_path / "out")]) == 2
    err = capfd.readouterr().err
    assert "checking" in err  # the bar was drawn (not --quiet)
    lines = err.rstrip("\n").split("\n")
    assert lines[-1].startswith("lmjax prepare: error: record ") and f"{corpus}:51" in lines[-1]
    assert sum("error:" in line for line in lines) == 1  # once, and nothing drawn after it


def test_inspect_takes_a_run_directory(base, capfd):
    hf = hf_checkpoint(base.parent / "hf-again")  # the same seed: the imported model
    n_params = sum(p.numel() for p in hf.parameters())
    assert cli.main(["inspect", str(base)]) == 0
    out = capfd.readouterr().out
    assert out.startswith(f"{base}: vocab_size=300, context_length=64, d_model=64, n_heads=4")
    assert f"{n_params:,}" in out
    assert cli.main(["inspect", str(base), "n_layers=1", "--lora", "r=4"]) == 0
    assert "LoRA (float base): r=4" in capfd.readouterr().out
    assert cli.main(["inspect", str(base.parent / "nothere")]) == 2
    line = _one_error_line(capfd, "inspect")
    assert "a run directory (with config.yaml)" in line and "no such directory" in line
    assert cli.main(["inspect", str(base / "tokenizer")]) == 2  # a directory, not a run
    assert "run path = " in _one_error_line(capfd, "inspect")


def test_init_state_with_adapters_in_place_of_the_model_config(base):
    run = load_run(base)
    lcfg = lora.LoraConfig(r=4, alpha=8, targets=("all-linear",))
    key, tx = jax.random.PRNGKey(0), optax.adamw(1e-3)
    adapters = lora.init(key, run.params, lcfg)
    with pytest.raises(ConfigError) as err:
        init_state(key, adapters, tx)
    message = str(err.value)
    assert message.startswith("init_state's cfg = 'dict'") and "\n" not in message
    assert "init_params=lambda k: lora.init(k, base, lcfg)" in message
    # The call the message names: the adapters are the state, the base stays outside it.
    state = init_state(key, run.model, tx, init_params=lambda k: lora.init(k, run.params, lcfg))
    want = lora.init(jax.random.split(key)[0], run.params, lcfg)
    assert jax.tree.structure(state.params) == jax.tree.structure(want)
    assert all(jax.tree.leaves(jax.tree.map(lambda a, b: bool((a == b).all()), state.params, want)))


def test_a_chat_sample_prompt_is_the_templates_generation_prompt(tmp_path):
    hf_checkpoint(tmp_path, chat=True)
    logging = LoggingConfig(sample_chat="What does the red fox do?")
    theirs = PreTrainedTokenizerFast.from_pretrained(str(tmp_path))
    chat = [{"role": "user", "content": logging.sample_chat}]
    want = theirs.apply_chat_template(chat, add_generation_prompt=True, return_dict=True)
    assert prompt_ids(load_hf_tokenizer(tmp_path), logging) == want["input_ids"]
    assert prompt_ids(ByteTokenizer(), LoggingConfig(sample_prompt="Hi")) == [72, 105]
    with pytest.raises(ConfigError) as err:
        prompt_ids(ByteTokenizer(), logging)
    assert str(err.value).startswith("logging.sample_chat = 'What does the red fox do?'")
    assert "byte tokenizer has none" in str(err.value) and "\n" not in str(err.value)
