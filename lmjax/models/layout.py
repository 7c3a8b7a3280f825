"""The parameter declaration: every leaf's name, shape, initializer and logical axes, once.

`declare(cfg)` is the single source: `init` draws arrays from it, `abstract_params` gives
`jax.ShapeDtypeStruct`s without allocating, `check_params` compares a tree against it, and
sharding rules (docs/scale.md) map its logical axes to mesh axes.

Logical axes: `vocab` (V), `context` (C), `embed` (D), `heads` (H * Dh, the concatenated query
features and the output projection's input), `kv_heads` (Hkv * Dh, the key/value features),
`head_dim` (Dh, the q/k norm scales; never split), `mlp` (F). A linear weight is `[out, in]`,
as in `lmjax.ops.linear`.
"""

from __future__ import annotations

import dataclasses
import zlib
from collections.abc import Callable

import jax
import jax.numpy as jnp

from lmjax import params as ptree
from lmjax.errors import ShapeError
from lmjax.models.config import ModelConfig
from lmjax.ops.linear import xavier_uniform

EMBEDDING_STDDEV = 0.02  # GPT-2's embedding initialization


def _normal(key, shape, dtype):
    return EMBEDDING_STDDEV * jax.random.normal(key, shape, dtype)


def _zeros(key, shape, dtype):
    del key
    return jnp.zeros(shape, dtype)


def _ones(key, shape, dtype):
    del key
    return jnp.ones(shape, dtype)


INITIALIZERS: dict[str, Callable] = {
    "normal(0.02)": _normal,
    "xavier_uniform": xavier_uniform,
    "zeros": _zeros,
    "ones": _ones,
}


@dataclasses.dataclass(frozen=True)
class ParamSpec:
    """One parameter leaf: its shape, its initializer (a key of `INITIALIZERS`), its axes."""

    shape: tuple[int, ...]
    init: str
    axes: tuple[str, ...]

    @property
    def size(self) -> int:
        n = 1
        for d in self.shape:
            n *= d
        return n


def _linear(name: str, out_axis: tuple[str, int], in_axis: tuple[str, int], bias: bool):
    (out_name, out_size), (in_name, in_size) = out_axis, in_axis
    specs = {
        f"{name}.weight": ParamSpec((out_size, in_size), "xavier_uniform", (out_name, in_name))
    }
    if bias:
        specs[f"{name}.bias"] = ParamSpec((out_size,), "zeros", (out_name,))
    return specs


def _norm(name: str, cfg: ModelConfig):
    specs = {f"{name}.scale": ParamSpec((cfg.d_model,), "ones", ("embed",))}
    if cfg.norm == "layernorm" and cfg.bias:
        specs[f"{name}.bias"] = ParamSpec((cfg.d_model,), "zeros", ("embed",))
    return specs


def _attention(prefix: str, cfg: ModelConfig) -> dict[str, ParamSpec]:
    """query [H*Dh, D], key/value [Hkv*Dh, D], output [D, H*Dh]; q/k norm scales [Dh]."""
    embed, heads, kv = (
        ("embed", cfg.d_model),
        ("heads", cfg.q_features),
        ("kv_heads", cfg.kv_features),
    )
    specs = _linear(f"{prefix}.query", heads, embed, cfg.qkv_has_bias)
    specs |= _linear(f"{prefix}.key", kv, embed, cfg.qkv_has_bias)
    specs |= _linear(f"{prefix}.value", kv, embed, cfg.qkv_has_bias)
    specs |= _linear(f"{prefix}.output", embed, heads, cfg.bias)
    if cfg.qk_norm:
        for name in ("query_norm", "key_norm"):
            specs[f"{prefix}.{name}.scale"] = ParamSpec((cfg.d_head,), "ones", ("head_dim",))
    return specs


def _block(prefix: str, cfg: ModelConfig) -> dict[str, ParamSpec]:
    embed, mlp = ("embed", cfg.d_model), ("mlp", cfg.d_ff)
    specs = _norm(f"{prefix}.attention_norm", cfg)
    specs |= _attention(f"{prefix}.attention", cfg)
    specs |= _norm(f"{prefix}.feed_forward_norm", cfg)
    ff = f"{prefix}.feed_forward"
    if cfg.activation == "swiglu":
        specs |= _linear(f"{ff}.gate", mlp, embed, cfg.bias)
        specs |= _linear(f"{ff}.up", mlp, embed, cfg.bias)
        specs |= _linear(f"{ff}.down", embed, mlp, cfg.bias)
    else:
        specs |= _linear(f"{ff}.expand", mlp, embed, cfg.bias)
        specs |= _linear(f"{ff}.project", embed, mlp, cfg.bias)
    return specs


def declare(cfg: ModelConfig) -> dict[str, ParamSpec]:
    """`{name: ParamSpec}` for every leaf of the model, in `lmjax.params` natural order."""
    v, c, d = cfg.vocab_size, cfg.context_length, cfg.d_model
    specs = {"token_embedding.weight": ParamSpec((v, d), "normal(0.02)", ("vocab", "embed"))}
    if cfg.positions == "learned":
        specs["position_embedding.weight"] = ParamSpec((c, d), "normal(0.02)", ("context", "embed"))
    for i in range(cfg.n_layers):
        specs |= _block(f"blocks.{i}", cfg)
    specs |= _norm("final_norm", cfg)
    if not cfg.tie_embeddings:
        specs |= _linear("language_model_head", ("vocab", v), ("embed", d), cfg.head_bias)
    return {name: specs[name] for name in sorted(specs, key=ptree.natural_key)}


def _leaf_key(key: jax.Array, name: str) -> jax.Array:
    # Keyed by name (a stable CRC, not Python's salted hash), so adding or removing one
    # parameter leaves every other parameter's initial value unchanged.
    return jax.random.fold_in(key, zlib.crc32(name.encode()) & 0x7FFFFFFF)


def init(key: jax.Array, cfg: ModelConfig) -> dict:
    """Parameters drawn from `declare(cfg)`: a nested dict with the names docs/models.md lists.

    Embeddings ~ N(0, 0.02^2), linear weights Xavier-uniform, biases 0, norm scales 1; each leaf
    gets its own key, `fold_in(key, crc32(name))`, in `cfg.param_dtype`.
    """
    dtype = cfg.params_dtype
    flat = {
        name: INITIALIZERS[spec.init](_leaf_key(key, name), spec.shape, dtype)
        for name, spec in declare(cfg).items()
    }
    return ptree.unflatten(flat)


def abstract_params(cfg: ModelConfig) -> dict:
    """The parameter tree as `jax.ShapeDtypeStruct`s: nothing is allocated."""
    flat = {
        name: jax.ShapeDtypeStruct(spec.shape, cfg.params_dtype)
        for name, spec in declare(cfg).items()
    }
    return ptree.unflatten(flat)


def check_params(params, cfg: ModelConfig) -> None:
    """Raise `ShapeError` naming the first leaf that is missing, unexpected or mis-shaped."""
    specs, flat = declare(cfg), ptree.flatten(params)
    # A LoRA adapter rides in its layer's dict (`lmjax.lora.attach`); models.project applies it.
    flat = {name: leaf for name, leaf in flat.items() if not name.endswith(".lora")}
    fix = "build the params with lmjax.models.init(key, cfg) for this same config"
    extra = sorted(flat.keys() - specs.keys(), key=ptree.natural_key)
    if extra:
        raise ShapeError.describe("unexpected parameter", extra[0], "none for this config", fix)
    for name, spec in specs.items():
        if name not in flat:
            raise ShapeError.describe("missing parameter", name, f"shape {spec.shape}", fix)
        shape, dtype = jnp.shape(flat[name]), jnp.result_type(flat[name])
        if tuple(shape) != spec.shape:
            raise ShapeError.describe(f"{name}.shape", shape, spec.shape, fix)
        if not jnp.issubdtype(dtype, jnp.floating):
            raise ShapeError.describe(f"{name}.dtype", dtype, "a float dtype", fix)
