"""Padded vocabularies (issue 34, item 1): a model whose embedding has more rows than its
tokenizer has ids (`model.tokenizer_size` n < `model.vocab_size` V).

The base is tests/_llama_run.py's tiny Llama with a 300-id BPE tokenizer.json and an embedding
and head of 320 rows. Its 20 padded head rows are set to twice the rows of the tokens that the
restricted greedy decode picks, so wherever they took part they would win: transformers'
unrestricted greedy decode picks a padded id at its first step (asserted), and the loss over all
320 logits differs from the loss over the tokenizer's 300 (asserted). Checked:
- lmjax's loss (fused head and plain path) equals the cross-entropy in torch of transformers'
  logits restricted to the tokenizer's rows; its gradient equals `jax.grad` of a plain reference
  that slices the logits, and the padded rows get exactly 0;
- lmjax's greedy ids equal transformers' greedy decode with the padded ids suppressed;
- sampling (greedy, temperature, top-k, top-p; contiguous and paged caches) never returns an id
  >= n even when the padded rows' logits are 1e4 (and does without tokenizer_size: the check
  has teeth);
- `lmjax finetune configs/finetune-lora.yaml finetune.base=RUN data.tokenizer=...` (the
  issue's command, whose errors chained) + `eval` + `generate` + `export-hf` on it: the export
  keeps the 320 rows and transformers loads it with lmjax's logits; `lmjax train` with
  model.vocab_size above the tokenizer's size records tokenizer_size;
- a tokenizer larger than the embedding is one error line with a fix.

Cost: about 48 s of CPU with no compilation cache (LMJAX_TEST_COMPILE_CACHE=0), 1-2 min wall on
2 loaded cores (the CLI fine-tune and train runs compile).
"""

from __future__ import annotations

import json
import math
import re
import shutil
from pathlib import Path
from types import SimpleNamespace

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
import transformers
import yaml
from _bad_input import assert_one_line_error, run_main
from _llama_run import PADDED_VOCAB, TEXT, VOCAB, hf_checkpoint
from tokenizers import Tokenizer

from lmjax import cli, generate, models, testing
from lmjax.errors import ConfigError
from lmjax.models.loss import loss_fn
from lmjax.train.runs import load_run

REPO = Path(__file__).resolve().parents[1]
PROMPT = "The quick brown fox"
NEW = 8  # greedy tokens compared with transformers
PADDED_IDS = list(range(VOCAB, PADDED_VOCAB))


def _hf_greedy(model, prompt: list[int], suppress: bool) -> list[int]:
    """transformers' greedy continuation of `prompt` (NEW tokens), padded ids suppressed or not."""
    out = model.generate(
        torch.tensor([prompt]),
        attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
        max_new_tokens=NEW,
        do_sample=False,
        suppress_tokens=PADDED_IDS if suppress else None,
        pad_token_id=0,
    )
    return out[0, len(prompt) :].tolist()


@pytest.fixture(scope="module")
def padded(tmp_path_factory):
    """The padded checkpoint (root/hf, its padded rows made to win), imported as root/base."""
    root = tmp_path_factory.mktemp("padded")
    model = hf_checkpoint(root / "hf", vocab_size=PADDED_VOCAB)
    tok = Tokenizer.from_file(str(root / "hf" / "tokenizer.json"))
    prompt = tok.encode(PROMPT).ids
    picked = sorted(set(_hf_greedy(model, prompt, suppress=True)))
    with torch.no_grad():
        weight = model.lm_head.weight  # untied: the embedding's padded rows stay random
        for k, i in enumerate(picked[: len(PADDED_IDS)]):
            weight[VOCAB + k] = 2 * weight[i]
    model.save_pretrained(root / "hf")
    (root / "corpus.txt").write_text(TEXT)
    assert cli.main(["import-hf", str(root / "hf"), "--out", str(root / "base")]) == 0
    return SimpleNamespace(root=root, hf=model, tok=tok, prompt=prompt, run=load_run(root / "base"))


def test_import_records_the_tokenizer_size_and_keeps_the_padded_rows(padded):
    model, params = padded.run.model, padded.run.params
    assert (model.vocab_size, model.tokenizer_size, model.vocab_ids) == (320, 300, 300)
    assert padded.tok.get_vocab_size() == VOCAB
    assert params["token_embedding"]["weight"].shape == (PADDED_VOCAB, 64)
    assert params["language_model_head"]["weight"].shape == (PADDED_VOCAB, 64)
    saved = yaml.safe_load((padded.root / "base" / "config.yaml").read_text())["model"]
    assert (saved["vocab_size"], saved["tokenizer_size"]) == (PADDED_VOCAB, VOCAB)


def test_a_run_imported_before_the_field_gets_it_from_its_tokenizer(padded):
    old = padded.root / "old"
    shutil.copytree(padded.root / "base", old)
    config = old / "config.yaml"
    config.write_text(re.sub(r"\n  tokenizer_size: \d+", "", config.read_text()))
    assert "tokenizer_size" not in config.read_text()
    assert load_run(old).model.tokenizer_size == VOCAB


def _batch(padded):
    ids = padded.tok.encode(TEXT[:600]).ids[:33]
    return np.asarray([ids[:-1]], np.int32), np.asarray([ids[1:]], np.int32)


def test_loss_equals_transformers_over_the_tokenizer_rows(padded):
    inputs, targets = _batch(padded)
    with torch.no_grad():
        logits = padded.hf(torch.from_numpy(inputs).long()).logits.double()[0]
    y = torch.from_numpy(targets[0]).long()
    want = torch.nn.functional.cross_entropy(logits[:, :VOCAB], y).item()
    unrestricted = torch.nn.functional.cross_entropy(logits, y).item()
    model, params = padded.run.model, padded.run.params
    # lse and the picked logit each move by at most max |logit error|.
    tol = 2 * testing.logits_atol(model, logits.numpy())
    assert abs(unrestricted - want) > 100 * tol  # the padded rows would change the loss
    for ops in ("custom", "reference"):  # the fused head; forward + cross_entropy
        got = float(
            jax.jit(loss_fn, static_argnums=3)(params, inputs, targets, model.replace(ops=ops))
        )
        assert abs(got - want) <= tol, (ops, got, want, tol)


def test_loss_gradient_equals_grad_of_sliced_reference(padded):
    inputs, targets = _batch(padded)
    model, params = padded.run.model, padded.run.params
    reference_model = model.replace(ops="reference", tokenizer_size=None)

    def reference(p):
        logits = models.forward(p, inputs, reference_model)[..., :VOCAB]
        logp = jax.nn.log_softmax(logits, axis=-1)
        return -jnp.mean(jnp.take_along_axis(logp, targets[..., None], axis=-1))

    want = jax.jit(jax.grad(reference))(params)
    got = jax.jit(jax.grad(loss_fn), static_argnums=3)(params, inputs, targets, model)
    # forward then backward, plus the softmax's sum over the rows
    chain = 2 * testing.forward_chain(model, inputs.shape[1]) + VOCAB
    scale = max(float(jnp.abs(g).max()) for g in jax.tree.leaves(want))
    pairs = zip(jax.tree_util.tree_leaves_with_path(got), jax.tree.leaves(want), strict=True)
    for (path, g), w in pairs:
        err = float(jnp.abs(g - w).max())
        assert err <= testing.f32_rtol(chain) * scale, (jax.tree_util.keystr(path), err, scale)
    head = got["language_model_head"]["weight"]
    assert float(jnp.abs(head[VOCAB:]).max()) == 0.0  # no mass, no gradient
    assert float(jnp.abs(head[:VOCAB]).max()) > 0.0


def test_greedy_ids_equal_transformers_with_padded_ids_suppressed(padded):
    want = _hf_greedy(padded.hf, padded.prompt, suppress=True)
    assert _hf_greedy(padded.hf, padded.prompt, suppress=False)[0] >= VOCAB  # teeth
    got = generate.generate(padded.run.params, [padded.prompt], padded.run.model,
                            max_new_tokens=NEW, temperature=0.0)  # fmt: skip
    assert got == [want]


# ---- sampling never returns a padded id --------------------------------------------------------

SMALL = models.preset(
    "gpt", vocab_size=40, tokenizer_size=30, context_length=16, d_model=32, n_layers=1
)


@pytest.fixture(scope="module")
def loud_padding():
    """SMALL's parameters with the head's padded biases at 1e4: unrestricted, every draw would
    be a padded id."""
    rng = np.random.default_rng(0)  # numpy, not models.init: no compile for random weights
    params = jax.tree.map(
        lambda a: (0.5 * rng.standard_normal(a.shape)).astype(a.dtype),
        models.abstract_params(SMALL),
    )
    params["language_model_head"]["bias"][SMALL.vocab_ids :] = 1e4
    return params


SAMPLINGS = {
    "greedy": dict(temperature=0.0),
    "temperature": dict(temperature=1.0),
    "top-k": dict(temperature=1.0, top_k=5),
    "top-p": dict(temperature=1.0, top_p=0.9),
    "paged": dict(temperature=1.0, cache="paged", page_size=4),
}


@pytest.mark.parametrize("options", SAMPLINGS.values(), ids=SAMPLINGS.keys())
def test_sampling_never_returns_a_padded_id(loud_padding, options):
    prompts = [[1, 2, 3], [4]]
    rows = generate.generate(loud_padding, prompts, SMALL, max_new_tokens=6, seed=1, **options)
    ids = [i for row in rows for i in row]
    assert len(ids) == 12 and all(0 <= i < SMALL.vocab_ids for i in ids), rows


def test_without_tokenizer_size_the_padded_rows_win(loud_padding):
    rows = generate.generate(
        loud_padding, [[1, 2, 3]], SMALL.replace(tokenizer_size=None), max_new_tokens=2
    )
    assert all(i >= SMALL.vocab_ids for i in rows[0])


def test_ids_at_or_past_the_tokenizer_size_are_refused(loud_padding):
    with pytest.raises(Exception, match=r"an id in \[0, 30\)"):
        generate.generate(loud_padding, [[1, 30]], SMALL, max_new_tokens=1)
    with pytest.raises(Exception, match=r"an id in \[0, 30\)"):
        generate.generate(loud_padding, [[1]], SMALL, max_new_tokens=1, stop_tokens=[35])


# ---- the command line on the imported padded run ----------------------------------------------


def test_finetune_eval_generate_export_on_a_padded_run(padded, capsys, monkeypatch):
    """The issue's own command: the shipped LoRA config over the imported base, with the data
    tokenizer the first error named (the base's label) and a small run."""
    root, ft = padded.root, padded.root / "ft"
    label = yaml.safe_load((root / "base" / "config.yaml").read_text())["data"]["tokenizer"]
    config = REPO / "configs" / "finetune-lora.yaml"
    argv = ["finetune", str(config), f"finetune.base={root / 'base'}",
            f"data.corpus={root / 'corpus.txt'}", f"data.tokenizer={label}", "train.steps=2",
            "train.batch_size=4", "train.seq_len=32", "train.eval_every=2", "train.eval_batches=1",
            "checkpoint.every=2", "logging.sample_tokens=4", "logging.sample_prompt=The",
            "logging.progress=false", "logging.plot=false", "logging.peak_flops=1e12",
            f"run.dir={ft}", "--lora", "targets=all-linear"]  # fmt: skip
    code, out, err = run_main(root, argv, capsys, monkeypatch)
    assert code == 0, err
    saved = yaml.safe_load((ft / "config.yaml").read_text())["model"]
    assert (saved["vocab_size"], saved["tokenizer_size"]) == (PADDED_VOCAB, VOCAB)
    losses = [json.loads(line).get("loss") for line in (ft / "metrics.jsonl").open()]
    assert any(x is not None for x in losses)
    assert all(math.isfinite(x) for x in losses if x is not None)

    # The imported base's config names no corpus, so `lmjax eval` scores the bundled one, which
    # lmjax reads from its cache ($XDG_CACHE_HOME/lmjax/shakespeare.txt, this test's own cache)
    # when it is there. A stand-in there: what is checked is that the padded run evaluates, on
    # any text, and the BPE tokenizer took 5 s of CPU over the 5 MB corpus (its main thread).
    stand_in = root / "cache" / "lmjax" / "shakespeare.txt"
    stand_in.parent.mkdir(parents=True, exist_ok=True)
    stand_in.write_text(TEXT * 10)
    for run in (root / "base", ft):  # the imported run itself failed as finetune did
        code, out, err = run_main(root, ["eval", str(run)], capsys, monkeypatch)
        assert code == 0, err
        assert math.isfinite(float(re.search(r"validation loss (\S+)", out).group(1))), out

    argv = ["generate", "--run", str(ft), "--prompt", PROMPT, "--temperature", "0",
            "--max-new-tokens", "6"]  # fmt: skip
    code, out, err = run_main(root, argv, capsys, monkeypatch)
    assert code == 0, err
    assert out.startswith(PROMPT), out

    code, out, err = run_main(root, ["export-hf", str(ft), "--out", str(root / "exp")],
                              capsys, monkeypatch)  # fmt: skip
    assert code == 0, err
    exported = transformers.AutoModelForCausalLM.from_pretrained(root / "exp").eval()
    assert exported.config.vocab_size == PADDED_VOCAB
    assert tuple(exported.model.embed_tokens.weight.shape) == (PADDED_VOCAB, 64)
    assert tuple(exported.lm_head.weight.shape) == (PADDED_VOCAB, 64)
    inputs = _batch(padded)[0]
    with torch.no_grad():
        want = exported(torch.from_numpy(inputs).long()).logits.numpy()
    merged = load_run(ft)
    got = np.asarray(models.forward(merged.params, inputs, merged.model))
    np.testing.assert_allclose(got, want, rtol=0, atol=testing.logits_atol(merged.model, want))


def _train_config(root, vocab_size: int):
    (root / "chars.txt").write_text("abcdefgh ijklmnop\n" * 40)  # 18 characters
    path = root / f"train-{vocab_size}.yaml"
    path.write_text(
        f"model: {{preset: gpt, vocab_size: {vocab_size}, context_length: 16}}\n"
        f"data: {{corpus: {root / 'chars.txt'}, tokenizer: char}}\n"
        "train: {steps: 2, batch_size: 2, seq_len: 8, eval_every: 2, eval_batches: 1}\n"
        "checkpoint: {every: 2, keep: 1}\n"
        "logging: {every: 1, progress: false, plot: false, sample_tokens: 0, "
        "peak_flops: 1.0e+12}\n"
        f"run: {{dir: {root / f'train-{vocab_size}'}}}\n"
    )
    return path


def test_train_with_an_embedding_larger_than_the_tokenizer(tmp_path, capsys, monkeypatch):
    config = _train_config(tmp_path, 64)
    code, out, err = run_main(tmp_path, ["train", str(config)], capsys, monkeypatch)
    assert code == 0, err
    saved = yaml.safe_load((tmp_path / "train-64" / "config.yaml").read_text())["model"]
    assert (saved["vocab_size"], saved["tokenizer_size"]) == (64, 18)
    run = load_run(tmp_path / "train-64")
    assert run.params["token_embedding"]["weight"].shape[0] == 64
    assert run.model.vocab_ids == 18


# ---- only a tokenizer larger than the embedding is an error -----------------------------------


def test_a_tokenizer_larger_than_the_embedding_is_one_line(tmp_path, capsys, monkeypatch):
    config = _train_config(tmp_path, 12)
    code, out, err = run_main(tmp_path, ["train", str(config)], capsys, monkeypatch)
    assert_one_line_error(code, out, err, "tokenizer size = 18; expected at most model.vocab_size")
    assert "model.vocab_size >= 18" in err
    assert not (tmp_path / "train-12").exists()


def test_tokenizer_size_above_vocab_size_is_refused():
    with pytest.raises(ConfigError, match="model.tokenizer_size = 41; expected <= model.vocab"):
        SMALL.replace(tokenizer_size=41)
    with pytest.raises(ConfigError, match="model.tokenizer_size"):
        SMALL.replace(tokenizer_size=0)
    unpadded = SMALL.replace(tokenizer_size=None)
    assert unpadded.vocab_ids == 40 and not unpadded.padded_vocab
    assert unpadded.for_tokenizer(40, "t", "f") == unpadded
    assert unpadded.for_tokenizer(25, "t", "f").tokenizer_size == 25
    assert SMALL.for_tokenizer(30, "t", "f") == SMALL
    with pytest.raises(ConfigError, match="t = 25; expected model.tokenizer_size = 30"):
        SMALL.for_tokenizer(25, "t", "f")
