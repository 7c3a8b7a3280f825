"""Adapters at work: attached to the base for the forward pass, merged into it, saved and loaded
(lmjax.lora's docstring).
"""

from __future__ import annotations

import dataclasses
import json
import os
from collections.abc import Mapping

import jax
import jax.numpy as jnp

from lmjax import ops
from lmjax import params as ptree
from lmjax.checks import require
from lmjax.errors import FileFormatError, ShapeError
from lmjax.io import safetensors
from lmjax.lora.config import LoraConfig
from lmjax.lora.layers import (
    adapter_layers,
    adapter_pairs,
    adapter_shapes,
    layer_shape,
    n_layers_of,
    split_layer,
    stack_adapters,
    stacked_pairs,
    targeted,
)
from lmjax.models.loss import Loss, loss_fn
from lmjax.quant import nf4

# ---- the forward pass --------------------------------------------------------------------------


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class Adapter:
    """One layer's adapter inside an attached tree: `adapter(x) = s (dropout(x) A^T) B^T`.

    `a [r, in]`, `b [out, r]`, the dropout `key` (None: no dropout) and the `gate` (None: on; a
    bool: this layer is targeted) are pytree children, so `jax.grad` reaches A and B, the
    compute-dtype cast of the model reaches A and B but not the key or the gate, and a scan over
    the stacked blocks hands each layer its slice of all four (attached, they lead with N);
    `scale` and `rate` are static.
    """

    a: jax.Array
    b: jax.Array
    key: jax.Array | None
    scale: float = dataclasses.field(metadata={"static": True})
    rate: float = dataclasses.field(metadata={"static": True})
    gate: jax.Array | None = None

    def __call__(self, x: jax.Array) -> jax.Array:
        if self.gate is None:
            return self._delta(x)
        # A gated-off layer adds exactly nothing and its A and B get exactly zero gradient; a
        # cond (not a select) so that its two matmuls are not computed at all.
        zeros = lambda x: jnp.zeros((*x.shape[:-1], self.b.shape[-2]), x.dtype)  # noqa: E731
        return jax.lax.cond(self.gate, self._delta, zeros, x)

    def _delta(self, x: jax.Array) -> jax.Array:
        if self.key is not None and self.rate > 0.0:
            x = ops.dropout(self.key, x, self.rate, False)
        h_NR = jnp.einsum("...i,ri->...r", x, self.a.astype(x.dtype))
        y_NO = jnp.einsum("...r,or->...o", h_NR, self.b.astype(x.dtype))
        return y_NO * jnp.asarray(self.scale, x.dtype)


def attach(params: dict, adapters: dict, lcfg: LoraConfig, dropout_key=None) -> dict:
    """The stacked base tree with `"lora": Adapter(...)` added to each adapted projection's dict
    (`blocks.attention.query.lora`, its arrays `[N, ...]`: the scan over the blocks slices them
    with the weights).

    Nothing is copied: untouched sub-trees are shared. Adapters under per-layer names are
    stacked first (`stack_adapters`). A projection `lcfg` targets in some layers only gets a
    gate `[N]` that switches the others off. `dropout_key` (None: no dropout, as in evaluation
    and sampling) gives each targeted layer its own key, `fold_in(dropout_key, k)`, k its index
    among the targeted per-layer names.
    """
    n = n_layers_of(params)
    pairs = stacked_pairs(adapters, n)
    gates = {name: _require_targeted(name, targeted(name, n, lcfg)) for name in pairs}
    index = _layer_index(gates, n)
    base = ptree.flatten(params)
    out = ptree.map_with_names(lambda _, leaf: leaf, params)  # a fresh dict skeleton, same leaves
    for name, (a, b) in pairs.items():
        _require_base_layer(name, f"{name}.weight" in base)
        _check_fits(name, a, b, layer_shape(base[f"{name}.weight"]))
        keys = None
        if dropout_key is not None and lcfg.dropout > 0.0:
            ks = jnp.asarray([index.get(layer, 0) for layer in ptree.layer_names(name, n)])
            keys = jax.vmap(jax.random.fold_in, in_axes=(None, 0))(dropout_key, ks)
        gate = None if all(gates[name]) else jnp.asarray(gates[name])
        node = out
        for part in name.split("."):
            node = node[part]
        node["lora"] = Adapter(a, b, keys, lcfg.scale, lcfg.dropout, gate)
    return out


def _layer_index(gates: Mapping[str, tuple[bool, ...]], n: int) -> dict[str, int]:
    """`{per-layer name: k}` over the gated-on layers in name order (each layer's dropout key)."""
    names = [
        layer
        for name, gate in gates.items()
        for layer, on in zip(ptree.layer_names(name, n), gate, strict=True)
        if on
    ]
    return {layer: k for k, layer in enumerate(sorted(names, key=ptree.natural_key))}


def _require_targeted(name: str, gate: tuple[bool, ...]) -> tuple[bool, ...]:
    if not any(gate):
        raise ShapeError.describe(
            f"adapters of {name}",
            "in no layer lora.targets select",
            "adapters only for the projections the LoraConfig targets",
            "pass the LoraConfig the adapters were made with (lmjax.lora.load_adapters gives it)",
        )
    return gate


def _require_base_layer(name: str, present: bool) -> None:
    fix = "load adapters made for this model"
    require(present, "adapter layer", name, "a linear layer of the base model", fix, ShapeError)


def _check_fits(name: str, a, b, weight_shape: tuple[int, ...]) -> None:
    """A [N, r, in] and B [N, out, r] for a stacked weight whose layers are [out, in]."""
    out_f, in_f = weight_shape
    if a.shape[-1] != in_f or b.shape[-2] != out_f:
        raise ShapeError.describe(
            f"adapter {name} (stacked layers)",
            (a.shape[1:], b.shape[1:]),
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
    """The adapter's weight update `s B A  [..., out, in]` (one layer's, or N stacked layers'),
    computed in float32."""
    hi = jax.lax.Precision.HIGHEST
    return scale * jnp.matmul(b.astype(jnp.float32), a.astype(jnp.float32), precision=hi)


def _dense(weight) -> jax.Array:
    if isinstance(weight, nf4.QuantizedWeight):  # merging needs the float weight (all layers)
        return nf4.dequantize(weight)
    return weight


def _apply_delta(params: dict, adapters: dict, lcfg: LoraConfig, sign: float) -> dict:
    # Every quantized weight becomes float, adapted or not: the result is a plain model.
    n = n_layers_of(params)
    flat = {name: _dense(leaf) for name, leaf in ptree.flatten(params).items()}
    for name, (a, b) in stacked_pairs(adapters, n).items():
        weight = flat.get(f"{name}.weight")
        _require_base_layer(name, weight is not None)
        _check_fits(name, a, b, tuple(weight.shape[1:]))
        gate = _require_targeted(name, targeted(name, n, lcfg))
        # Layer by layer: one layer's float32 temporaries at a time, and an untargeted layer's
        # weight is kept as it is, bit for bit.
        layers = [
            _updated(weight[i], a[i], b[i], sign * lcfg.scale) if on else weight[i]
            for i, on in enumerate(gate)
        ]
        flat[f"{name}.weight"] = jnp.stack(layers)
    return ptree.unflatten(flat)


def _updated(weight, a, b, scale: float):
    return (weight.astype(jnp.float32) + delta(a, b, scale)).astype(weight.dtype)


def merge(params: dict, adapters: dict, lcfg: LoraConfig) -> dict:
    """Plain model parameters with `W <- W + s B A` on every adapted layer (float32 math); the
    layers a partly targeted projection skips keep their weight bit for bit.

    Every NF4 weight of the base is dequantized (adapted or not), so a QLoRA model merges into
    a float model that `lmjax.models.forward`, `lmjax.io` and `export-hf` take as is.
    """
    return _apply_delta(params, adapters, lcfg, 1.0)


def unmerge(params: dict, adapters: dict, lcfg: LoraConfig) -> dict:
    """The inverse of `merge`: `W <- W - s B A` (equal to the base up to float rounding)."""
    return _apply_delta(params, adapters, lcfg, -1.0)


# ---- files -------------------------------------------------------------------------------------


def save_adapters(path: str | os.PathLike, adapters: dict, lcfg: LoraConfig) -> None:
    """One safetensors file: the adapter tensors, and the `LoraConfig` and the layer count N in
    its metadata. A projection targeted in every layer is stored stacked
    (`blocks.attention.query.lora_a [N, r, in]`); one targeted in some layers, as those layers
    alone under their per-layer names (`blocks.3.attention.query.lora_a [r, in]`)."""
    pairs = adapter_pairs(adapters)
    stacked = [a for name, (a, _) in pairs.items() if split_layer(name)[1] is None]
    meta = {"format": "lmjax-lora", "lora": json.dumps(lcfg.to_dict())}
    if not stacked:  # per-layer names only (a file read without knowing N): kept as they are
        safetensors.save(adapters, path, metadata=meta)
        return
    n = stacked[0].shape[0]
    flat = {}
    for name, (a, b) in pairs.items():
        gate = targeted(name, n, lcfg) if split_layer(name)[1] is None else None
        if gate is None or all(gate):
            flat |= {f"{name}.lora_a": a, f"{name}.lora_b": b}
            continue
        for i, layer in enumerate(ptree.layer_names(name, n)):
            if gate[i]:
                flat |= {f"{layer}.lora_a": a[i], f"{layer}.lora_b": b[i]}
    safetensors.save(ptree.unflatten(flat), path, metadata=meta | {"layers": str(n)})


def load_adapters(path: str | os.PathLike, expected=None) -> tuple[dict, LoraConfig]:
    """`(adapters, lcfg)` from `save_adapters`' file, stacked as `init` makes them: per-layer
    names (a partly targeted projection, or a file written before the blocks were stacked) are
    stacked with zeros in the other layers, given N from the file or from `expected` (an
    adapter tree or its `jax.eval_shape`, checked name by name when given); an old file so
    stacked is named in one stderr line (`lmjax.params.note_converted`). An old file read
    without `expected` keeps its per-layer names; `attach` and `merge` stack them."""
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
    adapters = safetensors.load(path)
    n = _file_layers(meta, expected)
    if n is not None and "layers" not in meta:  # a file from before the blocks were stacked
        ptree.note_converted(path)
    adapters = adapters if n is None else stack_adapters(adapters, n)
    if expected is not None:
        _check_expected(path, adapters, expected)
    adapter_layers(adapters)
    return adapters, lcfg


def _file_layers(meta: Mapping[str, str], expected) -> int | None:
    if meta.get("layers", "").isdecimal():
        return int(meta["layers"])
    pairs = adapter_pairs(expected) if expected is not None else {}
    stacked = [a.shape[0] for name, (a, _) in pairs.items() if split_layer(name)[1] is None]
    return stacked[0] if stacked else None


def _check_expected(path, adapters, expected) -> None:
    got, want = ptree.flatten(adapters), ptree.flatten(expected)
    for name in sorted(got.keys() | want.keys(), key=ptree.natural_key):
        found = _shape_dtype(got.get(name))
        wanted = _shape_dtype(want.get(name))
        if found != wanted:
            raise ShapeError.describe(
                f"{path} adapter {name} (shape, dtype)",
                found or "missing",
                wanted or "no such adapter",
                "load adapters made for this model and LoRA config",
            )


def _shape_dtype(leaf) -> tuple | None:
    return None if leaf is None else (tuple(leaf.shape), str(jnp.dtype(leaf.dtype)))


def count(adapters: dict, lcfg: LoraConfig | None = None) -> int:
    """Number of trainable adapter scalars: `r (in + out)` per adapted layer. With `lcfg`, the
    layers it targets (a partly targeted projection's other layers are gated off and stay
    zero); without, every layer the tree holds."""
    return sum(r * (in_f + out_f) for out_f, in_f, r in adapter_shapes(adapters, lcfg).values())
