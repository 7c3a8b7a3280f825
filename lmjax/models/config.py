"""`ModelConfig`: the frozen, validated description of a decoder (docs/models.md), and presets."""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp

from lmjax.checks import is_finite_real, is_int, is_real, require
from lmjax.errors import ConfigError

NORMS = ("layernorm", "rmsnorm")
ACTIVATIONS = ("gelu", "gelu_tanh", "relu", "swiglu")
POSITIONS = ("learned", "rope", "sinusoidal")
ATTENTION_IMPLS = ("auto", "materialized", "xla", "flash", "cudnn")
DTYPES = ("float32", "bfloat16", "float16")
OPS = ("custom", "reference")
ROPE_SCALINGS = ("none", "linear", "llama3")

# Names the block gives its projections' outputs (jax.ad_checkpoint.checkpoint_name), for
# policies that keep some and recompute the rest.
ATTENTION_PROJECTIONS = ("query_proj", "key_proj", "value_proj", "out_proj")
MLP_PROJECTIONS = ("mlp_in", "mlp_out")

# Remat policies: what the backward pass may keep from a block's forward instead of recomputing.
REMAT_POLICIES: dict[str, Any] = {
    "none": None,  # no jax.checkpoint: everything the VJPs need is stored
    "block": jax.checkpoint_policies.nothing_saveable,  # keep block inputs only
    "full": jax.checkpoint_policies.nothing_saveable,  # MaxText's name for "block"
    "dots": jax.checkpoint_policies.dots_saveable,  # keep matmul outputs, recompute the rest
    "dots_no_batch": jax.checkpoint_policies.dots_with_no_batch_dims_saveable,
    # MaxText's: keep the attention projections' outputs, recompute the MLP's (the widest).
    "save_dot_except_mlp": jax.checkpoint_policies.save_only_these_names(*ATTENTION_PROJECTIONS),
}

MAX_SIZE = 2**31 - 1
_SIZES = ("vocab_size", "context_length", "d_model", "n_heads", "n_layers", "d_ff")
_CHOICES = {
    "norm": NORMS,
    "activation": ACTIVATIONS,
    "positions": POSITIONS,
    "attention": ATTENTION_IMPLS,
    "remat": ("auto", *REMAT_POLICIES),
    "dtype": DTYPES,
    "param_dtype": DTYPES,
    "ops": OPS,
    "rope_scaling": ROPE_SCALINGS,
}


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    """A decoder-only transformer, validated on construction (docs/models.md).

    Sizes: vocab_size V, context_length C, d_model D, n_heads H, n_layers N, d_ff F; key/value
    heads Hkv = `kv_heads` (`n_kv_heads`, default H: grouped-query attention when fewer, each
    serving H / Hkv query heads) of `d_head` Dh features (`head_dim`, default D / H). The
    language-model head has a bias exactly when `bias` is set and the head is not tied to the
    token embedding; the q/k/v projections have one when `qkv_has_bias` (`qkv_bias`, default
    `bias`). `qk_norm` RMS-normalises each head of q and k (scale [Dh], eps `eps`) before RoPE.
    `rope_scaling` stretches RoPE's frequencies ("linear": all by `rope_factor`; "llama3": the
    low-frequency band by `rope_factor`, the high one not, interpolated between, with
    `rope_low_freq_factor`, `rope_high_freq_factor`, `rope_original_context`). With
    `sliding_window` W a query at position i sees keys j with i - W < j <= i.
    `scan_layers` runs the N blocks (stored stacked) as one `lax.scan` over the layer axis, so
    a program compiles one block whatever N is; false unrolls a Python loop over the same
    tree's slices. `remat` (a `REMAT_POLICIES` name) applies to one block (the scanned body);
    "auto" (the default) is `dots_no_batch` when scanned and "none" when unrolled
    (`remat_policy`; docs/models.md#scanned-layers says why).
    `ops="reference"` runs the plain-jnp `*_reference` primitives
    (differentiated by `jax.grad`) instead of the hand-written VJPs, for gradient comparisons;
    it then uses `attention_reference` whatever `attention` says. `attention` "auto" picks
    cuDNN on a CUDA GPU where it can, flash on a TPU, XLA on a CPU (`lmjax.models.attention`).
    """

    vocab_size: int
    context_length: int
    d_model: int
    n_heads: int
    n_layers: int
    d_ff: int
    norm: str = "layernorm"
    activation: str = "gelu"
    positions: str = "learned"
    bias: bool = True
    tie_embeddings: bool = False
    attention: str = "auto"
    remat: str = "auto"
    scan_layers: bool = True
    dtype: str = "float32"
    param_dtype: str = "float32"
    eps: float = 1e-5
    dropout: float = 0.0
    rope_theta: float = 10000.0
    ops: str = "custom"
    n_kv_heads: int | None = None
    head_dim: int | None = None
    qkv_bias: bool | None = None
    qk_norm: bool = False
    rope_scaling: str = "none"
    rope_factor: float = 1.0
    rope_low_freq_factor: float = 1.0
    rope_high_freq_factor: float = 4.0
    rope_original_context: int = 8192
    sliding_window: int | None = None
    tokenizer_size: int | None = None

    def __post_init__(self):
        for name in ("dtype", "param_dtype"):  # accept jnp.bfloat16 as well as "bfloat16"
            object.__setattr__(self, name, _dtype_name(getattr(self, name)))
        _validate(self)

    @property
    def kv_heads(self) -> int:
        """Hkv: key/value heads (`n_kv_heads`, or one per query head)."""
        return self.n_heads if self.n_kv_heads is None else self.n_kv_heads

    @property
    def d_head(self) -> int:
        """Dh: features per head (`head_dim`, or d_model / n_heads)."""
        return self.d_model // self.n_heads if self.head_dim is None else self.head_dim

    @property
    def q_features(self) -> int:
        """H * Dh: the query projection's width (and the output projection's input)."""
        return self.n_heads * self.d_head

    @property
    def kv_features(self) -> int:
        """Hkv * Dh: the key and value projections' width."""
        return self.kv_heads * self.d_head

    @property
    def vocab_ids(self) -> int:
        """n: the token ids the model reads and writes, [0, n) (`tokenizer_size`, or V)."""
        return self.vocab_size if self.tokenizer_size is None else self.tokenizer_size

    @property
    def padded_vocab(self) -> bool:
        """Whether the embedding has rows past the tokenizer's ids (n < V)."""
        return self.vocab_ids < self.vocab_size

    @property
    def qkv_has_bias(self) -> bool:
        """Whether query/key/value have biases: `qkv_bias`, or `bias` when that is None."""
        return self.bias if self.qkv_bias is None else self.qkv_bias

    @property
    def head_bias(self) -> bool:
        return self.bias and not self.tie_embeddings

    @property
    def remat_policy(self) -> str:
        """The `REMAT_POLICIES` name in force: `remat`, with "auto" resolved. A scan hands every
        value the backward needs from the forward loop to the backward loop in `[N, ...]`
        buffers, where XLA can no longer fuse cheap elementwise work away as it does across an
        unrolled program (GPT-2 124M on v5e:2x2, TPU compiler: 9.1 GB a device scanned with no
        remat, 6.1 GB unrolled, 3.9 GB scanned keeping the projections' outputs); so a
        scanned model keeps the projections' outputs and recomputes the rest."""
        if self.remat != "auto":
            return self.remat
        return "dots_no_batch" if self.scan_layers else "none"

    @property
    def compute_dtype(self) -> jnp.dtype:
        return jnp.dtype(self.dtype)

    @property
    def params_dtype(self) -> jnp.dtype:
        return jnp.dtype(self.param_dtype)

    def replace(self, **changes) -> ModelConfig:
        """A validated copy with `changes` applied (unknown field names are a ConfigError)."""
        return ModelConfig(**{**self.to_dict(), **_checked_fields(changes)})

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    def for_tokenizer(self, n_ids: int, what: str, fix: str) -> ModelConfig:
        """This model for a tokenizer of `n_ids` ids: `tokenizer_size` n_ids when the embedding
        is larger (padded), None when equal. ConfigError (`what` = n_ids, with `fix`) when the
        tokenizer is larger than the embedding, or differs from a `tokenizer_size` already set.
        """
        v, given = self.vocab_size, self.tokenizer_size
        expected = f"at most model.vocab_size = {v} ids (each id needs an embedding row)"
        require(n_ids <= v, what, n_ids, expected, fix)
        expected = f"model.tokenizer_size = {given} (the tokenizer this model was made for)"
        require(given in (None, n_ids), what, n_ids, expected, fix)
        return self.replace(tokenizer_size=n_ids if n_ids < v else None)

    @classmethod
    def from_dict(cls, fields: dict[str, Any]) -> ModelConfig:
        """Build from a plain mapping (e.g. YAML); unknown or missing keys are ConfigErrors."""
        fields = _checked_fields(fields)
        missing = [f.name for f in dataclasses.fields(cls) if f.name not in fields]
        missing = [m for m in missing if m in _SIZES]
        if missing:
            raise ConfigError.describe(
                "model config", f"missing {missing}", "every size field", "add them or use preset()"
            )
        return cls(**fields)


# A config is static data: `jax.jit(forward)(params, tokens, cfg)` treats it as part of the
# compiled function (hashed), not as an array argument, so no static_argnames is needed.
jax.tree_util.register_static(ModelConfig)


def _dtype_name(value):
    if isinstance(value, str):
        return value
    try:
        return jnp.dtype(value).name
    except (TypeError, ValueError):  # ValueError: a mapping numpy reads as a record spec
        return value  # not a dtype: _validate names it


def _checked_fields(fields: dict[str, Any]) -> dict[str, Any]:
    known = [f.name for f in dataclasses.fields(ModelConfig)]
    unknown = sorted(set(fields) - set(known))
    if unknown:
        raise ConfigError.describe(
            "model config key", unknown[0], f"one of {known}", "fix the spelling or remove it"
        )
    return dict(fields)


def _validate(cfg: ModelConfig) -> None:
    for name in _SIZES:
        value = getattr(cfg, name)
        # Token ids and positions are int32 inside the model, so sizes must fit in one.
        ok = is_int(value) and 1 <= value <= MAX_SIZE
        fix = f"set {name} to a positive integer that fits in int32"
        require(ok, f"model.{name}", value, f"an int in [1, {MAX_SIZE}]", fix)
    for name, allowed in _CHOICES.items():
        value = getattr(cfg, name)
        fix = "pick a listed value"
        require(value in allowed, f"model.{name}", value, f"one of {allowed}", fix)
    for name in ("bias", "tie_embeddings", "scan_layers"):
        value = getattr(cfg, name)
        fix = "write true or false (a YAML boolean, or name=true on the command line)"
        require(isinstance(value, bool), f"model.{name}", value, "True or False", fix)
    for name, fix in (
        ("eps", "use e.g. 1e-5 (LayerNorm) or 1e-6 (RMSNorm)"),
        ("rope_theta", "use e.g. 10000.0"),
    ):
        value = getattr(cfg, name)
        ok = is_finite_real(value) and value > 0
        require(ok, f"model.{name}", value, "a finite float > 0", fix)
    ok = is_real(cfg.dropout) and 0.0 <= cfg.dropout < 1.0
    require(ok, "model.dropout", cfg.dropout, "a float in [0, 1)", "use e.g. 0.1, or 0.0 for none")
    _validate_tokenizer_size(cfg)
    _validate_heads(cfg)
    _validate_rope(cfg)
    _validate_positions(cfg)


def _optional_size(cfg: ModelConfig, name: str, meaning: str) -> None:
    value = getattr(cfg, name)
    ok = value is None or (is_int(value) and 1 <= value <= MAX_SIZE)
    fix = f"set {name} to a positive integer, or null for {meaning}"
    require(ok, f"model.{name}", value, f"null or an int in [1, {MAX_SIZE}]", fix)


def _validate_tokenizer_size(cfg: ModelConfig) -> None:
    """tokenizer_size: null, or at most vocab_size (every id needs an embedding row)."""
    _optional_size(cfg, "tokenizer_size", "vocab_size (no padded rows)")
    n = cfg.tokenizer_size
    require(
        n is None or n <= cfg.vocab_size,
        "model.tokenizer_size",
        n,
        f"<= model.vocab_size = {cfg.vocab_size} (each token id needs an embedding row)",
        f"use a tokenizer of at most {cfg.vocab_size} ids, or a model with vocab_size >= {n}",
    )


def _validate_heads(cfg: ModelConfig) -> None:
    """n_kv_heads, head_dim, qkv_bias, qk_norm: the attention projections' shapes."""
    _optional_size(cfg, "n_kv_heads", "one key/value head per query head")
    _optional_size(cfg, "head_dim", "d_model / n_heads")
    require(
        cfg.n_heads % cfg.kv_heads == 0,
        "model.n_heads % model.n_kv_heads",
        f"{cfg.n_heads} % {cfg.kv_heads} = {cfg.n_heads % cfg.kv_heads}",
        "0 (each key/value head serves n_heads / n_kv_heads query heads)",
        "pick n_kv_heads dividing n_heads",
    )
    require(
        cfg.head_dim is not None or cfg.d_model % cfg.n_heads == 0,
        "model.d_model % model.n_heads",
        f"{cfg.d_model} % {cfg.n_heads} = {cfg.d_model % cfg.n_heads}",
        "0 (every head gets d_model / n_heads features)",
        "pick n_heads dividing d_model, or set head_dim explicitly",
    )
    fix = "write true or false, or null to follow model.bias"
    ok = cfg.qkv_bias is None or isinstance(cfg.qkv_bias, bool)
    require(ok, "model.qkv_bias", cfg.qkv_bias, "True, False or None", fix)
    fix = "write true or false (a YAML boolean, or name=true on the command line)"
    require(isinstance(cfg.qk_norm, bool), "model.qk_norm", cfg.qk_norm, "True or False", fix)


def _validate_rope(cfg: ModelConfig) -> None:
    """rope_scaling and its parameters (llama3's bands need high > low > 0)."""
    require(
        cfg.rope_scaling == "none" or cfg.positions == "rope",
        "model.rope_scaling",
        cfg.rope_scaling,
        "'none' unless positions='rope' (it scales RoPE's frequencies)",
        "set positions=rope or rope_scaling=none",
    )
    for name in ("rope_factor", "rope_low_freq_factor", "rope_high_freq_factor"):
        value = getattr(cfg, name)
        ok = is_finite_real(value) and value > 0
        require(ok, f"model.{name}", value, "a finite float > 0", "use e.g. 1.0 (no scaling)")
    value = cfg.rope_original_context
    ok = is_int(value) and 1 <= value <= MAX_SIZE
    fix = "use the checkpoint's original_max_position_embeddings, e.g. 8192"
    require(ok, "model.rope_original_context", value, f"an int in [1, {MAX_SIZE}]", fix)
    require(
        cfg.rope_scaling != "llama3" or cfg.rope_high_freq_factor > cfg.rope_low_freq_factor,
        "model.rope_high_freq_factor with rope_scaling='llama3'",
        cfg.rope_high_freq_factor,
        f"> rope_low_freq_factor = {cfg.rope_low_freq_factor} (the bands interpolate between)",
        "use the checkpoint's values, e.g. low 1.0 and high 4.0",
    )


def _validate_positions(cfg: ModelConfig) -> None:
    """What each position scheme needs of the head size and width; the sliding window."""
    require(
        cfg.positions != "rope" or cfg.d_head % 2 == 0,
        "d_head with positions='rope'",
        cfg.d_head,
        "an even head_dim (or d_model / n_heads): RoPE rotates pairs of features",
        "change head_dim, or d_model or n_heads so their ratio is even",
    )
    require(
        cfg.positions != "sinusoidal" or cfg.d_model % 2 == 0,
        "d_model with positions='sinusoidal'",
        cfg.d_model,
        "an even number (sine and cosine halves)",
        "use an even d_model",
    )
    _optional_size(cfg, "sliding_window", "no window (full causal attention)")


_GPT = dict(
    norm="layernorm", activation="gelu", positions="learned", bias=True, tie_embeddings=False
)
_GPT2 = dict(_GPT, activation="gelu_tanh", tie_embeddings=True, eps=1e-5)
_LLAMA = dict(
    norm="rmsnorm",
    activation="swiglu",
    positions="rope",
    bias=False,
    tie_embeddings=False,
    eps=1e-6,
)
_QWEN = dict(_LLAMA, tie_embeddings=True, rope_theta=1000000.0, eps=1e-6)


def _sizes(vocab, context, d_model, n_heads, n_layers, d_ff) -> dict[str, int]:
    return dict(
        vocab_size=vocab,
        context_length=context,
        d_model=d_model,
        n_heads=n_heads,
        n_layers=n_layers,
        d_ff=d_ff,
    )


_GPT2_SMALL = dict(
    vocab_size=50257, context_length=1024, d_model=768, n_heads=12, n_layers=12, d_ff=3072
)

PRESETS: dict[str, dict[str, Any]] = {
    # The reference 002 tiny decoder: 19,419 parameters.
    "gpt": dict(_GPT, vocab_size=27, context_length=16, d_model=32, n_heads=4, n_layers=2, d_ff=64),
    # Hugging Face GPT-2 small (124,439,808 parameters); the family default.
    "gpt2": dict(_GPT2, **_GPT2_SMALL),
    "gpt2-124m": dict(_GPT2, **_GPT2_SMALL),
    # Hugging Face GPT-2 medium (354,823,168 parameters).
    "gpt2-350m": dict(_GPT2, **_GPT2_SMALL)
    | dict(d_model=1024, n_heads=16, n_layers=24, d_ff=4096),
    # The reference 001 tiny Llama: 21,664 parameters.
    "llama": dict(
        _LLAMA, vocab_size=16, context_length=32, d_model=32, n_heads=2, n_layers=2, d_ff=64
    ),
    # A byte-level Llama small enough to train on a laptop CPU in minutes (918,656 parameters;
    # not the overfit model of the training tests, which is the "llama" preset above).
    "llama-tiny": dict(
        _LLAMA, vocab_size=256, context_length=256, d_model=128, n_heads=4, n_layers=4, d_ff=384
    ),
    # The shapes of today's open checkpoints (random weights; lmjax.io.hf loads the real ones).
    # Each count equals transformers' for the same config (tests/test_models_families.py).
    # HuggingFaceTB/SmolLM2-135M (LlamaForCausalLM): 134,515,008 parameters.
    "smollm2-135m": dict(
        _LLAMA,
        **_sizes(49152, 8192, 576, 9, 30, 1536),
        n_kv_heads=3,
        tie_embeddings=True,
        rope_theta=100000.0,
        eps=1e-5,
    ),
    # meta-llama/Llama-3.2-1B: 1,235,814,400 parameters, RoPE with Llama 3.1's scaling.
    "llama-3.2-1b": dict(
        _LLAMA,
        **_sizes(128256, 131072, 2048, 32, 16, 8192),
        n_kv_heads=8,
        tie_embeddings=True,
        rope_theta=500000.0,
        eps=1e-5,
        rope_scaling="llama3",
        rope_factor=32.0,
        rope_low_freq_factor=1.0,
        rope_high_freq_factor=4.0,
        rope_original_context=8192,
    ),
    # Qwen/Qwen2.5-0.5B: 494,032,768 parameters; biases on q, k, v only.
    "qwen2.5-0.5b": dict(
        _QWEN, **_sizes(151936, 32768, 896, 14, 24, 4864), n_kv_heads=2, qkv_bias=True
    ),
    # Qwen/Qwen3-0.6B: 596,049,920 parameters; head_dim 128 (16 x 128 != 1024), q/k norms.
    "qwen3-0.6b": dict(
        _QWEN,
        **_sizes(151936, 40960, 1024, 16, 28, 3072),
        n_kv_heads=8,
        head_dim=128,
        qk_norm=True,
    ),
}


def preset(name: str, /, **overrides) -> ModelConfig:
    """The named preset (`PRESETS`) with `overrides` applied, validated."""
    if name not in PRESETS:
        raise ConfigError.describe(
            "model preset", name, f"one of {tuple(PRESETS)}", "pick a listed preset"
        )
    return ModelConfig(**{**PRESETS[name], **_checked_fields(overrides)})
