"""What a fine-tuned run directory records of its base: `RUN/finetune.yaml` (`FinetuneSpec`).

    finetune: {base, base_path, qlora, base_step, base_sha256}
    lora:     {r, alpha, targets, dropout, init, rslora}

`lmjax.finetune` writes it; `lmjax.train.runs.load_run` reads it to rebuild the model a
fine-tuned run's adapters belong to (its base, frozen as it was trained: float or NF4). Both sit
on this module, so reading a run never imports the layer that fine-tunes.
"""

from __future__ import annotations

import dataclasses
import hashlib
from typing import Any

import jax
import numpy as np
import yaml

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
    lora: LoraConfig
    base_step: int | None = None  # the base checkpoint's step (None: a weights-only run)
    base_sha256: str | None = None  # `fingerprint` of the base's parameters

    def to_dict(self) -> dict[str, Any]:
        section = {"base": self.base, "base_path": self.base_path, "qlora": self.qlora}
        section |= {"base_step": self.base_step, "base_sha256": self.base_sha256}
        return {"finetune": section, "lora": self.lora.to_dict()}

    def to_yaml(self) -> str:
        return yaml.safe_dump(self.to_dict(), sort_keys=False)

    @classmethod
    def from_dict(cls, data: Any, where: str) -> FinetuneSpec:
        try:
            f = data["finetune"]
            lcfg = LoraConfig.from_dict(data["lora"])
            step, sha = f.get("base_step"), f.get("base_sha256")
            return cls(f["base"], f["base_path"], f["qlora"], lcfg, step, sha)
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


__all__ = ["FinetuneSpec", "fingerprint", "frozen_params", "read_spec"]
