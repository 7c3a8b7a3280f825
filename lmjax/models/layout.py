"""The parameter declaration: every leaf's name, shape, initializer and logical axes, once.

`declare(cfg)` is the single source: `init` draws arrays from it, `abstract_params` gives
`jax.ShapeDtypeStruct`s without allocating, `check_params` compares a tree against it, and
sharding rules (docs/scale.md) map its logical axes to mesh axes.

Logical axes: `vocab` (V), `context` (C), `embed` (D), `heads` (H * Dh, the concatenated query
features and the output projection's input), `kv_heads` (Hkv * Dh, the key/value features),
`head_dim` (Dh, the q/k norm scales; never split), `mlp` (F), `layers` (N, the leading axis
of every block leaf; never split). A linear weight is `[out, in]`, as in `lmjax.ops.linear`.

The blocks are stored stacked (`lmjax.params`): `declare` lists `blocks.attention.query.weight`
once with shape `[N, H*Dh, D]` and axes `("layers", "heads", "embed")`, so `lax.scan` runs one
block over the layer axis. `declare_layers` lists the same leaves under their per-layer names
(`blocks.3.attention.query.weight [H*Dh, D]`), as `lmjax inspect` and Hugging Face files show them.
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
from lmjax.quant.nf4 import QuantizedWeight

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


LAYERS = "layers"  # the logical axis of the stacked blocks' leading dimension


def _outer(cfg: ModelConfig) -> dict[str, ParamSpec]:
    """Every leaf outside the blocks: embeddings, the final norm, the head."""
    v, c, d = cfg.vocab_size, cfg.context_length, cfg.d_model
    specs = {"token_embedding.weight": ParamSpec((v, d), "normal(0.02)", ("vocab", "embed"))}
    if cfg.positions == "learned":
        specs["position_embedding.weight"] = ParamSpec((c, d), "normal(0.02)", ("context", "embed"))
    specs |= _norm("final_norm", cfg)
    if not cfg.tie_embeddings:
        specs |= _linear("language_model_head", ("vocab", v), ("embed", d), cfg.head_bias)
    return specs


def _sorted(specs: dict[str, ParamSpec]) -> dict[str, ParamSpec]:
    return {name: specs[name] for name in sorted(specs, key=ptree.natural_key)}


def declare(cfg: ModelConfig) -> dict[str, ParamSpec]:
    """`{name: ParamSpec}` for every leaf as stored, in `lmjax.params` natural order: each block
    leaf once, `[N, ...]` with the `layers` axis first (the module docstring)."""
    n = cfg.n_layers
    stacked = {
        name: ParamSpec((n, *spec.shape), spec.init, (LAYERS, *spec.axes))
        for name, spec in _block(ptree.STACKED, cfg).items()
    }
    return _sorted(_outer(cfg) | stacked)


def declare_layers(cfg: ModelConfig) -> dict[str, ParamSpec]:
    """`declare` under per-layer names: `blocks.{i}.<leaf>` for each layer i, without the
    layer axis (the names users read, and the layout of Hugging Face files)."""
    specs = _outer(cfg)
    for i in range(cfg.n_layers):
        specs |= _block(f"{ptree.STACKED}.{i}", cfg)
    return _sorted(specs)


def _leaf_key(key: jax.Array, name: str) -> jax.Array:
    # Keyed by name (a stable CRC, not Python's salted hash), so adding or removing one
    # parameter leaves every other parameter's initial value unchanged.
    return jax.random.fold_in(key, zlib.crc32(name.encode()) & 0x7FFFFFFF)


def init(key: jax.Array, cfg: ModelConfig) -> dict:
    """Parameters drawn from `declare(cfg)`: a nested dict with the names docs/models.md lists.

    Embeddings ~ N(0, 0.02^2), linear weights Xavier-uniform, biases 0, norm scales 1; each
    layer's leaf gets its own key, `fold_in(key, crc32(per-layer name))`, in `cfg.param_dtype`,
    and the layers are then stacked: the values do not depend on the layout.
    """
    dtype = cfg.params_dtype
    flat = {
        name: INITIALIZERS[spec.init](_leaf_key(key, name), spec.shape, dtype)
        for name, spec in declare_layers(cfg).items()
    }
    return ptree.stack(ptree.unflatten(flat))


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
    if extra and _per_layer(extra):
        fix = "stack per-layer blocks with lmjax.params.stack(params) (blocks are stored stacked)"
    if extra:
        raise ShapeError.describe("unexpected parameter", extra[0], "none for this config", fix)
    for name, spec in specs.items():
        if name not in flat:
            raise ShapeError.describe("missing parameter", name, f"shape {spec.shape}", fix)
        shape, dtype = _stored_shape(name, flat[name]), _stored_dtype(flat[name])
        if tuple(shape) != spec.shape:
            raise ShapeError.describe(f"{name}.shape", shape, spec.shape, fix)
        if not jnp.issubdtype(dtype, jnp.floating):
            raise ShapeError.describe(f"{name}.dtype", dtype, "a float dtype", fix)


def _stored_shape(name: str, leaf) -> tuple[int, ...]:
    """A leaf's shape as `declare` states it. An NF4 weight describes one layer's weight (its
    static `shape`); stacked, its arrays lead with the layer count."""
    if isinstance(leaf, QuantizedWeight):
        lead = (ptree.stacked_size(leaf),) if ptree.is_stacked(name) else ()
        return (*lead, *leaf.shape)
    return tuple(jnp.shape(leaf))


def _stored_dtype(leaf):
    return leaf.dtype if isinstance(leaf, QuantizedWeight) else jnp.result_type(leaf)


def _per_layer(names) -> bool:
    """Whether names hold per-layer blocks (`blocks.3.x`), the layout before blocks were stacked."""
    return any(n.startswith(f"{ptree.STACKED}.") and n.split(".")[1].isdecimal() for n in names)
