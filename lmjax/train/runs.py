"""Opening a finished (or running) run for evaluation, generation and export.

`load_run(path)` accepts a run directory (`RUN/config.yaml`) or one of its checkpoint steps
(`RUN/checkpoints/<step>`), and returns the resolved config, the model config, the parameters
and the run's tokenizer. Where the parameters come from is the run's kind (`RunDir.kind`):
the newest or the chosen checkpoint of a trained run; `RUN/model.safetensors` of a run that
holds weights only (`lmjax import-hf`, a fine-tune's merged/); for a `lmjax finetune` run, its
base (found and checked through `RUN/finetune.yaml`) merged with the checkpoint's adapters.
A checkpoint or `model.safetensors` saved before the blocks were stacked loads stacked, with one
line on stderr saying so (`lmjax.train.checkpoint.layers`).

`quantize="nf4"` gives weights whose block projections are NF4 (`lmjax.quant`), for decoding
through the quantized projection: a QLoRA run keeps the NF4 base it trained on with its adapters
attached (`lora.attach`, never merged: merging would dequantize it); any other run is loaded as
above and then quantized (`quantize_params`).
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import jax

from lmjax import lora, tokenizers
from lmjax.checks import require
from lmjax.config import DataConfig, RunConfig, TrainConfig
from lmjax.errors import CheckpointError, ConfigError, FileFormatError, LMJaxError
from lmjax.files import atomic_dir
from lmjax.io import safetensors
from lmjax.models import ModelConfig
from lmjax.quant.params import quantize_params
from lmjax.train import optim
from lmjax.train.checkpoint import check_same_model, note_converted
from lmjax.train.finetuned import FinetuneSpec, fingerprint, model_params, parts, read_spec
from lmjax.train.rundir import FINETUNED, TRAINED, WEIGHTS, RunDir, run_label
from lmjax.train.step import init_state

QUANTIZE = ("nf4",)  # what load_run's `quantize` takes besides None


@dataclasses.dataclass
class LoadedRun:
    directory: Path
    cfg: RunConfig
    model: ModelConfig
    params: dict
    tokenizer: tokenizers.Tokenizer | None
    step: int | None  # None for weights without a checkpoint


def split_run_path(path) -> tuple[Path, int | None]:
    """`RUN` -> (RUN, None); `RUN/checkpoints/STEP` -> (RUN, STEP) (`RunDir.parse`)."""
    run, step = RunDir.parse(path)
    return run.path, step


def read_config(run_dir: Path) -> RunConfig:
    return RunDir(Path(run_dir)).read_config()


def load_run(path, step: int | None = None, *, quantize: str | None = None) -> LoadedRun:
    """The run at `path` (module docstring). `quantize`: None (float weights, a fine-tune's
    merged) or "nf4" (block projections NF4; a QLoRA run's own base with adapters attached)."""
    require(quantize is None or quantize in QUANTIZE, "quantize", quantize,
            f"None or one of {QUANTIZE}", "pass quantize='nf4' or leave it unset")  # fmt: skip
    run, ckpt_step = RunDir.parse(path)
    step = step if step is not None else ckpt_step
    cfg = read_config(run.path)
    model, tokenizer = cfg.model_config(), run.tokenizer()
    kind = run.kind()
    if kind == FINETUNED:
        params, step = load_finetuned(run.path, cfg, step, quantize=quantize)
        return LoadedRun(run.path, cfg, with_own_tokenizer(model, tokenizer, run), params,
                         tokenizer, step)  # fmt: skip
    elif kind == TRAINED:
        ckpt = run.read_checkpoints()
        step = step if step is not None else ckpt.latest_step()
        abstract = _abstract_state(cfg, model)
        params, step = _restore_params(ckpt, model, abstract, step, ckpt.directory / str(step))
    elif kind == WEIGHTS:
        params, step = load_weights(run.weights_file, model), None
    else:
        raise CheckpointError.describe(
            "run",
            str(run.path),
            "a checkpoint under checkpoints/ or model.safetensors",
            "train the run first (it has no saved weights yet)",
        )
    params = params if quantize is None else quantize_params(params)
    model = with_own_tokenizer(model, tokenizer, run)
    return LoadedRun(run.path, cfg, model, params, tokenizer, step)


def load_weights(path: Path, model: ModelConfig) -> dict:
    """A weights-only run's `model.safetensors`; one written before the blocks were stacked
    (per-layer names) loads stacked, with the line that says so (`note_converted`)."""
    if safetensors.is_per_layer(path, model):
        note_converted(path)
    return safetensors.load(path, model)


def with_own_tokenizer(model: ModelConfig, tokenizer, run: RunDir) -> ModelConfig:
    """`model` with `tokenizer_size` from the run's own tokenizer (none: as it is). A run
    imported before the field existed, with a padded embedding, so decodes and scores only the
    tokenizer's ids; a tokenizer larger than the embedding is refused."""
    if tokenizer is None:
        return model
    fix = f"put the tokenizer these weights were trained with in {run.tokenizer_dir}"
    return model.for_tokenizer(tokenizer.vocab_size, f"{run.tokenizer_dir} size", fix)


def is_qlora(path) -> bool:
    """Whether `path` (a run or one of its checkpoints) is a QLoRA fine-tune: its base is NF4."""
    run = RunDir.parse(path)[0]
    return run.kind() == FINETUNED and read_spec(run).qlora


def _abstract_state(cfg: RunConfig, model: ModelConfig, init_params=None):
    """The `TrainState` shapes a checkpoint of `cfg` restores into (nothing allocated)."""
    tx, _ = optim.from_config(cfg)
    return jax.eval_shape(lambda: init_state(jax.random.PRNGKey(0), model, tx, init_params))


def _restore_params(ckpt, model: ModelConfig, abstract, step: int | None, where):
    """`(params, step)` of checkpoint `step` (None: the newest), its model checked first."""
    check_same_model(ckpt.read_meta(step), model, where)
    state = ckpt.restore(abstract, step)
    return state.params, int(state.step)


def load_finetuned(run_dir: Path, cfg: RunConfig, step: int | None, *, quantize=None):
    """`(merged params, step)` of a fine-tune run's checkpoint: its base (`finetune.yaml`),
    frozen as it was trained, merged with the checkpoint's adapters (or, for a full fine-tune,
    joined with the checkpoint's trained leaves). `quantize="nf4"`: a QLoRA run's NF4 base with
    the adapters attached, not merged; any other fine-tune's merged params quantized."""
    run = RunDir(Path(run_dir))
    spec = read_spec(run)
    init, frozen = parts(spec, load_base(spec, run).params)
    model = cfg.model_config()
    ckpt = run.read_checkpoints()
    abstract = _abstract_state(cfg, model, init)
    trained, step = _restore_params(ckpt, model, abstract, step, ckpt.directory)
    if quantize is None:
        return model_params(spec, frozen, trained), step
    if spec.qlora:  # the adapters ride on the NF4 base as in training (models.project)
        return lora.attach(frozen, trained, spec.lora), step
    return quantize_params(model_params(spec, frozen, trained)), step


def load_base(spec: FinetuneSpec, run: RunDir) -> LoadedRun:
    """The base a fine-tune trained on: its path and step, checked by content."""
    merged = run.merged_dir
    fix = (
        f"restore it, or set finetune.base_path in {run.finetune_file} to where it is now; "
        f"{merged} holds the merged model without the base"
    )
    try:
        base_run = load_run(spec.base_path, spec.base_step)
    except LMJaxError as err:
        raise CheckpointError.describe(
            "fine-tune base",
            run_label(spec.base_path, spec.base_step),
            f"the base run this fine-tune trained on ({type(err).__name__}: {err})",
            fix,
        ) from None
    if spec.base_sha256 is not None and fingerprint(base_run.params) != spec.base_sha256:
        raise CheckpointError.describe(
            "fine-tune base",
            run_label(spec.base_path, spec.base_step),
            f"the weights the adapters were trained on (sha256 {spec.base_sha256[:12]}); "
            "that base has changed",
            fix,
        )
    return base_run


def eval_tokenizer_dir(run: LoadedRun, cfg: RunConfig) -> Path | None:
    """The run's own tokenizer/ where `lmjax eval` must encode the data with it, else None
    (the data section's tokenizer).

    A fine-tune's corpus was encoded with its base's tokenizer (which the run keeps in
    tokenizer/): score with those ids even when the cached data directory is gone. A
    weights-only run with no prepared data (import-hf) is scored with its own tokenizer/ too:
    its data.tokenizer label (gpt2) need not be the vocabulary its weights were trained on.
    """
    directory = RunDir(run.directory)
    kind = directory.kind()
    unprepared = kind == WEIGHTS and cfg.data.dir is None
    require(
        not (unprepared and run.tokenizer is None),
        "run",
        str(run.directory),
        "a tokenizer/ directory (its weights-only config names no prepared data)",
        "copy the tokenizer/ of the run the weights came from into it",
        error=FileFormatError,
    )
    return directory.tokenizer_dir if kind == FINETUNED or unprepared else None


def write_weights_run(out, params: dict, model: ModelConfig, tokenizer, tokenizer_kind: str):
    """A run directory holding weights only (`model.safetensors`), e.g. an imported model.

    `lmjax generate`, `lmjax eval` and `lmjax export-hf` read it like a trained run. Its
    config evaluates on small batches (4 x min(256, C) tokens, 10 batches) so `lmjax eval`
    stays cheap; edit `config.yaml` or pass `--batch-size` / `--seq-len` for more. The
    directory is built under a temporary name and renamed; an existing `out` is refused.
    """
    out = Path(out)
    if out.exists():
        raise ConfigError.describe(
            "output run directory",
            str(out),
            "a path that does not exist yet",
            "pick a new --out (nothing was overwritten)",
        )
    if tokenizer is not None:  # a padded embedding (more rows than ids) records the ids
        fix = "write the weights with the tokenizer they were trained with"
        model = model.for_tokenizer(tokenizer.vocab_size, "tokenizer size", fix)
    train_cfg = TrainConfig(batch_size=4, seq_len=min(256, model.context_length), eval_batches=10)
    cfg = RunConfig(
        model=model.to_dict(), data=DataConfig(tokenizer=tokenizer_kind), train=train_cfg
    )
    with atomic_dir(out) as tmp:
        staged = RunDir(tmp)
        staged.write_config(cfg)
        safetensors.save(params, staged.weights_file, metadata={"format": "lmjax"})
        if tokenizer is not None:
            tokenizer.save(staged.tokenizer_dir)
    return out
