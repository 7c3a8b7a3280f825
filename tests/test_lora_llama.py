"""LoRA and QLoRA over a Llama-family model (SPEC section 6, issue 23) against peft.

A tiny random `transformers` LlamaForCausalLM (grouped-query attention: 4 heads, 2 key/value
heads, so key/value are [Hkv*Dh, D] = [32, 64]; untied head) is saved offline and loaded with
`lmjax.io.hf.load`. peft wraps it (`get_peft_model` with `target_modules` as peft spells them:
the attention projections, the MLP projections, or "all-linear"); every lora_A and lora_B is
redrawn at random (B nonzero, so the adapters change the logits), and the same tensors are
copied into lmjax's adapter tree under lmjax's names (`targets=` the same peft names).

Checked (float32, logits within `_atol`: a derived bound on either side's rounding, any CPU):
- lmjax's attached model gives peft's logits;
- `lora.merge` + `io.hf.save` loads in transformers with lmjax's merged logits, and those
  equal peft's `merge_and_unload`;
- QLoRA: the same adapters over the NF4 base (`quantize_params`) give the logits of lmjax's
  LoRA model over the dequantized base, and of peft over a transformers model holding
  bitsandbytes' dequantization of the same NF4 codes (the outside witness of the weights).
  Every input width is >= 64 (D = 64): bitsandbytes 0.50's CPU dequantize_4bit reads weights
  narrower than its 64-weight block wrongly (tests/_bnb.py).

And `lmjax import-hf` of such a model (with a tokenizer.json) -> `lmjax finetune --qlora --lora
targets=all-linear` -> `lmjax export-hf`: the loss goes down and transformers loads the export
with lmjax's merged logits. `lmjax inspect PRESET --qlora --lora ...` of the four Llama-family
presets prints adapter counts equal to hand counts from the published shapes, without allocating.

Cost: about 60 s CPU (~150 s wall on the loaded 2 cores): 3 target sets, one jit of each
adapted tree (~30 s); the CLI run ~15 s; the inspect subprocess ~10 s.
"""

from __future__ import annotations

import copy
import json
import re
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import peft
import pytest
import torch
import transformers
from _bnb import bnb_dequantized
from _llama_run import finetune_config, imported_run

from lmjax import cli, lora, models, testing
from lmjax import params as ptree
from lmjax.io import hf
from lmjax.quant import nf4
from lmjax.quant.params import quantize_params
from lmjax.train.runs import load_run

V, R, ALPHA = 96, 4, 8
TOKENS = np.random.default_rng(0).integers(0, V, (2, 12))
TARGET_SETS = {
    "attention": ["q_proj", "k_proj", "v_proj", "o_proj"],
    "mlp": ["gate_proj", "up_proj", "down_proj"],
    "all-linear": "all-linear",
}
# peft module name suffix -> lmjax layer name (the test's own table, not lmjax's aliases)
HF_TO_LMJAX = {
    "self_attn.q_proj": "attention.query",
    "self_attn.k_proj": "attention.key",
    "self_attn.v_proj": "attention.value",
    "self_attn.o_proj": "attention.output",
    "mlp.gate_proj": "feed_forward.gate",
    "mlp.up_proj": "feed_forward.up",
    "mlp.down_proj": "feed_forward.down",
}
forward = jax.jit(models.forward, static_argnums=2)


def _atol(cfg, reference) -> float:
    """Float32 rounding of either side of a logits comparison, derived (lmjax.testing's
    `logits_atol`): the adapters add x A then B, r more, on the 4 linears of a block's path; a
    merged W + s B A is one rounding more."""
    return testing.logits_atol(cfg, reference, extra=4 * R + 4)


@pytest.fixture(scope="module")
def base(tmp_path_factory):
    """(transformers model, lmjax params, lmjax cfg) of one tiny GQA Llama with an untied head."""
    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        vocab_size=V, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=32,
        initializer_range=0.1, tie_word_embeddings=False, bos_token_id=None,
        eos_token_id=None, pad_token_id=None,
    )  # fmt: skip
    model = transformers.LlamaForCausalLM(config).eval()
    directory = tmp_path_factory.mktemp("llama")
    model.save_pretrained(directory)
    params, cfg = hf.load(directory)
    assert (cfg.kv_heads, cfg.tie_embeddings) == (2, False)
    return model, params, cfg


def _peft_model(model, targets):
    """peft over a copy of `model`, every lora_A / lora_B redrawn (B nonzero)."""
    lcfg = peft.LoraConfig(r=R, lora_alpha=ALPHA, target_modules=targets, lora_dropout=0.0)
    wrapped = peft.get_peft_model(copy.deepcopy(model), lcfg).eval()
    gen = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for name, param in wrapped.named_parameters():
            if "lora_" in name:
                param.copy_(torch.randn(param.shape, generator=gen) * 0.1)
    return wrapped


def _adapters_of(wrapped) -> dict:
    """peft's lora_A [r, in] / lora_B [out, r] under lmjax's adapter names."""
    flat = {}
    for name, module in wrapped.named_modules():
        found = re.search(r"layers\.(\d+)\.(\w+\.\w+)$", name)
        if found and hasattr(module, "lora_A"):
            layer = f"blocks.{found[1]}.{HF_TO_LMJAX[found[2]]}"
            flat[f"{layer}.lora_a"] = jnp.asarray(module.lora_A["default"].weight.detach().numpy())
            flat[f"{layer}.lora_b"] = jnp.asarray(module.lora_B["default"].weight.detach().numpy())
    return ptree.unflatten(flat)


def _torch_logits(model) -> np.ndarray:
    with torch.no_grad():
        return model(torch.tensor(TOKENS)).logits.numpy()


def _lmjax_logits(params, cfg) -> np.ndarray:
    return np.asarray(forward(params, jnp.asarray(TOKENS), cfg))


@pytest.fixture(scope="module", params=sorted(TARGET_SETS))
def adapted(request, base):
    """(peft model, lmjax adapters, lmjax LoraConfig) for one target set."""
    model, params, _ = base
    targets = TARGET_SETS[request.param]
    wrapped = _peft_model(model, targets)
    adapters = _adapters_of(wrapped)
    spec = "|".join(targets) if isinstance(targets, list) else targets
    lcfg = lora.LoraConfig.parse(f"r={R},alpha={ALPHA},targets={spec}")
    # lmjax's aliases select exactly the layers peft adapted (GQA shapes included).
    assert lora.target_layers(params, lcfg) == {
        name: (out, inp) for name, (out, inp, _) in lora.adapter_shapes(adapters).items()
    }
    return wrapped, adapters, lcfg


def test_peft_names_select_the_llama_projections(base):
    _, _, cfg = base
    lcfg = lora.LoraConfig(r=2, targets=("k_proj", "down_proj"))
    chosen = lora.target_layers(cfg, lcfg)
    # key: [Hkv * Dh, D] = [2 * 16, 64]; down: [D, d_ff] = [64, 128]
    assert chosen == {
        "blocks.0.attention.key": (32, 64),
        "blocks.0.feed_forward.down": (64, 128),
        "blocks.1.attention.key": (32, 64),
        "blocks.1.feed_forward.down": (64, 128),
    }
    shapes = lora.adapter_shapes(lora.init(jax.random.PRNGKey(0), cfg, lcfg))
    assert shapes["blocks.1.attention.key"] == (32, 64, 2)


def test_logits_equal_peft(base, adapted):
    model, params, cfg = base
    wrapped, adapters, lcfg = adapted
    ours = _lmjax_logits(lora.attach(params, adapters, lcfg), cfg)
    plain = _lmjax_logits(params, cfg)
    assert np.abs(ours - plain).max() > 1e-2  # the adapters matter
    theirs = _torch_logits(wrapped)
    np.testing.assert_allclose(ours, theirs, atol=_atol(cfg, theirs), rtol=0)


def test_merged_export_loads_in_transformers(base, adapted, tmp_path):
    _, params, cfg = base
    wrapped, adapters, lcfg = adapted
    merged = lora.merge(params, adapters, lcfg)
    ours = _lmjax_logits(merged, cfg)
    hf.save(merged, cfg, tmp_path)
    loaded = transformers.AutoModelForCausalLM.from_pretrained(tmp_path).eval()
    np.testing.assert_allclose(_torch_logits(loaded), ours, atol=_atol(cfg, ours), rtol=0)
    peft_merged = copy.deepcopy(wrapped).merge_and_unload()
    np.testing.assert_allclose(_torch_logits(peft_merged), ours, atol=_atol(cfg, ours), rtol=0)


def _with_weights(model, weights: dict[str, torch.Tensor]):
    """A copy of the transformers model with `{lmjax layer name: weight}` put in place."""
    out = copy.deepcopy(model)
    lmjax_to_hf = {v: k for k, v in HF_TO_LMJAX.items()}
    with torch.no_grad():
        for name, weight in weights.items():
            _, i, part, proj = name.split(".")
            module = out.get_submodule(f"model.layers.{i}.{lmjax_to_hf[f'{part}.{proj}']}")
            module.weight.copy_(weight)
    return out


def layer_of(qw, i: int):
    """Layer i of a stacked NF4 weight (what the scan over the blocks hands the kernel)."""
    return jax.tree.map(lambda a: a[i], qw)


def test_qlora_equals_lora_over_the_dequantized_base(base, adapted):
    model, params, cfg = base
    _, adapters, lcfg = adapted
    frozen = quantize_params(params)
    flat = ptree.flatten(frozen)
    quantized = {k: v for k, v in flat.items() if isinstance(v, nf4.QuantizedWeight)}
    # every projection is NF4, stacked over both blocks (each layer quantized on its own)
    assert len(quantized) == 7 and all(v.lead_shape == (2,) for v in quantized.values())
    dense = ptree.unflatten(
        {k: nf4.dequantize(v) if k in quantized else v for k, v in flat.items()}
    )
    ours = _lmjax_logits(lora.attach(frozen, adapters, lcfg), cfg)
    dense_logits = _lmjax_logits(lora.attach(dense, adapters, lcfg), cfg)
    np.testing.assert_allclose(ours, dense_logits, atol=_atol(cfg, dense_logits), rtol=0)
    # The outside witness: peft over bitsandbytes' reading of the same NF4 bytes.
    witness = {  # per layer: layer i of a stacked NF4 weight is a QuantizedWeight of its own
        layer.removesuffix(".weight"): torch.from_numpy(bnb_dequantized(layer_of(v, i)))
        for k, v in quantized.items()
        for i, layer in enumerate(ptree.layer_names(k, v.lead_shape[0]))
    }
    wrapped = _peft_model(_with_weights(model, witness), TARGET_SETS["all-linear"])
    lcfg_all = lora.LoraConfig(r=R, alpha=ALPHA, targets=("all-linear",))
    expected = _torch_logits(wrapped)
    got = _lmjax_logits(lora.attach(frozen, _adapters_of(wrapped), lcfg_all), cfg)
    np.testing.assert_allclose(got, expected, atol=_atol(cfg, expected), rtol=0)


# ---- lmjax finetune of an imported Llama run -----------------------------------------------------


def test_cli_qlora_finetune_of_an_imported_llama_exports(tmp_path, monkeypatch):
    """import-hf -> finetune --qlora --lora targets=all-linear (over the config's q_proj|v_proj)
    -> export-hf of the run: the loss goes down; transformers loads the export with the logits
    of lmjax's merged model; every linear layer was adapted (all-linear)."""
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    base = imported_run(tmp_path)
    finetune_config(tmp_path, "lora: {r: 4, alpha: 8, targets: [q_proj, v_proj]}")
    out = tmp_path / "out"
    args = [
        "finetune",
        str(tmp_path / "ft.yaml"),
        f"run.dir={out}",
        "train.steps=16",
        "schedule.decay_steps=16",
        "--qlora",
    ]
    assert cli.main([*args, "--lora", "targets=all-linear"]) == 0
    losses = [json.loads(line)["loss"] for line in open(out / "metrics.jsonl") if '"loss"' in line]
    assert len(losses) == 16 and max(losses[-4:]) < losses[0] - 0.4, losses
    adapters, lcfg = lora.load_adapters(out / "adapters.safetensors")
    assert len(lora.adapter_layers(adapters)) == 2 * 7 and lcfg.targets == ("all-linear",)
    assert cli.main(["export-hf", str(out), "--out", str(tmp_path / "export")]) == 0
    merged = load_run(out / "merged")
    loaded = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "export").eval()
    ours = _lmjax_logits(merged.params, merged.model)
    atol = _atol(merged.model, ours)
    np.testing.assert_allclose(_torch_logits(loaded), ours, atol=atol, rtol=0)
    base_logits = _lmjax_logits(load_run(base).params, merged.model)
    assert np.abs(ours - base_logits).max() > 1e-2  # the export is the fine-tuned model


# ---- lmjax inspect --qlora --lora of the Llama-family presets ------------------------------------

# (layers, d_model, heads, kv heads, head dim, d_ff) as the checkpoints' config.json publish them
PUBLISHED = {
    "smollm2-135m": (30, 576, 9, 3, 64, 1536),
    "llama-3.2-1b": (16, 2048, 32, 8, 64, 8192),
    "qwen2.5-0.5b": (24, 896, 14, 2, 64, 4864),
    "qwen3-0.6b": (28, 1024, 16, 8, 128, 3072),
}
INSPECT = """
import contextlib, io, json, sys
from lmjax import cli
out = {}
for preset, lora in json.loads(sys.argv[1]):
    text = io.StringIO()
    with contextlib.redirect_stdout(text):
        assert cli.main(["inspect", preset, "--qlora", "--lora", lora]) == 0
    out[preset + " " + lora] = text.getvalue()
# VmHWM: this process's own peak (ru_maxrss would include the parent's, kept across exec)
status = open("/proc/self/status").read()
out["peak_rss_kb"] = int(status.split("VmHWM:")[1].split()[0])
print(json.dumps(out))
"""


def _hand_count(preset: str, targets: str, r: int = 8) -> int:
    """r (in + out) per adapted layer, from the published shapes (GQA: k, v out = Hkv Dh)."""
    layers, d, h, hkv, dh, ff = PUBLISHED[preset]
    shapes = {"q": (d, h * dh), "k": (d, hkv * dh), "v": (d, hkv * dh), "o": (h * dh, d)}
    shapes |= {"gate": (d, ff), "up": (d, ff), "down": (ff, d)}
    chosen = (
        shapes if targets == "all-linear" else [t.removesuffix("_proj") for t in targets.split("|")]
    )
    return layers * sum(r * sum(shapes[name]) for name in chosen)


def test_inspect_presets_print_the_qlora_memory_without_allocating():
    """One subprocess inspects every new preset (q_proj|v_proj, and all-linear for SmolLM2):
    the adapter count equals the hand count from the published shapes, and the process never
    held a model (llama-3.2-1b's float32 weights alone are 4.9 GB; the peak stays under 1 GB)."""
    runs = [(p, "r=8,targets=q_proj|v_proj") for p in PUBLISHED]
    runs.append(("smollm2-135m", "r=8,targets=all-linear"))
    done = subprocess.run(
        [sys.executable, "-c", INSPECT, json.dumps(runs)],
        capture_output=True, text=True, check=True, timeout=300,
    )  # fmt: skip
    out = json.loads(done.stdout.strip().splitlines()[-1])
    for preset, spec in runs:
        text = out[f"{preset} {spec}"]
        found = re.search(r"adapters, trainable \(([\d,]+) params\)", text)
        assert found, text
        assert int(found[1].replace(",", "")) == _hand_count(preset, spec.split("targets=")[1])
        assert "QLoRA (NF4 base)" in text and "NF4:" in text and "4.127 bits" in text
    assert out["peak_rss_kb"] < 1_000_000, out["peak_rss_kb"]
