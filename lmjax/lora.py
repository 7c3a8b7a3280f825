"""LoRA: low-rank adapters on chosen linear projections (docs/fine-tuning.md).

For a frozen projection `y = x W^T (+ b)`, `W [out, in]`, an adapter adds

    y = base_linear(x) + s * (dropout(x) A^T) B^T        A [r, in], B [out, r]
    s = alpha / r   (rsLoRA: alpha / sqrt(r))

`A` starts Kaiming-uniform as peft does (`kaiming_uniform_(a=sqrt(5))`, i.e. `U(-1/sqrt(in),
1/sqrt(in))`) or Gaussian `N(0, 1/r^2)` (peft's "gaussian"); `B` starts at zero, so an adapted
model starts equal to its base. Dropout acts on the adapter's input only.

    lcfg = LoraConfig(r=8, alpha=16)                         # targets: query and value
    adapters = init(key, params_or_model_cfg, lcfg)          # {"blocks": {"0": {"attention":
                                                             #   {"query": {"lora_a", "lora_b"}}}}}
    logits = models.forward(attach(params, adapters, lcfg), tokens, model_cfg)

Integration. `attach` returns the base tree with each adapted layer's dict extended by a
`"lora"` entry, an `Adapter` pytree (A, B, optional dropout key; scale and rate static).
`lmjax.models.project` recognises that entry and computes `linear(base) + adapter(x)`, so the base
weight may be a float array or an NF4 `QuantizedWeight` (QLoRA): the adapter never touches it,
and the float weight of a quantized layer is never materialized. Gradients are taken with
respect to the adapters only (`jax.grad` of a function of `adapters` with the base an ordinary,
non-differentiated argument); the model code, the KV-cache decoder and evaluation all accept an
attached tree unchanged.

Targets are globs (`lmjax.params.matches`) over linear layer names of `lmjax.models.declare(cfg)`,
i.e. weight names without `.weight` (`blocks.3.attention.query`; a glob over the weight name,
`*.query.weight`, selects the same layer); `"all-linear"` selects every
linear layer of the blocks (as peft's "all-linear": not the embeddings, norms or output head).
The Hugging Face / peft module names of Llama-family projections are aliases (`HF_TARGETS`),
so peft's `target_modules=["q_proj", "v_proj"]` is `targets=q_proj|v_proj` here:

    q_proj k_proj v_proj o_proj   ->  *.attention.query  .key  .value  .output
    gate_proj up_proj down_proj   ->  *.feed_forward.gate  .up  .down

With grouped-query attention the key/value adapters are `A [r, D]`, `B [Hkv*Dh, r]`, as peft's.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
from collections.abc import Mapping
from typing import Any

import jax
import jax.numpy as jnp

from lmjax import ops
from lmjax import params as ptree
from lmjax.checks import is_finite_real, is_int, is_positive_int, is_real, require
from lmjax.config.overrides import parse_value
from lmjax.errors import ConfigError, FileFormatError, ShapeError
from lmjax.io import safetensors
from lmjax.models import ModelConfig, declare
from lmjax.models.loss import Loss, loss_fn
from lmjax.quant import nf4

ALL_LINEAR = "all-linear"
INITS = ("kaiming", "gaussian")
DEFAULT_TARGETS = ("*.attention.query", "*.attention.value")
# peft's module names (a peft name matches a module whose name ends with it) -> lmjax's globs.
HF_TARGETS = {
    "q_proj": "*.attention.query",
    "k_proj": "*.attention.key",
    "v_proj": "*.attention.value",
    "o_proj": "*.attention.output",
    "gate_proj": "*.feed_forward.gate",
    "up_proj": "*.feed_forward.up",
    "down_proj": "*.feed_forward.down",
}


@dataclasses.dataclass(frozen=True)
class LoraConfig:
    """Which projections get adapters, their rank, scale, initialization and dropout."""

    r: int = 8
    alpha: float = 16.0
    targets: tuple[str, ...] = DEFAULT_TARGETS  # globs over layer names, or ("all-linear",)
    dropout: float = 0.0  # on the adapter input only
    init: str = "kaiming"  # kaiming (peft's default) | gaussian
    rslora: bool = False  # scale alpha / sqrt(r) instead of alpha / r

    def __post_init__(self):
        if isinstance(self.targets, str):
            object.__setattr__(self, "targets", (self.targets,))
        object.__setattr__(self, "targets", tuple(self.targets))
        _validate(self)

    @property
    def scale(self) -> float:
        return self.alpha / (math.sqrt(self.r) if self.rslora else self.r)

    def to_dict(self) -> dict[str, Any]:
        return {**dataclasses.asdict(self), "targets": list(self.targets)}

    @classmethod
    def from_dict(cls, data: Mapping[str, Any], where: str = "lora") -> LoraConfig:
        if not isinstance(data, Mapping):
            raise ConfigError.describe(where, data, "a mapping of LoRA fields", "write r: 8 ...")
        names = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(data) - names)
        if unknown:
            raise ConfigError.describe(
                f"{where} key", unknown[0], f"one of {sorted(names)}", "fix the spelling"
            )
        return cls(**{k: _coerce(k, v, where) for k, v in data.items()})

    @classmethod
    def parse(cls, text: str, base: LoraConfig | None = None) -> LoraConfig:
        """`"r=8,alpha=16,targets=*.query|*.value,rslora=true"` over `base` (default fields)."""
        if not isinstance(text, str):
            raise ConfigError.describe(
                "--lora", text, "a string such as 'r=8,alpha=16'", "pass the spec as one string"
            )
        fields: dict[str, Any] = {}
        for item in filter(None, (part.strip() for part in text.split(","))):
            key, sep, value = item.partition("=")
            if not sep:
                raise ConfigError.describe(
                    "--lora item", item, "key=value (e.g. r=8,alpha=16)", "write key=value pairs"
                )
            key = key.strip()
            if key in fields:
                raise ConfigError.describe(
                    "--lora key", key, "each key once", f"keep one {key}=... in {text!r}"
                )
            fields[key] = value.split("|") if key == "targets" else parse_value(value.strip())
        merged = {**(base or cls()).to_dict(), **fields}
        return cls.from_dict(merged, where="--lora")


def _coerce(key: str, value: Any, where: str) -> Any:
    if key == "targets":
        if isinstance(value, str):
            value = [value]
        if not isinstance(value, list | tuple) or not all(isinstance(v, str) for v in value):
            raise ConfigError.describe(
                f"{where}.targets",
                value,
                "a list of name globs or 'all-linear'",
                "e.g. ['*.attention.query', '*.attention.value']",
            )
        return tuple(value)
    if key == "alpha" and is_int(value):
        return float(value)
    return value


def _validate(c: LoraConfig) -> None:
    require(is_positive_int(c.r), "lora.r", c.r, "an int >= 1", "e.g. r=8")
    ok = is_finite_real(c.alpha) and c.alpha > 0
    require(ok, "lora.alpha", c.alpha, "a finite number > 0", "e.g. 16")
    ok = is_real(c.dropout) and 0 <= c.dropout < 1
    require(ok, "lora.dropout", c.dropout, "a float in [0, 1)", "e.g. 0.05, or 0")
    require(c.init in INITS, "lora.init", c.init, f"one of {INITS}", "pick one")
    ok = isinstance(c.rslora, bool)
    require(ok, "lora.rslora", c.rslora, "true or false", "write true/false")
    ok = bool(c.targets) and all(isinstance(t, str) and t for t in c.targets)
    globs = "a non-empty list of name globs"
    require(ok, "lora.targets", c.targets, globs, "e.g. ['*.attention.query']")
    alone = f"'{ALL_LINEAR}' alone (it already selects every block linear), or name globs"
    fix = f"write targets={ALL_LINEAR}, or list the globs"
    ok = ALL_LINEAR not in c.targets or len(c.targets) == 1
    require(ok, "lora.targets", c.targets, alone, fix)


# ---- which layers ------------------------------------------------------------------------------


def linear_layers(params_or_cfg) -> dict[str, tuple[int, int]]:
    """`{layer name: (out, in)}` of every linear projection inside the blocks, in name order.

    Accepts a `ModelConfig` (names from `declare`) or a parameter tree (float or quantized
    weights: anything with a 2-D `.shape`).
    """
    if isinstance(params_or_cfg, ModelConfig):
        shapes = {name: spec.shape for name, spec in declare(params_or_cfg).items()}
    else:
        shapes = {name: tuple(leaf.shape) for name, leaf in _flat_layers(params_or_cfg).items()}
    return {
        name.removesuffix(".weight"): shape
        for name, shape in shapes.items()
        if name.startswith("blocks.") and name.endswith(".weight") and len(shape) == 2
    }


def _flat_layers(params) -> dict[str, Any]:
    # A QuantizedWeight is a pytree, not a Mapping: flatten keeps it whole, as one "leaf".
    return ptree.flatten(params)


def target_layers(params_or_cfg, lcfg: LoraConfig) -> dict[str, tuple[int, int]]:
    """The adapted layers: `{name: (out, in)}`. A glob that selects nothing is an error, and so
    is a rank above a chosen layer's `min(out, in)`: the update `B A` can't have more rank than
    that, so the extra columns only cost memory (`r=99999999999999` asked XLA for petabytes)."""
    layers = linear_layers(params_or_cfg)
    chosen = layers if lcfg.targets == (ALL_LINEAR,) else _select(layers, lcfg.targets)
    for name, (out_f, in_f) in chosen.items():
        most = min(out_f, in_f)
        if lcfg.r > most:
            raise ConfigError.describe(
                "lora.r",
                lcfg.r,
                f"<= min(out, in) = {most} of {name} [{out_f}, {in_f}]",
                f"use r={most} or less (a higher rank adds parameters, not rank)",
            )
    return chosen


def _select(layers: dict[str, tuple[int, int]], targets) -> dict[str, tuple[int, int]]:
    for pattern in targets:
        if not any(_selects(pattern, name) for name in layers):
            example = next(iter(layers), "<none>")
            raise ConfigError.describe(
                "lora target",
                pattern,
                f"a glob matching at least one of the {len(layers)} linear layers (e.g. "
                f"{example!r}), a peft name ({', '.join(HF_TARGETS)}), or 'all-linear'",
                "check the spelling against `lmjax inspect`'s parameter names (drop '.weight')",
            )
    chosen = lambda name: any(_selects(p, name) for p in targets)  # noqa: E731
    return {name: shape for name, shape in layers.items() if chosen(name)}


def _selects(pattern: str, layer: str) -> bool:
    """A glob over the layer name (`blocks.0.attention.query`) or its weight's name, or a peft
    module name (`HF_TARGETS`)."""
    pattern = HF_TARGETS.get(pattern, pattern)
    return ptree.matches(layer, pattern) or ptree.matches(f"{layer}.weight", pattern)


# ---- parameters --------------------------------------------------------------------------------


def kaiming_bound(in_features: int) -> float:
    """peft's `kaiming_uniform_(A, a=sqrt(5))`: `sqrt(2 / (1 + a^2)) sqrt(3 / in) = 1/sqrt(in)`."""
    return 1.0 / math.sqrt(in_features)


def init(key: jax.Array, params_or_cfg, lcfg: LoraConfig, dtype=jnp.float32) -> dict:
    """Adapters `{layer: {"lora_a": A [r, in], "lora_b": B [out, r] = 0}}` as a nested dict.

    A is Kaiming-uniform `U(-1/sqrt(in), 1/sqrt(in))` (peft's default) or `N(0, 1/r^2)`
    (peft's "gaussian"); each layer's key is `fold_in(key, index)` in name order.
    """
    flat = {}
    for i, (name, (out_f, in_f)) in enumerate(target_layers(params_or_cfg, lcfg).items()):
        k = jax.random.fold_in(key, i)
        if lcfg.init == "kaiming":
            bound = kaiming_bound(in_f)
            a = jax.random.uniform(k, (lcfg.r, in_f), dtype, -bound, bound)
        else:
            a = jax.random.normal(k, (lcfg.r, in_f), dtype) / lcfg.r
        flat[f"{name}.lora_a"] = a
        flat[f"{name}.lora_b"] = jnp.zeros((out_f, lcfg.r), dtype)
    return ptree.unflatten(flat)


def adapter_layers(adapters) -> dict[str, tuple[Any, Any]]:
    """`{layer name: (A, B)}` of an adapter tree, checking its structure."""
    flat = ptree.flatten(adapters)
    layers: dict[str, tuple[Any, Any]] = {}
    for name in flat:
        layer, _, leaf = name.rpartition(".")
        if leaf not in ("lora_a", "lora_b") or not layer:
            raise ShapeError.describe(
                "adapter leaf",
                name,
                "<layer>.lora_a or <layer>.lora_b",
                "build adapters with lmjax.lora.init",
            )
        layers[layer] = (flat.get(f"{layer}.lora_a"), flat.get(f"{layer}.lora_b"))
    for layer, (a, b) in layers.items():
        if a is None or b is None or a.ndim != 2 or b.ndim != 2 or a.shape[0] != b.shape[1]:
            raise ShapeError.describe(
                f"adapter {layer}",
                (getattr(a, "shape", None), getattr(b, "shape", None)),
                "lora_a [r, in] and lora_b [out, r] with the same r",
                "build adapters with lmjax.lora.init",
            )
    return layers


def adapter_shapes(adapters) -> dict[str, tuple[int, int, int]]:
    """`{layer name: (out, in, r)}` of an adapter tree (or its `jax.eval_shape`)."""
    return {
        name: (b.shape[0], a.shape[1], a.shape[0])
        for name, (a, b) in adapter_layers(adapters).items()
    }


# ---- the forward pass --------------------------------------------------------------------------


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class Adapter:
    """One layer's adapter inside an attached tree: `adapter(x) = s (dropout(x) A^T) B^T`.

    `a [r, in]`, `b [out, r]` and the dropout `key` (None: no dropout) are pytree children (so
    `jax.grad` reaches A and B, and the compute-dtype cast of the model reaches A and B but not
    the uint32 key); `scale` and `rate` are static.
    """

    a: jax.Array
    b: jax.Array
    key: jax.Array | None
    scale: float = dataclasses.field(metadata={"static": True})
    rate: float = dataclasses.field(metadata={"static": True})

    def __call__(self, x: jax.Array) -> jax.Array:
        if self.key is not None and self.rate > 0.0:
            x = ops.dropout(self.key, x, self.rate, False)
        h_NR = jnp.einsum("...i,ri->...r", x, self.a.astype(x.dtype))
        y_NO = jnp.einsum("...r,or->...o", h_NR, self.b.astype(x.dtype))
        return y_NO * jnp.asarray(self.scale, x.dtype)


def attach(params: dict, adapters: dict, lcfg: LoraConfig, dropout_key=None) -> dict:
    """The base tree with `"lora": Adapter(...)` added to each adapted layer's dict.

    Nothing is copied: untouched sub-trees are shared. `dropout_key` (None: no dropout, as in
    evaluation and sampling) gives each layer its own key, `fold_in(dropout_key, index)`.
    """
    layers = adapter_layers(adapters)
    base = _flat_layers(params)
    out = ptree.map_with_names(lambda _, leaf: leaf, params)  # a fresh dict skeleton, same leaves
    for i, (name, (a, b)) in enumerate(layers.items()):
        _require_base_layer(name, f"{name}.weight" in base)
        _check_fits(name, a, b, tuple(base[f"{name}.weight"].shape))
        key = None
        if dropout_key is not None and lcfg.dropout > 0.0:
            key = jax.random.fold_in(dropout_key, i)
        node = out
        for part in name.split("."):
            node = node[part]
        node["lora"] = Adapter(a, b, key, lcfg.scale, lcfg.dropout)
    return out


def _require_base_layer(name: str, present: bool) -> None:
    fix = "load adapters made for this model"
    require(present, "adapter layer", name, "a linear layer of the base model", fix, ShapeError)


def _check_fits(name: str, a, b, weight_shape: tuple[int, ...]) -> None:
    out_f, in_f = weight_shape
    if a.shape[1] != in_f or b.shape[0] != out_f:
        raise ShapeError.describe(
            f"adapter {name}",
            (a.shape, b.shape),
            f"lora_a [r, {in_f}] and lora_b [{out_f}, r] for weight [{out_f}, {in_f}]",
            "load adapters made for this model",
        )


def objective(cfg, lcfg: LoraConfig):
    """The train-step objective (`lmjax.models.loss.Loss`) of LoRA fine-tuning:

        loss(adapters; base) = CE(forward(attach(base, adapters), x), y)

    differentiated with respect to the adapters only; the base model is the step's `frozen`
    argument. The step's dropout key is split between the model's dropout and the adapters'.
    """

    def fn(adapters, base, inputs_BT, targets_BT, key, **masks):  # masks: loss_fn's keywords
        model_key = adapter_key = None
        if key is not None:
            model_key, adapter_key = jax.random.split(key)
        params = attach(base, adapters, lcfg, adapter_key)
        return loss_fn(params, inputs_BT, targets_BT, cfg, model_key, **masks)

    return Loss(fn, uses_key=cfg.dropout > 0.0 or lcfg.dropout > 0.0)


# ---- merge, unmerge ----------------------------------------------------------------------------


def delta(a: jax.Array, b: jax.Array, scale: float) -> jax.Array:
    """The adapter's weight update `s B A  [out, in]`, computed in float32."""
    hi = jax.lax.Precision.HIGHEST
    return scale * jnp.matmul(b.astype(jnp.float32), a.astype(jnp.float32), precision=hi)


def _dense(weight) -> jax.Array:
    if isinstance(weight, nf4.QuantizedWeight):  # merging needs the float weight
        return nf4.dequantize(weight)
    return weight


def _apply_delta(params: dict, adapters: dict, lcfg: LoraConfig, sign: float) -> dict:
    # Every quantized weight becomes float, adapted or not: the result is a plain model.
    flat = {name: _dense(leaf) for name, leaf in _flat_layers(params).items()}
    for name, (a, b) in adapter_layers(adapters).items():
        weight = flat.get(f"{name}.weight")
        _require_base_layer(name, weight is not None)
        _check_fits(name, a, b, tuple(weight.shape))
        updated = weight.astype(jnp.float32) + sign * delta(a, b, lcfg.scale)
        flat[f"{name}.weight"] = updated.astype(weight.dtype)
    return ptree.unflatten(flat)


def merge(params: dict, adapters: dict, lcfg: LoraConfig) -> dict:
    """Plain model parameters with `W <- W + s B A` on every adapted layer (float32 math).

    Every NF4 weight of the base is dequantized (adapted or not), so a QLoRA model merges into
    a float model that `lmjax.models.forward`, `lmjax.io` and `export-hf` take as is.
    """
    return _apply_delta(params, adapters, lcfg, 1.0)


def unmerge(params: dict, adapters: dict, lcfg: LoraConfig) -> dict:
    """The inverse of `merge`: `W <- W - s B A` (equal to the base up to float rounding)."""
    return _apply_delta(params, adapters, lcfg, -1.0)


# ---- files -------------------------------------------------------------------------------------


def save_adapters(path: str | os.PathLike, adapters: dict, lcfg: LoraConfig) -> None:
    """One safetensors file: the adapter tensors, and the `LoraConfig` in its metadata."""
    adapter_layers(adapters)
    meta = {"format": "lmjax-lora", "lora": json.dumps(lcfg.to_dict())}
    safetensors.save(adapters, path, metadata=meta)


def load_adapters(path: str | os.PathLike, expected=None) -> tuple[dict, LoraConfig]:
    """`(adapters, lcfg)` from `save_adapters`' file; `expected` (an adapter tree or its
    `jax.eval_shape`) is checked name by name when given."""
    meta = safetensors.metadata(path)
    if meta.get("format") != "lmjax-lora" or "lora" not in meta:
        raise FileFormatError.describe(
            f"{path} metadata",
            meta.get("format"),
            "'lmjax-lora' with a 'lora' entry",
            "pass a file written by lmjax.lora.save_adapters (lmjax finetune's adapters)",
        )
    try:
        fields = json.loads(meta["lora"])
    except ValueError:
        raise FileFormatError.describe(
            f"{path} metadata lora", meta["lora"][:80], "a JSON object", "re-save the adapters"
        ) from None
    lcfg = LoraConfig.from_dict(fields, where=f"{path} lora")
    adapters = safetensors.load(path, expected)
    adapter_layers(adapters)
    return adapters, lcfg


def count(adapters: dict) -> int:
    """Number of trainable adapter scalars."""
    return ptree.count(adapters)


__all__ = [
    "ALL_LINEAR",
    "Adapter",
    "HF_TARGETS",
    "LoraConfig",
    "adapter_layers",
    "adapter_shapes",
    "attach",
    "count",
    "delta",
    "init",
    "kaiming_bound",
    "linear_layers",
    "load_adapters",
    "merge",
    "objective",
    "save_adapters",
    "target_layers",
    "unmerge",
]
