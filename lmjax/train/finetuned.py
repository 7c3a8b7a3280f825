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
from lmjax.errors import CheckpointError
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
    its path is spelled (relative, through a symlink, moved)."""
    digest = hashlib.sha256()
    for name, leaf in ptree.flatten(params).items():
        array = np.asarray(jax.device_get(leaf))
        digest.update(f"{name}:{array.dtype.str}:{array.shape};".encode())
        digest.update(np.ascontiguousarray(array).tobytes())
    return digest.hexdigest()


def frozen_params(base_params: dict, qlora: bool) -> dict:
    """The frozen base: the float parameters, or with linear weights in NF4 for QLoRA."""
    return quantize_params(base_params) if qlora else base_params


def partition(params: dict, freeze) -> tuple[dict, dict]:
    """`(trained, frozen)`: the leaves whose names match no `freeze` glob, and those matching
    one (`lmjax.params.mask`), as two nested trees under the same names."""
    frozen_mask = ptree.flatten(ptree.mask(params, tuple(freeze)))
    flat = ptree.flatten(params)
    trained = {name: leaf for name, leaf in flat.items() if not frozen_mask[name]}
    return ptree.unflatten(trained), ptree.unflatten(
        {name: leaf for name, leaf in flat.items() if frozen_mask[name]}
    )


def join(trained: dict, frozen: dict) -> dict:
    """The inverse of `partition`: one tree holding the leaves of both."""
    return ptree.unflatten(ptree.flatten(trained) | ptree.flatten(frozen))


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
        return join(trained, frozen)
    return lora.merge(frozen, trained, spec.lora)


__all__ = [
    "FinetuneSpec",
    "fingerprint",
    "frozen_params",
    "join",
    "model_params",
    "partition",
    "parts",
    "read_spec",
]
