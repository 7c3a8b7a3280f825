"""`lmjax finetune`: LoRA / QLoRA / full fine-tuning of a trained or imported model (SPEC
sections 6, 10).

A fine-tune config is a run config (`lmjax train`'s sections) without a model section, plus

    finetune: {base: RUN, qlora: false}       # RUN: a run directory, RUN/checkpoints/STEP, or
                                              # an `lmjax import-hf` run (any family)
    finetune: {..., data: FILE.jsonl}         # optional: SFT records, as --data (which wins)
    lora: {r: 8, alpha: 16, targets: [...], dropout: 0.05, init: kaiming, rslora: false}

or, for full fine-tuning (`--full`, `--freeze GLOB,...`; no lora section, no qlora):

    finetune: {base: RUN, full: true, freeze: ["token_embedding.*", "blocks.0.*"]}

where every base parameter trains except those whose name matches a `freeze` glob
(`lmjax.params.mask`): those get no gradient and no optimizer state (they are the step's frozen
argument, not part of the trained state) and are bit-identical in the result.

The model is the base run's (only `model.dropout`, `dtype`, `remat`, `attention` and `ops` may be
set); the corpus is encoded with the base run's own tokenizer (`with_base_tokenized_data`), so
any text works with a byte or GPT-2 base, and text of the base's characters with a char base.
With `qlora: true` the base's linear weights are quantized to NF4 (embeddings, norms and head
stay float) before the adapters are attached.

The run directory is `lmjax train`'s, written by the same loop (`lmjax.train.loop.train` with a
`Trainable`): config.yaml, metrics.jsonl, loss.png, samples.txt, checkpoints/ (of the adapters
and their optimizer state only; `--resume` continues), plus

    RUN/finetune.yaml          the base path, qlora and the LoRA config
    RUN/adapters.safetensors   the final adapters alone (`lmjax.lora.load_adapters`; not --full)
    RUN/merged/                the merged model as a weights-only run (generate / eval / export-hf;
                               for --full: the fine-tuned model)

`lmjax.train.load_run(RUN)` on a fine-tune run returns the merged parameters, so `lmjax
generate --run RUN`, `lmjax eval RUN` and `lmjax export-hf RUN` work on it directly too.

On a mesh (`parallel.mesh`, or several processes: `lmjax train`'s `parallel.run_mesh_shape`)
the frozen base, float or NF4, is laid out by the sharding rules (`sharded_parts`), the
adapters and their optimizer state are replicated, a full fine-tune's trained leaves are
sharded like a trained model's; the adapters and the merged model are gathered to the host and
written by process 0.
"""

from __future__ import annotations

import dataclasses
import filecmp
import shutil
import sys
import tempfile
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp

from lmjax import lora, parallel
from lmjax.checks import require
from lmjax.config import RunConfig, parse_run_overrides, read_yaml
from lmjax.errors import ConfigError, TokenError
from lmjax.finetune_memory import format_memory, memory
from lmjax.full_finetune import check_freeze, check_full, full_fields, full_trainable
from lmjax.lora import LoraConfig
from lmjax.models import abstract_params
from lmjax.train import data as D
from lmjax.train import loop, sft
from lmjax.train.finetuned import (
    FinetuneSpec,
    fingerprint,
    frozen_params,
    model_params,
    partition,
    parts,
    read_spec,
)
from lmjax.train.metrics import lora_flops_per_token
from lmjax.train.rundir import ADAPTERS_FILE, FINETUNE_FILE, MERGED_DIR, RunDir, run_label
from lmjax.train.runs import LoadedRun, load_finetuned, load_run, write_weights_run

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
) -> tuple[RunConfig, FinetuneSpec, Any]:
    """`(run config with the base's model, spec, the loaded base run)`; nothing is written.

    `weights=False` (`lmjax inspect`) reads only the base's config: the run's `params` are None
    and the spec has no `base_sha256`. `full` / `freeze` (`--full`, `--freeze 'a.*,b.*'`) over
    `finetune.full` / `finetune.freeze` (None: keep).
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
    cfg = RunConfig.from_dict(data, run_overrides)
    if weights and cfg.parallel.mesh is not None:  # before the data is prepared (and cached)
        parallel.check_mesh_shape(cfg.parallel.mesh, jax.device_count())
    resolved = str(Path(base).resolve())
    sha = fingerprint(base_run.params) if weights else None
    spec = FinetuneSpec(base, resolved, use_qlora, lcfg, base_run.step, sha, use_full, globs)
    if use_full:
        check_freeze(base_run.model, globs)
    else:
        lora.target_layers(base_run.model, lcfg)  # a target that selects nothing fails here
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
    if not isinstance(section, dict) or set(section) - set(FINETUNE_FIELDS):
        raise ConfigError.describe(
            "finetune section",
            section,
            f"a mapping with {', '.join(FINETUNE_FIELDS)} (base: a run path)",
            "write finetune: {base: runs/NAME, qlora: false}",
        )
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


def _require_tokenizer(base_run) -> None:
    fix = "fine-tune a run written by lmjax train or lmjax import-hf"
    where = str(base_run.directory)
    ok = base_run.tokenizer is not None
    require(ok, "base run", where, "a run with a tokenizer/ directory", fix)


def with_base_tokenized_data(cfg: RunConfig, base_run) -> RunConfig:
    """`cfg` with `data.dir` set to the corpus encoded by the base's own tokenizer (prepared once
    and cached like any data directory), so a char or BPE base fine-tunes on another corpus."""
    _require_tokenizer(base_run)
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
    _require_tokenizer(base_run)
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


def trainable(cfg: RunConfig, spec: FinetuneSpec, frozen: dict):
    """The loop's `Trainable` for LoRA over `frozen`."""
    model, lcfg = cfg.model_config(), spec.lora
    init = lambda key: lora.init(key, frozen, lcfg)  # noqa: E731
    shapes = lora.adapter_shapes(jax.eval_shape(init, jax.random.PRNGKey(0)))
    return loop.Trainable(
        init_params=init,
        flops_per_token=lambda model_cfg, seq_len: lora_flops_per_token(model_cfg, seq_len, shapes),
        loss=lora.objective(model, lcfg),
        frozen=frozen,
        model_params=lambda adapters: lora.attach(frozen, adapters, lcfg),
        meta={"finetune": spec.to_dict()},
        files={FINETUNE_FILE: spec.to_yaml()},
    )


def finetune(
    path,
    overrides=(),
    *,
    lora_text=None,
    qlora=None,
    resume=False,
    out=None,
    full=None,
    freeze=None,
    data=None,
):
    """Run (or resume) a fine-tune as configured; see the module docstring. `lora_text`:
    `--lora` fields over the config's; `qlora`: True/False over `finetune.qlora` (None: keep);
    `full` / `freeze`: `--full` and `--freeze`'s comma-separated globs; `data`: `--data`, a
    .jsonl of supervised fine-tuning records (`lmjax.train.sft`) instead of data.corpus (None:
    the config's finetune.data, if any).
    `out`: where progress and notes go (default: sys.stderr at the time of the call)."""
    out = sys.stderr if out is None else out  # looked up now: a redirected stderr is honoured
    cfg, spec, base_run = load_config(path, overrides, lora_text, qlora, full=full, freeze=freeze)
    data = records_file(path, overrides, data)
    run = RunDir.for_config(cfg, str(path))
    run_dir = run.path
    if resume:
        _check_same_spec(run, spec)
        _check_resume_data(run, data, path)
    else:  # the loop checks too, but after the data is prepared (and cached)
        run.check_writable(resume)
    # Before the data is prepared (and cached): a base NF4 can't hold fails with nothing written.
    init, frozen = sharded_parts(cfg, spec, base_run.params)
    cfg = prepare_base_data(cfg, base_run, sft_data=data, out=out)
    what = full_trainable(cfg, spec, init, frozen) if spec.full else trainable(cfg, spec, frozen)
    result = loop.train(cfg, config_path=str(path), resume=resume, out=out, trainable=what)
    # Host copies (over several processes a collective, so every process takes part); one
    # process writes them.
    trained = parallel.host_copy(result.params)
    merged = parallel.host_copy(_in_base_dtype(model_params(spec, frozen, result.params), base_run))
    if parallel.is_main():
        if not spec.full:
            lora.save_adapters(run.adapters_file, trained, spec.lora)
        _write_merged(run_dir, merged, base_run)
    parallel.barrier("lmjax finetune: adapters and merged model written")
    return result


def sharded_parts(cfg: RunConfig, spec: FinetuneSpec, base_params: dict):
    """`parts(spec, base)` (`(init, frozen)`) laid out on the run's mesh
    (`parallel.run_mesh_shape`: `parallel.mesh`, or data over every device of several
    processes); without one, `parts` itself.

    The frozen base, float or NF4, is sharded by the parameter rules (`lmjax.parallel.rules`:
    FSDP over d_model, tensor parallel over heads and MLP features; NF4 blocks over the same
    axes), so a device holds 1/fsdp of it. A full fine-tune's trained leaves start as the base's
    and are laid out the same way, with their optimizer state (the trainer's shardings). LoRA
    adapters are left to the trainer, which replicates them and their optimizer state: they are
    r (in + out) per layer, a fraction of a percent of the base, and a replicated A and B need no
    gather in any projection; their gradient is reduced over data x fsdp like any other.
    """
    rows = cfg.train.batch_size // cfg.train.grad_accum
    shape = parallel.run_mesh_shape(cfg.parallel.mesh, rows)
    if shape is None:
        return parts(spec, base_params)
    mesh, model = parallel.make_mesh(shape), cfg.model_config()

    def laid_out(tree):  # each device's block cut from this host's copy (every process's same)
        specs = parallel.state_specs(tree, model, shape)
        return parallel.place(tree, parallel.shardings(specs, mesh))

    if spec.full:  # trained and frozen leaves alike: split after they are laid out
        return parts(spec, laid_out(base_params))
    _, frozen = parts(spec, base_params)  # NF4 quantized here, then laid out
    frozen = laid_out(frozen)
    return (lambda key: lora.init(key, frozen, spec.lora)), frozen


def abstract_trainable(cfg: RunConfig, spec: FinetuneSpec) -> loop.Trainable:
    """The fine-tune's `Trainable` over the base's shapes alone (nothing read or allocated), as
    `finetune` builds it from real weights: what `lmjax compile` lowers a fine-tune's step from.
    A full fine-tune's trained leaves start as zeros of the base's shapes (`parts` copies real
    ones)."""
    base = abstract_params(cfg.model_config())
    if spec.full:
        trained, frozen = partition(base, spec.freeze)
        init = lambda key: jax.tree.map(lambda a: jnp.zeros(a.shape, a.dtype), trained)  # noqa: E731
        return full_trainable(cfg, spec, init, frozen)
    return trainable(cfg, spec, jax.eval_shape(lambda b: frozen_params(b, spec.qlora), base))


def prepare_base_data(cfg: RunConfig, base_run, sft_data=None, out=None) -> RunConfig:
    """`cfg` with its corpus prepared by the base's tokenizer (cached), checked to be the
    base's. The one place a fine-tune's data is made. `sft_data`: a .jsonl of prompt/completion
    or chat records instead (`lmjax.train.sft`: the loss on completion tokens only)."""
    if sft_data is not None:
        _require_tokenizer(base_run)
        tok_dir = RunDir(base_run.directory).tokenizer_dir
        cfg = sft.with_sft_data(cfg, sft_data, tok_dir, out)
    else:
        cfg = with_base_tokenized_data(cfg, base_run)
    prepared = loop.prepare_data(cfg, cfg.logging.progress)
    check_tokenizer(prepared, base_run)
    return cfg


def _check_same_spec(run: RunDir, spec: FinetuneSpec) -> None:
    fix = "check run.dir, or drop --resume to start a new fine-tune"
    expected = f"a fine-tune run (with {FINETUNE_FILE})"
    require(run.is_finetune(), "run directory to resume", str(run.path), expected, fix)
    saved = read_spec(run)
    # The base is compared by content: the same weights may be named by another path.
    if saved.base_sha256 is not None and saved.base_sha256 != spec.base_sha256:
        raise ConfigError.describe(
            "base weights on resume",
            f"{spec.base_path} (sha256 {spec.base_sha256[:12]})",
            f"the weights the run started from ({run_label(saved.base_path, saved.base_step)}, "
            f"sha256 {saved.base_sha256[:12]})",
            "point finetune.base at that base (e.g. RUN/checkpoints/STEP if it trained on), or "
            "start a new run",
        )
    fields = ("qlora", "lora", "full", "freeze")
    fields += () if saved.base_sha256 is not None else ("base_path",)
    for field in fields:
        if getattr(saved, field) != getattr(spec, field):
            raise ConfigError.describe(
                f"{field} on resume",
                getattr(spec, field),
                f"the run's {getattr(saved, field)!r}",
                "resume with the same finetune/lora settings, or start a new run",
            )


def _check_resume_data(run: RunDir, data, config_path) -> None:
    """A run fine-tuned on SFT records (`--data`) resumes only with `--data` again: data.corpus
    alone would read the records file as a text corpus."""
    saved = run.read_config().data
    if data is not None or not sft.is_sft_dir(saved.dir):
        return
    raise ConfigError.describe(
        "--data on resume",
        "not given",
        f"the SFT records the run trained on ({saved.corpus})",
        f"resume with lmjax finetune {config_path} --resume --data {saved.corpus} (and the "
        "same overrides)",
    )


def _in_base_dtype(params: dict, base_run) -> dict:
    return jax.tree.map(lambda a: a.astype(base_run.model.params_dtype), params)


def _write_merged(run_dir: Path, params: dict, base_run) -> None:
    target = RunDir(run_dir).merged_dir
    tmp = run_dir / f".{MERGED_DIR}.new"
    shutil.rmtree(tmp, ignore_errors=True)
    kind = base_run.cfg.data.tokenizer
    write_weights_run(tmp, params, base_run.model, base_run.tokenizer, kind)
    shutil.rmtree(target, ignore_errors=True)
    tmp.rename(target)


__all__ = [
    "ADAPTERS_FILE",
    "FINETUNE_FIELDS",
    "MERGED_DIR",
    "MODEL_FIELDS",
    "SPEC_FILE",
    "FinetuneSpec",
    "abstract_trainable",
    "check_tokenizer",
    "fingerprint",
    "finetune",
    "format_memory",
    "frozen_params",
    "load_config",
    "load_finetuned",
    "memory",
    "prepare_base_data",
    "records_file",
    "sharded_parts",
    "trainable",
    "with_base_tokenized_data",
]
