"""`lmjax train`: a run resolved into a `Plan`, then trained by a `Trainer`.

    RUN/config.yaml        the resolved config (vocab size filled in from the data)
    RUN/tokenizer/         a copy of the data's tokenizer, so the run is self-contained
    RUN/metrics.jsonl      {"step", "loss", "lr", "grad_norm", "tokens_per_s", "mfu", ...} every
                           logging.every steps, {"step", "val_loss", "val_perplexity"} at evals
    RUN/loss.png           train and validation loss against step
    RUN/samples.txt        text sampled at every evaluation
    RUN/checkpoints/<s>/   orbax checkpoints (see `lmjax.train.checkpoint`)

A new run refuses an existing directory (nothing is overwritten); `resume=True` continues from
the newest complete checkpoint (damaged newer steps are moved to `<step>.corrupt` and a killed
save's temporary directory is removed, each reported on `out`; see `lmjax.train.checkpoint`),
redoing nothing and skipping nothing: the batches are a function of
(seed, step) and the dropout keys of (key, step), so N steps + resume + M steps equals N + M
straight steps bit for bit on CPU. A non-finite loss stops the run with `NonFiniteError` naming
the step; the newest checkpoint on disk is the last good one.

The pieces: `lmjax.train.plan` (config, data and run directory, resolved once and checked),
`lmjax.train.trainer` (the state and the jitted step, calling the checkpoints,
`lmjax.train.progress` for metrics, `lmjax.train.evaluate` and `lmjax.train.sampling`). This
module builds them (`build_trainer`) and is where the names callers know stay importable.
"""

from __future__ import annotations

import dataclasses
import sys

import jax

from lmjax import parallel
from lmjax.config import RunConfig
from lmjax.data.prepared import TOKENIZER_DIR
from lmjax.files import atomic_write_text
from lmjax.train import compile_cache, optim
from lmjax.train.evaluate import Evaluator, evaluate
from lmjax.train.metrics import flops_per_token, measured_peak_flops
from lmjax.train.plan import (
    RESUMABLE_CHANGES,
    Plan,
    make_plan,
    preflight,
    prepare_data,
    resolve,
    warmup_only_note,
)
from lmjax.train.rundir import RunDir
from lmjax.train.sampling import Sampler, sample_text
from lmjax.train.step import init_state, make_eval_step, make_train_step
from lmjax.train.trainer import Pieces, RunResult, Step, Trainable, Trainer


def default_run_dir(config_path: str | None):
    """`runs/<the config file's stem>` (`runs/run` without a file)."""
    return RunDir.default(config_path).path


def train(
    cfg: RunConfig,
    *,
    config_path: str | None = None,
    resume: bool = False,
    out=None,
    trainable: Trainable | None = None,
) -> RunResult:
    """Run (or resume) training as configured; see the module docstring. `trainable`: what is
    trained (default every model parameter; `lmjax.finetune` passes LoRA's). `out`: the stream
    of the progress bar and notes (default: `sys.stderr` at call time, so a redirect applies)."""
    out = sys.stderr if out is None else out
    trainable = trainable or Trainable()
    finetune = trainable.frozen is not None
    plan = make_plan(cfg, config_path=config_path, resume=resume, finetune=finetune)
    if note := warmup_only_note(plan.cfg):
        print(note, file=out)
    for note in trainable.notes if parallel.is_main() else ():
        print(note, file=out)
    # Every host reads and writes its own cache; the result says where (`lmjax train` prints it
    # with the run's files, so an error stays one line on stderr).
    cache_note = compile_cache.enable(plan.cfg.run.compile_cache)
    # Every host checks the (shared) run directory before process 0 writes into it.
    parallel.barrier("lmjax train: run directory checked")
    plan.run.path.mkdir(parents=True, exist_ok=True)
    result = build_trainer(plan, trainable, out).run(lambda: publish(plan, trainable))
    return dataclasses.replace(result, compile_cache=cache_note)


def publish(plan: Plan, trainable: Trainable) -> None:
    """The run's own files: config.yaml, the trainable's files, the data's tokenizer (once).
    One writer per run; the other hosts join the checkpoints."""
    if not parallel.is_main():
        return
    plan.run.write_config(plan.cfg)
    for name, text in trainable.files.items():
        atomic_write_text(plan.run.path / name, text)
    plan.run.copy_tokenizer(plan.data.directory / TOKENIZER_DIR)


def build_trainer(plan: Plan, trainable: Trainable, out) -> Trainer:
    """The jitted step (on the plan's mesh, if any) and the pieces the trainer calls."""
    cfg, model = plan.cfg, plan.model
    tx, lr = optim.from_config(cfg)
    mesh, shardings = _mesh_and_shardings(plan.mesh_shape, model, tx, trainable.init_params)
    step = make_train_step(model, tx, lr, shardings, loss=trainable.loss)
    # On a mesh the eval batch is split like a training batch: left as host arrays it was
    # replicated, every device running the whole micro-batch.
    eval_sharding = None if mesh is None else parallel.batch_sharding(mesh, 2)
    to_model = trainable.model_params
    val = plan.data.val
    evaluate_fn = make_eval_step(model, mesh)  # looked up here: tests record the eval batches
    documents = plan.data.val_documents if cfg.data.packing else None
    evaluator = Evaluator(
        evaluate_fn,
        val,
        cfg.train,
        cfg.seq_len,
        model.vocab_ids,
        to_model,
        eval_sharding,
        documents,
    )
    samples = plan.run.samples_file
    sampler = Sampler(
        model, plan.data.tokenizer, cfg.logging, to_model, samples, mesh is not None,
        trainable.stop_ids,
    )  # fmt: skip
    count = trainable.flops_per_token or flops_per_token
    flops = count(model, cfg.seq_len) * plan.tokens_per_step
    peak = cfg.logging.peak_flops or measured_peak_flops(str(model.compute_dtype))
    pieces = Pieces(evaluator, sampler, flops, peak)
    return Trainer(plan, trainable, Step(step, tx, mesh, shardings), pieces, out)


def _mesh_and_shardings(shape: dict[str, int] | None, model, tx, init_params=None):
    """`(mesh, TrainState of NamedShardings)` on the plan's mesh shape (`parallel.run_mesh_shape`:
    a multi-process run without `parallel.mesh` gets one too), else `(None, None)`. The state is
    the trainable's (`init_params`: a fine-tune's adapters, replicated as leaves the model's
    declaration does not know, or a full fine-tune's unfrozen leaves, sharded by the rules)."""
    if shape is None:
        return None, None
    mesh = parallel.make_mesh(shape)
    key = jax.random.PRNGKey(0)
    abstract = jax.eval_shape(lambda: init_state(key, model, tx, init_params))
    specs = parallel.state_specs(abstract, model, parallel.mesh_shape(mesh))
    return mesh, parallel.shardings(specs, mesh)


__all__ = [
    "RESUMABLE_CHANGES",
    "RunResult",
    "Trainable",
    "build_trainer",
    "default_run_dir",
    "evaluate",
    "preflight",
    "prepare_data",
    "publish",
    "resolve",
    "sample_text",
    "train",
    "warmup_only_note",
]
