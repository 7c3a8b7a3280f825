"""What a fine-tuned run directory records of its base: `RUN/finetune.yaml` (`FinetuneSpec`).

    finetune: {base, base_path, qlora, base_step, base_sha256, full, freeze}
    lora:     {r, alpha, targets, dropout, init, rslora}     (null for a full fine-tune)

`lmjax.finetune` writes it; `lmjax.train.runs.load_run` reads it to rebuild the model a
fine-tuned run's adapters belong to (its base, frozen as it was trained: float or NF4). Both sit
on this module, so reading a run never imports the layer that fine-tunes.

Two kinds of fine-tune split the base in two, the trained tree (the loop's state: the checkpoint
holds it and its optimizer state) and the frozen one (the step's `frozen` argument):

    LoRA / QLoRA   trained = adapters (lora.init)       frozen = the base (NF4 linears: QLoRA)
    full (--full)  trained = the base's leaves matching  frozen = the leaves matching a `freeze`
                   no `freeze` glob (their base values)   glob (no gradient, no optimizer state)

A stacked block leaf (`lmjax.params`: `blocks.attention.query.weight [N, ...]`) that a glob
freezes in some layers only (`blocks.0.*`) is in both: trained, with its frozen layers' slices
zero, and frozen, whole. `join` takes each layer from the frozen copy where frozen and from the
trained one elsewhere (`jnp.where`), so the frozen slices are the base's bit for bit, their
gradient is exactly zero (not counted in the global norm, as when they were leaves of their
own), and a zero slice with a zero gradient stays zero under SGD, Adam and AdamW alike.

`parts(spec, base)` gives `(init, frozen)` and `model_params(spec, frozen, trained)` the plain
model (LoRA merged, or the two halves joined).
"""

from __future__ import annotations

import dataclasses
import hashlib
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import yaml

from lmjax import lora
from lmjax import params as ptree
from lmjax.errors import CheckpointError, ShapeError
from lmjax.lora import LoraConfig
from lmjax.quant.params import quantize_params
from lmjax.train.rundir import RunDir


@dataclasses.dataclass(frozen=True)
class FinetuneSpec:
    base: str  # the base run as given
    base_path: str  # ... resolved (absolute, symlinks followed) when the fine-tune started
    qlora: bool
    lora: LoraConfig | None  # None: a full fine-tune
    base_step: int | None = None  # the base checkpoint's step (None: a weights-only run)
    base_sha256: str | None = None  # `fingerprint` of the base's parameters
    full: bool = False  # train the base's own parameters (lora is None), not adapters
    freeze: tuple[str, ...] = ()  # full: globs over parameter names kept frozen

    @property
    def kind(self) -> str:
        """How messages name it: "LoRA", "QLoRA" or "full"."""
        return "full" if self.full else "QLoRA" if self.qlora else "LoRA"

    def to_dict(self) -> dict[str, Any]:
        section = {"base": self.base, "base_path": self.base_path, "qlora": self.qlora}
        section |= {"base_step": self.base_step, "base_sha256": self.base_sha256}
        section |= {"full": self.full, "freeze": list(self.freeze)}
        return {"finetune": section, "lora": None if self.lora is None else self.lora.to_dict()}

    def to_yaml(self) -> str:
        return yaml.safe_dump(self.to_dict(), sort_keys=False)

    @classmethod
    def from_dict(cls, data: Any, where: str) -> FinetuneSpec:
        try:
            f = data["finetune"]
            full, freeze = bool(f.get("full", False)), tuple(f.get("freeze") or ())
            lcfg = None if full else LoraConfig.from_dict(data["lora"])
            step, sha = f.get("base_step"), f.get("base_sha256")
            return cls(f["base"], f["base_path"], f["qlora"], lcfg, step, sha, full, freeze)
        except (KeyError, TypeError, AttributeError):
            raise CheckpointError.describe(
                where,
                "incomplete",
                "finetune: {base, base_path, qlora, ...} and lora: {...}",
                "restore the file (lmjax finetune writes it) or start a new run",
            ) from None


def read_spec(run: RunDir) -> FinetuneSpec:
    """The `FinetuneSpec` a fine-tuned run directory holds (`CheckpointError` if incomplete)."""
    where = run.finetune_file
    return FinetuneSpec.from_dict(yaml.safe_load(where.read_text(encoding="utf-8")), str(where))


def fingerprint(params) -> str:
    """sha256 over the parameters' names, dtypes, shapes and bytes: the base's identity, however
    its path is spelled (relative, through a symlink, moved). Taken layer by layer
    (`lmjax.params.unstack`: `blocks.{i}.…`), so a base's fingerprint does not depend on how
    its blocks are stored (fine-tunes recorded it before they were stacked)."""
    digest = hashlib.sha256()
    host = jax.tree.map(lambda leaf: np.asarray(jax.device_get(leaf)), params)
    for name, array in ptree.flatten(ptree.unstack(host)).items():
        digest.update(f"{name}:{array.dtype.str}:{array.shape};".encode())
        digest.update(np.ascontiguousarray(array).tobytes())
    return digest.hexdigest()


def frozen_params(base_params: dict, qlora: bool) -> dict:
    """The frozen base: the float parameters, or with linear weights in NF4 for QLoRA."""
    return quantize_params(base_params) if qlora else base_params


def partition(params: dict, freeze) -> tuple[dict, dict]:
    """`(trained, frozen)`: the leaves whose names match no `freeze` glob, and those matching
    one (`lmjax.params.layer_matches`: stacked leaves by their per-layer names), as two nested
    trees under the same names. A stacked leaf frozen in some layers only is in both: trained
    with those slices zero, frozen whole (module docstring)."""
    trained, frozen = {}, {}
    for name, leaf in ptree.flatten(params).items():
        layers = frozen_layers(name, leaf, freeze)
        if layers is True:
            frozen[name] = leaf
        elif layers is False:
            trained[name] = leaf
        else:
            trained[name], frozen[name] = _zero_layers(leaf, layers), leaf
    return ptree.unflatten(trained), ptree.unflatten(frozen)


def frozen_layers(name: str, leaf, freeze) -> bool | tuple[bool, ...]:
    """Whether `freeze` freezes the leaf: a bool, or for a stacked leaf frozen in some layers
    only, one bool per layer."""
    chosen = ptree.layer_matches(name, leaf, tuple(freeze))
    if isinstance(chosen, tuple) and (all(chosen) or not any(chosen)):
        return all(chosen)
    return chosen


def _layer_mask(layers: tuple[bool, ...], ndim: int) -> np.ndarray:
    """`[N, 1, ...]`: True on the frozen layers, broadcasting over a stacked leaf."""
    return np.asarray(layers).reshape((-1,) + (1,) * (ndim - 1))


def _zero_layers(leaf, layers: tuple[bool, ...]):
    if isinstance(leaf, jax.ShapeDtypeStruct):  # traced: nothing to fill
        return leaf
    return jnp.where(_layer_mask(layers, leaf.ndim), jnp.zeros((), leaf.dtype), leaf)


def join(trained: dict, frozen: dict, freeze=()) -> dict:
    """The inverse of `partition`: one tree holding the leaves of both. A leaf in both (frozen
    in some layers by `freeze`, the globs `partition` had) takes its frozen layers from
    `frozen`, the others from `trained`."""
    flat_trained, flat_frozen = ptree.flatten(trained), ptree.flatten(frozen)
    out = flat_trained | flat_frozen
    for name in flat_trained.keys() & flat_frozen.keys():
        layers = frozen_layers(name, flat_frozen[name], freeze)
        if not isinstance(layers, tuple):
            raise ShapeError.describe(
                f"{name} in both the trained and the frozen tree",
                f"freeze {list(freeze)} frozen {'every' if layers else 'no'} layer of it",
                "the freeze globs that partition split it with (some of its layers frozen)",
                "join with the spec's freeze globs (FinetuneSpec.freeze)",
            )
        mask = _layer_mask(layers, flat_frozen[name].ndim)
        out[name] = jnp.where(mask, flat_frozen[name], flat_trained[name])
    return ptree.unflatten(out)


def parts(spec: FinetuneSpec, base_params: dict):
    """`(init, frozen)`: `init(key)` gives the trained tree at step 0 (LoRA's adapters, or the
    base's unfrozen leaves), `frozen` the step's frozen argument."""
    if spec.full:
        trained, frozen = partition(base_params, spec.freeze)
        # Copies: the train step donates its state, and the base's arrays must outlive it.
        return (lambda key: jax.tree.map(jnp.copy, trained)), frozen
    frozen = frozen_params(base_params, spec.qlora)
    return (lambda key: lora.init(key, frozen, spec.lora)), frozen


def model_params(spec: FinetuneSpec, frozen: dict, trained: dict) -> dict:
    """The plain model a fine-tune's trained tree makes with its frozen part: LoRA merged into
    the base (NF4 dequantized), or the full fine-tune's two halves joined."""
    if spec.full:
        return join(trained, frozen, spec.freeze)
    return lora.merge(frozen, trained, spec.lora)


__all__ = [
    "FinetuneSpec",
    "fingerprint",
    "frozen_layers",
    "frozen_params",
    "join",
    "model_params",
    "partition",
    "parts",
    "read_spec",
]
