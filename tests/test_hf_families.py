"""Hugging Face llama / mistral / qwen2 / qwen3 checkpoints (SPEC section 8) against transformers.

Each family is a tiny random-initialised `transformers` model (torch.manual_seed, saved offline
with save_pretrained), chosen to exercise what differs between them:

    llama        grouped-query attention (4 heads, 2 key/value heads), untied head, llama3 RoPE
                 scaling (original context 16 < the prompts' positions, so it matters)
    llama_tied   SmolLM-like: tied head, multi-query attention (one key/value head)
    llama_bias   attention_bias: q, k, v and o biases (lmjax's MLP/head biases load as zeros)
    mistral      a sliding window of 6, shorter than every prompt
    qwen2        q, k, v biases only
    qwen3        qk-norm and an explicit head_dim (12 * 4 heads != d_model 32)

Checked: lmjax's logits within `lmjax.testing.logits_atol` of transformers' (float32: a derived
bound on either program's rounding, on any CPU); greedy decoding of 32 tokens
with `lmjax.generate` equal to `generate(do_sample=False)` for one prompt and for a batch of
prompts of different lengths (transformers left-pads them); load -> save -> from_pretrained
gives the same tensors under the same names; a sharded checkpoint loads the same params.
The weights are drawn with initializer_range 0.3 (not 0.02) so that greedy decoding has clear
winners rather than near-ties that float noise could flip.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import safetensors.torch
import torch
import transformers

from lmjax import generate, models, testing
from lmjax import params as ptree
from lmjax.io import hf

V, C, NEW_TOKENS = 96, 64, 32
COMMON = dict(
    vocab_size=V, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
    num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=C,
    initializer_range=0.3, bos_token_id=None, eos_token_id=None, pad_token_id=None,
)  # fmt: skip
LLAMA3_ROPE = dict(
    rope_type="llama3", rope_theta=500000.0, factor=8.0, low_freq_factor=1.0,
    high_freq_factor=4.0, original_max_position_embeddings=16,
)  # fmt: skip
# family -> (transformers config class, its extra fields, what lmjax's config must say)
FAMILIES = {
    "llama": (
        "LlamaConfig",
        dict(rope_parameters=LLAMA3_ROPE),
        dict(n_kv_heads=2, rope_scaling="llama3", rope_factor=8.0, rope_original_context=16),
    ),
    "llama_tied": (
        "LlamaConfig",
        dict(tie_word_embeddings=True, num_key_value_heads=1),
        dict(n_kv_heads=1, tie_embeddings=True),
    ),
    "llama_bias": ("LlamaConfig", dict(attention_bias=True), dict(bias=True, qkv_bias=None)),
    "mistral": ("MistralConfig", dict(sliding_window=6), dict(sliding_window=6)),
    "qwen2": ("Qwen2Config", {}, dict(bias=False, qkv_bias=True)),
    "qwen3": ("Qwen3Config", dict(head_dim=12), dict(head_dim=12, qk_norm=True)),
}
PROMPT = [int(t) for t in np.random.default_rng(1).integers(0, V, 10)]
BATCH = [PROMPT[:5], [int(t) for t in np.random.default_rng(2).integers(0, V, 12)]]

forward = jax.jit(models.forward)


def _hf_model(family: str, **changes):
    config_class, extra, _ = FAMILIES[family]
    torch.manual_seed(0)
    config = getattr(transformers, config_class)(**COMMON | extra | changes)
    return transformers.AutoModelForCausalLM.from_config(config).eval()


@pytest.fixture(scope="module", params=sorted(FAMILIES))
def family(request, tmp_path_factory):
    """(name, transformers model, its save_pretrained directory, lmjax's (params, cfg))."""
    model = _hf_model(request.param)
    directory = tmp_path_factory.mktemp(request.param)
    model.save_pretrained(directory)
    return request.param, model, directory, hf.load(directory)


def test_config_maps_every_field(family):
    name, _, _, (_, cfg) = family
    for field, value in FAMILIES[name][2].items():
        assert getattr(cfg, field) == value, field
    assert (cfg.d_model, cfg.n_heads, cfg.n_layers, cfg.d_ff) == (32, 4, 2, 64)
    assert (cfg.vocab_size, cfg.context_length, cfg.norm) == (V, C, "rmsnorm")


def test_logits_match_transformers(family):
    _, model, _, (params, cfg) = family
    tokens = np.random.default_rng(0).integers(0, V, (2, 40))
    with torch.no_grad():
        theirs = model(torch.tensor(tokens)).logits.numpy()
    ours = np.asarray(forward(params, jnp.asarray(tokens), cfg))
    np.testing.assert_allclose(ours, theirs, atol=testing.logits_atol(cfg, theirs), rtol=0)


def _hf_greedy(model, prompts: list[list[int]]) -> list[list[int]]:
    """transformers' greedy continuations of `prompts`, left-padded into one batch."""
    width = max(map(len, prompts))
    ids = torch.tensor([[0] * (width - len(p)) + p for p in prompts])
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
    with torch.no_grad():
        out = model.generate(
            ids, attention_mask=mask, max_new_tokens=NEW_TOKENS, do_sample=False, pad_token_id=0
        )
    return out[:, width:].tolist()


@pytest.mark.parametrize("prompts", [[PROMPT], BATCH], ids=["single", "batch"])
def test_greedy_generation_matches_transformers(family, prompts):
    _, model, _, (params, cfg) = family
    theirs = _hf_greedy(model, prompts)
    assert all(len(row) == NEW_TOKENS and len(set(row)) >= 4 for row in theirs)  # not one token
    assert generate.generate(params, prompts, cfg, max_new_tokens=NEW_TOKENS) == theirs


def _tensors(directory) -> dict[str, torch.Tensor]:
    files = sorted(directory.glob("*.safetensors"))
    return {k: v for f in files for k, v in safetensors.torch.load_file(str(f)).items()}


def test_load_save_from_pretrained_gives_the_same_tensors(family, tmp_path):
    name, model, directory, (params, cfg) = family
    written = hf.save(params, cfg, tmp_path)
    assert written == name.split("_")[0]
    theirs, ours = _tensors(directory), _tensors(tmp_path)
    assert sorted(ours) == sorted(theirs)
    for key in theirs:
        assert ours[key].dtype == theirs[key].dtype and torch.equal(ours[key], theirs[key]), key
    back, info = transformers.AutoModelForCausalLM.from_pretrained(
        tmp_path, output_loading_info=True
    )
    assert type(back) is type(model)
    assert not (info["missing_keys"] or info["unexpected_keys"] or info["mismatched_keys"])
    for key, tensor in back.state_dict().items():
        assert torch.equal(tensor, model.state_dict()[key]), key
    # Every config field as transformers reads it, but those that are no part of the model.
    assert _fields(back.config) == _fields(model.config)


_NOT_MODEL = {"_name_or_path", "architectures", "dtype", "initializer_range"}


def _fields(config) -> dict:
    return {k: v for k, v in config.to_dict().items() if k not in _NOT_MODEL}


def test_sharded_checkpoint_loads_the_same_params(tmp_path):
    # One family is enough: the index and shard reading is shared (io.hf_files).
    model = _hf_model("qwen3")
    model.save_pretrained(tmp_path / "one")
    model.save_pretrained(tmp_path / "sharded", max_shard_size="20KB")
    assert not (tmp_path / "sharded" / "model.safetensors").exists()
    assert len(list((tmp_path / "sharded").glob("model-*-of-*.safetensors"))) > 2
    params, cfg = hf.load(tmp_path / "one")
    back, back_cfg = hf.load(tmp_path / "sharded")
    assert back_cfg == cfg
    flat = ptree.flatten(params)
    assert sorted(ptree.flatten(back)) == sorted(flat)
    for key, leaf in ptree.flatten(back).items():
        np.testing.assert_array_equal(np.asarray(leaf), np.asarray(flat[key]))


def _hf_tokenizer(directory, vocab_size: int) -> None:
    """A byte-level BPE tokenizer.json (+ tokenizer_config.json) of `vocab_size` tokens, built
    offline with `tokenizers` and saved as transformers does."""
    from tokenizers import Tokenizer, decoders, pre_tokenizers, trainers
    from tokenizers import models as bpe_models

    tok = Tokenizer(bpe_models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        special_tokens=["<|endoftext|>"], show_progress=False,
    )  # fmt: skip
    tok.train_from_iterator(["the cat sat on the mat; the end. " * 8], trainer)
    fast = transformers.PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|endoftext|>")
    fast.save_pretrained(directory)


def test_import_and_export_commands_carry_the_tokenizer(tmp_path, capsys):
    from lmjax import cli, train

    model = _hf_model("qwen2", vocab_size=300)  # byte-level BPE needs 256 byte tokens
    model.save_pretrained(tmp_path / "hf")
    _hf_tokenizer(tmp_path / "hf", 280)
    text = "the cat sat on the mat"
    ids = transformers.AutoTokenizer.from_pretrained(tmp_path / "hf").encode(text)
    assert cli.main(["import-hf", str(tmp_path / "hf"), "--out", str(tmp_path / "run")]) == 0
    assert "qwen2" in capsys.readouterr().out
    run = train.load_run(tmp_path / "run")
    assert run.tokenizer.kind == "hf" and run.tokenizer.encode(text) == ids
    assert cli.main(["export-hf", str(tmp_path / "run"), "--out", str(tmp_path / "back")]) == 0
    assert transformers.AutoTokenizer.from_pretrained(tmp_path / "back").encode(text) == ids
    back = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "back")
    assert type(back) is type(model)
    for key, tensor in back.state_dict().items():
        assert torch.equal(tensor, model.state_dict()[key]), key


def _config(family: str, **changes) -> dict:
    config_class, extra, _ = FAMILIES[family]
    return getattr(transformers, config_class)(**COMMON | extra | changes).to_dict()


def test_older_rope_and_window_spellings_map_the_same():
    from lmjax.io.hf_llama_config import config_from_hf

    new = _config("llama")
    old = {k: v for k, v in new.items() if k != "rope_parameters"}
    old |= {"rope_theta": 500000.0, "rope_scaling": dict(LLAMA3_ROPE, rope_type=None)}
    old["rope_scaling"] = {k: v for k, v in old["rope_scaling"].items() if k != "rope_type"}
    old["rope_scaling"]["type"] = "llama3"  # transformers 4's spelling
    del old["rope_scaling"]["rope_theta"]
    assert config_from_hf(old, "float32", "old")[0] == config_from_hf(new, "float32", "new")[0]
    linear = _config("llama", rope_parameters=dict(rope_type="linear", factor=2.0))
    cfg = config_from_hf(linear, "float32", "linear")[0]
    assert (cfg.rope_scaling, cfg.rope_factor, cfg.rope_theta) == ("linear", 2.0, 10000.0)
    # Qwen2's window counts only with use_sliding_window, and then on every layer from
    # max_window_layers on (here all of them).
    off = _config("qwen2", sliding_window=8, use_sliding_window=False)
    on = _config("qwen2", sliding_window=8, use_sliding_window=True, max_window_layers=0)
    assert config_from_hf(off, "float32", "off")[0].sliding_window is None
    assert config_from_hf(on, "float32", "on")[0].sliding_window == 8
