"""config.json of the Llama family (llama, mistral, qwen2, qwen3) <-> `ModelConfig`.

    config_from_hf(hf, dtype, where) -> (cfg, layout)    import: every field that changes the
                                                         maths is mapped or refused by name
    config_to_hf(cfg, layout) -> dict                    export, for layout.family

Field by field (HF -> lmjax): hidden_size D, intermediate_size F, num_attention_heads H,
num_key_value_heads Hkv (n_kv_heads), head_dim Dh (explicit only when != D / H),
num_hidden_layers N, vocab_size V, max_position_embeddings C, rms_norm_eps eps, rope_theta and
rope scaling (transformers 5's `rope_parameters` or the older `rope_theta` + `rope_scaling`; types
default, linear, llama3), tie_word_embeddings, sliding_window (mistral; qwen2/qwen3 only with
use_sliding_window and the same window on every layer). Biases: llama and qwen3's
`attention_bias` puts one on q, k, v and o; llama's `mlp_bias` on gate/up/down; qwen2 always has
q, k, v biases and no other. lmjax's `bias` covers o, the MLP and an untied head together, so a
family bias lmjax has and the checkpoint lacks loads as zeros (exact), and export writes a zero
where the family needs one lmjax lacks; a nonzero one no family holds is refused.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from lmjax.checks import is_finite_real, is_int
from lmjax.errors import ConfigError, FileFormatError
from lmjax.io.hf_files import model_config
from lmjax.models import ModelConfig

FAMILIES = ("llama", "mistral", "qwen2", "qwen3")
ARCHITECTURES = {
    "llama": "LlamaForCausalLM",
    "mistral": "MistralForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
}
_FIX = "convert the checkpoint to a plain llama/mistral/qwen2/qwen3 one, or train it in lmjax"
_SIZES = ("hidden_size", "intermediate_size", "num_attention_heads", "num_hidden_layers")
_SIZES += ("vocab_size", "max_position_embeddings")
# Fields some transformers config classes carry that change the maths when not at this value.
_MUST_BE = {
    "hidden_act": "silu",
    "partial_rotary_factor": 1.0,
    "attn_logit_softcapping": None,
    "final_logit_softcapping": None,
    "quantization_config": None,
}
# lmjax's field -> config.json's key, for the errors of ModelConfig's own checks.
KEYS = dict(vocab_size="vocab_size", context_length="max_position_embeddings")
KEYS |= dict(d_model="hidden_size", n_heads="num_attention_heads", d_ff="intermediate_size")
KEYS |= dict(n_kv_heads="num_key_value_heads", head_dim="head_dim", d_head="head_dim")
KEYS |= dict(n_layers="num_hidden_layers", eps="rms_norm_eps", sliding_window="sliding_window")
KEYS |= dict(rope_theta="rope_theta", rope_factor="factor", rope_low_freq_factor="low_freq_factor")
KEYS |= dict(rope_high_freq_factor="high_freq_factor")
KEYS |= dict(rope_original_context="original_max_position_embeddings")
_ROPE_KEYS = {
    "none": {"rope_type", "type", "rope_theta"},
    "linear": {"rope_type", "type", "rope_theta", "factor"},
    "llama3": {"rope_type", "type", "rope_theta", "factor", "low_freq_factor"}
    | {"high_freq_factor", "original_max_position_embeddings"},
}


@dataclasses.dataclass(frozen=True)
class Layout:
    """Which tensors the HF state dict holds beyond the always-present ones."""

    family: str
    qkv_bias: bool  # q_proj/k_proj/v_proj.bias
    o_bias: bool  # o_proj.bias
    mlp_bias: bool  # gate/up/down_proj.bias
    qk_norm: bool  # self_attn.q_norm/k_norm.weight (qwen3)
    tied: bool  # no lm_head.weight


def _bad(where: str, key: str, value: Any, expected: str) -> FileFormatError:
    return FileFormatError.describe(f"{where} {key}", value, expected, _FIX)


def _int(hf: dict, key: str, where: str, default: Any = None) -> int:
    value = hf.get(key, default)
    if not is_int(value) or value < 1:
        raise _bad(where, key, value, "a positive int")
    return value


def _real(hf: dict, key: str, where: str, default: float) -> float:
    value = hf.get(key, default)
    if not is_finite_real(value) or value <= 0:
        raise _bad(where, key, value, "a finite number > 0")
    return float(value)


def _flag(hf: dict, key: str, where: str, default: bool = False) -> bool:
    value = hf.get(key, default)
    if not isinstance(value, bool):
        raise _bad(where, key, value, "true or false")
    return value


def _rope(hf: dict, where: str) -> dict[str, Any]:
    """ModelConfig's rope fields from `rope_parameters` (transformers 5) or the older keys."""
    params = hf.get("rope_parameters")
    key = "rope_parameters"
    if params is None:
        params, key = dict(hf.get("rope_scaling") or {}), "rope_scaling"
        params.setdefault("rope_theta", hf.get("rope_theta", 10000.0))
    if not isinstance(params, dict):
        raise _bad(where, key, params, "a JSON object {rope_type, rope_theta, ...}")
    kind = params.get("rope_type", params.get("type", "default"))
    kind = "none" if kind in ("default", None) else kind
    if not isinstance(kind, str) or kind not in _ROPE_KEYS:
        raise _bad(where, f"{key}.rope_type", kind, "one of 'default', 'linear', 'llama3'")
    extra = sorted(set(params) - _ROPE_KEYS[kind])
    if extra:
        raise _bad(where, f"{key}.{extra[0]}", params[extra[0]], f"absent for rope_type {kind!r}")
    fields = dict(rope_theta=_real(params, "rope_theta", f"{where} {key}", 10000.0))
    fields["rope_scaling"] = kind
    if kind != "none":
        fields["rope_factor"] = _real(params, "factor", f"{where} {key}", None)
    if kind == "llama3":
        fields["rope_low_freq_factor"] = _real(params, "low_freq_factor", where, None)
        fields["rope_high_freq_factor"] = _real(params, "high_freq_factor", where, None)
        original = "original_max_position_embeddings"
        fields["rope_original_context"] = _int(params, original, f"{where} {key}")
    return fields


def _window(hf: dict, family: str, n_layers: int, where: str) -> int | None:
    """The one sliding window of every layer (None: full attention), as transformers reads it."""
    if family == "llama":
        return None  # LlamaAttention has no sliding window, whatever the file says
    if family == "mistral":
        window = hf.get("sliding_window", 4096)  # MistralConfig's default
        return None if window is None else _int(hf, "sliding_window", where, 4096)
    use = _flag(hf, "use_sliding_window", where)
    window = _int(hf, "sliding_window", f"{where} (use_sliding_window true)", 4096) if use else None
    types, kinds = hf.get("layer_types"), ("full_attention", "sliding_attention")
    if types is None:  # what Qwen2Config / Qwen3Config derive: layers >= max_window_layers slide
        first = hf.get("max_window_layers", 28)
        if not is_int(first) or first < 0:
            raise _bad(where, "max_window_layers", first, "an int >= 0")
        sliding = max(0, n_layers - first)
        windows = ({None} if first > 0 else set()) | ({window} if sliding else set())
    elif (
        not isinstance(types, list) or len(types) != n_layers or any(t not in kinds for t in types)
    ):
        expected = f"{n_layers} (num_hidden_layers) of {kinds}"
        raise _bad(where, "layer_types", types, expected)
    else:
        windows = {window if t == "sliding_attention" else None for t in types}
        sliding = types.count("sliding_attention")
    if len(windows) > 1:
        raise _bad(
            where,
            "layer_types / max_window_layers",
            f"{sliding} of {n_layers} layers with a sliding window",
            "the same attention on every layer (lmjax has one sliding_window per model)",
        )
    return windows.pop()


def _layout(hf: dict, family: str, where: str) -> Layout:
    attention_bias = family in ("llama", "qwen3") and _flag(hf, "attention_bias", where)
    mlp_bias = family == "llama" and _flag(hf, "mlp_bias", where)
    return Layout(
        family=family,
        qkv_bias=attention_bias or family == "qwen2",
        o_bias=attention_bias,
        mlp_bias=mlp_bias,
        qk_norm=family == "qwen3",
        tied=_flag(hf, "tie_word_embeddings", where),
    )


def _check_known(hf: dict, family: str, where: str) -> None:
    missing = [key for key in _SIZES if key not in hf]
    if missing:
        raise _bad(where, f"keys (model_type {family!r})", missing, "present")
    for key, value in _MUST_BE.items():
        if hf.get(key, value) != value:
            raise _bad(where, key, hf[key], f"{value!r} (lmjax does not express another)")


def config_from_hf(hf: dict, dtype: str, where: str) -> tuple[ModelConfig, Layout]:
    """The lmjax config of a llama/mistral/qwen2/qwen3 `config.json` dict, and its layout."""
    family = hf.get("model_type")
    _check_known(hf, family, where)
    layout = _layout(hf, family, where)
    d, h = _int(hf, "hidden_size", where), _int(hf, "num_attention_heads", where)
    kv = h if hf.get("num_key_value_heads") is None else _int(hf, "num_key_value_heads", where)
    head_dim = _int(hf, "head_dim", where) if hf.get("head_dim") is not None else None
    bias = layout.o_bias or layout.mlp_bias
    fields = dict(
        vocab_size=_int(hf, "vocab_size", where),
        context_length=_int(hf, "max_position_embeddings", where),
        d_model=d,
        n_heads=h,
        n_kv_heads=None if kv == h else kv,
        head_dim=None if head_dim is None or head_dim * h == d else head_dim,
        n_layers=_int(hf, "num_hidden_layers", where),
        d_ff=_int(hf, "intermediate_size", where),
        eps=_real(hf, "rms_norm_eps", where, 1e-6),
        bias=bias,
        qkv_bias=None if layout.qkv_bias == bias else layout.qkv_bias,
        qk_norm=layout.qk_norm,
        tie_embeddings=layout.tied,
        param_dtype=dtype,
        **_rope(hf, where),
    )
    fields["sliding_window"] = _window(hf, family, fields["n_layers"], where)
    return model_config("llama", fields, KEYS, where), layout


def _rope_to_hf(cfg: ModelConfig) -> dict[str, Any]:
    params: dict[str, Any] = {"rope_type": "default", "rope_theta": cfg.rope_theta}
    if cfg.rope_scaling != "none":
        params |= {"rope_type": cfg.rope_scaling, "factor": cfg.rope_factor}
    if cfg.rope_scaling == "llama3":
        params |= {"low_freq_factor": cfg.rope_low_freq_factor}
        params |= {"high_freq_factor": cfg.rope_high_freq_factor}
        params |= {"original_max_position_embeddings": cfg.rope_original_context}
    return params


def _window_to_hf(cfg: ModelConfig, family: str) -> dict[str, Any]:
    window = cfg.sliding_window
    if family == "mistral":
        return {"sliding_window": window}
    if family in ("qwen2", "qwen3"):  # max_window_layers 0: every layer slides
        if window is None:  # max_window_layers then means nothing: transformers' default stays
            return {"use_sliding_window": False, "sliding_window": None}
        return {"use_sliding_window": True, "sliding_window": window, "max_window_layers": 0}
    return {}


def config_to_hf(cfg: ModelConfig, layout: Layout) -> dict[str, Any]:
    """`config.json` contents for `cfg` as `layout.family` (see `choose_layout`)."""
    family = layout.family
    hf: dict[str, Any] = {
        "architectures": [ARCHITECTURES[family]],
        "model_type": family,
        "vocab_size": cfg.vocab_size,
        "max_position_embeddings": cfg.context_length,
        "hidden_size": cfg.d_model,
        "intermediate_size": cfg.d_ff,
        "num_hidden_layers": cfg.n_layers,
        "num_attention_heads": cfg.n_heads,
        "num_key_value_heads": cfg.kv_heads,
        "head_dim": cfg.d_head,
        "hidden_act": "silu",
        "rms_norm_eps": cfg.eps,
        "rope_parameters": _rope_to_hf(cfg),
        "tie_word_embeddings": cfg.tie_embeddings,
        "attention_dropout": cfg.dropout,
        "bos_token_id": None,  # the config classes' defaults (1, 2) would stop generate early
        "eos_token_id": None,
        "dtype": cfg.param_dtype,
    }
    if family == "qwen2" and cfg.head_dim is None:  # Qwen2Config has no head_dim field
        del hf["head_dim"]  # (Qwen2Attention reads one if present, else D / H)
    if family in ("llama", "qwen3"):
        hf["attention_bias"] = layout.qkv_bias
    if family == "llama":
        hf["mlp_bias"] = layout.mlp_bias
    return hf | _window_to_hf(cfg, family)


def _refuse(what: str, value: Any, why: str) -> ConfigError:
    return ConfigError.describe(what, value, why, "export a config a Hugging Face family expresses")


def choose_layout(cfg: ModelConfig, nonzero: dict[str, bool]) -> Layout:
    """The family that expresses `cfg`: qk_norm -> qwen3; q/k/v biases without `bias` -> qwen2;
    a sliding window -> mistral; else llama.

    `nonzero[kind]` says whether the params hold a nonzero bias of kind "o", "mlp" or "head":
    lmjax's `bias` declares all three, and a zero one need not be written.
    """
    needs = {
        "rmsnorm": cfg.norm == "rmsnorm",
        "swiglu": cfg.activation == "swiglu",
        "rope": cfg.positions == "rope",
    }
    for name, ok in needs.items():
        if not ok:
            raise _refuse("model config", cfg.to_dict(), f"{name} for a llama-family export")
    if nonzero["head"]:
        raise _refuse("language_model_head.bias", "nonzero", "zero (no family has a head bias)")
    qkv, o, mlp = cfg.qkv_has_bias, nonzero["o"], nonzero["mlp"]
    if cfg.qk_norm:
        family = "qwen3"
    elif qkv and not cfg.bias:  # Qwen2's q/k/v biases (lmjax declares no o/MLP bias then)
        family = "qwen2"
    elif cfg.sliding_window is not None:
        family = "mistral"
    else:
        family = "llama"
    if family in ("qwen3", "mistral") and mlp:
        raise _refuse("feed_forward biases", "nonzero", f"zero ({family} has no MLP bias)")
    if family == "mistral" and (qkv or o):
        raise _refuse(
            "attention biases", "present", "none with a sliding window (or qkv_bias alone: qwen2)"
        )
    attention = qkv or o  # llama/qwen3's attention_bias: q, k, v and o together
    return Layout(
        family=family,
        qkv_bias=attention or family == "qwen2",
        o_bias=attention and family != "qwen2",
        mlp_bias=mlp,
        qk_norm=cfg.qk_norm,
        tied=cfg.tie_embeddings,
    )
