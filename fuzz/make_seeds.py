"""Write fuzz/fixtures (tiny weights and a tokenizer.json the targets read beside the input) and
fuzz/corpus/TARGET/ (each target's seeds). Run once; both are committed:

    JAX_PLATFORMS=cpu python fuzz/make_seeds.py
"""

from __future__ import annotations

import json
import shutil
import sys
import tempfile
from pathlib import Path

import jax
import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

HERE = Path(__file__).parent
ROOT = HERE.parent
sys.path.insert(0, str(ROOT / "tests"))
sys.path.insert(0, str(HERE))
from _llama_run import CHAT_TEMPLATE, tokenizer  # noqa: E402
from targets import gzipped  # noqa: E402

from lmjax import models  # noqa: E402
from lmjax.io import hf, hf_gpt2, hf_llama_config  # noqa: E402
from lmjax.io import safetensors as st  # noqa: E402
from lmjax.tokenizers import BPETokenizer  # noqa: E402

SMALL = dict(vocab_size=8, hidden_size=8, intermediate_size=16, num_hidden_layers=1)
SMALL |= dict(num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=16)
GPT2 = dict(vocab_size=8, n_positions=8, n_embd=8, n_layer=1, n_head=2)
# a chat template reaching for files, the environment or Python internals (fuzz/targets.py's
# canary sits in both a file and an environment variable)
ESCAPES = {
    "probe": "{{ messages[0].__class__ }}",
    "probe_globals": "{{ raise_exception.__globals__['os'].environ }}",
    "probe_include": "{% include 'secret.txt' %}",
    "probe_mro": "{{ ''.__class__.__mro__[1].__subclasses__() }}",
    "probe_format": "{{ '{0.__class__.__init__.__globals__}'.format(namespace) }}",
    "probe_power": "{{ 2 ** 99999999 }}{{ 'x' * 99999999 }}",
}


def _family_configs() -> dict[str, dict]:
    """Each family's fixture config.json (every key transformers writes), at SMALL sizes."""
    fields = ROOT / "tests" / "fixtures" / "hf_fields"
    out = {}
    for family in ("gpt2", "llama", "mistral", "qwen2", "qwen3"):
        config = json.loads((fields / family / "config.json").read_text())
        config |= GPT2 if family == "gpt2" else SMALL
        if "head_dim" in config:
            config["head_dim"] = 4
        if "layer_types" in config:
            config["layer_types"] = ["full_attention"]
        if family == "mistral":
            config["sliding_window"] = 4
        out[family] = config
    return out


def _seed(target: str, name: str, data: bytes) -> None:
    (HERE / "corpus" / target).mkdir(parents=True, exist_ok=True)
    (HERE / "corpus" / target / name).write_bytes(data)


def main() -> None:
    shutil.rmtree(HERE / "corpus", ignore_errors=True)
    (HERE / "fixtures").mkdir(exist_ok=True)
    for family, config in _family_configs().items():
        if family == "gpt2":
            cfg = hf_gpt2.config_from_hf(config)
        else:
            cfg = hf_llama_config.config_from_hf(config, "float32", "config.json")[0]
        with tempfile.TemporaryDirectory() as tmp:
            hf.save(models.init(jax.random.key(0), cfg), cfg, tmp)
            weights = HERE / "fixtures" / f"{family}.safetensors"
            shutil.copy(Path(tmp) / "model.safetensors", weights)
        _seed("config_json", family, json.dumps(config, indent=1).encode())
    _seed("safetensors_header", "gpt2", (HERE / "fixtures" / "gpt2.safetensors").read_bytes())
    with tempfile.TemporaryDirectory() as tmp:
        st.save({"a": np.arange(6, dtype=np.float32).reshape(2, 3)}, Path(tmp) / "s.safetensors")
        _seed("safetensors_header", "small", (Path(tmp) / "s.safetensors").read_bytes())
    tok = tokenizer(chat=True)
    tok.save(str(HERE / "fixtures" / "tokenizer.json"))
    small = tokenizer(chat=False)
    _seed("tokenizer_json", "bytelevel_bpe", small.to_str().encode())
    bpe = BPETokenizer.train(["the cat sat on the mat; the end"], 262)
    with tempfile.TemporaryDirectory() as tmp:
        bpe.save(tmp)
        vocab, merges = (Path(tmp) / n for n in ("vocab.json", "merges.txt"))
        _seed("bpe_files", "trained", vocab.read_bytes() + b"\0" + merges.read_bytes())
    fields = ROOT / "tests" / "fixtures" / "hf_fields" / "tokenizer"
    _seed("tokenizer_config", "chatml", (fields / "tokenizer_config.json").read_bytes())
    for name, escape in ESCAPES.items():  # what the sandbox must stop, for mutations to vary
        probe = {"chat_template": CHAT_TEMPLATE + escape, "eos_token": "<|im_end|>"}
        _seed("tokenizer_config", name, json.dumps(probe).encode())
    _seed("generation_config", "list", (fields / "generation_config.json").read_bytes())
    _seed("generation_config", "int", b'{"eos_token_id": 2, "bos_token_id": 0}')
    tiny = (ROOT / "tests" / "fixtures" / "per_layer_run" / "tiny.yaml").read_bytes()
    _seed("run_config", "tiny", tiny + b"\0train.steps=3\nmodel.n_layers=2")
    _seed("run_config", "plain", b"model: {d_model: 32, n_layers: 2}\ntrain: {steps: 10}\n")
    lines = b'{"text": "hello there"}\n{"text": "a second \\u00e9 record"}\n\n{"other": 1}\n'
    _seed("corpus_txt", "text", "Some text, \u00e9 and \U0001f98a.\n".encode())
    _seed("corpus_jsonl", "records", lines)
    _seed("corpus_jsonl_gz", "records", gzipped(lines))
    with tempfile.TemporaryDirectory() as tmp:
        table = pa.table({"text": ["one", "two", None, ""], "n": [1, 2, 3, 4]})
        pq.write_table(table, Path(tmp) / "c.parquet")
        _seed("corpus_parquet", "table", (Path(tmp) / "c.parquet").read_bytes())


if __name__ == "__main__":
    main()
