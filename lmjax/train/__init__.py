"""Training (docs/training.md): the state, the jitted step, optimizers, the run loop and trainer,
checkpoints, metrics and loggers, evaluation, and opening a finished run (`load_run`).

It imports `lmjax.data` (batches) and the layers below (models, lora, quant, parallel, io,
tokenizers, generate); `lmjax.finetune` and `lmjax.cli` import it, never the other way.
`finetuned` is the record a fine-tuned run keeps of its base, read here so that `load_run`
rebuilds any run without importing `lmjax.finetune`.

Notebook use:

    tx, lr = lmjax.train.optim.from_config(run_cfg)          # or any optax transformation
    state = lmjax.train.init_state(jax.random.PRNGKey(0), model_cfg, tx)
    train_step = lmjax.train.make_train_step(model_cfg, tx, lr)
    state, metrics = train_step(state, {"inputs": x_ABT, "targets": y_ABT})

Command line: `lmjax prepare`, `lmjax train CONFIG`, `lmjax eval RUN`.
"""

import warnings

import lmjax.data
from lmjax.train import optim
from lmjax.train.checkpoint import Checkpoints
from lmjax.train.loop import RunResult, evaluate, prepare_data, sample_text, train
from lmjax.train.rundir import RunDir
from lmjax.train.runs import LoadedRun, load_run
from lmjax.train.step import TrainState, init_state, loss_fn, make_eval_step, make_train_step

__all__ = [
    "Checkpoints",
    "LoadedRun",
    "RunDir",
    "RunResult",
    "TrainState",
    "evaluate",
    "init_state",
    "load_run",
    "loss_fn",
    "make_eval_step",
    "make_train_step",
    "optim",
    "prepare_data",
    "sample_text",
    "train",
]


def __getattr__(name: str):
    """`lmjax.train.data`, the data pipeline's old home: `lmjax.data` now, with a warning (kept
    for one release; remove after 0.2)."""
    if name == "data":
        warnings.warn(
            "lmjax.train.data moved to lmjax.data; lmjax.train.data goes in the next release",
            DeprecationWarning,
            stacklevel=2,
        )
        return lmjax.data
    raise AttributeError(f"module 'lmjax.train' has no attribute {name!r}")
