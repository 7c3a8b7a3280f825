"""Decoding from a quantized model (issue 32, item 4): `lmjax generate --quantize nf4` on a plain
run, and `lmjax generate` on a QLoRA run, decode through the NF4 projection (`models.project`
-> `quantized_linear`: the tiled path on this CPU) and give the greedy tokens of the model whose
weights are the dequantized NF4 weights.

The witness is independent of the code under test: every NF4 weight dequantized here by
`nf4.dequantize`, then the full forward pass re-run on the growing sequence
(`_decoding.greedy_witness`), no KV cache, no quantized projection.
"""

from __future__ import annotations

from pathlib import Path

import jax
import numpy as np
import pytest
from _decoding import greedy_witness

from lmjax import cli, lora, models
from lmjax import params as ptree
from lmjax.config import RunConfig
from lmjax.errors import ConfigError
from lmjax.generate import generate
from lmjax.quant import nf4
from lmjax.quant.params import LINEAR_WEIGHTS, quantize_params
from lmjax.train import loop
from lmjax.train.runs import is_qlora, load_run, write_weights_run

TEXT = "".join(
    f"Sonnet {i}: shall I compare thee to a summer's day, {i % 7}?\n" for i in range(300)
)
CONFIG = """
finetune: {{base: {base}, qlora: true}}
lora: {{r: 4, alpha: 8, targets: all-linear, dropout: 0.0}}
data: {{corpus: {corpus}, tokenizer: char}}
optimizer: {{name: adamw, lr: 0.05, weight_decay: 0.0}}
schedule: {{warmup_steps: 1, decay_steps: 3}}
train: {{steps: 3, batch_size: 4, seq_len: 16, eval_every: 3, eval_batches: 1}}
checkpoint: {{every: 3, keep: 1}}
logging: {{every: 1, progress: false, sample_tokens: 0, plot: false}}
"""
PROMPT, NEW = "So", 8


def _is_nf4(leaf) -> bool:
    return isinstance(leaf, nf4.QuantizedWeight)


def dequantized(params: dict) -> dict:
    """Every NF4 leaf replaced by its float weight; adapters and float leaves as they are."""
    return jax.tree.map(lambda a: nf4.dequantize(a) if _is_nf4(a) else a, params, is_leaf=_is_nf4)


@pytest.fixture(scope="module")
def ws(tmp_path_factory):
    """A char corpus and a weights-only Llama-shaped base (GQA, SwiGLU: every projection kind)
    with in-features of 64, so the GPU kernel (I % 64 == 0) would take every projection."""
    root = tmp_path_factory.mktemp("generate_nf4")
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("XDG_CACHE_HOME", str(root / "cache"))
        (root / "corpus.txt").write_text(TEXT)
        data = {"corpus": str(root / "corpus.txt"), "tokenizer": "char"}
        cfg = RunConfig.from_dict({"model": {"preset": "llama", "vocab_size": None}, "data": data})
        prepared = loop.prepare_data(cfg, progress=False)
        shape = dict(context_length=16, d_model=64, n_heads=4, n_kv_heads=2, n_layers=2, d_ff=128)
        model = models.preset("llama", vocab_size=prepared.vocab_size, **shape)
        params = models.init(jax.random.PRNGKey(0), model)
        write_weights_run(root / "base", params, model, prepared.tokenizer, "char")
        (root / "ft.yaml").write_text(CONFIG.format(base=root / "base", corpus=data["corpus"]))
        yield root


def cli_text(*argv: str, capsys) -> str:
    capsys.readouterr()
    assert cli.main(["generate", *argv, "--prompt", PROMPT, "--max-new-tokens", str(NEW),
                     "--temperature", "0"]) == 0  # fmt: skip
    return capsys.readouterr().out


def test_quantize_nf4_decodes_the_dequantized_model(ws, capsys):
    base = load_run(ws / "base")
    run = load_run(ws / "base", quantize="nf4")
    flat = ptree.flatten(run.params)
    quantized = {name for name, leaf in flat.items() if _is_nf4(leaf)}
    linear = ptree.flatten(ptree.mask(run.params, LINEAR_WEIGHTS))  # by per-layer names
    assert quantized and quantized == {n for n, chosen in linear.items() if chosen}
    witness_params = dequantized(quantize_params(base.params))  # quantized here, independently
    for name in quantized:  # NF4 changed every weight it kept: the check below is not vacuous
        original = np.asarray(ptree.flatten(base.params)[name])
        assert float(np.abs(np.asarray(ptree.flatten(witness_params)[name]) - original).max()) > 0
    prompts = [run.tokenizer.encode(PROMPT), run.tokenizer.encode("Sonnet 1")]
    expected = [greedy_witness(witness_params, p, run.model, NEW) for p in prompts]
    assert generate(run.params, prompts, run.model, max_new_tokens=NEW) == expected
    text = cli_text("--run", str(ws / "base"), "--quantize", "nf4", capsys=capsys)
    assert text == PROMPT + run.tokenizer.decode(expected[0]) + "\n"


@pytest.fixture(scope="module")
def qlora_run(ws):
    out = ws / "qlora"
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("XDG_CACHE_HOME", str(ws / "cache"))
        assert cli.main(["finetune", str(ws / "ft.yaml"), f"run.dir={out}"]) == 0
    return out


@pytest.mark.slow
def test_qlora_run_decodes_its_nf4_base_with_adapters(ws, qlora_run, capsys):
    assert is_qlora(qlora_run) and is_qlora(qlora_run / "checkpoints" / "3")
    assert not is_qlora(ws / "base")
    run = load_run(qlora_run, quantize="nf4")
    flat = ptree.flatten(run.params)
    # 7 projections a block, each stacked over both blocks with its adapter.
    assert sum(_is_nf4(leaf) for leaf in flat.values()) == 7
    assert all(leaf.lead_shape == (2,) for leaf in flat.values() if _is_nf4(leaf))
    assert sum(isinstance(leaf, lora.Adapter) for leaf in flat.values()) == 7
    adapters, lcfg = lora.load_adapters(qlora_run / "adapters.safetensors")
    assert any(np.asarray(b).any() for _, b in lora.adapter_layers(adapters).values())
    frozen = quantize_params(load_run(ws / "base").params)  # the NF4 base, quantized here
    witness_params = lora.attach(dequantized(frozen), adapters, lcfg)
    expected = greedy_witness(witness_params, run.tokenizer.encode(PROMPT), run.model, NEW)
    want = PROMPT + run.tokenizer.decode(expected) + "\n"
    assert cli_text("--run", str(qlora_run), capsys=capsys) == want  # NF4 by default
    # --quantize none decodes the merged float model (the dequantized base plus s B A).
    assert all(not _is_nf4(leaf) for leaf in ptree.flatten(load_run(qlora_run).params).values())
    assert cli_text("--run", str(qlora_run), "--quantize", "none", capsys=capsys) == want


def test_load_run_refuses_an_unknown_quantization(ws):
    with pytest.raises(ConfigError, match="quantize = 'int8'"):
        load_run(Path(ws / "base"), quantize="int8")
