"""The files of a Hugging Face checkpoint directory, shared by every family's loader.

    weight_files(path) -> (safetensors files, config.json or None)
        a directory with model.safetensors or a sharded model.safetensors.index.json (its
        shards: plain names in the same directory), or one .safetensors file
    read_json(path)                        config.json / the index, FileFormatError if not JSON
    model_config(name, fields, keys, where) the preset's config; its ConfigError re-raised
                                           naming config.json's keys, not lmjax's fields
    read_headers(files, rename) -> entries  {name: (file, key, dtype, shape)}, no tensor read
    read_state(entries) -> {name: numpy}   the tensors, read once their shapes were checked
    check_finite(state, where)             no NaN/inf in a float weight
    stacked_params(flat, dtype) -> params  per-layer names (`blocks.{i}.…`) -> the stacked tree
    per_layer_flat(params) -> {name: numpy}  the inverse, for export

Every family maps names layer by layer (`blocks.{i}.…` <-> `h.{i}.…`), as the files hold them;
the model's tree stores its blocks stacked (`lmjax.params`), so the layers are stacked at the
boundary: after the mapping on import, and unstacked before it on export.

Every failure is one `lmjax.errors` line naming the file. The family modules (hf_gpt2,
hf_llama) map names and configs; nothing here knows a model.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import safetensors

from lmjax import params as ptree
from lmjax.errors import CheckpointError, ConfigError, FileFormatError, ShapeError
from lmjax.io import safetensors as st
from lmjax.models import ModelConfig, check_params, preset

FIX_CHECKPOINT = (
    "point at a Hugging Face checkpoint directory (the output of save_pretrained, "
    "or of huggingface_hub.snapshot_download)"
)

Entries = dict[str, tuple[Path, str, np.dtype, tuple]]


def weight_files(path: Path) -> tuple[list[Path], Path | None]:
    """(safetensors files, config.json or None) for a directory or a single file."""
    if not path.exists():
        raise CheckpointError.describe(
            "Hugging Face checkpoint path",
            str(path),
            "an existing directory or .safetensors file",
            "check the path (download with huggingface_hub.snapshot_download(repo_id))",
        )
    if not path.is_dir():  # a file (or a pipe, which the safetensors reader refuses)
        config = path.parent / "config.json"
        return [path], config if config.exists() else None
    config = path / "config.json"
    index = path / "model.safetensors.index.json"
    if (path / "model.safetensors").exists():
        files = [path / "model.safetensors"]
    elif index.exists():
        files = [path / name for name in _shard_names(index)]
    else:
        found = sorted(p.name for p in path.iterdir())[:8]
        hint = (
            "convert it: AutoModelForCausalLM.from_pretrained(dir).save_pretrained(out) writes "
            "model.safetensors"
            if (path / "pytorch_model.bin").exists()
            else FIX_CHECKPOINT
        )
        raise CheckpointError.describe(
            f"files in {path}", found, "model.safetensors (or its sharded index)", hint
        )
    return files, config if config.exists() else None


def read_json(path: Path):
    """The JSON in `path`; unreadable, non-UTF-8 or non-JSON content raises FileFormatError."""
    if path.exists() and not (path.is_file() or path.is_dir()):  # reading a pipe could block
        raise FileFormatError.describe(
            str(path), "a pipe, socket or device", "a regular file", FIX_CHECKPOINT
        )
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (ValueError, RecursionError) as err:  # UnicodeDecodeError is a ValueError
        raise FileFormatError.describe(str(path), str(err), "JSON", FIX_CHECKPOINT) from None
    except OSError as err:  # a directory, no permission...
        raise FileFormatError.describe(
            str(path), err.strerror or str(err), "a readable JSON file", FIX_CHECKPOINT
        ) from None


def model_config(name: str, fields: dict, keys: dict[str, str], where: str) -> ModelConfig:
    """`preset(name, **fields)`, whose checks (sizes in [1, 2**31 - 1], heads dividing the width,
    an even RoPE head size...) are the last word on config.json: a ConfigError is re-raised as
    one FileFormatError line naming the file and its keys (`keys`: lmjax field -> file key), so
    `model.n_heads` reads `num_attention_heads`. Nothing is allocated before this check."""
    try:
        return preset(name, **fields)
    except ConfigError as err:
        names = "|".join(sorted(keys, key=len, reverse=True))
        text = re.sub(rf"\b(?:model\.)?({names})\b", lambda m: keys[m.group(1)], str(err))
        text = text.partition(". Fix: ")[0]
        fix = "restore the checkpoint's own config.json (its sizes must describe its weights)"
        raise ConfigError(f"{where} {text}. Fix: {fix}.") from None


def _shard_names(index: Path) -> list[str]:
    """The shard file names of `model.safetensors.index.json`: plain names in its directory."""
    index_json = read_json(index)
    weight_map = index_json.get("weight_map") if isinstance(index_json, dict) else None
    if not isinstance(weight_map, dict) or not weight_map:
        raise FileFormatError.describe(
            f"{index} weight_map",
            weight_map,
            "a non-empty JSON object {tensor name: file name}",
            FIX_CHECKPOINT,
        )
    for key, name in weight_map.items():
        plain = isinstance(name, str) and name not in ("", ".", "..")
        if not (plain and "/" not in name and "\\" not in name and Path(name).name == name):
            raise FileFormatError.describe(
                f"{index} weight_map[{key!r}]",
                name,
                f"a plain file name inside {index.parent} (no directories)",
                FIX_CHECKPOINT,
            )
    return sorted(set(weight_map.values()))


def read_headers(files: list[Path], rename: Callable[[str], str | None]) -> Entries:
    """`{name: (file, key, dtype, shape)}` from the validated headers (no tensor is read).

    `rename(key)` is the family's name for a stored key (a prefix dropped), or None for a key
    that is no parameter (a mask buffer); two keys of one name are a CheckpointError.
    """
    entries: Entries = {}
    for file in files:
        for key, (dtype, shape) in st.read_header(file)[0].items():
            name = rename(key)
            if name is None:
                continue
            if name in entries:
                raise CheckpointError.describe(
                    f"{file}: key", key, "each parameter once", "remove the duplicate"
                )
            entries[name] = (file, key, dtype, shape)
    return entries


def read_state(entries: Entries) -> dict[str, np.ndarray]:
    """The tensors of `entries` (checked against the config first, so sizes are known).

    bf16 and f16 come back as numpy arrays of that dtype (ml_dtypes' bfloat16); the caller casts.
    """
    state: dict[str, np.ndarray] = {}
    for file in dict.fromkeys(file for file, *_ in entries.values()):
        try:
            with safetensors.safe_open(str(file), framework="numpy") as handle:
                for name, (where, key, _, _) in entries.items():
                    if where == file:
                        state[name] = handle.get_tensor(key)
        except (safetensors.SafetensorError, OSError, ValueError) as err:
            raise FileFormatError.describe(
                f"{file}: contents", str(err), "a readable safetensors file", FIX_CHECKPOINT
            ) from None
    return state


def check_finite(state: dict[str, np.ndarray], where: Path) -> None:
    """Every float weight is finite: a NaN or inf means a corrupt file (no checkpoint holds one)."""
    for name, array in state.items():
        if array.dtype.kind in "biu":  # integers can't be NaN
            continue
        finite = np.isfinite(array.astype(np.float32, copy=False))
        if not finite.all():
            raise CheckpointError.describe(
                f"{where}: {name}",
                f"{finite.size - int(finite.sum())} NaN/inf values",
                "finite weights",
                "download or export the checkpoint again (it is corrupt)",
            )


def check_layers(names, n_layers: int, prefix: str, config_key: str, where: Path) -> None:
    """The weights hold blocks `{prefix}0 .. {prefix}{n-1}`, no more, no fewer.

    Checked from the names alone, before the expected names are listed (n_layers of them per
    block): a config.json claiming 10**8 layers would otherwise cost minutes and gigabytes.
    """
    pattern = re.compile(re.escape(prefix) + r"(\d+)\.")
    found = {m.group(1) for m in map(pattern.match, names) if m}
    if len(found) != n_layers or found != {str(i) for i in range(n_layers)}:
        blocks = sorted(found, key=lambda i: (len(i), i))
        shown = ", ".join(f"{prefix}{i}" for i in blocks[:4]) + (", ..." if len(blocks) > 4 else "")
        shown = shown or f"no {prefix}N.* names"
        raise CheckpointError.describe(
            f"{where}: blocks in the weights",
            f"{len(found)} ({shown})",
            f"{prefix}0 .. {prefix}{n_layers - 1} ({n_layers} layers, {config_key} in the config)",
            "point at the config.json saved with these weights",
        )


def check_tied(state: dict, head: str, embedding: str, where: Path) -> None:
    """A stored `head` weight of a tied model must equal the token `embedding` it is tied to."""
    if head in state and not np.array_equal(state[head], state[embedding]):
        raise CheckpointError.describe(
            f"{where}: {head}",
            f"differs from {embedding}",
            "tied (equal) weights (tie_word_embeddings is true)",
            "set tie_word_embeddings to false in config.json, or re-tie the model before export",
        )


def check_export_dtypes(params: dict, cfg: ModelConfig) -> None:
    """The params fit `cfg`, every leaf in cfg.param_dtype (the dtype config.json states)."""
    check_params(params, cfg)
    for name, leaf in ptree.flatten(params).items():
        if np.dtype(leaf.dtype) != np.dtype(cfg.param_dtype):
            raise ShapeError.describe(
                f"parameter {name} dtype",
                np.dtype(leaf.dtype),
                f"{cfg.param_dtype} (the config's param_dtype, written to config.json)",
                "cast the params to cfg.param_dtype, or export with a config whose param_dtype "
                "matches them",
            )


def stacked_params(flat: dict[str, np.ndarray], dtype: str) -> dict:
    """The model tree of a family's flat per-layer tensors (`blocks.{i}.…`, numpy): the
    layers stacked into `[N, ...]` leaves (`lmjax.params.stack`), each a jax array of `dtype`."""
    stacked = ptree.stack(ptree.unflatten(flat))  # numpy: stacked on the host
    return jax.tree.map(lambda a: jnp.asarray(a, dtype=dtype), stacked)


def per_layer_flat(params: dict) -> dict[str, np.ndarray]:
    """A model tree's tensors under their per-layer names (`blocks.{i}.…`), as numpy: what a
    family maps to its file's names (the inverse of `stacked_params`, dtype kept)."""
    host = jax.tree.map(np.asarray, params)  # one transfer a stacked leaf; slices are views
    return ptree.flatten(ptree.unstack(host))
