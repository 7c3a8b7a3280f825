"""`RunConfig`: everything `lmjax train` needs, loaded from YAML + overrides and validated once."""

from __future__ import annotations

import dataclasses
import typing
from typing import Any

from lmjax.checks import require
from lmjax.config.overrides import parse_overrides
from lmjax.config.sections import (
    DECAYS,
    OPTIMIZERS,
    SECTIONS,
    CheckpointConfig,
    DataConfig,
    LoggingConfig,
    OptimizerConfig,
    ParallelConfig,
    RunSection,
    ScheduleConfig,
    TrainConfig,
    validate_data,
)
from lmjax.config.typed import build_section, hint_options, require_mapping, unknown_name
from lmjax.config.yaml_file import read_yaml
from lmjax.errors import ConfigError
from lmjax.models import ModelConfig, preset
from lmjax.parallel.mesh import check_batch, check_mesh_shape

_SECTION_NAMES = ["model", *SECTIONS]


@dataclasses.dataclass(frozen=True)
class RunConfig:
    """A whole run: the model (a preset name plus field overrides) and every other section.

    `model` stays a plain mapping until the data is known: with `vocab_size` null (the usual
    case) the tokenizer's vocabulary size fills it in (`with_vocab_size`), so one config works
    for any corpus. `model_config()` builds the validated `ModelConfig`.
    """

    model: dict[str, Any]
    optimizer: OptimizerConfig = OptimizerConfig()
    schedule: ScheduleConfig = ScheduleConfig()
    data: DataConfig = DataConfig()
    train: TrainConfig = TrainConfig()
    run: RunSection = RunSection()
    checkpoint: CheckpointConfig = CheckpointConfig()
    logging: LoggingConfig = LoggingConfig()
    parallel: ParallelConfig = ParallelConfig()

    def __post_init__(self):
        _validate_run(self)

    def model_config(self) -> ModelConfig:
        fields = dict(self.model)
        if self.vocab_from_data or ("preset" not in fields and "vocab_size" not in fields):
            raise ConfigError.describe(
                "model.vocab_size", None, "an int", "set it, or let `lmjax train` take it from data"
            )
        name = fields.pop("preset", None)
        fix = "e.g. model.preset=gpt"
        require(
            name is None or isinstance(name, str),
            "model.preset",
            name,
            "a preset name (a string)",
            fix,
        )
        return preset(name, **fields) if name else ModelConfig.from_dict(fields)

    @property
    def vocab_from_data(self) -> bool:
        """`model.vocab_size: null`: the tokenizer decides (absent: the preset's value)."""
        return "vocab_size" in self.model and self.model["vocab_size"] is None

    def with_vocab_size(self, vocab_size: int) -> RunConfig:
        return self.replace(model={**self.model, "vocab_size": vocab_size})

    @property
    def seq_len(self) -> int:
        return self.train.seq_len or self._model_with_any_vocab().context_length

    def _model_with_any_vocab(self) -> ModelConfig:
        """The model config, with vocab_size 1 if the data is still to decide it."""
        if self.vocab_from_data:  # tokenizer_size dropped too: it may not exceed vocab_size
            model = {**self.model, "vocab_size": 1, "tokenizer_size": None}
            return self.replace(model=model).model_config()
        return self.model_config()

    def replace(self, **changes) -> RunConfig:
        return dataclasses.replace(self, **changes)

    def to_dict(self) -> dict[str, Any]:
        out = {"model": dict(self.model)}
        for name in SECTIONS:
            section = dataclasses.asdict(getattr(self, name))
            out[name] = {k: list(v) if isinstance(v, tuple) else v for k, v in section.items()}
        return out

    @classmethod
    def from_dict(
        cls, data: Any, overrides: dict[str, Any] | None = None, known_also: tuple[str, ...] = ()
    ) -> RunConfig:
        """Build from nested mappings (YAML) plus dotted `overrides`; unknown keys are errors.
        `known_also`: sections the caller has read and removed (a fine-tune's `finetune` and
        `lora`), listed with these in the error for an unknown section."""
        sections = [*_SECTION_NAMES, *known_also]
        data = _apply_overrides(require_mapping(data, "config"), overrides or {}, sections)
        unknown = sorted(set(data) - set(_SECTION_NAMES))
        if unknown:
            raise unknown_name("config section", unknown[0], sections)
        model = require_mapping({} if data.get("model") is None else data["model"], "model")
        sections = {
            name: build_section(cls_, {} if data.get(name) is None else data[name], name)
            for name, cls_ in SECTIONS.items()
        }
        return cls(model=dict(model), **sections)


def load_run_config(path, overrides: list[str] | dict[str, Any] = ()) -> RunConfig:
    """Read a YAML run config and apply `key=value` overrides (`model.n_layers=4`)."""
    # list("a=1") would be its characters
    fix = f"pass [{overrides!r}]"
    ok = not isinstance(overrides, str)
    require(ok, "overrides", overrides, "a list of 'key=value' strings", fix)
    if not isinstance(overrides, dict):
        overrides = parse_run_overrides(list(overrides))
    return RunConfig.from_dict(read_yaml(path), overrides)


def parse_run_overrides(items: list[str]) -> dict[str, Any]:
    """`parse_overrides`, but a string field keeps the text as written: `run.dir=007` is the
    directory "007" and `logging.sample_prompt=1.50` the prompt "1.50", not 7 and 1.5 (and
    `=true` the text "true"; `=null` is still None where the field allows it)."""
    out = parse_overrides(items)
    texts = {}
    for item in items:
        key, _, text = item.partition("=")
        texts[key.strip()] = text.strip()
    for key, value in out.items():
        section, _, field = key.partition(".")
        hint = typing.get_type_hints(SECTIONS[section]).get(field) if section in SECTIONS else None
        options = hint_options(hint)
        scalar = isinstance(value, int | float)  # bools included: "true" for a str-only field
        if scalar and str in options and not {int, float, bool} & set(options):
            out[key] = texts[key]
    return out


def _apply_overrides(
    data: dict[str, Any], overrides: dict[str, Any], sections: list[str]
) -> dict[str, Any]:
    """`{"model.n_layers": 4}` sets `data["model"]["n_layers"]`; sections are copied first.
    `sections`: the command's section names, for the error naming an unknown one."""
    data = {k: dict(v) if isinstance(v, dict) else v for k, v in data.items()}
    for key, value in overrides.items():
        section, dot, field = key.partition(".")
        expected = "section.field (e.g. model.n_layers=4, train.steps=100)"
        ok = bool(dot and field) and "." not in field
        require(ok, "override key", key, expected, "prefix the field with its section")
        if section not in _SECTION_NAMES:
            raise unknown_name("override section", section, sections)
        current = {} if data.get(section) is None else data[section]
        data[section] = {**require_mapping(current, section), field: value}
    return data


def _validate_run(cfg: RunConfig) -> None:
    """Range checks across sections (types were checked when the sections were built)."""
    require_mapping(cfg.model, "model")
    context = cfg._model_with_any_vocab().context_length  # raises on a bad preset, field or value
    _validate_optimizer(cfg.optimizer, cfg.schedule)
    validate_data(cfg.data)
    _validate_train(cfg.train, context)
    c, g = cfg.checkpoint, cfg.logging
    require(c.every >= 1, "checkpoint.every", c.every, "an int >= 1", "e.g. 500")
    require(c.keep >= 1, "checkpoint.keep", c.keep, "an int >= 1", "e.g. 3")
    require(g.every >= 1, "logging.every", g.every, "an int >= 1", "e.g. 10")
    require(g.sample_tokens >= 0, "logging.sample_tokens", g.sample_tokens, ">= 0", "e.g. 200")
    temp = g.sample_temperature
    require(temp >= 0, "logging.sample_temperature", temp, ">= 0 (0 = greedy)", "e.g. 0.8")
    peak = g.peak_flops
    require(peak is None or peak > 0, "logging.peak_flops", peak, "> 0 or null", "leave it null")
    if cfg.parallel.mesh is not None:
        check_batch(
            cfg.train.batch_size // cfg.train.grad_accum, check_mesh_shape(cfg.parallel.mesh)
        )


def _validate_optimizer(o: OptimizerConfig, s: ScheduleConfig) -> None:
    require(o.name in OPTIMIZERS, "optimizer.name", o.name, f"one of {OPTIMIZERS}", "pick one")
    ok = o.lr > 0 and o.lr < float("inf")
    require(ok, "optimizer.lr", o.lr, "a finite float > 0", "e.g. 3e-4")
    for name in ("b1", "b2", "momentum"):
        value = getattr(o, name)
        require(0 <= value < 1, f"optimizer.{name}", value, "a float in [0, 1)", "e.g. 0.9")
    require(o.eps > 0, "optimizer.eps", o.eps, "a float > 0", "e.g. 1e-8")
    require(o.weight_decay >= 0, "optimizer.weight_decay", o.weight_decay, ">= 0", "e.g. 0.1")
    clip = o.clip_norm
    require(clip is None or clip > 0, "optimizer.clip_norm", clip, "> 0 or null", "e.g. 1.0")
    require(s.decay in DECAYS, "schedule.decay", s.decay, f"one of {DECAYS}", "pick one")
    require(s.warmup_steps >= 0, "schedule.warmup_steps", s.warmup_steps, ">= 0", "e.g. 100")
    require(
        s.decay_steps is None or s.decay_steps > s.warmup_steps,
        "schedule.decay_steps",
        s.decay_steps,
        f"null or > warmup_steps = {s.warmup_steps}",
        "lengthen it, or leave it null (train.steps; a run no longer than its warmup then "
        "stays on the warmup ramp), or lower schedule.warmup_steps",
    )
    ratio = s.final_lr_ratio
    require(0 <= ratio <= 1, "schedule.final_lr_ratio", ratio, "a float in [0, 1]", "e.g. 0.1")


def _validate_train(t: TrainConfig, context: int) -> None:
    require(0 <= t.seed < 2**31, "train.seed", t.seed, "an int in [0, 2**31)", "e.g. 0")
    for name in ("steps", "batch_size", "grad_accum", "eval_every", "eval_batches"):
        value = getattr(t, name)
        require(value >= 1, f"train.{name}", value, "an int >= 1", "use a positive integer")
    require(
        t.batch_size % t.grad_accum == 0,
        "train.batch_size",
        t.batch_size,
        f"a multiple of train.grad_accum = {t.grad_accum}",
        "each micro-batch holds batch_size / grad_accum sequences",
    )
    require(
        t.seq_len is None or 1 <= t.seq_len <= context,
        "train.seq_len",
        t.seq_len,
        f"null or an int in [1, model.context_length = {context}]",
        "lower it or raise model.context_length",
    )
