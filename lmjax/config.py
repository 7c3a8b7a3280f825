"""Configuration helpers shared by the command line and the library.

`parse_overrides(["n_layers=4", "bias=false"])` turns `key=value` strings into typed values:
integers, floats (`1e-5` too, which YAML 1.1 would leave a string), `true`/`false`, `null`,
else the string itself.
"""

from __future__ import annotations

import dataclasses
import math
import os
import types
import typing
from collections.abc import Hashable
from typing import Any

from lmjax.errors import ConfigError

# Only these spellings are special, so string options such as "yes" or "none" (remat=none)
# stay strings.
_WORDS = {"true": True, "false": False, "null": None}


def parse_value(text: str) -> Any:
    """`"4"` -> 4, `"1e-5"` -> 1e-05, `"true"` -> True, `"null"` -> None, `"none"` -> "none"."""
    for convert in (int, float):
        try:
            value = convert(text)
        except ValueError:
            continue
        # float() also reads "nan", "inf" and "infinity": those stay strings (run.dir=nan).
        if any(c.isdigit() for c in text):
            return value
    return _WORDS.get(text.lower(), text)


def parse_overrides(items: list[str]) -> dict[str, Any]:
    """`["a.b=1", "c=x"]` -> `{"a.b": 1, "c": "x"}`; a later key overrides an earlier one."""
    out: dict[str, Any] = {}
    for item in items:
        if not isinstance(item, str):
            raise ConfigError.describe(
                "override", item, "a 'key=value' string", "pass overrides as strings"
            )
        key, sep, text = item.partition("=")
        if not sep or not key.strip():
            raise ConfigError.describe(
                "override", item, "key=value (e.g. n_layers=4)", "write the key, '=', the value"
            )
        out[key.strip()] = parse_value(text.strip())
    return out


# ---------------------------------------------------------------------------------------------
# RunConfig: everything `lmjax train` needs, loaded from YAML + overrides and validated once.


@dataclasses.dataclass(frozen=True)
class OptimizerConfig:
    """optax optimizer. `no_decay`: name globs exempt from AdamW weight decay (SPEC section 5)."""

    name: str = "adamw"  # adamw | adam | sgd
    lr: float = 3e-4  # peak learning rate (after warmup)
    b1: float = 0.9
    b2: float = 0.95
    eps: float = 1e-8
    weight_decay: float = 0.1  # adamw only
    no_decay: tuple[str, ...] = ("*.bias", "*norm.scale", "*embedding.weight")
    momentum: float = 0.9  # sgd only
    nesterov: bool = False  # sgd only
    clip_norm: float | None = 1.0  # global-norm clipping; null disables


@dataclasses.dataclass(frozen=True)
class ScheduleConfig:
    """Linear warmup from 0 to `lr`, then `decay` down to `lr * final_lr_ratio`."""

    warmup_steps: int = 100
    decay: str = "cosine"  # cosine | linear | constant
    decay_steps: int | None = None  # warmup + decay; null = train.steps (>= warmup_steps + 1)
    final_lr_ratio: float = 0.1


@dataclasses.dataclass(frozen=True)
class DataConfig:
    """`corpus`: "shakespeare" (the bundled corpus) or a text file; prepared into `dir`."""

    corpus: str = "shakespeare"
    dir: str | None = None  # prepared token files; null = a cache dir keyed by corpus + tokenizer
    tokenizer: str = "char"  # char | byte | bpe (trained on the corpus) | gpt2 (GPT-2's own)
    vocab_size: int | None = None  # bpe only: the trained vocabulary size
    val_fraction: float = 0.1


@dataclasses.dataclass(frozen=True)
class TrainConfig:
    steps: int = 1000
    batch_size: int = 32  # sequences per optimizer step (split over grad_accum micro-batches)
    seq_len: int | None = None  # null = model.context_length
    grad_accum: int = 1
    seed: int = 0
    eval_every: int = 250
    eval_batches: int = 20


@dataclasses.dataclass(frozen=True)
class RunSection:
    dir: str | None = None  # null = runs/<config file stem>


@dataclasses.dataclass(frozen=True)
class CheckpointConfig:
    every: int = 500  # and always at the last step
    keep: int = 3  # newest checkpoints kept on disk


@dataclasses.dataclass(frozen=True)
class LoggingConfig:
    every: int = 10  # metrics.jsonl / progress-bar refresh period in steps
    progress: bool = True
    plot: bool = True
    sample_tokens: int = 200  # text sampled at each evaluation; 0 disables
    sample_prompt: str = "\n"
    sample_temperature: float = 0.8
    peak_flops: float | None = None  # for MFU; null = measure a matmul on the device


@dataclasses.dataclass(frozen=True)
class ParallelConfig:
    """Device mesh (SPEC section 9, `lmjax.parallel`): `mesh: {data: 2, fsdp: 4}` (model: 1).

    null (the default) trains on one device exactly as before; the axis sizes' product must
    equal the device count, checked when the run starts. An override may write the mesh as
    text: `parallel.mesh=data=2,fsdp=4`.
    """

    mesh: dict[str, int] | str | None = None

    def __post_init__(self):
        if isinstance(self.mesh, str):
            from lmjax.parallel.mesh import parse_mesh_text

            object.__setattr__(self, "mesh", parse_mesh_text(self.mesh, "parallel.mesh"))


_SECTIONS = {
    "optimizer": OptimizerConfig,
    "schedule": ScheduleConfig,
    "data": DataConfig,
    "train": TrainConfig,
    "run": RunSection,
    "checkpoint": CheckpointConfig,
    "logging": LoggingConfig,
    "parallel": ParallelConfig,
}


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

    def model_config(self):
        from lmjax.models import ModelConfig, preset

        fields = dict(self.model)
        if self.vocab_from_data or ("preset" not in fields and "vocab_size" not in fields):
            raise ConfigError.describe(
                "model.vocab_size", None, "an int", "set it, or let `lmjax train` take it from data"
            )
        name = fields.pop("preset", None)
        if name is not None and not isinstance(name, str):
            raise ConfigError.describe(
                "model.preset", name, "a preset name (a string)", "e.g. model.preset=gpt"
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

    def _model_with_any_vocab(self):
        if self.vocab_from_data:
            return self.with_vocab_size(1).model_config()
        return self.model_config()

    def replace(self, **changes) -> RunConfig:
        return dataclasses.replace(self, **changes)

    def to_dict(self) -> dict[str, Any]:
        out = {"model": dict(self.model)}
        for name in _SECTIONS:
            section = dataclasses.asdict(getattr(self, name))
            out[name] = {k: list(v) if isinstance(v, tuple) else v for k, v in section.items()}
        return out

    @classmethod
    def from_dict(cls, data: Any, overrides: dict[str, Any] | None = None) -> RunConfig:
        """Build from nested mappings (YAML) plus dotted `overrides`; unknown keys are errors."""
        data = _apply_overrides(_require_mapping(data, "config"), overrides or {})
        unknown = sorted(set(data) - {"model", *_SECTIONS})
        if unknown:
            raise ConfigError.describe(
                "config section", unknown[0], f"one of {['model', *_SECTIONS]}", "fix or remove it"
            )
        model = _require_mapping({} if data.get("model") is None else data["model"], "model")
        sections = {
            name: _build_section(cls_, {} if data.get(name) is None else data[name], name)
            for name, cls_ in _SECTIONS.items()
        }
        return cls(model=dict(model), **sections)


def load_run_config(path, overrides: list[str] | dict[str, Any] = ()) -> RunConfig:
    """Read a YAML run config and apply `key=value` overrides (`model.n_layers=4`)."""
    if isinstance(overrides, str):  # list("a=1") would be its characters
        raise ConfigError.describe(
            "overrides", overrides, "a list of 'key=value' strings", f"pass [{overrides!r}]"
        )
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
        hint = (
            typing.get_type_hints(_SECTIONS[section]).get(field) if section in _SECTIONS else None
        )
        options = typing.get_args(hint) if typing.get_origin(hint) is types.UnionType else (hint,)
        scalar = isinstance(value, int | float)  # bools included: "true" for a str-only field
        if scalar and str in options and not {int, float, bool} & set(options):
            out[key] = texts[key]
    return out


def read_yaml(path) -> Any:
    """A config file's YAML (`{}` when empty), with one-line errors and duplicate keys refused."""
    import yaml

    from lmjax.errors import FileFormatError

    if not isinstance(path, str | os.PathLike):  # open(3) would read, then close, descriptor 3
        raise ConfigError.describe(
            "config file", path, "a path (a str or os.PathLike)", "pass e.g. 'configs/tiny.yaml'"
        )
    try:
        with open(path, encoding="utf-8") as handle:
            data = yaml.load(handle, Loader=_unique_key_loader())
    except FileNotFoundError:
        raise ConfigError.describe(
            "config file", str(path), "an existing YAML file", "check the path (see configs/)"
        ) from None
    except IsADirectoryError:
        raise ConfigError.describe(
            "config file", str(path), "a YAML file, not a directory", "pass configs/<name>.yaml"
        ) from None
    except ConfigError:
        raise  # a repeated or unhashable key (the loader's own check)
    except (yaml.YAMLError, UnicodeDecodeError, ValueError) as err:
        # ValueError: an int literal over Python's 4,300-digit limit for int(str).
        first = " ".join(str(err).split())
        raise FileFormatError.describe(
            f"config file {path}", f"unparseable YAML ({first})", "valid YAML", "fix the syntax"
        ) from None
    except RecursionError:
        raise FileFormatError.describe(
            f"config file {path}", "nested deeper than the YAML reader's recursion limit",
            "a config: sections of key: value, a few levels deep", "flatten the nesting",
        ) from None  # fmt: skip
    return {} if data is None else data


def _unique_key_loader():
    import yaml

    # libyaml's parser (when PyYAML has it) refuses nesting past 1,000 levels at once; the pure
    # Python one takes seconds to reach its recursion limit on such a file.
    class Loader(getattr(yaml, "CSafeLoader", yaml.SafeLoader)):
        """SafeLoader that refuses a key given twice in one mapping (YAML keeps the last)."""

    def construct_mapping(loader, node, deep=False):
        seen = set()
        for key_node, _ in node.value:
            if key_node.tag == "tag:yaml.org,2002:merge":
                continue  # `<<: *base`: merged entries may be overridden (construct_mapping)
            key = loader.construct_object(key_node, deep=True)  # a list key, filled in
            if not isinstance(key, Hashable):
                raise ConfigError.describe(
                    "config key", key, f"a string (line {key_node.start_mark.line + 1})",
                    "write a plain key: a list or mapping can't name a field",
                )  # fmt: skip
            if key in seen:
                line = key_node.start_mark.line + 1
                raise ConfigError.describe(
                    "config key", key, f"once per mapping (repeated on line {line})",
                    "merge the two entries",
                )  # fmt: skip
            seen.add(key)
        return loader.construct_mapping(node, deep=deep)

    Loader.add_constructor(yaml.resolver.BaseResolver.DEFAULT_MAPPING_TAG, construct_mapping)
    return Loader


def _require_mapping(value: Any, where: str) -> dict[str, Any]:
    if not isinstance(value, dict):
        raise ConfigError.describe(
            where, value, "a mapping of key: value", f"write {where} as a YAML mapping"
        )
    bad = [k for k in value if not isinstance(k, str)]
    if bad:
        raise ConfigError.describe(f"{where} key", bad[0], "a string", "quote the key")
    return value


def _apply_overrides(data: dict[str, Any], overrides: dict[str, Any]) -> dict[str, Any]:
    """`{"model.n_layers": 4}` sets `data["model"]["n_layers"]`; sections are copied first."""
    data = {k: dict(v) if isinstance(v, dict) else v for k, v in data.items()}
    for key, value in overrides.items():
        section, dot, field = key.partition(".")
        if not dot or not field or "." in field:
            raise ConfigError.describe(
                "override key",
                key,
                "section.field (e.g. model.n_layers=4, train.steps=100)",
                "prefix the field with its section",
            )
        if section not in ("model", *_SECTIONS):
            raise ConfigError.describe(
                "override section", section, f"one of {['model', *_SECTIONS]}", "fix the key"
            )
        current = {} if data.get(section) is None else data[section]
        data[section] = {**_require_mapping(current, section), field: value}
    return data


def _build_section(cls, values: Any, where: str):
    values = _require_mapping(values, where)
    hints = typing.get_type_hints(cls)
    unknown = sorted(set(values) - set(hints))
    if unknown:
        raise ConfigError.describe(
            f"{where} key", unknown[0], f"one of {sorted(hints)}", "fix the spelling or remove it"
        )
    return cls(**{k: _coerce(v, hints[k], f"{where}.{k}") for k, v in values.items()})


def _coerce(value: Any, hint: Any, where: str) -> Any:
    """Check `value` against a field's type hint; ints are accepted for floats, lists for tuples."""
    options = typing.get_args(hint) if typing.get_origin(hint) is types.UnionType else (hint,)
    if value is None:
        if type(None) in options:
            return None
        raise ConfigError.describe(where, None, _type_name(hint), "give it a value")
    for option in options:
        if option is bool and isinstance(value, bool):
            return value
        if option is int and isinstance(value, int) and not isinstance(value, bool):
            # Steps, sizes and counts become int32 arrays (optax's step count, shapes).
            _check(-(2**31) <= value < 2**31, where, value, "an int in [-2**31, 2**31)", "lower it")
            return value
        if option is float and isinstance(value, int | float) and not isinstance(value, bool):
            return _finite(float(value), where, value)
        if option is float and isinstance(value, str) and isinstance(parse_value(value), float):
            # YAML 1.1 reads `1e-2` (no dot) as a string
            return _finite(parse_value(value), where, value)
        if option is str and isinstance(value, str):
            return value
        if option is str and isinstance(value, int) and not isinstance(value, bool):
            return str(value)  # run.dir=2024 is a name, not a number
        if typing.get_origin(option) is dict and isinstance(value, dict):
            return dict(value)  # the entries are checked by the section's validation
        if typing.get_origin(option) is tuple and isinstance(value, list | tuple):
            if all(isinstance(v, str) for v in value):
                return tuple(value)
    raise ConfigError.describe(where, value, _type_name(hint), "write a value of that type")


def _finite(number: float, where: str, value: Any) -> float:
    """No field means anything by inf or NaN (`1e999` reads as inf): null switches options off."""
    _check(math.isfinite(number), where, value, "a finite number", "write a finite value")
    return number


def _type_name(hint: Any) -> str:
    names = {int: "an int", float: "a number", str: "a string", bool: "true or false"}
    options = typing.get_args(hint) if typing.get_origin(hint) is types.UnionType else (hint,)
    words = [
        names.get(o, "a mapping" if typing.get_origin(o) is dict else "a list of strings")
        for o in options
        if o is not type(None)
    ]
    return " or ".join(words) + (" or null" if type(None) in options else "")


def _check(ok: bool, where: str, value: Any, expected: str, fix: str) -> None:
    if not ok:
        raise ConfigError.describe(where, value, expected, fix)


def validate_data(d: DataConfig) -> None:
    """The data section's own checks (also used by `lmjax prepare`, which has no RunConfig)."""
    _check(
        d.tokenizer in TOKENIZERS, "data.tokenizer", d.tokenizer, f"one of {TOKENIZERS}", "pick one"
    )
    _check(
        (d.vocab_size is not None) == (d.tokenizer == "bpe"),
        "data.vocab_size",
        d.vocab_size,
        "an int >= 257 with tokenizer bpe, null otherwise",
        "set data.vocab_size (prepare --vocab-size) only for bpe",
    )
    _check(0 < d.val_fraction < 1, "data.val_fraction", d.val_fraction, "in (0, 1)", "e.g. 0.1")


def _validate_run(cfg: RunConfig) -> None:
    """Range checks across sections (types were checked when the sections were built)."""
    _require_mapping(cfg.model, "model")
    cfg._model_with_any_vocab()  # raises on a bad preset, field or value
    o, s, d, t = cfg.optimizer, cfg.schedule, cfg.data, cfg.train
    _check(o.name in OPTIMIZERS, "optimizer.name", o.name, f"one of {OPTIMIZERS}", "pick one")
    _check(
        o.lr > 0 and o.lr < float("inf"), "optimizer.lr", o.lr, "a finite float > 0", "e.g. 3e-4"
    )
    for name in ("b1", "b2", "momentum"):
        value = getattr(o, name)
        _check(0 <= value < 1, f"optimizer.{name}", value, "a float in [0, 1)", "e.g. 0.9")
    _check(o.eps > 0, "optimizer.eps", o.eps, "a float > 0", "e.g. 1e-8")
    _check(o.weight_decay >= 0, "optimizer.weight_decay", o.weight_decay, ">= 0", "e.g. 0.1")
    clip = o.clip_norm
    _check(clip is None or clip > 0, "optimizer.clip_norm", clip, "> 0 or null", "e.g. 1.0")
    _check(s.decay in DECAYS, "schedule.decay", s.decay, f"one of {DECAYS}", "pick one")
    _check(s.warmup_steps >= 0, "schedule.warmup_steps", s.warmup_steps, ">= 0", "e.g. 100")
    _check(
        s.decay_steps is None or s.decay_steps > s.warmup_steps,
        "schedule.decay_steps",
        s.decay_steps,
        f"null or > warmup_steps = {s.warmup_steps}",
        "lengthen it, or leave it null (train.steps; a run no longer than its warmup then "
        "stays on the warmup ramp), or lower schedule.warmup_steps",
    )
    ratio = s.final_lr_ratio
    _check(0 <= ratio <= 1, "schedule.final_lr_ratio", ratio, "a float in [0, 1]", "e.g. 0.1")
    validate_data(d)
    _check(0 <= t.seed < 2**31, "train.seed", t.seed, "an int in [0, 2**31)", "e.g. 0")
    for name in ("steps", "batch_size", "grad_accum", "eval_every", "eval_batches"):
        value = getattr(t, name)
        _check(value >= 1, f"train.{name}", value, "an int >= 1", "use a positive integer")
    _check(
        t.batch_size % t.grad_accum == 0,
        "train.batch_size",
        t.batch_size,
        f"a multiple of train.grad_accum = {t.grad_accum}",
        "each micro-batch holds batch_size / grad_accum sequences",
    )
    context = cfg._model_with_any_vocab().context_length
    _check(
        t.seq_len is None or 1 <= t.seq_len <= context,
        "train.seq_len",
        t.seq_len,
        f"null or an int in [1, model.context_length = {context}]",
        "lower it or raise model.context_length",
    )
    c, g = cfg.checkpoint, cfg.logging
    _check(c.every >= 1, "checkpoint.every", c.every, "an int >= 1", "e.g. 500")
    _check(c.keep >= 1, "checkpoint.keep", c.keep, "an int >= 1", "e.g. 3")
    _check(g.every >= 1, "logging.every", g.every, "an int >= 1", "e.g. 10")
    _check(g.sample_tokens >= 0, "logging.sample_tokens", g.sample_tokens, ">= 0", "e.g. 200")
    temp = g.sample_temperature
    _check(temp >= 0, "logging.sample_temperature", temp, ">= 0 (0 = greedy)", "e.g. 0.8")
    peak = g.peak_flops
    _check(peak is None or peak > 0, "logging.peak_flops", peak, "> 0 or null", "leave it null")
    if cfg.parallel.mesh is not None:
        from lmjax.parallel.mesh import check_batch, check_mesh_shape

        check_batch(t.batch_size // t.grad_accum, check_mesh_shape(cfg.parallel.mesh))


OPTIMIZERS = ("adamw", "adam", "sgd")
DECAYS = ("cosine", "linear", "constant")
TOKENIZERS = ("char", "byte", "bpe", "gpt2")
