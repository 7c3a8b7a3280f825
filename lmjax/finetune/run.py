"""`lmjax finetune`: LoRA / QLoRA / full fine-tuning of a trained or imported model
(docs/fine-tuning.md).

A fine-tune config is a run config (`lmjax train`'s sections) without a model section, plus

    finetune: {base: RUN, qlora: false}       # RUN: a run directory, RUN/checkpoints/STEP, or
                                              # an `lmjax import-hf` run (any family)
    finetune: {..., data: FILE.jsonl}         # optional: SFT records, as --data (which wins)
    lora: {r: 8, alpha: 16, targets: [...], dropout: 0.05, init: kaiming, rslora: false}

or, for full fine-tuning (`--full`, `--freeze GLOB,...`; no lora section, no qlora):

    finetune: {base: RUN, full: true, freeze: ["token_embedding.*", "blocks.0.*"]}

where every base parameter trains except those whose name matches a `freeze` glob (per-layer
names, `lmjax.finetune.full`): those get no gradient and no optimizer state (they are the step's
frozen argument, not part of the trained state) and are bit-identical in the result; a stacked
block leaf frozen in some layers only trains with a zero gradient on those (`full`).

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
import shutil
import sys
from pathlib import Path

import jax
import jax.numpy as jnp

from lmjax import lora, parallel
from lmjax.chat import run_stop_ids
from lmjax.checks import require
from lmjax.config import RunConfig
from lmjax.data import sft
from lmjax.errors import ConfigError
from lmjax.files import replace_dir
from lmjax.finetune.config import (
    check_tokenizer,
    load_config,
    records_file,
    require_tokenizer,
    with_base_tokenized_data,
)
from lmjax.finetune.full import full_trainable
from lmjax.finetune.notes import adapters_line, finished
from lmjax.models import abstract_params
from lmjax.train import loop
from lmjax.train.finetuned import (
    FinetuneSpec,
    frozen_params,
    model_params,
    partition,
    parts,
    read_spec,
)
from lmjax.train.metrics import lora_flops_per_token
from lmjax.train.rundir import FINETUNE_FILE, STAGED_MERGED, RunDir, run_label
from lmjax.train.runs import write_weights_run


def trainable(cfg: RunConfig, spec: FinetuneSpec, frozen: dict):
    """The loop's `Trainable` for LoRA over `frozen`."""
    model, lcfg = cfg.model_config(), spec.lora
    init = lambda key: lora.init(key, frozen, lcfg)  # noqa: E731
    # Per layer, the targeted layers only: a gated-off layer's adapter does no work to count.
    shapes = lora.adapter_shapes(jax.eval_shape(init, jax.random.PRNGKey(0)), lcfg)
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
    .jsonl of supervised fine-tuning records (`lmjax.data.sft`) instead of data.corpus (None:
    the config's finetune.data, if any).
    `out`: where progress and notes go (default: sys.stderr at the time of the call)."""
    out = sys.stderr if out is None else out  # looked up now: a redirected stderr is honoured
    cfg, spec, base_run = load_config(
        path, overrides, lora_text, qlora, full=full, freeze=freeze, out=out
    )
    data = records_file(path, overrides, data)
    run = RunDir.for_config(cfg, str(path))
    run_dir = run.path
    if resume:
        _check_same_spec(run, spec)
        _check_resume_data(run, data, path)
        done = finished(run, cfg.train.steps, spec.full)  # said; nothing read or written
        if done is not None:
            return done
    else:  # the loop checks too, but after the data is prepared (and cached)
        run.check_writable(resume)
    # Before the data is prepared (and cached): a base NF4 can't hold fails with nothing written.
    init, frozen = sharded_parts(cfg, spec, base_run.params)
    cfg = prepare_base_data(cfg, base_run, sft_data=data, out=out)
    what = full_trainable(cfg, spec, init, frozen) if spec.full else trainable(cfg, spec, frozen)
    if not spec.full:  # said once the run is checked: what trains, and over what base
        what = dataclasses.replace(
            what, notes=(adapters_line(spec, cfg.model_config(), init, frozen),)
        )
    if cfg.logging.sample_chat is not None:  # a chat sample ends where a chat reply would
        what = dataclasses.replace(what, stop_ids=tuple(run_stop_ids(base_run)))
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
    or chat records instead (`lmjax.data.sft`: the loss on completion tokens only)."""
    if sft_data is not None:
        require_tokenizer(base_run)
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
    """RUN/merged/, built whole beside it and put in its place (`replace_dir`): a kill leaves
    the old merged model, the new one or none, never one half written or half removed."""
    staged = run_dir / STAGED_MERGED
    shutil.rmtree(staged, ignore_errors=True)  # one a kill left, complete or not
    kind = base_run.cfg.data.tokenizer
    write_weights_run(staged, params, base_run.model, base_run.tokenizer, kind)
    replace_dir(staged, RunDir(run_dir).merged_dir)
