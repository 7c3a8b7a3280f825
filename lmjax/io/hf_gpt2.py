"""Hugging Face GPT-2 checkpoints <-> lmjax's `gpt2` preset (docs/interop.md).

    load(path, dtype="float32", n_heads=None) -> (params, cfg)
        path: a directory with config.json and model.safetensors (or a sharded
        model.safetensors.index.json), or one .safetensors file (config.json beside it is used;
        without one, pass n_heads)
    save(params, cfg, out_dir)
        writes config.json + model.safetensors that transformers' GPT2LMHeadModel loads

The mapping, for block i (D = d_model; HF's Conv1D stores its weight [in, out], lmjax's linear
[out, in], so every projection is transposed):

    wte.weight [V,D]                -> token_embedding.weight           (lm_head is tied to it)
    wpe.weight [C,D]                -> position_embedding.weight
    h.i.ln_1.{weight,bias}          -> blocks.i.attention_norm.{scale,bias}
    h.i.attn.c_attn.weight [D,3D]   -> blocks.i.attention.{query,key,value}.weight
                                       = W[:, jD:(j+1)D]^T  (j = 0, 1, 2)
    h.i.attn.c_attn.bias [3D]       -> blocks.i.attention.{query,key,value}.bias = b[jD:(j+1)D]
    h.i.attn.c_proj.{weight,bias}   -> blocks.i.attention.output        (weight^T)
    h.i.ln_2.{weight,bias}          -> blocks.i.feed_forward_norm.{scale,bias}
    h.i.mlp.c_fc.{weight,bias}      -> blocks.i.feed_forward.expand     (weight^T)
    h.i.mlp.c_proj.{weight,bias}    -> blocks.i.feed_forward.project    (weight^T)
    ln_f.{weight,bias}              -> final_norm.{scale,bias}

`blocks.i.…` are the per-layer names; the model stores its blocks stacked (`[N, ...]` leaves,
`lmjax.params`), so `load` stacks the layers after the mapping and `save` unstacks them before
it (`hf_files.stacked_params`, `hf_files.per_layer_flat`).

Keys may carry the `transformer.` prefix (what `save_pretrained` writes) or not (the hub's
original `gpt2` files). `h.i.attn.bias` / `h.i.attn.masked_bias` are causal-mask buffers, not
parameters, and are ignored. A `lm_head.weight`, if present, must equal `wte.weight`. Every
other difference (a missing, unknown or mis-shaped key, a config lmjax cannot express) raises
an `lmjax.errors` error that names all of them.
"""

from __future__ import annotations

import json
import os
import re
from pathlib import Path

import numpy as np

from lmjax import params as ptree
from lmjax.checks import is_int, is_real, require
from lmjax.errors import CheckpointError, ConfigError, FileFormatError
from lmjax.files import atomic_write_text
from lmjax.io import hf_files
from lmjax.io import safetensors as st
from lmjax.models import ModelConfig, check_params

_ACTIVATIONS = {"gelu_new": "gelu_tanh", "gelu_pytorch_tanh": "gelu_tanh", "gelu": "gelu"}
_ACTIVATIONS |= {"relu": "relu"}
_TO_HF_ACTIVATION = {"gelu_tanh": "gelu_new", "gelu": "gelu", "relu": "relu"}
_BUFFER = re.compile(r"h\.\d+\.attn\.(bias|masked_bias)")
_FIX_CKPT = "point at a Hugging Face GPT-2 checkpoint (GPT2LMHeadModel.save_pretrained output)"


# ---- configs ---------------------------------------------------------------------------------


_SIZES = ("vocab_size", "n_positions", "n_embd", "n_head", "n_layer")
# lmjax's field -> config.json's key, for the errors of ModelConfig's own checks.
KEYS = dict(vocab_size="vocab_size", context_length="n_positions", d_model="n_embd")
KEYS |= dict(n_heads="n_head", n_layers="n_layer", d_ff="n_inner", eps="layer_norm_epsilon")
KEYS |= dict(d_head="n_embd / n_head")


def _check_numbers(hf: dict, where: str) -> None:
    """Sizes are ints >= 1 (n_inner one or null), layer_norm_epsilon a number, when present."""
    for key in (*_SIZES, "n_inner"):
        value = hf.get(key)
        ok = key not in hf or (is_int(value) and value >= 1) or (key == "n_inner" and value is None)
        kind = "an int >= 1 or null" if key == "n_inner" else "an int >= 1"
        require(ok, f"{where} {key}", value, kind, _FIX_CKPT)
    eps = hf.get("layer_norm_epsilon", 1e-5)
    require(is_real(eps), f"{where} layer_norm_epsilon", eps, "a number (GPT-2: 1e-05)", _FIX_CKPT)


def config_from_hf(hf: dict, dtype: str = "float32", where: str = "config.json") -> ModelConfig:
    """The lmjax config of a GPT-2 `config.json` dict; unsupported options raise ConfigError.

    `where` names the file in error messages.
    """
    if not isinstance(hf, dict):
        raise FileFormatError.describe(
            f"{where} top level", type(hf).__name__, "a JSON object", _FIX_CKPT
        )
    if hf.get("model_type", "gpt2") != "gpt2":
        raise ConfigError.describe(f"{where} model_type", hf.get("model_type"), "'gpt2'", _FIX_CKPT)
    unsupported = {
        "activation_function": (hf.get("activation_function", "gelu_new"), tuple(_ACTIVATIONS)),
        "tie_word_embeddings": (hf.get("tie_word_embeddings", True), (True,)),
        "scale_attn_weights": (hf.get("scale_attn_weights", True), (True,)),
        "scale_attn_by_inverse_layer_idx": (
            hf.get("scale_attn_by_inverse_layer_idx", False),
            (False,),
        ),
        "add_cross_attention": (hf.get("add_cross_attention", False), (False,)),
    }
    missing = [k for k in _SIZES if k not in hf]
    if missing:
        # config.json without model_type is read as GPT-2's (the hub's original gpt2 has none)
        implied = "" if "model_type" in hf else " (no model_type: read as gpt2's config)"
        raise ConfigError.describe(f"{where} keys", missing, f"present{implied}", _FIX_CKPT)
    _check_numbers(hf, where)
    for key, (value, allowed) in unsupported.items():
        expected = f"one of {allowed} (what lmjax's gpt2 expresses)"
        fix = "convert the model to a plain GPT-2 first"
        require(value in allowed, f"{where} {key}", value, expected, fix)
    d = hf["n_embd"]
    fields = dict(
        vocab_size=hf["vocab_size"],
        context_length=hf["n_positions"],
        d_model=d,
        n_heads=hf["n_head"],
        n_layers=hf["n_layer"],
        d_ff=4 * d if hf.get("n_inner") is None else hf["n_inner"],
        activation=_ACTIVATIONS[hf.get("activation_function", "gelu_new")],
        eps=float(hf.get("layer_norm_epsilon", 1e-5)),
        param_dtype=dtype,
    )
    return hf_files.model_config("gpt2", fields, KEYS, where)


def config_to_hf(cfg: ModelConfig) -> dict:
    """`config.json` contents for `cfg`; raises ConfigError if GPT-2 cannot express it."""
    needs = dict(norm="layernorm", positions="learned", bias=True, tie_embeddings=True)
    for key, value in needs.items():
        ok = getattr(cfg, key) == value
        fix = "export only gpt2-preset models"
        require(ok, f"model.{key}", getattr(cfg, key), f"{value!r} for a GPT-2 export", fix)
    if cfg.activation not in _TO_HF_ACTIVATION:
        raise ConfigError.describe(
            "model.activation", cfg.activation, f"one of {tuple(_TO_HF_ACTIVATION)}", "use gpt2"
        )
    eos = 50256 if cfg.vocab_size == 50257 else None  # GPT-2's <|endoftext|>; none otherwise
    return {
        "architectures": ["GPT2LMHeadModel"],
        "model_type": "gpt2",
        "vocab_size": cfg.vocab_size,
        "n_positions": cfg.context_length,
        "n_embd": cfg.d_model,
        "n_layer": cfg.n_layers,
        "n_head": cfg.n_heads,
        "n_inner": cfg.d_ff,
        "activation_function": _TO_HF_ACTIVATION[cfg.activation],
        "layer_norm_epsilon": cfg.eps,
        "resid_pdrop": cfg.dropout,
        "embd_pdrop": cfg.dropout,
        "attn_pdrop": cfg.dropout,
        "tie_word_embeddings": True,
        "bos_token_id": eos,
        "eos_token_id": eos,
        "dtype": cfg.param_dtype,
    }


# ---- names and shapes ------------------------------------------------------------------------


def hf_shapes(cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Every parameter of the HF GPT-2 state dict (without prefix, lm_head or buffers)."""
    v, c, d, f = cfg.vocab_size, cfg.context_length, cfg.d_model, cfg.d_ff
    shapes = {"wte.weight": (v, d), "wpe.weight": (c, d)}
    for i in range(cfg.n_layers):
        h = f"h.{i}"
        shapes |= {f"{h}.ln_1.weight": (d,), f"{h}.ln_1.bias": (d,)}
        shapes |= {f"{h}.attn.c_attn.weight": (d, 3 * d), f"{h}.attn.c_attn.bias": (3 * d,)}
        shapes |= {f"{h}.attn.c_proj.weight": (d, d), f"{h}.attn.c_proj.bias": (d,)}
        shapes |= {f"{h}.ln_2.weight": (d,), f"{h}.ln_2.bias": (d,)}
        shapes |= {f"{h}.mlp.c_fc.weight": (d, f), f"{h}.mlp.c_fc.bias": (f,)}
        shapes |= {f"{h}.mlp.c_proj.weight": (f, d), f"{h}.mlp.c_proj.bias": (d,)}
    return shapes | {"ln_f.weight": (d,), "ln_f.bias": (d,)}


_NORMS = {"ln_1": "attention_norm", "ln_2": "feed_forward_norm"}
_LINEARS = {"attn.c_proj": "attention.output", "mlp.c_fc": "feed_forward.expand"}
_LINEARS |= {"mlp.c_proj": "feed_forward.project"}
_QKV = ("query", "key", "value")


_TOP = (
    ("wte.weight", "token_embedding.weight", False),
    ("wpe.weight", "position_embedding.weight", False),
    ("ln_f.weight", "final_norm.scale", False),
    ("ln_f.bias", "final_norm.bias", False),
)


def _block_names(i: int) -> list[tuple[str, str, bool]]:
    """(HF name, lmjax name, transposed) of block i's tensors, all but the fused c_attn.

    HF's Conv1D stores a linear weight as [in, out], lmjax as [out, in]: those are transposed.
    """
    h, b = f"h.{i}", f"blocks.{i}"
    names = []
    for hf, ours in _NORMS.items():
        names += [(f"{h}.{hf}.weight", f"{b}.{ours}.scale", False)]
        names += [(f"{h}.{hf}.bias", f"{b}.{ours}.bias", False)]
    for hf, ours in _LINEARS.items():
        names += [(f"{h}.{hf}.weight", f"{b}.{ours}.weight", True)]
        names += [(f"{h}.{hf}.bias", f"{b}.{ours}.bias", False)]
    return names


def _renamed(tensors: dict, names, *, to_lmjax: bool) -> dict[str, np.ndarray]:
    """The tensors `names` lists, under their lmjax names (`to_lmjax`) or their HF ones."""
    out = {}
    for hf, ours, transposed in names:
        a = tensors[hf] if to_lmjax else tensors[ours]
        out[ours if to_lmjax else hf] = a.T if transposed else a
    return out


def to_lmjax(state: dict[str, np.ndarray], cfg: ModelConfig) -> dict[str, np.ndarray]:
    """HF state (names as in `hf_shapes`) -> flat lmjax names (docs/models.md), as numpy.

    c_attn's fused [D, 3D] weight (and [3D] bias) splits into query, key and value.
    """
    d = cfg.d_model
    flat = _renamed(state, _TOP, to_lmjax=True)
    for i in range(cfg.n_layers):
        flat |= _renamed(state, _block_names(i), to_lmjax=True)
        h, b = f"h.{i}", f"blocks.{i}"
        w_DE, b_E = state[f"{h}.attn.c_attn.weight"], state[f"{h}.attn.c_attn.bias"]
        for j, proj in enumerate(_QKV):
            flat[f"{b}.attention.{proj}.weight"] = w_DE[:, j * d : (j + 1) * d].T
            flat[f"{b}.attention.{proj}.bias"] = b_E[j * d : (j + 1) * d]
    return {name: np.ascontiguousarray(a) for name, a in flat.items()}


def to_hf(flat: dict[str, np.ndarray], cfg: ModelConfig) -> dict[str, np.ndarray]:
    """Flat lmjax names -> HF state names (without prefix); the inverse of `to_lmjax`."""
    state = _renamed(flat, _TOP, to_lmjax=False)
    for i in range(cfg.n_layers):
        state |= _renamed(flat, _block_names(i), to_lmjax=False)
        h, b = f"h.{i}", f"blocks.{i}"
        attn = [f"{b}.attention.{proj}" for proj in _QKV]
        state[f"{h}.attn.c_attn.weight"] = np.concatenate([flat[f"{a}.weight"].T for a in attn], 1)
        state[f"{h}.attn.c_attn.bias"] = np.concatenate([flat[f"{a}.bias"] for a in attn], 0)
    return {name: np.ascontiguousarray(a) for name, a in state.items()}


# ---- files -----------------------------------------------------------------------------------


def _rename(key: str) -> str | None:
    """The name of a stored key: without `transformer.`; None for a causal-mask buffer."""
    name = key.removeprefix("transformer.")
    return None if _BUFFER.fullmatch(name) else name


def _infer_config(shapes: dict[str, tuple], n_heads: int | None, where: Path) -> dict:
    if n_heads is None:  # import-hf never passes one: the file it lacks is what to name
        folder = where if where.is_dir() else where.parent
        raise CheckpointError.describe(
            f"{folder / 'config.json'}",
            "missing",
            "the config.json saved with these weights (model_type, head counts, sizes: "
            "the weights alone do not say them)",
            "copy the checkpoint's config.json beside its weights (save_pretrained writes it), "
            "or import the complete directory or model id (in Python, GPT-2 weights alone "
            "load with hf_gpt2.load(path, n_heads=...))",
        )
    need = ("wte.weight", "wpe.weight", "h.0.mlp.c_fc.weight")
    missing = [k for k in need if k not in shapes]
    if missing:
        raise CheckpointError.describe(f"{where}: keys", missing, "present", _FIX_CKPT)
    bad = {k: shapes[k] for k in need if len(shapes[k]) != 2}
    if bad:
        raise CheckpointError.describe(f"{where}: shapes", bad, "2-d matrices", _FIX_CKPT)
    # Counted, not max(index) + 1: a name like h.99999999999.x must not set the size of anything
    # (`hf_files.check_layers` then requires exactly h.0 .. h.{n-1}).
    layers = {k.split(".", 2)[1] for k in shapes if re.fullmatch(r"h\.\d+\..*", k)}
    return {
        "vocab_size": shapes["wte.weight"][0],
        "n_embd": shapes["wte.weight"][1],
        "n_positions": shapes["wpe.weight"][0],
        "n_inner": shapes["h.0.mlp.c_fc.weight"][1],
        "n_layer": len(layers),
        "n_head": n_heads,
    }


def _check_shapes(shapes: dict[str, tuple], cfg: ModelConfig, where: Path) -> None:
    """Every GPT-2 key present with its shape, nothing else (a tied lm_head aside)."""
    want = {k: (None, shape) for k, shape in hf_shapes(cfg).items()}
    if "lm_head.weight" in shapes:
        want["lm_head.weight"] = (None, want["wte.weight"][1])
    st.report_mismatches(
        where,
        {k: (None, shape) for k, shape in shapes.items()},
        want,
        f"the GPT-2 state dict of config.json (vocab_size {cfg.vocab_size}, n_positions "
        f"{cfg.context_length}, n_embd {cfg.d_model}, n_inner {cfg.d_ff})",
        _FIX_CKPT,
        unexpected="not a GPT-2 key:",
    )


def check_tokenizer(tokenizer, cfg: ModelConfig, where: str | os.PathLike) -> None:
    """Refuse a tokenizer (found beside a checkpoint) that can produce ids the model lacks."""
    if tokenizer.vocab_size > cfg.vocab_size:
        raise FileFormatError.describe(
            f"{where}: tokenizer vocabulary",
            f"{tokenizer.vocab_size} tokens",
            f"at most the model's vocab_size ({cfg.vocab_size}): every id it encodes must exist",
            "put the tokenizer saved with this checkpoint (tokenizer.json, or vocab.json and "
            "merges.txt) beside it; one with fewer ids than the model's rows is fine",
        )


def load(
    path: str | os.PathLike, dtype: str = "float32", n_heads: int | None = None
) -> tuple[dict, ModelConfig]:
    """`(params, cfg)` of a Hugging Face GPT-2 checkpoint; tensors are cast to `dtype`."""
    path = Path(path)
    files, config_path = hf_files.weight_files(path)
    entries = hf_files.read_headers(files, _rename)
    shapes = {name: shape for name, (_, _, _, shape) in entries.items()}
    if config_path is not None:
        cfg = config_from_hf(hf_files.read_json(config_path), dtype, where=str(config_path))
    else:
        cfg = config_from_hf(_infer_config(shapes, n_heads, path), dtype, where=str(path))
    # Before the expected names are listed (12 per configured layer).
    hf_files.check_layers(shapes, cfg.n_layers, "h.", "n_layer", path)
    _check_shapes(shapes, cfg, path)  # before any tensor is read
    state = hf_files.read_state(entries)
    hf_files.check_finite(state, path)
    hf_files.check_tied(state, "lm_head.weight", "wte.weight", path)
    params = hf_files.stacked_params(to_lmjax(state, cfg), dtype)
    check_params(params, cfg)
    return params, cfg


def save(params: dict, cfg: ModelConfig, out_dir: str | os.PathLike) -> None:
    """Write `out_dir/config.json` and `out_dir/model.safetensors` (keys `transformer.*`,
    no lm_head: it is tied) so that `GPT2LMHeadModel.from_pretrained(out_dir)` loads them."""
    hf = config_to_hf(cfg)
    hf_files.check_export_dtypes(params, cfg)
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    state = {f"transformer.{k}": a for k, a in to_hf(hf_files.per_layer_flat(params), cfg).items()}
    st.save(ptree.unflatten(state), out_dir / "model.safetensors", metadata={"format": "pt"})
    atomic_write_text(out_dir / "config.json", json.dumps(hf, indent=2) + "\n")


__all__ = [
    "check_tokenizer",
    "config_from_hf",
    "config_to_hf",
    "hf_shapes",
    "load",
    "save",
    "to_hf",
    "to_lmjax",
]
