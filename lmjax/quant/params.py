"""Quantize a model's linear weights to NF4, and count the bytes (docs/fine-tuning.md, QLoRA).

Only the `[out, in]` weights of the attention and feed-forward projections are quantized:
embeddings, norms, biases and the language-model head stay float (as in QLoRA, where the
frozen base is NF4 but the input and output layers keep their precision).

The blocks are stored stacked (`lmjax.params`): `blocks.attention.query.weight [N, out, in]`
becomes one stacked `QuantizedWeight` whose layers are quantized one by one (the bytes each
layer had as a weight of its own; `lmjax.quant.nf4.quantize_layers`), so patterns are globs over
per-layer names (`blocks.*.attention.query.weight`) that pick a projection in every layer or in
none.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping

import jax
import numpy as np

from lmjax import params as ptree
from lmjax.errors import ShapeError
from lmjax.quant.nf4 import QuantizedWeight, quantize, quantize_layers

# Every projection of a block (GPT-2 style expand/project and Llama style gate/up/down).
_PROJECTIONS = {
    "attention": ("query", "key", "value", "output"),
    "feed_forward": ("expand", "project", "gate", "up", "down"),
}
LINEAR_WEIGHTS = tuple(
    f"blocks.*.{part}.{name}.weight" for part, names in _PROJECTIONS.items() for name in names
)


def quantize_params(params: Mapping, patterns: str | Iterable[str] | None = None) -> dict:
    """A copy of `params` with every leaf matching `patterns` replaced by `quantize(leaf)`.

    `patterns`: globs over `lmjax.params` names (default `LINEAR_WEIGHTS`, the block
    projections). Given explicitly, every pattern must match a leaf (a typo raises); with the
    default, at least one leaf must match. A matched leaf must be a 2-D float weight that is
    not already quantized, and one of `LINEAR_WEIGHTS` (the patterns only narrow the default):
    embedding tables are gathered by row, never multiplied, and the head stays float
    (docs/fine-tuning.md), so selecting them is an error rather than a model that fails later.
    """
    chosen = LINEAR_WEIGHTS if patterns is None else patterns
    flat = ptree.flatten(params)
    picked = {name: _picked(name, leaf, chosen) for name, leaf in flat.items()}
    if patterns is not None:
        ptree.mask(params, chosen, require_match=True)  # a pattern matching nothing: a typo
    if not any(picked.values()):
        raise ShapeError.describe(
            "quantize_params patterns",
            chosen,
            "globs matching at least one parameter name",
            "pass patterns that name linear weights, e.g. 'blocks.*.attention.query.weight'",
        )

    def convert(name, leaf):
        if not picked[name]:
            return leaf
        stacked = ptree.is_stacked(name) and not isinstance(leaf, QuantizedWeight)
        if isinstance(leaf, QuantizedWeight) or np.ndim(leaf) != 2 + stacked:
            raise ShapeError.describe(
                f"parameter {name!r}",
                type(leaf).__name__ if isinstance(leaf, QuantizedWeight) else np.shape(leaf),
                "a 2-D [out, in] float weight (stacked: [layers, out, in]) that is not "
                "quantized yet",
                "narrow the patterns to linear weights",
            )
        if not is_linear_weight(name, leaf):
            raise ShapeError.describe(
                f"parameter {name!r}",
                "not a block projection",
                "a weight matching lmjax.quant.params.LINEAR_WEIGHTS: embeddings, norms and the "
                "head stay float",
                "narrow the patterns to block projections, e.g. 'blocks.*.attention.*.weight'",
            )
        return quantize_leaf(name, leaf)

    return ptree.map_with_names(convert, params)


def is_linear_weight(name: str, leaf) -> bool:
    """Whether the leaf is a block projection's weight (`LINEAR_WEIGHTS`; stacked: in every
    layer), what `quantize_params` quantizes by default."""
    return all(ptree.layers_matched(name, leaf, LINEAR_WEIGHTS))


def quantize_leaf(name: str, leaf) -> QuantizedWeight:
    """One weight in NF4: a stacked block leaf `[N, out, in]` layer by layer
    (`quantize_layers`), any other `[out, in]` as it is (`quantize`)."""
    return quantize_layers(leaf) if ptree.is_stacked(name) else quantize(leaf)


def _picked(name: str, leaf, patterns) -> bool:
    """Whether `patterns` pick the leaf: a stacked one in every layer, or none (one stacked NF4
    weight holds all of them)."""
    chosen = ptree.layers_matched(name, leaf, patterns)
    if all(chosen) or not any(chosen):
        return all(chosen)
    layers = [i for i, on in enumerate(chosen) if on]
    rest = name.removeprefix(ptree.STACKED + ".")
    raise ShapeError.describe(
        f"quantize_params patterns over {name}",
        f"layers {layers} of {len(chosen)}",
        "every layer of a projection or none (its layers are one stacked NF4 weight)",
        f"quantize it in every layer, e.g. '{ptree.STACKED}.*.{rest}'",
    )


def _leaf_bytes(leaf) -> int:
    if isinstance(leaf, QuantizedWeight):
        return leaf.nbytes
    # Arrays, ShapeDtypeStructs (under jax.eval_shape) and pytree leaves such as adapters.
    return sum(int(np.prod(a.shape)) * np.dtype(a.dtype).itemsize for a in jax.tree.leaves(leaf))


def weight_bytes(params: Mapping) -> dict[str, int]:
    """Bytes of a parameter tree, split by kind:

    `quantized` (the NF4 leaves as stored), `quantized_as_float` (what those leaves took in
    their original dtype), `float` (every other leaf), `total` = quantized + float, and
    `quantized_params` (how many weights are NF4).
    """
    flat = ptree.flatten(params)
    quant = [leaf for leaf in flat.values() if isinstance(leaf, QuantizedWeight)]
    other = [leaf for leaf in flat.values() if not isinstance(leaf, QuantizedWeight)]
    stored = sum(_leaf_bytes(q) for q in quant)
    floats = sum(_leaf_bytes(leaf) for leaf in other)
    return {
        "quantized": stored,
        "quantized_as_float": sum(q.weights * np.dtype(q.dtype).itemsize for q in quant),
        "float": floats,
        "total": stored + floats,
        "quantized_params": sum(q.weights for q in quant),  # every layer of a stacked weight
    }


__all__ = [
    "LINEAR_WEIGHTS",
    "is_linear_weight",
    "quantize_leaf",
    "quantize_params",
    "weight_bytes",
]
