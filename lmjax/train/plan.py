"""A run resolved once: config, data and run directory, checked before anything is written.

    plan = make_plan(cfg, config_path="configs/x.yaml", resume=False)
    plan.cfg     the config to train: vocab size from the data, decay length pinned (or the
                 resumed run's, with only `RESUMABLE_CHANGES` differing from the saved one)
    plan.model   plan.cfg.model_config(), resolved once
    plan.run     the `RunDir`, checked writable (new, or resumable)
    plan.data    the prepared data, opened
    plan.mesh_shape  the device mesh the run trains on (`parallel.run_mesh_shape`), or None

Everything that would otherwise fail later (a split shorter than a sequence, a sample prompt
the tokenizer can't encode or that leaves no room, a mesh the devices can't hold) fails here.
"""

from __future__ import annotations

import dataclasses
import sys
from typing import Any

from lmjax import parallel
from lmjax.checks import require
from lmjax.config import RunConfig
from lmjax.data import prepared as D
from lmjax.data.sft import is_sft_dir
from lmjax.data.sft_rows import SFTSplit
from lmjax.errors import ConfigError, LMJaxError
from lmjax.models import ModelConfig
from lmjax.train.rundir import RunDir
from lmjax.train.sampling import prompt_ids
from lmjax.train.wandb_log import require_installed

# Sections a resumed run may change: how long to train and how to log/checkpoint, never what.
RESUMABLE_CHANGES = (
    "train.steps",
    "train.eval_every",
    "train.eval_batches",
    "train.tensorboard",
    "train.wandb",
    "train.wandb_project",
    "run.",
    "logging.",
    "checkpoint.",
    "parallel.",  # a checkpoint restores onto any mesh
    # How the program runs the same model (docs/models.md#scanned-layers): a run saved before
    # `remat: auto` and scanning were the defaults recorded `remat: none`.
    "model.remat",
    "model.scan_layers",
)


@dataclasses.dataclass(frozen=True)
class Plan:
    """What `lmjax train` trains, resolved (see the module docstring)."""

    cfg: RunConfig
    model: ModelConfig
    run: RunDir
    data: D.Prepared
    resume: bool
    mesh_shape: dict[str, int] | None = None  # `parallel.run_mesh_shape`; None: one device

    @property
    def tokens_per_step(self) -> int:
        return self.cfg.train.batch_size * self.cfg.seq_len


def make_plan(
    cfg: RunConfig, *, config_path: str | None, resume: bool, finetune: bool = False
) -> Plan:
    """Resolve and check a run (`finetune`: the run trains adapters over a frozen base)."""
    require_installed(cfg.train.wandb)  # before anything (the data cache) is written
    run = RunDir.for_config(cfg, config_path)
    started_afresh = run.never_started()
    resume = run.check_writable(resume)
    if started_afresh and parallel.is_main():
        print(
            f"lmjax: {run.path} holds no config.yaml and no checkpoint (a run stopped while it "
            "started): starting a new run in it",
            file=sys.stderr,
            flush=True,
        )
    # A fine-tune's checkpoints hold adapters, not a model: restoring them as one would fail
    # after config.yaml had been rewritten.
    ok = not (resume and not finetune and run.is_finetune())
    fix = "it is a fine-tune: continue it with lmjax finetune CONFIG --resume"
    require(ok, "run directory to resume", str(run.path), "a run written by lmjax train", fix)
    prepared = prepare_data(cfg, cfg.logging.progress)
    cfg = resolve(cfg, prepared)
    cfg = resumed_config(run, cfg) if resume else pin_schedule(cfg)
    model = cfg.model_config()
    preflight(cfg, model, prepared)
    # The mesh against the device count and the batch, before anything is written.
    rows = cfg.train.batch_size // cfg.train.grad_accum
    mesh_shape = parallel.run_mesh_shape(cfg.parallel.mesh, rows)
    return Plan(cfg, model, run, prepared, resume, mesh_shape)


def prepare_data(cfg: RunConfig, progress: bool = True, tokenizer_dir=None) -> D.Prepared:
    """Prepare (or reuse) the config's data and open it; `tokenizer_dir`: encode with that saved
    tokenizer instead of building one from the corpus (a fine-tune encodes with its base's)."""
    return D.open_prepared(D.prepare_section(cfg.data, progress, tokenizer_dir=tokenizer_dir))


def resolve(cfg: RunConfig, prepared: D.Prepared) -> RunConfig:
    """Fill model.vocab_size from the data (when null), and model.tokenizer_size when the
    embedding has more rows than the data's tokenizer has ids (a padded vocabulary); a tokenizer
    larger than the embedding is refused (`D.check_vocab`)."""
    if cfg.vocab_from_data:
        cfg = cfg.with_vocab_size(prepared.vocab_size)
    size = D.check_vocab(prepared, cfg.model_config()).tokenizer_size
    if size != cfg.model.get("tokenizer_size"):
        cfg = cfg.replace(model={**cfg.model, "tokenizer_size": size})
    return cfg


def pin_schedule(cfg: RunConfig) -> RunConfig:
    """Write the decay length into the config, so extending a run keeps its schedule.

    A run no longer than its warmup (a smoke run, `train.steps=3` under 50 warmup steps) pins
    the decay to start right after the warmup: every step it takes is on the warmup ramp."""
    if cfg.schedule.decay_steps is not None:
        return cfg
    decay_steps = max(cfg.train.steps, cfg.schedule.warmup_steps + 1)
    return cfg.replace(schedule=dataclasses.replace(cfg.schedule, decay_steps=decay_steps))


def warmup_only_note(cfg: RunConfig) -> str | None:
    """The line that says a run ends inside its warmup (the learning rate never reaches its
    peak), or None when the run is longer than the warmup."""
    steps, warmup = cfg.train.steps, cfg.schedule.warmup_steps
    if steps > warmup:
        return None
    return (
        f"note: train.steps = {steps} <= schedule.warmup_steps = {warmup}: the learning rate "
        f"follows the warmup ramp for the whole run, reaching {steps}/{warmup} of optimizer.lr "
        f"= {cfg.optimizer.lr:g}"
    )


def preflight(cfg: RunConfig, model: ModelConfig, prepared: D.Prepared) -> None:
    """What would otherwise fail at the first evaluation, checked before anything is written."""
    for name, tokens in (("train", prepared.train), ("validation", prepared.val)):
        if isinstance(tokens, SFTSplit):  # a row is one record padded: any record makes one
            continue
        require(
            len(tokens) >= cfg.seq_len + 1,
            f"{name} split of {prepared.directory}",
            f"{len(tokens)} tokens",
            f"at least train.seq_len + 1 = {cfg.seq_len + 1}",
            "lower train.seq_len, use a longer corpus, or change data.val_fraction",
        )
    g = cfg.logging
    if g.sample_tokens == 0:
        return
    what = "logging.sample_prompt" if g.sample_chat is None else "logging.sample_chat"
    text = g.sample_prompt if g.sample_chat is None else g.sample_chat
    try:
        ids = prompt_ids(prepared.tokenizer, g)
    except ConfigError:
        raise
    except LMJaxError as err:
        expected = f"text the tokenizer can encode ({err})"
        fix = "change the prompt or set logging.sample_tokens=0"
        raise ConfigError.describe(what, text, expected, fix) from None
    room = model.context_length - len(ids)
    require(
        bool(ids) and g.sample_tokens <= room,
        "logging.sample_tokens",
        g.sample_tokens,
        f"<= context_length - prompt tokens = {room} and a non-empty prompt",
        f"lower logging.sample_tokens or shorten {what}",
    )


def _flat(cfg: RunConfig) -> dict[str, Any]:
    """`section.field -> value`, with the model section as the resolved `ModelConfig`."""
    sections = {**cfg.to_dict(), "model": cfg.model_config().to_dict()}
    return {f"{s}.{k}": v for s, fields in sections.items() for k, v in fields.items()}


def resumed_config(run: RunDir, cfg: RunConfig) -> RunConfig:
    """The config to resume with: the saved schedule length, and nothing else changed."""
    saved = pin_schedule(run.read_config())
    if cfg.schedule.decay_steps is None:  # keep the run's schedule when steps are extended
        schedule = dataclasses.replace(cfg.schedule, decay_steps=saved.schedule.decay_steps)
        cfg = cfg.replace(schedule=schedule)
    old, new = _flat(saved), _flat(cfg)
    sft_records = saved.data.corpus if is_sft_dir(saved.data.dir) else None
    for key in sorted(set(old) | set(new)):
        fix = f"resume with {key}={_override_text(old.get(key))} or start a new run"
        if sft_records is not None and key in ("data.corpus", "data.dir"):
            # The records file is not a corpus: data.corpus=FILE would read it as text.
            fix = f"resume with --data {sft_records} (the run's SFT records) or start a new run"
        require(
            old.get(key) == new.get(key) or key.startswith(RESUMABLE_CHANGES),
            f"{key} on resume",
            new.get(key),
            f"the run's value {old.get(key)!r} (only {', '.join(RESUMABLE_CHANGES)} may change)",
            fix,
        )
    latest = run.latest_step()
    require(
        latest is None or cfg.train.steps >= latest,
        "train.steps on resume",
        cfg.train.steps,
        f">= the newest checkpoint's step {latest}",
        f"resume with train.steps={latest} or more",
    )
    return cfg


def _override_text(value) -> str:
    return (
        "null" if value is None else str(value).lower() if isinstance(value, bool) else str(value)
    )


__all__ = [
    "Plan",
    "RESUMABLE_CHANGES",
    "make_plan",
    "pin_schedule",
    "preflight",
    "prepare_data",
    "resolve",
    "resumed_config",
    "warmup_only_note",
]
