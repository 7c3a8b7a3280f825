"""`RunDir` (one owner of a run directory's layout and kind) and `data.known_vocab_size`.

No JAX compile: the runs here are files on disk (a weights-only run is written with a 1-layer
model's initial weights); the whole file costs well under a second after imports.
"""

from __future__ import annotations

import dataclasses

import jax
import pytest

from lmjax import models
from lmjax.config import DataConfig, RunConfig
from lmjax.data import known_vocab_size
from lmjax.errors import ConfigError, FileFormatError
from lmjax.tokenizers import ByteTokenizer, CharTokenizer
from lmjax.train import bench
from lmjax.train.rundir import FINETUNED, TRAINED, WEIGHTS, RunDir
from lmjax.train.runs import eval_tokenizer_dir, load_run, write_weights_run

TINY = dict(n_layers=1, d_model=16, n_heads=2, d_ff=32, context_length=16)


def test_known_vocab_size_for_each_tokenizer():
    """byte and gpt2 have fixed vocabularies, bpe the configured one; char depends on the text."""
    assert known_vocab_size(DataConfig(tokenizer="byte")) == 256
    assert known_vocab_size(DataConfig(tokenizer="gpt2")) == 50_257
    assert known_vocab_size(DataConfig(tokenizer="bpe", vocab_size=300)) == 300
    assert known_vocab_size(DataConfig(tokenizer="char")) is None


def test_bench_model_takes_the_vocab_from_the_tokenizer():
    """Found: bench knew only gpt2's size, so timing a byte-tokenizer config with
    model.vocab_size: null asked for the data; it now uses the one vocabulary-size function."""
    run = RunConfig(model={"preset": "gpt", "vocab_size": None}, data=DataConfig(tokenizer="byte"))
    assert bench.run_config_model(run).vocab_size == 256
    bpe = RunConfig(
        model={"preset": "gpt", "vocab_size": None},
        data=DataConfig(tokenizer="bpe", vocab_size=300),
    )
    assert bench.run_config_model(bpe).vocab_size == 300
    char = RunConfig(model={"preset": "gpt", "vocab_size": None}, data=DataConfig(tokenizer="char"))
    with pytest.raises(ConfigError, match="model.vocab_size"):
        bench.run_config_model(char)


def test_parse_and_default_paths(tmp_path):
    run = tmp_path / "run"
    (run / "checkpoints" / "12").mkdir(parents=True)
    (run / "config.yaml").write_text("{}\n")
    assert RunDir.parse(run) == (RunDir(run), None)
    assert RunDir.parse(run / "checkpoints" / "12") == (RunDir(run), 12)
    with pytest.raises(ConfigError, match="run path"):
        RunDir.parse(tmp_path / "elsewhere")
    assert RunDir.default("configs/tiny.yaml").path.as_posix() == "runs/tiny"
    assert RunDir.default(None).path.as_posix() == "runs/run"


def test_kind_of_a_weights_run_and_its_files(tmp_path):
    """A weights-only run (import-hf's layout): kind WEIGHTS, its config and tokenizer read back;
    finetune.yaml beside it would make it a fine-tune, a checkpoint step a trained run."""
    model = models.ModelConfig(vocab_size=5, **TINY)
    tok = CharTokenizer.train("abcd")
    out = write_weights_run(
        tmp_path / "w", models.init(jax.random.key(0), model), model, tok, "char"
    )
    run = RunDir(out)
    assert run.kind() == WEIGHTS and run.latest_step() is None
    # 5 embedding rows, 4 characters: the config records the tokenizer's size (padded rows)
    assert run.read_config().model_config() == model.replace(tokenizer_size=tok.vocab_size)
    assert run.tokenizer().encode("dab") == tok.encode("dab")
    assert load_run(out).step is None
    run.checkpoints_dir.mkdir()  # an empty checkpoints/ (no step saved yet): still weights
    assert run.kind() == WEIGHTS
    run.finetune_file.write_text("finetune: {}\n")
    assert run.kind() == FINETUNED
    assert RunDir(tmp_path / "empty").kind() is None and TRAINED == "trained"


def test_check_writable(tmp_path):
    RunDir(tmp_path / "new").check_writable(resume=False)
    (tmp_path / "used").mkdir()
    (tmp_path / "used" / "x").write_text("")
    with pytest.raises(ConfigError, match="a new \\(or empty\\) directory"):
        RunDir(tmp_path / "used").check_writable(resume=False)
    with pytest.raises(ConfigError, match="with config.yaml"):
        RunDir(tmp_path / "used").check_writable(resume=True)
    (tmp_path / "file").write_text("")
    with pytest.raises(ConfigError, match="is a file"):
        RunDir(tmp_path / "file" / "run").check_writable(resume=False)


def test_tokenizer_absent_is_none(tmp_path):
    assert RunDir(tmp_path).tokenizer() is None
    ByteTokenizer().save(RunDir(tmp_path).tokenizer_dir)
    assert RunDir(tmp_path).tokenizer().vocab_size == 256


def test_eval_tokenizer_dir_by_kind(tmp_path):
    """eval encodes a weights-only run's text with its own tokenizer/ (its config names no
    prepared data), refuses one without a tokenizer, and uses the data's for a data.dir."""
    model = models.ModelConfig(vocab_size=5, **TINY)
    params = models.init(jax.random.key(0), model)
    with_tok = write_weights_run(tmp_path / "a", params, model, CharTokenizer.train("abcd"), "char")
    loaded = load_run(with_tok)
    assert eval_tokenizer_dir(loaded, loaded.cfg) == RunDir(with_tok).tokenizer_dir
    prepared = loaded.cfg.replace(data=dataclasses.replace(loaded.cfg.data, dir="data/x"))
    assert eval_tokenizer_dir(loaded, prepared) is None
    bare = load_run(write_weights_run(tmp_path / "b", params, model, None, "char"))
    with pytest.raises(FileFormatError, match="a tokenizer/ directory"):
        eval_tokenizer_dir(bare, bare.cfg)
