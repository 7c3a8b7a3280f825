"""Which layers get adapters (globs over per-layer names), and the adapters' stacked parameters:
init, stacking per-layer adapters, their per-layer view (lmjax.lora's docstring).
"""

from __future__ import annotations

import math
import re
from collections.abc import Mapping
from typing import Any

import jax
import jax.numpy as jnp

from lmjax import params as ptree
from lmjax.errors import ConfigError, ShapeError
from lmjax.lora.config import ALL_LINEAR, HF_TARGETS, LoraConfig
from lmjax.models import ModelConfig, declare_layers
from lmjax.quant import nf4

# ---- which layers ------------------------------------------------------------------------------


def linear_layers(params_or_cfg) -> dict[str, tuple[int, int]]:
    """`{layer name: (out, in)}` of every linear projection inside the blocks, per layer
    (`blocks.3.attention.query`), in name order.

    Accepts a `ModelConfig` (names from `declare_layers`) or a stacked parameter tree (float or
    quantized weights: a stacked float weight is `[N, out, in]`, an NF4 one states its layers'
    `[out, in]` as its `.shape`).
    """
    if isinstance(params_or_cfg, ModelConfig):
        shapes = {name: spec.shape for name, spec in declare_layers(params_or_cfg).items()}
    else:
        shapes = {}
        for name, leaf in ptree.flatten(params_or_cfg).items():
            if ptree.is_stacked(name):
                n, shape = ptree.stacked_size(leaf), layer_shape(leaf)
                shapes |= dict.fromkeys(ptree.layer_names(name, n), shape)
    layers = {
        name.removesuffix(".weight"): tuple(shape)
        for name, shape in shapes.items()
        if name.startswith(f"{ptree.STACKED}.") and name.endswith(".weight") and len(shape) == 2
    }
    return {name: layers[name] for name in sorted(layers, key=ptree.natural_key)}


def layer_shape(leaf) -> tuple[int, ...]:
    """One layer's shape of a stacked leaf: an NF4 weight's static `shape` already is."""
    return tuple(leaf.shape) if isinstance(leaf, nf4.QuantizedWeight) else tuple(leaf.shape[1:])


def target_layers(params_or_cfg, lcfg: LoraConfig) -> dict[str, tuple[int, int]]:
    """The adapted layers, per layer: `{blocks.{i}.<projection>: (out, in)}`. A glob that selects
    nothing is an error, and so is a rank above a chosen layer's `min(out, in)`: the update
    `B A` can't have more rank than that, so the extra columns only cost memory
    (`r=99999999999999` asked XLA for petabytes)."""
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


def targeted(projection: str, n_layers: int, lcfg: LoraConfig) -> tuple[bool, ...]:
    """Which of the N layers of a stacked projection (`blocks.attention.query`) `lcfg` targets:
    its gate (module docstring, "Stacked layers")."""
    names = ptree.layer_names(projection, n_layers)
    if lcfg.targets == (ALL_LINEAR,):
        return (True,) * n_layers
    return tuple(any(_selects(p, name) for p in lcfg.targets) for name in names)


def split_layer(layer: str) -> tuple[str, int | None]:
    """`blocks.3.attention.query` -> `("blocks.attention.query", 3)`; stacked -> `(name, None)`."""
    match = _PER_LAYER.fullmatch(layer)
    if match is None:
        return layer, None
    return f"{ptree.STACKED}.{match[2]}", int(match[1])


_PER_LAYER = re.compile(rf"{ptree.STACKED}\.(\d+)\.(.+)")


def n_layers_of(params_or_cfg) -> int:
    """N: the model's layer count, from its config or its stacked blocks."""
    if isinstance(params_or_cfg, ModelConfig):
        return params_or_cfg.n_layers
    blocks = params_or_cfg.get(ptree.STACKED) if isinstance(params_or_cfg, Mapping) else None
    if not isinstance(blocks, Mapping) or not blocks or all(k.isdecimal() for k in blocks):
        raise ShapeError.describe(
            "base parameters",
            "per-layer blocks" if blocks else "no blocks",
            "a model's stacked blocks (params['blocks'] leaves [N, ...])",
            "pass lmjax.models.init's tree, or lmjax.params.stack(params)",
        )
    return ptree.stacked_size(blocks)


# ---- parameters --------------------------------------------------------------------------------


def kaiming_bound(in_features: int) -> float:
    """peft's `kaiming_uniform_(A, a=sqrt(5))`: `sqrt(2 / (1 + a^2)) sqrt(3 / in) = 1/sqrt(in)`."""
    return 1.0 / math.sqrt(in_features)


def init(key: jax.Array, params_or_cfg, lcfg: LoraConfig, dtype=jnp.float32) -> dict:
    """Stacked adapters `{blocks: {<projection>: {"lora_a": A [N, r, in], "lora_b": B [N, out, r]
    = 0}}}` for every projection `lcfg` targets in at least one layer.

    A is Kaiming-uniform `U(-1/sqrt(in), 1/sqrt(in))` (peft's default) or `N(0, 1/r^2)`
    (peft's "gaussian"), drawn per layer: layer `blocks.{i}.<projection>` gets
    `fold_in(key, k)`, k its index among the targeted per-layer names in name order (the values
    adapters had when each layer was its own tree). A layer the targets skip has A = B = 0.
    """
    n = n_layers_of(params_or_cfg)
    chosen = target_layers(params_or_cfg, lcfg)
    index = {name: k for k, name in enumerate(chosen)}
    projections: dict[str, tuple[int, int]] = {}
    for name, shape in chosen.items():
        projections.setdefault(split_layer(name)[0], shape)
    flat = {}
    for projection, (out_f, in_f) in projections.items():
        names = ptree.layer_names(projection, n)
        ks = jnp.asarray([index.get(name, 0) for name in names])
        a = _draw_layers(key, ks, lcfg, in_f, dtype)
        gate = jnp.asarray([name in index for name in names])
        flat[f"{projection}.lora_a"] = jnp.where(gate[:, None, None], a, jnp.zeros((), dtype))
        flat[f"{projection}.lora_b"] = jnp.zeros((n, out_f, lcfg.r), dtype)
    return ptree.unflatten(flat)


def _draw_layers(key, ks: jax.Array, lcfg: LoraConfig, in_f: int, dtype) -> jax.Array:
    """A `[N, r, in]`, layer i drawn from `fold_in(key, ks[i])` (vmapped: the same values as
    drawing each layer alone)."""

    def one(k):
        layer_key = jax.random.fold_in(key, k)
        if lcfg.init == "kaiming":
            bound = kaiming_bound(in_f)
            return jax.random.uniform(layer_key, (lcfg.r, in_f), dtype, -bound, bound)
        return jax.random.normal(layer_key, (lcfg.r, in_f), dtype) / lcfg.r

    return jax.vmap(one)(ks)


def adapter_pairs(adapters) -> dict[str, tuple[Any, Any]]:
    """`{layer or projection name: (A, B)}` of an adapter tree as it is (stacked projections
    and per-layer names alike), checking each pair's shapes."""
    flat = ptree.flatten(adapters)
    pairs: dict[str, tuple[Any, Any]] = {}
    for name in flat:
        layer, _, leaf = name.rpartition(".")
        if leaf not in ("lora_a", "lora_b") or not layer:
            raise ShapeError.describe(
                "adapter leaf",
                name,
                "<layer>.lora_a or <layer>.lora_b",
                "build adapters with lmjax.lora.init",
            )
        pairs[layer] = (flat.get(f"{layer}.lora_a"), flat.get(f"{layer}.lora_b"))
    for layer, (a, b) in pairs.items():
        lead = 1 if split_layer(layer)[1] is None else 0  # a stacked pair leads with N
        if not _pair_fits(a, b, lead):
            shape = "[N, r, in] and [N, out, r]" if lead else "[r, in] and [out, r]"
            raise ShapeError.describe(
                f"adapter {layer}",
                (getattr(a, "shape", None), getattr(b, "shape", None)),
                f"lora_a and lora_b {shape} with the same r",
                "build adapters with lmjax.lora.init",
            )
    return pairs


def _pair_fits(a, b, lead: int) -> bool:
    if a is None or b is None or a.ndim != 2 + lead or b.ndim != 2 + lead:
        return False
    return a.shape[:lead] == b.shape[:lead] and a.shape[lead] == b.shape[lead + 1]


def stack_adapters(adapters, n_layers: int) -> dict:
    """Adapters under per-layer names (`blocks.3.attention.query.lora_a [r, in]`, as files and
    checkpoints held them before the blocks were stacked) -> the stacked tree `init` makes:
    each projection `[N, ...]`, zeros in the layers the tree does not name. Stacked entries
    pass through; a projection named both ways is an error."""
    pairs = adapter_pairs(adapters)
    stacked = {name: ab for name, ab in pairs.items() if split_layer(name)[1] is None}
    layers: dict[str, dict[int, tuple[Any, Any]]] = {}
    for name, ab in pairs.items():
        projection, i = split_layer(name)
        if i is None:
            continue
        if i >= n_layers or projection in stacked:
            where = "also stacked" if i < n_layers else f"past a {n_layers}-layer model"
            raise ShapeError.describe(
                "adapter layer",
                f"{name} ({where})",
                f"each of the {n_layers} layers once, stacked or per layer",
                "load adapters made for this model",
            )
        layers.setdefault(projection, {})[i] = ab
    flat = {f"{name}.{k}": x for name, (a, b) in stacked.items() for k, x in _ab(a, b).items()}
    for projection, given in layers.items():
        a, b = _stack_layers(projection, given, n_layers)
        flat |= {f"{projection}.{k}": x for k, x in _ab(a, b).items()}
    return ptree.unflatten(flat)


def _stack_layers(projection: str, given: dict[int, tuple[Any, Any]], n_layers: int):
    """`{layer i: (A_i, B_i)}` -> `(A [N, r, in], B [N, out, r])`, zeros where not given."""
    shapes = {(a.shape, b.shape) for a, b in given.values()}
    if len(shapes) != 1:
        raise ShapeError.describe(
            f"adapters of {projection}",
            sorted(shapes),
            "one shape in every layer",
            "load adapters made for this model",
        )
    a0, b0 = next(iter(given.values()))
    zeros = (jnp.zeros(a0.shape, a0.dtype), jnp.zeros(b0.shape, b0.dtype))
    layers = [given.get(i, zeros) for i in range(n_layers)]
    return jnp.stack([a for a, _ in layers]), jnp.stack([b for _, b in layers])


def _ab(a, b) -> dict[str, Any]:
    return {"lora_a": a, "lora_b": b}


def stacked_pairs(adapters, n_layers: int) -> dict[str, tuple[Any, Any]]:
    """`{projection: (A [N, r, in], B [N, out, r])}`, per-layer names stacked first."""
    pairs = adapter_pairs(stack_adapters(adapters, n_layers))
    for projection, (a, _) in pairs.items():
        if a.shape[0] != n_layers:
            raise ShapeError.describe(
                f"adapter {projection} layers",
                a.shape[0],
                n_layers,
                "load adapters made for this model",
            )
    return pairs


def _layer_view(leaf, i: int):
    """Layer i of a stacked array (or of its `jax.ShapeDtypeStruct`)."""
    if isinstance(leaf, jax.ShapeDtypeStruct):
        return jax.ShapeDtypeStruct(leaf.shape[1:], leaf.dtype)
    return leaf[i]


def adapter_layers(adapters, lcfg: LoraConfig | None = None) -> dict[str, tuple[Any, Any]]:
    """`{layer name: (A [r, in], B [out, r])}` per layer (`blocks.3.attention.query`), in name
    order, checking the tree's structure: a stacked projection's layer i is its slice i. With
    `lcfg`, only the layers it targets (the others of a partly targeted projection are gated
    off: module docstring); without, every layer the tree holds."""
    out: dict[str, tuple[Any, Any]] = {}
    for name, (a, b) in adapter_pairs(adapters).items():
        if split_layer(name)[1] is not None:
            out[name] = (a, b)
            continue
        n = a.shape[0]
        gate = targeted(name, n, lcfg) if lcfg is not None else (True,) * n
        for i, layer in enumerate(ptree.layer_names(name, n)):
            if gate[i]:
                out[layer] = (_layer_view(a, i), _layer_view(b, i))
    return {name: out[name] for name in sorted(out, key=ptree.natural_key)}


def adapter_shapes(adapters, lcfg: LoraConfig | None = None) -> dict[str, tuple[int, int, int]]:
    """`{layer name: (out, in, r)}` per layer of an adapter tree (or its `jax.eval_shape`); with
    `lcfg`, the layers it targets (`adapter_layers`)."""
    return {
        name: (b.shape[0], a.shape[1], a.shape[0])
        for name, (a, b) in adapter_layers(adapters, lcfg).items()
    }
