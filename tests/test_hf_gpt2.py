"""Hugging Face GPT-2 import/export (SPEC section 8) against `transformers` on CPU torch.

The witness is a `GPT2LMHeadModel` built offline from a tiny `GPT2Config` and trained for 100 Adam
steps on real text (Python's documentation, as bytes), so its greedy continuation is that text
rather than one repeated token. We check, against transformers:

- lmjax's logits of the imported model (float32, within `lmjax.testing.logits_atol`: a derived
  bound on float32 rounding in either program, any CPU);
- greedy decoding of 64 tokens token for token against `generate(do_sample=False)` (lmjax side:
  a plain loop over a jitted `forward` on a fixed-size buffer; causality makes the padding
  after the current position irrelevant);
- HF -> lmjax -> HF is bit-exact, and what `save` writes loads with no missing/unexpected keys;
- the other key layouts (no `transformer.` prefix, `lm_head.weight`, mask buffers) load the same.
"""

from __future__ import annotations

import json
import pydoc_data.topics
import shutil

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import safetensors.numpy
import safetensors.torch
import torch
from transformers import GPT2Config, GPT2LMHeadModel

from lmjax import models, testing
from lmjax import params as ptree
from lmjax.errors import CheckpointError, ConfigError, FileFormatError, ShapeError
from lmjax.io import hf_files, hf_gpt2

C, NEW_TOKENS = 96, 64
HF_CONFIG = dict(
    vocab_size=256, n_positions=C, n_embd=32, n_layer=2, n_head=4, activation_function="gelu_new",
    resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=None, eos_token_id=None,
)  # fmt: skip
TEXT = "".join(pydoc_data.topics.topics[k] for k in sorted(pydoc_data.topics.topics))
DATA = list(TEXT.encode("utf-8")[: 4 * C])  # 4 windows of real text, as bytes
PROMPT = DATA[2 * C : 2 * C + 16]


def _train(model: GPT2LMHeadModel, steps: int = 100) -> None:
    # One fixed batch, learned nearly by heart: greedy decoding then continues the text
    # instead of repeating one byte (which partly trained tiny models do).
    batch = torch.tensor(DATA).reshape(4, C)
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # tiny matmuls: threads only contend on a shared CPU
    try:
        for _ in range(steps):
            loss = model(batch, labels=batch).loss
            opt.zero_grad()
            loss.backward()
            opt.step()
    finally:
        torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory):
    torch.manual_seed(0)
    model = GPT2LMHeadModel(GPT2Config(**HF_CONFIG))
    _train(model)
    out = tmp_path_factory.mktemp("hf")
    model.eval().save_pretrained(out)
    return out


@pytest.fixture(scope="module")
def hf_model(hf_dir):
    return GPT2LMHeadModel.from_pretrained(hf_dir).eval()


@pytest.fixture(scope="module")
def imported(hf_dir):
    return hf_gpt2.load(hf_dir)


forward = jax.jit(models.forward)


def _hf_logits(model, tokens) -> np.ndarray:
    with torch.no_grad():
        return model(torch.tensor(np.asarray(tokens))).logits.numpy()


def test_imported_logits_match_transformers(hf_model, imported):
    params, cfg = imported
    assert cfg == models.preset(
        "gpt2", vocab_size=256, context_length=C, d_model=32, n_heads=4, n_layers=2, d_ff=128
    )
    tokens = np.random.default_rng(0).integers(0, 256, (2, C))
    theirs = _hf_logits(hf_model, tokens)
    np.testing.assert_allclose(
        np.asarray(forward(params, jnp.asarray(tokens), cfg)), theirs,
        atol=testing.logits_atol(cfg, theirs), rtol=0,
    )  # fmt: skip


def _greedy(params, cfg, prompt: list[int], n: int) -> list[int]:
    buffer = np.zeros((1, cfg.context_length), np.int32)
    buffer[0, : len(prompt)] = prompt
    length = len(prompt)
    for _ in range(n):
        logits = forward(params, jnp.asarray(buffer), cfg)
        buffer[0, length] = int(jnp.argmax(logits[0, length - 1]))
        length += 1
    return buffer[0, len(prompt) : length].tolist()


def test_greedy_generation_matches_transformers_generate(hf_model, imported):
    with torch.no_grad():
        out = hf_model.generate(
            torch.tensor([PROMPT]), attention_mask=torch.ones(1, len(PROMPT), dtype=torch.long),
            max_new_tokens=NEW_TOKENS, do_sample=False, pad_token_id=0,
        )  # fmt: skip
    theirs = out[0, len(PROMPT) :].tolist()
    assert len(theirs) == NEW_TOKENS and len(set(theirs)) >= 12  # a real continuation
    assert _greedy(*imported, PROMPT, NEW_TOKENS) == theirs
    # lmjax.generate (KV cache, both cache layouts) gives the same tokens.
    from lmjax import generate

    for cache in ("contiguous", "paged"):
        ours = generate.generate(
            imported[0], [PROMPT], imported[1], max_new_tokens=NEW_TOKENS, cache=cache
        )
        assert ours == [theirs], cache


def _tensors(path):
    return safetensors.torch.load_file(str(path))


def test_round_trip_hf_lmjax_hf_is_exact(hf_dir, imported, tmp_path):
    params, cfg = imported
    hf_gpt2.save(params, cfg, tmp_path)
    theirs, ours = _tensors(hf_dir / "model.safetensors"), _tensors(tmp_path / "model.safetensors")
    assert set(ours) == set(theirs)
    for key in theirs:
        assert ours[key].dtype == theirs[key].dtype and torch.equal(ours[key], theirs[key]), key
    model, info = GPT2LMHeadModel.from_pretrained(tmp_path, output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"]
    assert not info["mismatched_keys"]
    assert json.loads((tmp_path / "config.json").read_text())["n_inner"] == 128


def test_export_of_lmjax_params_loads_in_transformers(tmp_path):
    cfg = models.preset(
        "gpt2", vocab_size=50, context_length=16, d_model=16, n_heads=2, n_layers=2, d_ff=48
    )
    params = models.init(jax.random.PRNGKey(3), cfg)
    # Shift biases and norm parameters off 0/1 so a misplaced one changes the logits.
    rng = np.random.default_rng(4)
    params = jax.tree.map(lambda a: a + 0.1 * rng.standard_normal(a.shape, np.float32), params)
    hf_gpt2.save(params, cfg, tmp_path)
    model = GPT2LMHeadModel.from_pretrained(tmp_path).eval()
    tokens = np.random.default_rng(1).integers(0, 50, (2, 16))
    theirs = _hf_logits(model, tokens)
    np.testing.assert_allclose(
        np.asarray(forward(params, jnp.asarray(tokens), cfg)), theirs,
        atol=testing.logits_atol(cfg, theirs), rtol=0,
    )  # fmt: skip
    back, back_cfg = hf_gpt2.load(tmp_path)
    assert back_cfg == cfg
    for name, leaf in ptree.flatten(params).items():
        np.testing.assert_array_equal(np.asarray(ptree.flatten(back)[name]), np.asarray(leaf))


def test_hub_layout_with_lm_head_and_buffers_loads_the_same(hf_dir, imported, tmp_path):
    # The original hub file: no "transformer." prefix, tied lm_head.weight stored, mask buffers.
    state = {
        k.removeprefix("transformer."): v for k, v in _tensors(hf_dir / "model.safetensors").items()
    }
    state = {k: v.numpy() for k, v in state.items()}
    state["lm_head.weight"] = state["wte.weight"].copy()
    for i in range(2):
        state[f"h.{i}.attn.bias"] = np.tril(np.ones((C, C), np.float32))[None, None]
        state[f"h.{i}.attn.masked_bias"] = np.array(-1e4, np.float32)
    safetensors.numpy.save_file(state, str(tmp_path / "model.safetensors"), {"format": "pt"})
    params, cfg = hf_gpt2.load(tmp_path / "model.safetensors", n_heads=4)  # no config.json here
    assert cfg == imported[1]
    for name, leaf in ptree.flatten(imported[0]).items():
        np.testing.assert_array_equal(np.asarray(ptree.flatten(params)[name]), np.asarray(leaf))
    with pytest.raises(CheckpointError, match="config.json = 'missing'"):
        hf_gpt2.load(tmp_path / "model.safetensors")


def _edited_copy(hf_dir, tmp_path, edit_state=None, edit_config=None):
    out = tmp_path / "edited"
    shutil.copytree(hf_dir, out)
    if edit_state:
        state = {k: v.numpy() for k, v in _tensors(out / "model.safetensors").items()}
        edit_state(state)
        safetensors.numpy.save_file(state, str(out / "model.safetensors"), {"format": "pt"})
    if edit_config:
        config = json.loads((out / "config.json").read_text())
        edit_config(config)
        (out / "config.json").write_text(json.dumps(config))
    return out


def _rename_to_llama(state):
    state["transformer.h.0.attn.q_proj.weight"] = state.pop("transformer.h.0.attn.c_attn.weight")


def _untie(state):
    state["lm_head.weight"] = state["transformer.wte.weight"] + 1.0


@pytest.mark.parametrize(
    "edit_state, edit_config, error, message",
    [
        (_rename_to_llama, None, CheckpointError, "2 parameter mismatches"),
        (None, lambda c: c.update(n_inner=64), CheckpointError, r"h\.1\.mlp\.c_proj\.weight shape"),
        (_untie, None, CheckpointError, "differs from wte"),
        (None, lambda c: c.update(model_type="llama"), ConfigError, "model_type"),
        (None, lambda c: c.update(tie_word_embeddings=False), ConfigError, "tie_word"),
    ],
)
def test_bad_checkpoints_raise_errors_naming_the_problem(
    hf_dir, tmp_path, edit_state, edit_config, error, message
):
    path = _edited_copy(hf_dir, tmp_path, edit_state, edit_config)
    with pytest.raises(error, match=message) as err:
        hf_gpt2.load(path)
    if edit_state is _rename_to_llama:  # both the unknown key and the missing one are named
        assert "not a GPT-2 key: h.0.attn.q_proj.weight" in str(err.value)
        assert "missing h.0.attn.c_attn.weight (32, 96)" in str(err.value)


def test_missing_paths_and_files(tmp_path):
    with pytest.raises(CheckpointError, match="existing directory"):
        hf_gpt2.load(tmp_path / "nope")
    (tmp_path / "pytorch_model.bin").write_bytes(b"")
    with pytest.raises(CheckpointError, match="save_pretrained"):
        hf_gpt2.load(tmp_path)
    llama = models.preset("llama")
    with pytest.raises(ConfigError, match="GPT-2 export"):
        hf_gpt2.save(models.abstract_params(llama), llama, tmp_path / "out")
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize(
    "config, error, message",
    [
        (lambda c: [c], FileFormatError, "config.json top level = 'list'; expected a JSON object"),
        (lambda c: c | {"layer_norm_epsilon": None}, ConfigError, "layer_norm_epsilon = None"),
        (lambda c: c | {"layer_norm_epsilon": "1e-5"}, ConfigError, "layer_norm_epsilon"),
        (lambda c: c | {"n_embd": "32"}, ConfigError, "n_embd = '32'; expected an int"),
        (lambda c: c | {"n_layer": 2.0}, ConfigError, "n_layer = 2.0"),
        (lambda c: c | {"n_inner": True}, ConfigError, "n_inner = True"),
    ],
)
def test_malformed_config_json_is_named(hf_dir, tmp_path, config, error, message):
    out = tmp_path / "ckpt"
    shutil.copytree(hf_dir, out)
    (out / "config.json").write_text(
        json.dumps(config(json.loads((hf_dir / "config.json").read_text())))
    )
    with pytest.raises(error, match=message) as err:
        hf_gpt2.load(out)
    assert str(out / "config.json") in str(err.value)


def _sharded(hf_dir, tmp_path, weight_map):
    # A directory with only an index (no model.safetensors), pointing wherever `weight_map` says.
    out = tmp_path / "ckpt" / "sharded"
    out.mkdir(parents=True)
    shutil.copy(hf_dir / "config.json", out)
    shutil.copy(hf_dir / "model.safetensors", out / "shard-1.safetensors")
    (out / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    return out


def test_sharded_index_names_plain_files_in_its_directory(hf_dir, imported, tmp_path):
    keys = _tensors(hf_dir / "model.safetensors").keys()
    good = _sharded(hf_dir, tmp_path / "good", {k: "shard-1.safetensors" for k in keys})
    params, _ = hf_gpt2.load(good)
    for name, leaf in ptree.flatten(imported[0]).items():
        np.testing.assert_array_equal(np.asarray(ptree.flatten(params)[name]), np.asarray(leaf))
    cases = [
        ({k: "../outside.safetensors" for k in keys}, "plain file name inside"),
        ({"wte.weight": "/etc/passwd"}, "plain file name inside"),
        ({"wte.weight": ".."}, "plain file name inside"),
        ({"wte.weight": 3}, "plain file name inside"),
        (sorted(keys), r"weight_map = \['transformer"),
        ({}, "non-empty JSON object"),
    ]
    for i, (weight_map, message) in enumerate(cases):
        path = _sharded(hf_dir, tmp_path / "bad" / str(i), weight_map)
        # A valid checkpoint just outside the directory: the index must not reach it.
        shutil.copy(hf_dir / "model.safetensors", path.parent / "outside.safetensors")
        with pytest.raises(FileFormatError, match=message) as err:
            hf_gpt2.load(path)
        assert str(path / "model.safetensors.index.json") in str(err.value)


def test_names_and_shapes_are_checked_before_any_tensor_is_read(hf_dir, tmp_path, monkeypatch):
    path = _edited_copy(hf_dir, tmp_path, edit_config=lambda c: c.update(n_inner=64))

    def refuse(*args, **kwargs):
        raise AssertionError("a tensor was read before the header was checked")

    monkeypatch.setattr(hf_files.safetensors, "safe_open", refuse)  # the shared reader
    with pytest.raises(CheckpointError, match=r"h\.0\.mlp\.c_fc\.weight shape \(32, 128\)"):
        hf_gpt2.load(path)


def test_export_refuses_params_whose_dtype_differs_from_the_config(imported, tmp_path):
    params, cfg = imported  # float32 config
    bf16 = jax.tree.map(lambda a: a.astype(jnp.bfloat16), params)
    # The first leaf in natural order, named as stored (stacked: every layer at once).
    match = r"parameter blocks\.attention\.key\.bias dtype = dtype\(bfloat16\)"
    with pytest.raises(ShapeError, match=match):
        hf_gpt2.save(bf16, cfg, tmp_path / "out")
    assert not (tmp_path / "out" / "model.safetensors").exists()


def test_full_size_gpt2_maps_onto_the_preset():
    # GPT-2 small's real names and shapes, without allocating it (torch's meta device).
    hf_config = GPT2Config()
    with torch.device("meta"):
        model = GPT2LMHeadModel(hf_config)
    shapes = {
        k.removeprefix("transformer."): tuple(v.shape)
        for k, v in model.state_dict().items()
        if k != "lm_head.weight"
    }
    cfg = hf_gpt2.config_from_hf(hf_config.to_dict())
    assert cfg == models.preset("gpt2")
    assert hf_gpt2.hf_shapes(cfg) == shapes
    assert models.param_count(cfg) == sum(int(np.prod(s)) for s in shapes.values())
    assert hf_gpt2.config_to_hf(cfg)["eos_token_id"] == 50256


# ---- the command line: lmjax import-hf DIR --out RUN, lmjax export-hf RUN --out DIR ----------


def test_import_and_export_commands_round_trip(hf_dir, hf_model, imported, tmp_path, capsys):
    from lmjax import cli, train
    from lmjax.tokenizers.bpe import bytes_to_unicode

    source = tmp_path / "hf"
    shutil.copytree(hf_dir, source)
    # The witness model was trained on raw bytes: a 256-token byte-level vocabulary, no merges.
    byte_text = bytes_to_unicode()
    (source / "vocab.json").write_text(json.dumps({byte_text[b]: b for b in range(256)}))
    (source / "merges.txt").write_text("#version: 0.2\n")
    assert cli.main(["import-hf", str(source), "--out", str(tmp_path / "run")]) == 0
    run = train.load_run(tmp_path / "run")
    assert run.model == imported[1] and run.step is None
    for name, value in ptree.flatten(run.params).items():
        np.testing.assert_array_equal(value, ptree.flatten(imported[0])[name])
    assert run.tokenizer.encode("hé") == list("hé".encode())
    # The README's `lmjax generate --checkpoint RUN` on an imported run (greedy, so it must
    # print the prompt followed by transformers' greedy continuation).
    capsys.readouterr()
    prompt = list(b"The ")
    argv = ["generate", "--checkpoint", str(tmp_path / "run"), "--prompt", "The "]
    assert cli.main([*argv, "--temperature", "0", "--max-new-tokens", "6"]) == 0
    greedy = hf_model.generate(
        torch.tensor([prompt]), max_new_tokens=6, do_sample=False, pad_token_id=0
    )[0].tolist()
    assert len(greedy) == len(prompt) + 6
    assert capsys.readouterr().out.rstrip("\n") == bytes(greedy).decode("utf-8", "replace")

    assert cli.main(["export-hf", str(tmp_path / "run"), "--out", str(tmp_path / "back")]) == 0
    back = GPT2LMHeadModel.from_pretrained(tmp_path / "back").eval()
    tokens = np.random.default_rng(1).integers(0, 256, (1, C))
    np.testing.assert_array_equal(_hf_logits(back, tokens), _hf_logits(hf_model, tokens))
    assert (tmp_path / "back/vocab.json").is_file() and (tmp_path / "back/merges.txt").is_file()
    capsys.readouterr()

    # Existing outputs are refused and left as they were.
    before = (tmp_path / "run/model.safetensors").read_bytes()
    assert cli.main(["import-hf", str(source), "--out", str(tmp_path / "run")]) == 2
    assert cli.main(["export-hf", str(tmp_path / "run"), "--out", str(tmp_path / "back")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 2 and all("nothing was overwritten" in line for line in err)
    assert (tmp_path / "run/model.safetensors").read_bytes() == before
    assert cli.main(["import-hf", str(tmp_path / "nowhere"), "--out", str(tmp_path / "r2")]) == 2
    assert not (tmp_path / "r2").exists()
