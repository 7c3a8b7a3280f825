"""Run configuration: frozen dataclasses, YAML files, `key=value` overrides, validation.

    cfg = load_run_config("configs/tiny.yaml", ["model.n_layers=4", "train.steps=100"])

`overrides`: `parse_value` / `parse_overrides` (text -> typed values; imports nothing above
the checks). `yaml_file`: `read_yaml`. `sections`: the sections besides `model`
(`OptimizerConfig`, ..., `ParallelConfig`) and their choices. `typed`: a section built from a
mapping, each value checked against its field's type. `run`: `RunConfig` (the model mapping
plus every section, validated across sections) and `load_run_config`.

Where it sits: above `lmjax.models` (it builds the `ModelConfig`) and `lmjax.parallel` (it
checks the mesh), below `lmjax.train`; `lmjax.lora` uses only `overrides`.
"""

from lmjax.config.overrides import parse_overrides, parse_value
from lmjax.config.run import RunConfig, load_run_config, parse_run_overrides
from lmjax.config.sections import (
    DECAYS,
    OPTIMIZERS,
    SECTIONS,
    TOKENIZERS,
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
from lmjax.config.typed import unknown_name
from lmjax.config.yaml_file import read_yaml

__all__ = [
    "DECAYS",
    "OPTIMIZERS",
    "SECTIONS",
    "TOKENIZERS",
    "CheckpointConfig",
    "DataConfig",
    "LoggingConfig",
    "OptimizerConfig",
    "ParallelConfig",
    "RunConfig",
    "RunSection",
    "ScheduleConfig",
    "TrainConfig",
    "load_run_config",
    "parse_overrides",
    "parse_run_overrides",
    "parse_value",
    "read_yaml",
    "unknown_name",
    "validate_data",
]
