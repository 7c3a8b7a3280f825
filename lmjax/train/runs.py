"""Opening a finished (or running) run for evaluation, generation and export.

`load_run(path)` accepts a run directory (`RUN/config.yaml`) or one of its checkpoint steps
(`RUN/checkpoints/<step>`), and returns the resolved config, the model config, the parameters
(from the newest or the chosen checkpoint, or from `RUN/model.safetensors` for a run that holds
weights only, such as one made by `lmjax import-hf`; for a `lmjax finetune` run, its base merged
with the checkpoint's adapters) and the run's tokenizer.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import jax
import yaml

from lmjax import tokenizers
from lmjax.config import RunConfig
from lmjax.errors import CheckpointError, ConfigError, FileFormatError
from lmjax.models import ModelConfig
from lmjax.train import optim
from lmjax.train.checkpoint import Checkpoints, check_same_model
from lmjax.train.step import init_state


@dataclasses.dataclass
class LoadedRun:
    directory: Path
    cfg: RunConfig
    model: ModelConfig
    params: dict
    tokenizer: tokenizers.Tokenizer | None
    step: int | None  # None for weights without a checkpoint


def split_run_path(path) -> tuple[Path, int | None]:
    """`RUN` -> (RUN, None); `RUN/checkpoints/STEP` -> (RUN, STEP)."""
    path = Path(path)
    if (path / "config.yaml").is_file():
        return path, None
    parent = path.parent.parent
    if (
        path.name.isdigit()
        and path.parent.name == "checkpoints"
        and (parent / "config.yaml").is_file()
    ):
        return parent, int(path.name)
    raise ConfigError.describe(
        "run path",
        str(path),
        "a run directory (with config.yaml) or RUN/checkpoints/<step>",
        "pass the directory `lmjax train` wrote",
    )


def read_config(run_dir: Path) -> RunConfig:
    try:
        data = yaml.safe_load((run_dir / "config.yaml").read_text(encoding="utf-8"))
    except (yaml.YAMLError, UnicodeDecodeError) as err:
        raise FileFormatError.describe(
            str(run_dir / "config.yaml"),
            f"unparseable ({type(err).__name__})",
            "valid YAML",
            "restore the file from the run's checkpoint meta or re-run",
        ) from None
    return RunConfig.from_dict(data)


def load_run(path, step: int | None = None) -> LoadedRun:
    run_dir, ckpt_step = split_run_path(path)
    step = step if step is not None else ckpt_step
    cfg = read_config(run_dir)
    model = cfg.model_config()
    tok_dir = run_dir / "tokenizer"
    tok = tokenizers.load(tok_dir) if tok_dir.is_dir() else None
    if (run_dir / "finetune.yaml").is_file():  # `lmjax finetune`: its base with the adapters
        from lmjax.finetune import load_finetuned

        params, step = load_finetuned(run_dir, cfg, step)
    elif (run_dir / "checkpoints").is_dir() and Checkpoints(
        run_dir / "checkpoints", create=False
    ).steps():
        params, step = _params_from_checkpoint(run_dir, cfg, model, step)
    elif (run_dir / "model.safetensors").is_file():
        from lmjax.io import safetensors

        params, step = safetensors.load(run_dir / "model.safetensors", model), None
    else:
        raise CheckpointError.describe(
            "run",
            str(run_dir),
            "a checkpoint under checkpoints/ or model.safetensors",
            "train the run first (it has no saved weights yet)",
        )
    return LoadedRun(run_dir, cfg, model, params, tok, step)


def _params_from_checkpoint(run_dir: Path, cfg: RunConfig, model: ModelConfig, step):
    ckpt = Checkpoints(run_dir / "checkpoints", create=False)
    tx, _ = optim.from_config(cfg)
    abstract = jax.eval_shape(lambda: init_state(jax.random.PRNGKey(0), model, tx))
    step = step if step is not None else ckpt.latest_step()
    check_same_model(ckpt.read_meta(step), model, ckpt.directory / str(step))
    state = ckpt.restore(abstract, step)
    return state.params, int(state.step)


def write_weights_run(out, params: dict, model: ModelConfig, tokenizer, tokenizer_kind: str):
    """A run directory holding weights only (`model.safetensors`), e.g. an imported model.

    `lmjax generate`, `lmjax eval` and `lmjax export-hf` read it like a trained run. Its
    config evaluates on small batches (4 x min(256, C) tokens, 10 batches) so `lmjax eval`
    stays cheap; edit `config.yaml` or pass `--batch-size` / `--seq-len` for more. The
    directory is built under a temporary name and renamed; an existing `out` is refused.
    """
    from lmjax.config import DataConfig, TrainConfig
    from lmjax.files import atomic_dir, atomic_write_text
    from lmjax.io import safetensors

    out = Path(out)
    if out.exists():
        raise ConfigError.describe(
            "output run directory",
            str(out),
            "a path that does not exist yet",
            "pick a new --out (nothing was overwritten)",
        )
    train_cfg = TrainConfig(batch_size=4, seq_len=min(256, model.context_length), eval_batches=10)
    cfg = RunConfig(
        model=model.to_dict(), data=DataConfig(tokenizer=tokenizer_kind), train=train_cfg
    )
    with atomic_dir(out) as tmp:
        atomic_write_text(tmp / "config.yaml", yaml.safe_dump(cfg.to_dict(), sort_keys=False))
        safetensors.save(params, tmp / "model.safetensors", metadata={"format": "lmjax"})
        if tokenizer is not None:
            tokenizer.save(tmp / "tokenizer")
    return out
