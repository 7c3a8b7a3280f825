"""The sections of a run config besides `model`: frozen dataclasses with their defaults.

A section's fields are typed; `lmjax.config.typed` checks a mapping (YAML) against those types
when it builds a section, and `lmjax.config.run` checks the ranges across sections.
"""

from __future__ import annotations

import dataclasses

from lmjax.checks import is_positive_int, require
from lmjax.parallel.mesh import parse_mesh_text

OPTIMIZERS = ("adamw", "adam", "sgd")
DECAYS = ("cosine", "linear", "constant")
# hf: the Hugging Face tokenizer a run holds in its tokenizer/ (lmjax import-hf): its
# tokenizer.json, or its vocab.json + merges.txt. It is read from there, never built.
TOKENIZERS = ("char", "byte", "bpe", "gpt2", "hf")


@dataclasses.dataclass(frozen=True)
class OptimizerConfig:
    """optax optimizer. `no_decay`: name globs exempt from AdamW weight decay (docs/training.md)."""

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
    # char | byte | bpe (trained on the corpus) | gpt2 (GPT-2's own) | hf (the run's own
    # Hugging Face tokenizer/, from import-hf)
    tokenizer: str = "char"
    vocab_size: int | None = None  # bpe only: the trained vocabulary size
    val_fraction: float = 0.1
    packing: bool = False  # rows of whole documents with segment ids (else random crops)
    field: str = "text"  # the text field of .jsonl records / column of .parquet files
    eot: str = "auto"  # appended to each document: auto | none | a special token's text
    skip_bad: bool = False  # skip (and count) malformed records instead of failing
    workers: int | None = None  # tokenizing processes; null = min(CPU count, 4)


@dataclasses.dataclass(frozen=True)
class TrainConfig:
    steps: int = 1000
    batch_size: int = 32  # sequences per optimizer step (split over grad_accum micro-batches)
    seq_len: int | None = None  # null = model.context_length
    grad_accum: int = 1
    seed: int = 0
    eval_every: int = 250
    eval_batches: int = 20
    tensorboard: bool = True  # event files in RUN/tensorboard/ (lmjax.train.tensorboard)
    wandb: bool = False  # Weights & Biases logging (lmjax.train.wandb_log; pip install wandb)
    wandb_project: str = "lmjax"  # the W&B project the run logs to


@dataclasses.dataclass(frozen=True)
class RunSection:
    dir: str | None = None  # null = runs/<config file stem>
    # JAX's persistent compilation cache, ~/.cache/lmjax/jax-compile (lmjax.train.compile_cache)
    compile_cache: bool = True


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
    # A user message instead: the prompt is the tokenizer's chat template over it, ending with
    # the assistant header (`lmjax.train.sampling.prompt_ids`); null = sample_prompt.
    sample_chat: str | None = None
    sample_temperature: float = 0.8
    peak_flops: float | None = None  # for MFU; null = measure a matmul on the device


@dataclasses.dataclass(frozen=True)
class ParallelConfig:
    """Device mesh (docs/scale.md, `lmjax.parallel`): `mesh: {data: 2, fsdp: 4}` (model: 1).

    null (the default) trains on one device exactly as before in one process, and over every
    device, data-parallel, in a multi-process run (`lmjax.parallel.run_mesh_shape`); the axis
    sizes' product must equal the device count, checked when the run starts. An override may
    write the mesh as text: `parallel.mesh=data=2,fsdp=4`.
    """

    mesh: dict[str, int] | str | None = None

    def __post_init__(self):
        if isinstance(self.mesh, str):
            object.__setattr__(self, "mesh", parse_mesh_text(self.mesh, "parallel.mesh"))


# Section name -> its dataclass, in the order a config file lists them.
SECTIONS = {
    "optimizer": OptimizerConfig,
    "schedule": ScheduleConfig,
    "data": DataConfig,
    "train": TrainConfig,
    "run": RunSection,
    "checkpoint": CheckpointConfig,
    "logging": LoggingConfig,
    "parallel": ParallelConfig,
}


def validate_data(d: DataConfig) -> None:
    """The data section's own checks (also used by `lmjax prepare`, which has no RunConfig)."""
    require(
        d.tokenizer in TOKENIZERS, "data.tokenizer", d.tokenizer, f"one of {TOKENIZERS}", "pick one"
    )
    require(
        (d.vocab_size is not None) == (d.tokenizer == "bpe"),
        "data.vocab_size",
        d.vocab_size,
        "an int >= 257 with tokenizer bpe, null otherwise",
        "set data.vocab_size (prepare --vocab-size) only for bpe",
    )
    require(0 < d.val_fraction < 1, "data.val_fraction", d.val_fraction, "in (0, 1)", "e.g. 0.1")
    require(bool(d.field), "data.field", d.field, "a non-empty field name", "e.g. text")
    require(bool(d.eot), "data.eot", d.eot, "'auto', 'none' or a special token", "e.g. auto")
    workers_ok = d.workers is None or is_positive_int(d.workers)
    require(workers_ok, "data.workers", d.workers, "null or an int >= 1", "e.g. 4")
