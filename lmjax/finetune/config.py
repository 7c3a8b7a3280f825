"""A fine-tune's config (`lmjax finetune CONFIG`): the run config with the base's model and
tokenizer, the `FinetuneSpec` it records, and the loaded base run (`load_config`).

The sections a fine-tune config may hold, and which model fields it may change, are in
`lmjax.finetune.run`'s docstring; this module reads and checks them, and encodes the corpus with
the base run's own tokenizer (`with_base_tokenized_data`). Nothing here writes a run.
"""

from __future__ import annotations

import dataclasses
import filecmp
import sys
import tempfile
from pathlib import Path
from typing import Any

import jax

from lmjax import lora, parallel
from lmjax.checks import is_int, require
from lmjax.config import RunConfig, parse_run_overrides, read_yaml, unknown_name
from lmjax.data import prepared as D
from lmjax.errors import ConfigError, TokenError
from lmjax.finetune.full import check_freeze, check_full, full_fields
from lmjax.lora import LoraConfig
from lmjax.train.finetuned import (
    FinetuneSpec,
    fingerprint,
)
from lmjax.train.rundir import FINETUNE_FILE, RunDir
from lmjax.train.runs import LoadedRun, load_run

SPEC_FILE = FINETUNE_FILE  # the names callers know (cli prints ADAPTERS_FILE and MERGED_DIR)
MODEL_FIELDS = ("dropout", "dtype", "remat", "attention", "ops")  # what a fine-tune may change
# The finetune section; `data` (SFT records, as --data) is read by `records_file`.
FINETUNE_FIELDS = ("base", "qlora", "full", "freeze", "data")


def load_config(
    path,
    overrides=(),
    lora_text: str | None = None,
    qlora: bool | None = None,
    *,
    weights=True,
    full: bool | None = None,
    freeze: str | None = None,
    out=None,
) -> tuple[RunConfig, FinetuneSpec, Any]:
    """`(run config with the base's model, spec, the loaded base run)`; nothing is written.

    `weights=False` (`lmjax inspect`) reads only the base's config: the run's `params` are None
    and the spec has no `base_sha256`. `full` / `freeze` (`--full`, `--freeze 'a.*,b.*'`) over
    `finetune.full` / `finetune.freeze` (None: keep). `out`: where a note goes (a recipe's
    train.seq_len fitted to the base; default sys.stderr at call time).
    """
    data, run_overrides = _sections(path, overrides)
    section = data.pop("finetune", None) or {}
    lora_section = data.pop("lora", None) or {}
    _check_finetune_section(section)
    use_full, globs = full_fields(section, full, freeze)
    qlora_value = section.get("qlora", False)
    require(isinstance(qlora_value, bool), "finetune.qlora", qlora_value, "true or false", "fix it")
    use_qlora = bool(qlora_value) if qlora is None else qlora
    if use_full:
        check_full(use_qlora, lora_section, lora_text)
        lcfg = None
    else:
        lcfg = LoraConfig.from_dict(lora_section)
        if lora_text is not None:
            lcfg = LoraConfig.parse(lora_text, lcfg)
    base = section.get("base")
    if not isinstance(base, str) or not base:
        raise ConfigError.describe(
            "finetune.base",
            base,
            "a run directory, RUN/checkpoints/STEP or an import-hf run",
            "set finetune.base in the config or pass finetune.base=PATH",
        )
    base_run = load_run(base) if weights else _base_config_only(base)
    if weights:
        _check_base_step(base, base_run)
    model = _model_section(data.pop("model", None) or {}, run_overrides, base_run)
    data["model"] = model
    data["data"] = _data_section(data.get("data") or {}, run_overrides, base_run)
    data["train"], note = _train_section(data.get("train"), run_overrides, base_run.model)
    cfg = RunConfig.from_dict(data, run_overrides, known_also=("finetune", "lora"))
    if weights and cfg.parallel.mesh is not None:  # before the data is prepared (and cached)
        parallel.check_mesh_shape(cfg.parallel.mesh, jax.device_count())
    resolved = str(Path(base).resolve())
    sha = fingerprint(base_run.params) if weights else None
    spec = FinetuneSpec(base, resolved, use_qlora, lcfg, base_run.step, sha, use_full, globs)
    if use_full:
        check_freeze(base_run.model, globs)
    else:
        lora.target_layers(base_run.model, lcfg)  # a target that selects nothing fails here
    if note:  # once the config is whole: a refused one is one error line
        print(note, file=out or sys.stderr)
    return cfg, spec, base_run


def _sections(path, overrides) -> tuple[dict, dict]:
    """The config's sections with the finetune.* and lora.* overrides applied, and the other
    overrides (for `RunConfig.from_dict`)."""
    data = read_yaml(path)
    if not isinstance(data, dict):
        raise ConfigError.describe("config", data, "a mapping of sections", "see configs/")
    data = {k: dict(v) if isinstance(v, dict) else v for k, v in data.items()}
    items = parse_run_overrides(list(overrides)) if not isinstance(overrides, dict) else overrides
    run_overrides = {}
    for key, value in items.items():
        section, _, field = key.partition(".")
        if section in ("finetune", "lora") and field:
            data[section] = {**(data.get(section) or {}), field: value}
        else:
            run_overrides[key] = value
    return data, run_overrides


def _check_finetune_section(section) -> None:
    if not isinstance(section, dict):
        raise ConfigError.describe(
            "finetune section",
            section,
            f"a mapping with {', '.join(FINETUNE_FIELDS)} (base: a run path)",
            "write finetune: {base: runs/NAME, qlora: false}",
        )
    unknown = sorted(str(k) for k in set(section) - set(FINETUNE_FIELDS))
    if unknown:  # a typo (finetune.bsae): the key and the nearest field, not the whole section
        raise unknown_name("finetune key", unknown[0], FINETUNE_FIELDS)
    records = section.get("data")
    ok = records is None or (isinstance(records, str) and records != "")
    fix = "write finetune.data: FILE.jsonl, or pass --data FILE.jsonl"
    require(ok, "finetune.data", records, "a .jsonl file of SFT records, or null", fix)


def records_file(path, overrides=(), data: str | None = None) -> str | None:
    """The SFT records a fine-tune trains on: `--data` (`data`), else the config's
    `finetune.data` (after overrides), else None (data.corpus, as plain text)."""
    if data is not None:
        return data
    section = _sections(path, overrides)[0].get("finetune") or {}
    _check_finetune_section(section)
    return section.get("data")


def _check_base_step(base: str, base_run) -> None:
    """`RUN/checkpoints/STEP` must name a checkpoint the base has: a weights-only run (import-hf,
    merged/) has none, and `load_run` would hand back its weights whatever STEP said."""
    step = RunDir.parse(base)[1]
    if step is not None and base_run.step != step:
        raise ConfigError.describe(
            "finetune.base",
            base,
            f"a checkpoint of {base_run.directory}"
            + (" (it holds weights only, no checkpoints)" if base_run.step is None else ""),
            f"set finetune.base={base_run.directory} to use its weights",
        )


def _base_config_only(base: str):
    run, step = RunDir.parse(base)
    run_dir = run.path
    if step is not None and not Path(base).is_dir():
        raise ConfigError.describe(
            "finetune.base",
            base,
            f"a checkpoint directory of {run_dir}",
            f"check the step (ls {run_dir / 'checkpoints'}), or set finetune.base={run_dir}",
        )
    cfg = run.read_config()
    return LoadedRun(run_dir, cfg, cfg.model_config(), None, None, step)


def _model_section(model: Any, overrides: dict, base_run) -> dict:
    if not isinstance(model, dict):
        raise ConfigError.describe("model", model, "a mapping", "write model: {dropout: 0.0}")
    changes = {**model}
    for key in [k for k in overrides if k.startswith("model.")]:
        changes[key.removeprefix("model.")] = overrides.pop(key)
    bad = sorted(set(changes) - set(MODEL_FIELDS))
    if bad:
        raise ConfigError.describe(
            "model field",
            bad[0],
            f"one of {MODEL_FIELDS} (the rest is the base model's)",
            "remove it: a fine-tune keeps the base architecture",
        )
    return {**base_run.model.to_dict(), **changes}


def _train_section(train: Any, overrides: dict, model) -> tuple[Any, str | None]:
    """`(train section, note)`: a `seq_len` longer than the base's context fitted to it, and the
    line saying so. A fine-tune keeps the base's architecture, so a recipe written for longer
    contexts (the Llama recipes' 1024) still runs on a shorter base. A
    train.seq_len given on the command line is the user's choice: refused, naming what the
    base allows."""
    context = model.context_length
    given = overrides.get("train.seq_len")
    if is_int(given) and given > context:
        raise ConfigError.describe(
            "train.seq_len",
            given,
            f"null or an int in [1, {context}] (the base's context_length; a fine-tune keeps "
            "the base's architecture)",
            f"pass train.seq_len={context} or less, or leave it out (then at most {context})",
        )
    seq_len = train.get("seq_len") if isinstance(train, dict) else None
    if "train.seq_len" in overrides or not is_int(seq_len) or seq_len <= context:
        return train, None  # RunConfig checks what is left
    note = (
        f"note: train.seq_len = {seq_len} > the base's context_length = {context}: fine-tuning "
        f"on {context}-token sequences"
    )
    return {**train, "seq_len": context}, note


def _data_section(data: Any, overrides: dict, base_run) -> dict:
    if not isinstance(data, dict):
        return data  # RunConfig reports it
    base_data = base_run.cfg.data
    given = {**data, **{k[len("data.") :]: v for k, v in overrides.items() if k[:5] == "data."}}
    out = {**data}
    out.setdefault("tokenizer", base_data.tokenizer)
    if out["tokenizer"] == "bpe":
        out.setdefault("vocab_size", base_data.vocab_size)
    # The corpus is encoded with the base's own tokenizer (with_base_tokenized_data): another
    # kind named here would only mislabel the run's config and its cached data.
    for field in ("tokenizer", "vocab_size"):
        if field in given and given[field] != getattr(base_data, field):
            raise ConfigError.describe(
                f"data.{field}",
                given[field],
                f"the base's {getattr(base_data, field)!r} (a fine-tune encodes its corpus with "
                "the base's tokenizer)",
                f"pass data.{field}={getattr(base_data, field)} (or leave it out of the config)",
            )
    return out


def require_tokenizer(base_run) -> None:
    fix = "fine-tune a run written by lmjax train or lmjax import-hf"
    where = str(base_run.directory)
    ok = base_run.tokenizer is not None
    require(ok, "base run", where, "a run with a tokenizer/ directory", fix)


def with_base_tokenized_data(cfg: RunConfig, base_run) -> RunConfig:
    """`cfg` with `data.dir` set to the corpus encoded by the base's own tokenizer (prepared once
    and cached like any data directory), so a char or BPE base fine-tunes on another corpus."""
    require_tokenizer(base_run)
    tok_dir = RunDir(base_run.directory).tokenizer_dir
    try:
        out = D.prepare_section(cfg.data, cfg.logging.progress, tokenizer_dir=tok_dir)
    except TokenError as err:
        raise ConfigError.describe(
            "data.corpus",
            cfg.data.corpus,
            f"text the base's {base_run.tokenizer.kind} tokenizer can encode ({err})",
            "fine-tune on text of the base's characters, or use a base with a byte or gpt2 "
            "tokenizer",
        ) from None
    return cfg.replace(data=dataclasses.replace(cfg.data, dir=str(out)))


def check_tokenizer(prepared, base_run) -> None:
    """The data's tokenizer must be the base run's, file for file."""
    require_tokenizer(base_run)
    with tempfile.TemporaryDirectory() as tmp:
        ours, theirs = Path(tmp) / "data", Path(tmp) / "base"
        prepared.tokenizer.save(ours)
        base_run.tokenizer.save(theirs)
        names = sorted(p.name for p in ours.iterdir())
        same = names == sorted(p.name for p in theirs.iterdir()) and all(
            filecmp.cmp(ours / n, theirs / n, shallow=False) for n in names
        )
    if not same:
        raise ConfigError.describe(
            "data tokenizer",
            f"{prepared.tokenizer.kind} of {prepared.directory}",
            f"the base run's tokenizer ({RunDir(base_run.directory).tokenizer_dir})",
            "fine-tune on data the base's tokenizer makes: byte and gpt2 work on any corpus; "
            "char and bpe vocabularies are built from the corpus, so only a corpus giving the "
            "same characters (char) or the base's own corpus (bpe) matches",
        )
