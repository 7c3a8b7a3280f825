"""Training (SPEC section 5): optimizers, the jitted step, data, checkpoints and the run loop.

Notebook use:

    tx, lr = lmjax.train.optim.from_config(run_cfg)          # or any optax transformation
    state = lmjax.train.init_state(jax.random.PRNGKey(0), model_cfg, tx)
    train_step = lmjax.train.make_train_step(model_cfg, tx, lr)
    state, metrics = train_step(state, {"inputs": x_ABT, "targets": y_ABT})

Command line: `lmjax prepare`, `lmjax train CONFIG`, `lmjax eval RUN`.
"""

from lmjax.train import data, optim
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
    "data",
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
