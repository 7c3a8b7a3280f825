"""RunConfig: YAML + key=value overrides, validated once, unknown keys rejected by name."""

from __future__ import annotations

from pathlib import Path

import pytest

from lmjax.config import RunConfig, load_run_config, parse_overrides
from lmjax.errors import ConfigError, FileFormatError, LMJaxError

ALL_CONFIGS = sorted((Path(__file__).parent.parent / "configs").glob("*.yaml"))
# `lmjax finetune` configs name a base run and take their model from it (with the recipes
# shipped in the package, `lmjax finetune --recipe NAME`); the rest are `lmjax train` configs.
RECIPES = sorted((Path(__file__).parent.parent / "lmjax/finetune/recipes").glob("*.yaml"))
FINETUNE_CONFIGS = [p for p in ALL_CONFIGS if p.name.startswith("finetune-")] + RECIPES
CONFIGS = [p for p in ALL_CONFIGS if p not in FINETUNE_CONFIGS]
BASE = {"model": {"preset": "gpt"}}


def test_shipped_configs_load_and_build_their_models():
    assert {p.name for p in CONFIGS} >= {
        "tiny-shakespeare.yaml",
        "gpt2-124m.yaml",
        "llama-small.yaml",
    }
    for path in CONFIGS:
        cfg = load_run_config(path)
        model = cfg.with_vocab_size(cfg.data.vocab_size or 97).model_config()
        assert model.n_layers >= 1 and cfg.train.steps >= 1
        # The sample must fit in one context (a character is at most one token here), else
        # `lmjax train` refuses the config before starting.
        prompt = len(cfg.logging.sample_prompt.encode())
        assert prompt + cfg.logging.sample_tokens <= model.context_length, path.name


def test_shipped_finetune_configs_load_over_a_base_run(tmp_path):
    """Each finetune-*.yaml loads with its base swapped for a tiny char-level weights-only run."""
    import jax

    from lmjax import finetune, models
    from lmjax.tokenizers.simple import CharTokenizer
    from lmjax.train.runs import write_weights_run

    assert {p.name for p in FINETUNE_CONFIGS} == {
        "finetune-lora.yaml",
        "finetune-qlora.yaml",
        "llama-lora.yaml",  # recipes for an imported chat model (tests/test_recipes.py)
        "llama-qlora.yaml",
    }
    tokenizer = CharTokenizer.train("abcdefgh ")
    model = models.preset("llama-tiny", vocab_size=tokenizer.vocab_size, context_length=1024)
    base = tmp_path / "base"
    write_weights_run(base, models.init(jax.random.key(0), model), model, tokenizer, "char")
    for path in FINETUNE_CONFIGS:
        cfg, spec, _ = finetune.load_config(path, {"finetune.base": str(base)})
        assert spec.qlora == ("qlora" in path.name), path.name
        assert spec.lora.r >= 1 and cfg.train.steps >= 1
        dtype = "bfloat16" if "llama" in path.name else model.dtype  # the recipes compute in bf16
        assert cfg.model_config() == model.replace(dtype=dtype), path.name
        if cfg.logging.sample_chat is not None:  # rendered by the base's chat template
            continue
        prompt = len(cfg.logging.sample_prompt.encode())
        assert prompt + cfg.logging.sample_tokens <= model.context_length, path.name


def test_overrides_reach_every_section_with_types():
    cfg = RunConfig.from_dict(
        BASE,
        parse_overrides(
            [
                "model.n_layers=3",
                "train.steps=7",
                "run.dir=/tmp/x",
                "data.corpus=my.txt",
                "optimizer.lr=1e-3",
                "optimizer.clip_norm=null",
                "logging.progress=false",
            ]
        ),
    )
    assert cfg.model == {"preset": "gpt", "n_layers": 3}
    assert cfg.with_vocab_size(27).model_config().n_layers == 3
    assert (cfg.train.steps, cfg.run.dir, cfg.data.corpus) == (7, "/tmp/x", "my.txt")
    assert cfg.optimizer.lr == 1e-3 and isinstance(cfg.optimizer.lr, float)
    assert cfg.optimizer.clip_norm is None and cfg.logging.progress is False


def test_int_is_accepted_for_float_fields_and_lists_for_tuples():
    cfg = RunConfig.from_dict({**BASE, "optimizer": {"lr": 1, "no_decay": ["*.bias"]}})
    assert cfg.optimizer.lr == 1.0 and type(cfg.optimizer.lr) is float
    assert cfg.optimizer.no_decay == ("*.bias",)


def test_round_trip_through_to_dict():
    cfg = load_run_config(CONFIGS[0], ["train.steps=3"])
    assert RunConfig.from_dict(cfg.to_dict()) == cfg


@pytest.mark.parametrize(
    ("data", "overrides", "named"),
    [
        (BASE, {"optimizer.lrr": 1.0}, "'lrr'"),
        (BASE, {"modle.n_layers": 2}, "'modle'"),
        (BASE, {"steps": 3}, "'steps'"),
        (BASE, {"model.n_layer": 2}, "'n_layer'"),
        ({**BASE, "trian": {"steps": 1}}, {}, "'trian'"),
        ({**BASE, "train": {"step": 1}}, {}, "'step'"),
        (BASE, {"train.steps": 0}, "train.steps = 0"),
        (BASE, {"train.steps": "ten"}, "train.steps = 'ten'"),
        (BASE, {"train.steps": True}, "train.steps = True"),
        (BASE, {"optimizer.name": "lion"}, "optimizer.name = 'lion'"),
        (BASE, {"optimizer.lr": -1.0}, "optimizer.lr = -1.0"),
        (BASE, {"optimizer.b2": 1.0}, "optimizer.b2 = 1.0"),
        (BASE, {"schedule.decay": "step"}, "schedule.decay = 'step'"),
        (BASE, {"schedule.warmup_steps": 10, "schedule.decay_steps": 5}, "decay_steps = 5"),
        (BASE, {"schedule.warmup_steps": 10, "schedule.decay_steps": 5}, "lower schedule.warmup"),
        (BASE, {"data.tokenizer": "word"}, "data.tokenizer = 'word'"),
        (BASE, {"data.vocab_size": 300}, "data.vocab_size = 300"),
        (BASE, {"data.val_fraction": 1.0}, "data.val_fraction = 1.0"),
        (BASE, {"train.batch_size": 6, "train.grad_accum": 4}, "train.batch_size = 6"),
        (BASE, {"train.seq_len": 17}, "train.seq_len = 17"),
        (BASE, {"model.preset": "gpt5"}, "'gpt5'"),
        (BASE, {"model.d_model": 30}, "d_model"),
        ({"model": [1, 2]}, {}, "model = [1, 2]"),
        ([1], {}, "config = [1]"),
    ],
)
def test_bad_configs_name_the_offender(data, overrides, named):
    with pytest.raises(ConfigError) as info:
        RunConfig.from_dict(data, overrides)
    message = str(info.value)
    assert named in message and "expected" in message and "Fix:" in message
    assert "\n" not in message


def test_yaml_file_errors(tmp_path):
    with pytest.raises(ConfigError, match="config file = .*missing.yaml"):
        load_run_config(tmp_path / "missing.yaml")
    with pytest.raises(ConfigError, match="not a directory"):
        load_run_config(tmp_path)
    bad = tmp_path / "bad.yaml"
    bad.write_text("model: {preset: gpt\ntrain: [")
    with pytest.raises(FileFormatError, match="unparseable YAML"):
        load_run_config(bad)
    bad.write_text("- a\n- b\n")
    with pytest.raises(ConfigError, match="config = "):
        load_run_config(bad)
    empty = tmp_path / "empty.yaml"
    empty.write_text("")
    assert load_run_config(empty, ["model.preset=gpt"]).model == {"preset": "gpt"}


def test_model_vocab_size_must_be_resolved_before_building_the_model():
    cfg = RunConfig.from_dict(BASE)  # the gpt preset has a vocab, so use an explicit null
    nulled = cfg.replace(model={"preset": "gpt", "vocab_size": None})
    with pytest.raises(LMJaxError, match="model.vocab_size = None"):
        nulled.model_config()
    assert nulled.with_vocab_size(50).model_config().vocab_size == 50


def test_yaml_details(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text("model: {preset: gpt}\ntrain:\n  steps: 5\ntrain:\n  batch_size: 4\n")
    with pytest.raises(ConfigError, match="config key = 'train'.*repeated on line 4"):
        load_run_config(path)
    path.write_text("model: {preset: gpt}\noptimizer: {lr: 1e-2}\ntrain: 0\n")
    with pytest.raises(ConfigError, match="train = 0; expected a mapping"):
        load_run_config(path)
    path.write_text("model: {preset: gpt}\noptimizer: {lr: 1e-2}\n")
    cfg = load_run_config(path, ["run.dir=2024"])
    assert cfg.optimizer.lr == 0.01 and cfg.run.dir == "2024"  # YAML 1.1 reads 1e-2 as a string
    with pytest.raises(ConfigError, match="optimizer.lr = 'fast'"):
        load_run_config(path, ["optimizer.lr=fast"])
